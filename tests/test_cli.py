"""The shared command line (lra_core.cli): absl-style overrides, --help, the config listing, and
configs read back from a workdir's config.json."""

import importlib
import json
import re
import subprocess
import sys

import pytest

import lra_core
from lra_core import cli
from lra_core.checkpoints.saved_config import load_workdir_config
from lra_core.config import PROJECT_ROOT
from lra_core.errors import ConfigError

SPEC = "configs/lra/listops/transformer.py:tiny"


# -- overrides ---------------------------------------------------------------------------------------------


def test_overrides_take_their_value_after_an_equals_sign_or_a_space():
  overrides, rest = cli.split_overrides(
    [
      "--config",
      SPEC,
      "--config.train.steps",
      "7",
      "--workdir",
      "w",
      "--config.optim.lr=0.5",
      "--config.optim.b1",
      "-0.1",
      "--force",
    ]
  )
  assert overrides == ["train.steps=7", "optim.lr=0.5", "optim.b1=-0.1"]
  assert rest == ["--config", SPEC, "--workdir", "w", "--force"]


@pytest.mark.parametrize(
  "main",
  ["lra_core.bench.side_by_side", "lra_core.bench.decode", "lra_core.bench.generate", "lra_core.bench.train_step"],
)
def test_the_benchmarks_take_the_trainers_override_syntax_beside_override(main, monkeypatch):
  """--config.KEY=VALUE and --config.KEY VALUE join --override's list, after it (lra-bench refused them once)."""
  seen = []
  monkeypatch.setattr(cli, "setup_logging", lambda: (_ for _ in ()).throw(SystemExit(seen)))  # stop after parsing
  real = cli.parse_overriding
  monkeypatch.setattr(cli, "parse_overriding", lambda parser, argv: seen.append(real(parser, argv)) or seen[-1])
  argv = ["--config", SPEC, "--override", "a=1", "--config.b=2", "--config.c", "3"]
  with pytest.raises(SystemExit):
    importlib.import_module(main).main(argv)
  assert seen[0].override == ["a=1", "b=2", "c=3"] and seen[0].config == SPEC


@pytest.mark.parametrize("argv", [["--config.train.steps"], ["--config.train.steps", "--workdir=w"]])
def test_an_override_without_a_value_is_one_sentence(argv):
  with pytest.raises(
    ConfigError,
    match=r"^--config\.train\.steps needs a value: --config\.train\.steps=VALUE or "
    r"--config\.train\.steps VALUE\.$",
  ):
    cli.split_overrides(argv)


@pytest.mark.parametrize(
  "argv, expected",
  [
    (
      ["--confg.train.steps=3"],
      r"^--confg\.train\.steps=3 is not an option of .*; did you mean --config\.train\.steps=3\?$",
    ),
    (["--workdri=w"], r"^--workdri=w is not an option of .*; did you mean --workdir\?$"),
    (["--zzz"], r"^--zzz is not an option of .*; .* --help lists its options\.$"),
  ],
)
def test_an_unknown_option_is_one_sentence_naming_the_nearest(argv, expected):
  with pytest.raises(ConfigError, match=expected):
    cli.parse([f"--config={SPEC}", "--workdir=w", *argv])


def test_parse_accepts_both_spellings_of_every_flag():
  spaced = cli.parse(["--config", SPEC, "--config.train.steps", "7", "--workdir", "w", "--config.model.d_model", "16"])
  joined = cli.parse([f"--config={SPEC}", "--config.train.steps=7", "--workdir=w", "--config.model.d_model=16"])
  for args in (spaced, joined):
    assert args.config.train.steps == 7 and args.config.model.d_model == 16
    assert args.workdir == "w" and args.spec == SPEC and args.overrides == ["train.steps=7", "model.d_model=16"]


def test_help_shows_the_override_syntax_the_config_folders_and_an_example(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.parse(["--help"], prog="python -m lra_core.train")
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert "--config.KEY=VALUE or --config.KEY VALUE" in out
  assert "configs/<dataset>/<model>.py[:ARG[,ARG...]]" in out
  for folder in ("c4", "enwik8", "imagenet64", "lra/listops", "lra/pathx", "pg19"):
    assert re.search(rf"[ ,]{re.escape(folder)}[,\n]", out), folder
  assert "python -m lra_core.configs" in out and "examples:\n  python -m lra_core.train --config configs/" in out


def test_a_command_shows_its_own_example(capsys):
  from lra_core import evaluate

  with pytest.raises(SystemExit):
    evaluate.main(["--help"])
  out = capsys.readouterr().out
  assert f"examples:\n  {evaluate.EXAMPLE}" in out
  assert "default: the workdir's config.json" in " ".join(out.split())  # argparse wraps the flag help


# -- config listing -----------------------------------------------------------------------------------------


def _files_with_get_config():
  """Independently of the listing: the files under configs/ whose text defines get_config."""
  root = PROJECT_ROOT / "configs"
  return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "\ndef get_config(" in p.read_text())


def test_the_listing_covers_every_config_file_and_each_declares_its_args():
  files = cli.config_files()
  assert list(files) == _files_with_get_config() and len(files) > 30
  for file in files:
    assert cli.config_args(file), file
  assert cli.config_args("lra/listops/transformer.py") == ("tiny", "default", "plus", "plusplus")
  assert cli.config_args("lra/listops/fit.py") == ("tiny",)  # checked in configs/lra/common.py
  assert "flash_quad" in cli.config_args("c4/flash_quad.py")  # checked in configs/c4/flash.py


def test_the_listed_args_are_exactly_those_the_file_accepts():
  for file in cli.config_files():
    with pytest.raises(ConfigError, match="is not known; expected a comma-separated subset of") as error:
      lra_core.load_config(f"configs/{file}:no_such_arg")
    accepted = re.search(r"subset of (\[.*\])\.$", str(error.value)).group(1)
    assert accepted == repr(list(cli.config_args(file))), file


def test_every_listed_arg_loads():
  for file in cli.config_files():
    for arg in cli.config_args(file):
      try:
        config = lra_core.load_config(f"configs/{file}:{arg}")
      except ConfigError:  # an arg that needs a size beside it (block_transformer's megabyte)
        config = lra_core.load_config(f"configs/{file}:{arg},tiny")
      assert config.task in lra_core.task_kinds.TASKS


def test_python_m_lra_core_configs_and_list_configs_print_the_listing():
  out = subprocess.run(
    [sys.executable, "-m", "lra_core.configs"], capture_output=True, text=True, timeout=300, cwd="/"
  ).stdout
  assert "  lra/listops/transformer.py: tiny, default, plus, plusplus\n" in out
  for file in cli.config_files():
    assert f"\n  {file}: " in out, file
  again = subprocess.run(
    [sys.executable, "-m", "lra_core.train", "--list_configs"], capture_output=True, text=True, timeout=300
  )
  assert again.returncode == 0 and again.stdout == out


# -- configs from a workdir ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "spec",
  [
    SPEC,
    "configs/imagenet64/fit_denoiser.py:tiny",
    "configs/c4/block_transformer.py:tiny",
    "configs/pg19/transformer_vq.py:tiny",
  ],
)
def test_a_saved_config_reads_back_equal(tmp_path, spec):
  config = lra_core.load_config(spec)
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))  # as the trainer writes it
  again = load_workdir_config(tmp_path)
  assert again.to_dict() == config.to_dict() and again.sharding.rules == config.sharding.rules
  changed = load_workdir_config(str(tmp_path), ["train.eval_batch_size=16"])
  assert changed.train.eval_batch_size == 16 and changed.model.to_dict() == config.model.to_dict()


def test_without_config_the_workdirs_config_json_is_read(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(lra_core.load_config(SPEC).to_dict()))
  args = cli.parse(
    ["--workdir", str(tmp_path), "--config.train.eval_batch_size", "16"], config_from_workdir=load_workdir_config
  )
  assert args.config.train.eval_batch_size == 16 and args.spec == f"{tmp_path}/config.json"
  explicit = cli.parse(
    ["--workdir", str(tmp_path), "--config", SPEC, "--config.model.d_model=16"], config_from_workdir=load_workdir_config
  )
  assert explicit.spec == SPEC and explicit.config.model.d_model == 16


def test_a_workdir_without_config_json_is_one_sentence(tmp_path):
  with pytest.raises(ConfigError, match=r"workdir '.*nothing' does not exist; give the workdir of a run"):
    cli.parse(["--workdir", str(tmp_path / "nothing")], config_from_workdir=load_workdir_config)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match=r"has no config\.json; give --config=<spec>, or the workdir of a run"):
    cli.parse(["--workdir", str(tmp_path / "empty")], config_from_workdir=load_workdir_config)
  (tmp_path / "config.json").write_text("{")
  with pytest.raises(ConfigError, match=r"is not valid JSON"):
    load_workdir_config(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(lra_core.load_config(SPEC).to_dict()))
  with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'"):
    load_workdir_config(tmp_path, ["train.stepz=3"])
