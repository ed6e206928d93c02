"""scripts/sweep.py runs a grid of config overrides and gathers the runs' summaries into tables.

One module fixture trains a real 2x2 sweep (2 or 3 steps of a 1-layer ListOps model on the
fixture's files, over train.steps x train.eval_batches: neither changes a compiled function, so
the four runs compile once on a cold cache); the other tests replace the trainer with a stub, as
they test the sweep, not training.
"""

import csv
import gc
import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import pytest

import fixtures.listops
from lra_core import cli, sweep
from lra_core.errors import ConfigError, DataError

LISTOPS = fixtures.listops.SPEC
FAST = ["--config.train.test_at_end=False", "--config.model.num_layers=1"]
NAMES = ["steps-2_eval_batches-1", "steps-2_eval_batches-2", "steps-3_eval_batches-1", "steps-3_eval_batches-2"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
  """(workdir, argv) of a trained 2x2 sweep: train.steps=2,3 x train.eval_batches=1,2."""
  data = fixtures.listops.build(tmp_path_factory.mktemp("listops"))
  workdir = tmp_path_factory.mktemp("sweep")
  argv = [
    f"--config={LISTOPS}",
    "--sweep",
    "train.steps=2,3",
    "--sweep=train.eval_batches=1,2",
    f"--workdir={workdir}",
    *(f"--config.{o}" for o in data),
    *FAST,
  ]
  assert sweep.main(argv) == 0
  return workdir, argv


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def stub_trainer(monkeypatch, fail_lr=None):
  """Replaces the trainer: writes a fixed summary.json, or raises DataError when optim.lr == fail_lr."""
  calls = []

  def train_and_evaluate(config, workdir):
    calls.append(workdir)
    if config.optim.lr == fail_lr:
      raise DataError("data.dir '/nowhere' has no basic_train.tsv.")
    summary = {
      "step": config.train.steps,
      "num_params": 1234,
      "val_loss": 1.23456789,
      "val_accuracy": 0.5,
      "param_checksum": 0.123456789012,
    }
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(workdir) / "summary.json").write_text(json.dumps(summary))
    return summary

  monkeypatch.setattr(sweep.train, "train_and_evaluate", train_and_evaluate)
  return calls


@pytest.mark.slow
def test_grid_trains_every_run_and_tables_their_summaries(grid):
  workdir, _ = grid
  summaries = [json.loads((workdir / name / "summary.json").read_text()) for name in NAMES]
  rows = read_csv(workdir / "results.csv")
  assert [(r["train.steps"], r["train.eval_batches"], r["step"]) for r in rows] == [
    ("2", "1", "2"),
    ("2", "2", "2"),
    ("3", "1", "3"),
    ("3", "2", "3"),
  ]
  columns = list(rows[0])
  # val_examples / val_split_examples: what val_* cover (train.eval_batches of the validation split).
  metrics = ["val_accuracy", "val_examples", "val_loss", "val_split_examples", "step"]
  assert columns[:7] == ["train.steps", "train.eval_batches", *metrics]
  assert [int(r["val_examples"]) for r in rows] == [s["val_examples"] for s in summaries] == [8, 12, 8, 12]
  assert columns[-1] == "param_checksum" and "status" not in columns
  assert [float(r["val_loss"]) for r in rows] == [s["val_loss"] for s in summaries]  # full precision
  checksums = [s["param_checksum"] for s in summaries]
  assert checksums[0] == checksums[1] != checksums[2] == checksums[3]  # each run got its own train.steps
  table = (workdir / "results.md").read_text().splitlines()
  assert len(table) == 6 and table[0].startswith("| train.steps | train.eval_batches | " + " | ".join(metrics[:3]))
  last = summaries[3]
  counts = f"{last['val_examples']} | {last['val_loss']:.4g} | {last['val_split_examples']}"
  assert table[5].startswith(f"| 3 | 2 | {last['val_accuracy']:.4g} | {counts} | 3 |")
  record = json.loads((workdir / "sweep.json").read_text())
  assert [r["name"] for r in record["runs"]] == NAMES
  assert record["runs"][1]["overrides"] == ["train.steps=2", "train.eval_batches=2"]


@pytest.mark.slow
def test_rerun_skips_finished_runs(grid, monkeypatch, tmp_path):
  workdir, argv = grid
  before = (workdir / "results.csv").read_text()
  calls = stub_trainer(monkeypatch)
  assert sweep.main(argv) == 0 and calls == []
  assert (workdir / "results.csv").read_text() == before
  copy = shutil.copytree(workdir, tmp_path / "sweep")
  assert sweep.main([*argv, f"--workdir={copy}", "--force"]) == 0 and len(calls) == 4
  assert sweep.main([*argv, f"--workdir={copy}", "--config.train.log_every=1"]) == 0  # not finished
  assert len(calls) == 8


@pytest.mark.slow
def test_collect_rebuilds_the_tables(grid, tmp_path):
  workdir = shutil.copytree(grid[0], tmp_path / "sweep")
  tables = {name: (workdir / name).read_text() for name in ("results.md", "results.csv")}
  for name in tables:
    (workdir / name).unlink()
  assert sweep.main(["--collect", f"--workdir={workdir}"]) == 0
  assert {name: (workdir / name).read_text() for name in tables} == tables
  (workdir / NAMES[2] / "summary.json").unlink()
  assert sweep.main(["--collect", f"--workdir={workdir}"]) == 1
  assert [r["status"] for r in read_csv(workdir / "results.csv")] == ["ok", "ok", "no summary.json", "ok"]


def test_product_and_zip_order():
  sweeps = {"a": ["1", "2"], "b": ["x", "y"]}
  assert sweep.grid(sweeps, zipped=False) == [
    {"a": "1", "b": "x"},
    {"a": "1", "b": "y"},
    {"a": "2", "b": "x"},
    {"a": "2", "b": "y"},
  ]
  assert sweep.grid(sweeps, zipped=True) == [{"a": "1", "b": "x"}, {"a": "2", "b": "y"}]
  with pytest.raises(ConfigError) as e:
    sweep.main(
      [
        f"--config={LISTOPS}",
        "--sweep",
        "model.d_model=32,64,128",
        "--sweep",
        "optim.lr=1e-3,3e-3",
        "--zip",
        "--dry-run",
      ]
    )
  assert str(e.value) == (
    "--zip needs the same number of values in every sweep, but model.d_model has 3, optim.lr has 2."
  )


def test_values_and_names():
  assert sweep.split_values("1, (2, 3),'a,b',[4,5]") == ["1", "(2, 3)", "'a,b'", "[4,5]"]
  assert (
    sweep.run_name({"model.dropout": "0.1", "data.dropout": "(1, 2)", "optim.lr": "1e-4"})
    == "model.dropout-0.1_data.dropout-1_2_lr-1e-4"
  )
  with pytest.raises(ConfigError, match="is not of the form KEY=V1,V2"):
    sweep.parse_sweep("optim.lr")


@pytest.mark.parametrize(
  "swept,sentence",
  [
    ("optim.lrr=1e-3", "error: unknown config key 'optim.lrr'; did you mean 'optim.lr'"),
    ("train.steps=2,0", "error: train.steps must be a positive integer, got 0."),  # the last run only
  ],
)
def test_bad_run_fails_before_any_run(swept, sentence, tmp_path, monkeypatch, capsys):
  calls = stub_trainer(monkeypatch)
  argv = [f"--config={LISTOPS}", "--sweep", swept, f"--workdir={tmp_path / 'sweep'}"]
  with pytest.raises(SystemExit) as e:
    cli.run(lambda: sweep.main(argv))
  assert e.value.code == 2 and capsys.readouterr().err.startswith(sentence)
  assert calls == [] and not (tmp_path / "sweep").exists()


def test_launcher_and_dry_run_print_the_commands(tmp_path, capsys):
  workdir = tmp_path / "sweep"
  argv = [
    f"--config={LISTOPS}",
    "--sweep",
    "model.d_model=32,64",
    f"--workdir={workdir}",
    "--config.data.dir=/data/list ops",
  ]
  assert sweep.main([*argv, "--launcher=python scripts/launch_tpu.py --name=x --zone=y"]) == 0
  assert capsys.readouterr().out.splitlines() == [
    f"python scripts/launch_tpu.py --name=x --zone=y -- --config={LISTOPS} --workdir={workdir}/d_model-{d} "
    f"'--config.data.dir=/data/list ops' --config.model.d_model={d}"
    for d in (32, 64)
  ]
  assert json.loads((workdir / "sweep.json").read_text())["overrides"] == ["data.dir=/data/list ops"]
  assert sweep.main([*argv, f"--workdir={tmp_path / 'dry'}", "--dry-run"]) == 0
  assert capsys.readouterr().out.splitlines()[1] == (
    f"python -m lra_core.train --config={LISTOPS} --workdir={tmp_path}/dry/d_model-64 "
    "'--config.data.dir=/data/list ops' --config.model.d_model=64"
  )
  assert not (tmp_path / "dry").exists()


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
  calls = stub_trainer(monkeypatch, fail_lr=3e-3)
  workdir = tmp_path / "sweep"
  assert sweep.main([f"--config={LISTOPS}", "--sweep", "optim.lr=3e-3,1e-3", f"--workdir={workdir}"]) == 1
  assert len(calls) == 2
  rows = read_csv(workdir / "results.csv")
  assert list(rows[0]) == ["optim.lr", "val_accuracy", "val_loss", "step", "num_params", "param_checksum", "status"]
  assert [r["status"] for r in rows] == ["failed: data.dir '/nowhere' has no basic_train.tsv.", "ok"]
  assert rows[1]["val_loss"] == "1.23456789"
  assert capsys.readouterr().out.splitlines()[-1] == "| 1e-3 | 0.5 | 1.235 | 4 | 1234 | 0.123456789012 | ok |"


@pytest.mark.parametrize("why, status", [("interrupted", cli.EXIT_INTERRUPTED), ("preempted", cli.EXIT_PREEMPTED)])
def test_a_run_that_saves_at_ctrl_c_or_sigterm_ends_the_sweep(why, status, tmp_path, monkeypatch, capsys):
  """The trainer saved and left (Ctrl-C: 130, SIGTERM: 75): the sweep starts no other run and exits as
  the trainer does; the same command continues."""
  calls = []

  def train_and_evaluate(config, workdir):
    calls.append(workdir)
    return {"stopped_at": 3, why: True}

  monkeypatch.setattr(sweep.train, "train_and_evaluate", train_and_evaluate)
  workdir = tmp_path / "sweep"
  assert sweep.main([f"--config={LISTOPS}", "--sweep", "optim.lr=3e-3,1e-3", f"--workdir={workdir}"]) == status
  assert len(calls) == 1
  assert capsys.readouterr().out.startswith(f"{why}: run ")


def _ctrl_c_in_a_callback(phase, info):
  if phase == "start":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in this frame: what it raises is printed and dropped


# The callback's KeyboardInterrupt is printed and dropped by design: that is the case under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", ["in a callback", "in the background"])
def test_a_ctrl_c_as_a_run_ends_starts_no_other_run(where, tmp_path, monkeypatch):
  """A Ctrl-C after a run's loop (its final evaluation, its `done:` line) ends the sweep with 130 and
  starts no other run: also where its KeyboardInterrupt is raised in a callback that only prints it (as
  JAX's garbage-collection hook does), and in a sweep started in the background, which inherits SIGINT
  ignored. Before, the next run started and the sweep exited 0."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are set from the main thread only")
  calls = []

  def train_and_evaluate(config, workdir):
    calls.append(workdir)
    if where == "in a callback":
      gc.callbacks.append(_ctrl_c_in_a_callback)
      try:
        gc.collect()
      finally:
        gc.callbacks.remove(_ctrl_c_in_a_callback)
    else:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
    return {"step": 4, "val_loss": 1.0}

  monkeypatch.setattr(sweep.train, "train_and_evaluate", train_and_evaluate)
  argv = [f"--config={LISTOPS}", "--sweep", "optim.lr=3e-3,1e-3", f"--workdir={tmp_path / 'sweep'}"]
  inherited = signal.signal(
    signal.SIGINT, signal.SIG_IGN if where == "in the background" else signal.default_int_handler
  )
  try:
    with pytest.raises(SystemExit) as exit_:
      cli.run(lambda: sys.exit(sweep.main(argv)))
  finally:
    signal.signal(signal.SIGINT, inherited)
  assert exit_.value.code == cli.EXIT_INTERRUPTED and len(calls) == 1
