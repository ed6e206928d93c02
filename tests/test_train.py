"""End-to-end runs of the one trainer: every task, resume, checkpoints, accumulation, CLI."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import lra_core
from lra_core.run.metrics import read_metrics
from lra_core.train import coverage, train_and_evaluate

LISTOPS = "configs/lra/listops/transformer.py:tiny"
pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # a stopped and resumed run compiles once
ENWIK8 = "configs/enwik8/transformer.py:tiny"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  rng = np.random.default_rng(0)
  words = np.array(["alpha", "beta", "gamma", "delta", "the", "a", "of", "and"])
  path = tmp_path_factory.mktemp("text") / "corpus.txt"
  path.write_text(" ".join(rng.choice(words, size=6000)))
  return str(path)


@pytest.fixture(scope="module")
def aan_dir(tmp_path_factory):
  """A small retrieval set in the LRA AAN TSV layout: label, id1, id2, text1, text2."""
  rng = np.random.default_rng(1)
  folder = tmp_path_factory.mktemp("aan")
  topics = ["graph parsing", "speech tagging", "neural translation", "topic models"]
  for name, n in (("train", 64), ("eval", 16), ("test", 16)):
    lines = []
    for i in range(n):
      a, b = rng.integers(len(topics), size=2)
      lines.append(f"{int(a == b)}\tid{i}a\tid{i}b\tA paper on {topics[a]}.\tWe study {topics[b]} here.")
    (folder / f"new_aan_pairs.{name}.tsv").write_text("\n".join(lines) + "\n")
  return str(folder)


def listops(cache_dir, *overrides):
  return lra_core.load_config(LISTOPS, [f"data.cache_dir={cache_dir}", *overrides])


def test_classify_end_to_end_writes_all_outputs(tmp_path, cache_dir):
  summary = train_and_evaluate(listops(cache_dir, "train.eval_every=2"), tmp_path)
  assert 0.0 <= summary["test_accuracy"] <= 1.0 and np.isfinite(summary["test_loss"])
  assert np.isfinite(summary["param_checksum"])
  assert json.loads((tmp_path / "summary.json").read_text())["param_checksum"] == summary["param_checksum"]
  assert json.loads((tmp_path / "config.json").read_text())["task"] == "classify"
  records = read_metrics(tmp_path)
  assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4]  # tiny: log_every 0, every step of 4
  assert any("val_accuracy" in r for r in records)
  # What val_* and test_* cover (tiny: 2 eval batches of 8 of the 40 validation examples), in the summary only.
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert (saved["val_examples"], saved["val_split_examples"], saved["test_examples"]) == (16, 40, 40)
  said = "val_* over 16 of the 40 validation examples (train.eval_batches), test_* over all 40 test examples"
  assert coverage(saved) == said
  assert not any("val_examples" in r for r in records)
  assert list((tmp_path / "tensorboard").iterdir())
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4]


def test_stopped_and_resumed_run_matches_uninterrupted(tmp_path, cache_dir):
  config = listops(cache_dir, "train.steps=6", "model.dropout=0.1")
  full = train_and_evaluate(config, tmp_path / "full")
  assert train_and_evaluate(config, tmp_path / "split", stop_at_step=3) == {"stopped_at": 3}
  resumed = train_and_evaluate(config, tmp_path / "split")
  assert resumed["param_checksum"] == full["param_checksum"]
  assert resumed["test_loss"] == full["test_loss"]
  # Running a finished workdir again changes nothing.
  assert train_and_evaluate(config, tmp_path / "split")["param_checksum"] == full["param_checksum"]


@pytest.mark.slow
def test_lm_with_update_windows_and_grad_accumulation(tmp_path, text_file):
  overrides = [f"data.path={text_file}", "train.steps=4", "train.eval_batches=1"]
  windows = train_and_evaluate(lra_core.load_config(ENWIK8, overrides + ["train.update_len=16"]), tmp_path / "windows")
  assert {"test_bits_per_byte", "test_perplexity", "val_loss"} <= set(windows)
  assert windows["test_bits_per_byte"] == pytest.approx(windows["test_loss"] / np.log(2))
  # Accumulating 2 micro-batches gives the full-batch gradient (without dropout). SGD, because
  # Adam's first steps are sign-like and would amplify float rounding in near-zero gradients.
  sgd = overrides + ["optim.name=sgd", "optim.lr=0.5", "optim.clip_norm=0.0", "model.dropout=0.0"]
  full = train_and_evaluate(lra_core.load_config(ENWIK8, sgd), tmp_path / "full")
  accum = train_and_evaluate(lra_core.load_config(ENWIK8, sgd + ["train.grad_accum_steps=2"]), tmp_path / "accum")
  assert accum["param_checksum"] == pytest.approx(full["param_checksum"], rel=1e-7)
  assert accum["param_checksum"] != pytest.approx(windows["param_checksum"], rel=1e-7)


def test_mlm_end_to_end(tmp_path, text_file):
  config = lra_core.load_config("configs/enwik8/transformer.py:tiny,mlm", [f"data.path={text_file}"])
  summary = train_and_evaluate(config, tmp_path)
  assert np.isfinite(summary["test_loss"]) and 0 <= summary["test_accuracy"] <= 1


def test_retrieval_end_to_end(tmp_path, aan_dir):
  config = lra_core.load_config("configs/lra/retrieval/transformer.py:tiny", [f"data.dir={aan_dir}"])
  summary = train_and_evaluate(config, tmp_path)
  assert 0 <= summary["test_accuracy"] <= 1


def test_evaluate_and_sample_from_a_workdir(tmp_path, text_file, caplog):
  from lra_core.evaluate import evaluate
  from lra_core.sample import sample

  config = lra_core.load_config(ENWIK8, [f"data.path={text_file}"])
  with caplog.at_level("INFO"):
    summary = train_and_evaluate(config, tmp_path)
  # The last log line gives the checksum in full, as runs are compared by it.
  assert f"param_checksum={summary['param_checksum']}" in caplog.text
  result = evaluate(config, tmp_path, "test")
  assert result["step"] == 4 and result["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
  assert (tmp_path / "eval_test_4.json").exists()
  texts = sample(config, tmp_path, prompt="the ", num_samples=2, max_new_tokens=5, temperature=0.0)
  assert texts[0] == texts[1] and texts[0].startswith("the ")
  # By default as many new tokens as the tiny model's learned position table leaves after the prompt
  # (it holds train.seq_len), and asking for more is one sentence.
  limit = config.train.seq_len
  assert sample(config, tmp_path, prompt="the ", temperature=0.0)[0].startswith("the ")  # 100 would not fit
  with pytest.raises(
    lra_core.DecodingError, match=rf"exceed the {limit} positions.*--max_new_tokens {limit - 4} or less\.$"
  ):
    sample(config, tmp_path, prompt="the ", max_new_tokens=limit)


def test_a_start_refused_for_its_data_leaves_no_workdir_behind(tmp_path):
  config = lra_core.load_config(ENWIK8, [f"data.path={tmp_path / 'missing'}"])
  with pytest.raises(lra_core.UserError, match="does not exist"):
    train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_data_and_model_mismatch_is_a_clear_error(tmp_path, cache_dir):
  with pytest.raises(lra_core.ConfigError, match="model.vocab_size 8 is smaller"):
    train_and_evaluate(listops(cache_dir, "model.vocab_size=8"), tmp_path)
  with pytest.raises(lra_core.ConfigError, match="num_classes 4 does not match"):
    train_and_evaluate(listops(cache_dir, "model.num_classes=4"), tmp_path)


def test_non_finite_loss_stops_with_step_and_metric(tmp_path, cache_dir):
  config = listops(cache_dir, "optim.lr=1e30", "optim.schedule=constant", "optim.warmup_steps=0", "train.log_every=1")
  with pytest.raises(lra_core.TrainingDiverged, match=r"non-finite \w+ \(\w+\) at step \d"):
    train_and_evaluate(config, tmp_path)


def run_cli(*args, cwd=None):
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def own_lines(stderr: str) -> list[str]:
  """stderr without what the CUDA plugin of the test extra (gpu-compile) logs at every start on a host
  without a CUDA driver (absl's pre-initialisation notice and "cudart_stub.cc ... Could not find cuda
  drivers"): the library's lines, not the command's."""
  return [
    line
    for line in stderr.strip().splitlines()
    if "cudart_stub.cc" not in line and not line.startswith("WARNING: All log messages before absl::")
  ]


def test_cli_reports_config_errors_in_one_sentence(tmp_path):
  proc = run_cli("lra_core.train", f"--config={LISTOPS}", "--config.train.stepz=3", f"--workdir={tmp_path}")
  assert proc.returncode == 2
  # Nothing else either: a bad config starts no backend, so the plugins of the test extra say nothing.
  assert proc.stderr.splitlines() == [
    "error: unknown config key 'train.stepz'; did you mean 'train.steps' or 'train.seed' or 'train.tracker'."
  ]


@pytest.mark.parametrize(
  "command, folder, line",
  [
    (
      ["-m", "lra_core.train", f"--config={LISTOPS}", "--confg.train.steps=3"],
      ".",
      "error: --confg.train.steps=3 is not an option of python -m lra_core.train; did you mean --config.train.steps=3?",
    ),
    (["-m", "lra_core.evaluate", "--workdir={tmp}/nope"], ".", "error: workdir '{tmp}/nope' does not exist; "),
    # Run inside scripts/, where sys.argv[0] names no folder.
    (["plot.py", "--metrics=train_los", "{tmp}"], "scripts", "error: no workdir logged 'train_los'; "),
    # A script that imports JAX itself.
    (["scripts/tpu_variants.py", "--topology=nope"], ".", "error: topology 'nope' is not known; "),
  ],
  ids=["train", "evaluate", "plot_inside_scripts", "tpu_variants"],
)
def test_every_command_says_its_one_line_without_accelerator_plugin_noise(tmp_path, command, folder, line):
  """On a host without accelerators, with the CUDA plugin of the test extra installed and JAX_PLATFORMS=cpu (as
  the suite sets it), a command's error is its one line: the plugin's start-up lines are dropped
  (lra_core/runtime/quiet_start.py)."""
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 2.0}) + "\n")
  root = pathlib.Path(__file__).resolve().parent.parent
  proc = subprocess.run(
    [sys.executable, *(a.format(tmp=tmp_path) for a in command)],
    cwd=root / folder,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(line.format(tmp=tmp_path)), proc.stderr[-3000:]


@pytest.mark.slow
def test_cli_trains_tiny_config_from_another_directory(tmp_path, cache_dir):
  proc = run_cli(
    "lra_core.train",
    f"--config={LISTOPS}",
    f"--workdir={tmp_path / 'run'}",
    f"--config.data.cache_dir={cache_dir}",
    "--config.train.steps=2",
    cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "test_accuracy=" in proc.stdout and "validation examples (train.eval_batches), test_* over all" in proc.stdout
  assert (tmp_path / "run" / "summary.json").exists()
