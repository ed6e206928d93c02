"""train.init_from checked before anything is written or compiled: a run whose config.model differs
from the source's (a Hugging Face folder's config.json, or another run's saved config) in several
settings is refused in one sentence naming each, with both values and the overrides that fix them; the
refused start creates no workdir and changes nothing in one that exists; settings that only change how
a model computes may differ; a resumed run is not checked; a parameter shape found to differ later is
one sentence too."""

import json
import re

import pytest
from flax import nnx
from test_hf import AS_OURS, CONFIG

import lra_core
from lra_core import hf, layout
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.checkpoints.init_from import check_source, warm_start
from lra_core.errors import ConfigError
from lra_core.models import transformer
from lra_core.protocol import RunInfo
from lra_core.run import optim
from lra_core.run.state import make_state_spec
from lra_core.train import train_and_evaluate

TINY = "configs/c4/transformer.py:tiny"
# Three settings off the folder's model (2 layers, d_ff 80, 4 heads): each changes parameter shapes.
THREE_OFF = ["model.num_layers=4", "model.d_ff=64", "model.num_heads=2"]
# Settings that only change how the model computes: a run may differ from its source in these.
COMPUTE_ONLY = ["model.dtype=bfloat16", "model.remat=full", "model.scan_layers=True", "model.dropout=0.1"]


def hf_folder(path):
  """A tiny GPT-NeoX folder, as lra_core.hf.save_folder writes a model of the transformer family."""
  section = hf.gpt_neox.model_section(CONFIG)
  model = transformer.Model(section, RunInfo(task="lm", seq_len=section.max_len), rngs=nnx.Rngs(params=0))
  hf.save_folder(path, section, model)
  return path


def run_workdir(path, spec, overrides=()):
  """A workdir holding the config.json a run of `spec` wrote (as the trainer writes it), no checkpoint."""
  path.mkdir(parents=True)
  config = lra_core.load_config(spec, ["train.seq_len=64", *overrides])
  (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
  return path


def listing(folder) -> dict:
  """Every path under `folder`, relative, with its bytes (None for a folder)."""
  return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def an_existing_workdir(path):
  """A workdir a refused start must leave as it is: a finished run's files and an empty folder."""
  path.mkdir()
  (path / "config.json").write_text('{"model": {"name": "transformer"}}\n')
  (path / "summary.json").write_text('{"step": 4}\n')
  (path / "metrics.jsonl").write_text('{"step": 2, "train_loss": 5.0}\n')
  (path / "tensorboard").mkdir()
  return path


def refusal(config, workdir) -> str:
  """The one sentence `train_and_evaluate` refuses `config` with, the workdir left as it was."""
  existed = workdir.exists()
  before = listing(workdir) if existed else None
  with pytest.raises(ConfigError) as e:
    train_and_evaluate(config, workdir)
  said = str(e.value)
  assert "\n" not in said and said.endswith("."), said
  if existed:
    assert listing(workdir) == before
  else:
    assert not workdir.exists()
  return said


def test_a_folder_start_names_every_setting_off_at_once_and_leaves_no_workdir(tmp_path):
  folder = hf_folder(tmp_path / "pythia")
  config = lra_core.load_config(TINY, [*AS_OURS, *THREE_OFF, f"train.init_from=hf:{folder}"])
  said = refusal(config, tmp_path / "run")
  assert said == (
    f"train.init_from hf:{folder}: 3 settings differ from the checkpoint: model.num_layers 4 here, 2 there; "
    "model.num_heads 2 here, 4 there; model.d_ff 64 here, 80 there; "
    "set --config.model.num_layers=2 --config.model.num_heads=4 --config.model.d_ff=80."
  )
  assert refusal(config, an_existing_workdir(tmp_path / "old")) == said
  # The overrides it gives are the fix: the start is then accepted (with compute settings of its own).
  fix = re.search(r"; set (.*)\.$", said).group(1).split()
  fixed = lra_core.load_config(TINY, [*AS_OURS, *THREE_OFF, *COMPUTE_ONLY, *fix, f"train.init_from=hf:{folder}"])
  check_source(fixed, tmp_path / "run")
  # One setting off reads as one.
  one = lra_core.load_config(TINY, [*AS_OURS, "model.d_ff=64", f"train.init_from=hf:{folder}"])
  assert refusal(one, tmp_path / "run") == (
    f"train.init_from hf:{folder}: model.d_ff is 64 here and 80 in the checkpoint; set --config.model.d_ff=80."
  )


def test_a_folder_start_of_a_latte_run_without_a_window_is_refused_before_the_workdir(tmp_path):
  folder = hf_folder(tmp_path / "pythia")
  config = lra_core.load_config("configs/c4/latte.py:tiny", [f"train.init_from=hf:{folder}"])
  assert "as Latte-Macchiato: set model.window" in refusal(config, tmp_path / "run")


def test_a_run_workdir_start_names_every_setting_off_at_once_and_leaves_the_workdir_as_it_was(tmp_path):
  source = run_workdir(tmp_path / "source", TINY)
  config = lra_core.load_config(TINY, ["train.seq_len=64", *THREE_OFF, *COMPUTE_ONLY, f"train.init_from={source}"])
  said = refusal(config, tmp_path / "run")
  assert said == (
    f"train.init_from {str(source)!r}: 3 settings differ from the checkpoint: model.d_ff 64 here, 128 there; "
    "model.num_heads 2 here, 4 there; model.num_layers 4 here, 2 there; "
    "set --config.model.d_ff=128 --config.model.num_heads=4 --config.model.num_layers=2."
  )
  assert refusal(config, an_existing_workdir(tmp_path / "old")) == said
  fixed = lra_core.load_config(TINY, ["train.seq_len=64", *COMPUTE_ONLY, f"train.init_from={source}"])
  check_source(fixed, tmp_path / "run")
  # Another family's run is one sentence too.
  flash = lra_core.load_config("configs/c4/flash.py:tiny", [f"train.init_from={source}"])
  assert refusal(flash, tmp_path / "run") == (
    f"train.init_from {str(source)!r} holds a transformer model, whose parameters a flash run cannot start from; "
    "give the workdir of a flash run."
  )


def test_a_resumed_run_is_not_checked_against_its_source(tmp_path):
  """A workdir with a checkpoint resumes it: the source of its warm start may have changed or gone."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  gone = lra_core.load_config(TINY, [f"train.init_from={tmp_path / 'gone'}"])
  check_source(gone, workdir)
  with pytest.raises(ConfigError, match=r"has no config\.json; expected the workdir of a run\.$"):
    check_source(gone, tmp_path / "fresh")
  (tmp_path / "bare").mkdir()
  (tmp_path / "bare" / "config.json").write_text("{}")
  bare = lra_core.load_config(TINY, [f"train.init_from={tmp_path / 'bare'}"])
  with pytest.raises(ConfigError, match=r"its config\.json holds no model section; expected the workdir of a run\.$"):
    check_source(bare, tmp_path / "fresh")


def test_an_uptraining_start_compares_the_transformer_it_uptrains_from(tmp_path):
  spec = "configs/c4/block_transformer.py:tiny"
  vanilla = run_workdir(tmp_path / "vanilla", f"{spec},vanilla")
  check_source(lra_core.load_config(f"{spec},uptrain", [f"train.init_from={vanilla}"]), tmp_path / "up")
  wider = run_workdir(tmp_path / "wider", f"{spec},vanilla", ["model.d_ff=96", "model.vocab_size=300"])
  said = refusal(lra_core.load_config(f"{spec},uptrain", [f"train.init_from={wider}"]), tmp_path / "up")
  assert said.startswith(
    f"train.init_from {str(wider)!r}: the transformer this block_transformer run uptrains from differs from the "
    "checkpoint in 2 settings: model.vocab_size 258 here, 300 there; model.d_ff "
  ), said
  block = run_workdir(tmp_path / "block", f"{spec},uptrain")
  said = refusal(lra_core.load_config(f"{spec},uptrain", [f"train.init_from={block}"]), tmp_path / "up")
  assert "holds a block_transformer model, not a vanilla transformer" in said


def test_a_parameter_shape_found_to_differ_later_is_one_sentence(tmp_path):
  """model.max_len may change (a run may read longer sequences than its source), but where it sizes a
  learned position table the parameters differ: the warm start names the first that does."""
  source = run_workdir(tmp_path / "source", TINY, ["model.max_len=64"])
  saved = lra_core.load_config(TINY, ["train.seq_len=64", "model.max_len=64"])
  spec = make_state_spec(saved, layout.make_mesh(saved.mesh), optim.make_optimizer(saved)[0])
  checkpoints = Checkpointer(source, async_save=False)
  checkpoints.save(1, spec.init(), {"next_batch": 1})
  checkpoints.close()
  config = lra_core.load_config(TINY, ["train.seq_len=64", "model.max_len=128", f"train.init_from={source}"])
  check_source(config, tmp_path / "run")
  spec = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0])
  with pytest.raises(ConfigError) as e:
    warm_start(config, spec, spec.init(), str(source), layout.make_mesh(config.mesh))
  said = str(e.value)
  assert "\n" not in said and re.fullmatch(
    rf"train\.init_from {re.escape(repr(str(source)))} holds a transformer model whose parameters do not match "
    r"this transformer model \(parameter [\w.]+: shape \[128, 64\] here, shape \[64, 64\] there\)\.",
    said,
  ), said
