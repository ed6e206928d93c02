"""Checkpoints that cannot be read, changed configs, non-finite steps and bad token ids.

The trainer runs here share one small ListOps config, so they compile once."""

import gc
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import fixtures.listops
import lra_core
from lra_core import layout
from lra_core.checkpoints import read_failures, save_limit
from lra_core.checkpoints.checkpointer import Checkpointer, restore_params
from lra_core.checkpoints.init_from import warm_start
from lra_core.checkpoints.saved_config import load_workdir_config
from lra_core.errors import ConfigError, DataError, StoreFailure
from lra_core.run import data_setup, optim
from lra_core.run.metrics import read_metrics
from lra_core.run.state import make_state_spec, param_checksum
from lra_core.train import train_and_evaluate

SPEC = fixtures.listops.SPEC
# collect_garbage: restores made to fail here (conftest.py); the runs' steps are compiled once and read back
pytestmark = pytest.mark.usefixtures("persistent_compile_cache", "collect_garbage")
FAST = ["train.test_at_end=False", "train.eval_batches=1", "train.checkpoint_every=2", "train.steps=6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return fixtures.listops.build(tmp_path_factory.mktemp("listops"))


def config(data, *overrides):
  return lra_core.load_config(SPEC, [*data, *FAST, *overrides])


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  return workdir, train_and_evaluate(config(data), workdir)


def _corrupt(step_dir):
  """Overwrites every file of a checkpoint's state with garbage of the same size."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  assert files
  for p in files:
    p.write_bytes(b"\x00garbage" * (p.stat().st_size // 8 + 1))


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(data, uninterrupted, tmp_path, caplog):
  reference, summary = uninterrupted
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "summary.json").unlink()
  _corrupt(workdir / "checkpoints" / "6")
  again = train_and_evaluate(config(data), workdir)
  assert "checkpoint step 6" in caplog.text and "resuming from step 4 instead" in caplog.text
  # Steps 5 and 6 were trained again, to the same parameters; the bad folder was kept aside.
  assert again["param_checksum"] == summary["param_checksum"]
  assert (workdir / "unreadable_checkpoints" / "6" / "state").is_dir()
  assert Checkpointer(workdir, async_save=False).all_steps() == [2, 4, 6]


def test_a_warm_start_reads_the_newest_readable_checkpoint_of_its_source(data, uninterrupted, tmp_path, caplog):
  """train.init_from (and evaluate, sample) fall back like a resume: a damaged newest checkpoint (its
  metadata too: that read was outside the fallback, a DATA_LOSS traceback) gives way to the one before;
  none readable, or a damaged config.json, is one sentence. Nothing of the source run is moved."""
  reference, _ = uninterrupted
  source = tmp_path / "source"
  shutil.copytree(reference, source)
  _corrupt(source / "checkpoints" / "6")
  cfg = config(data)
  abstract = make_state_spec(cfg, layout.make_mesh(cfg.mesh), optim.make_optimizer(cfg)[0]).abstract
  _, step = restore_params(source, abstract)
  assert step == 4 and "checkpoint step 6 in" in caplog.text and "; using step 4" in caplog.text
  assert (source / "checkpoints" / "6").is_dir()
  for older in (2, 4):
    _corrupt(source / "checkpoints" / str(older))
  with pytest.raises(
    lra_core.CheckpointError, match=r"^checkpoint step 6 in .* cannot be read \(.*\) and no older one can\.$"
  ):
    restore_params(source, abstract)
  (source / "config.json").write_bytes(b'{"model": \xff')
  with pytest.raises(
    ConfigError, match=r"^train\.init_from .*: its config\.json cannot be read \(UnicodeDecodeError: "
  ):
    warm_start(cfg, None, None, str(source), None)


def test_a_resume_over_changed_data_files_warns_and_over_a_shortened_one_stops(tmp_path, caplog):
  """Each checkpoint keeps the size and mtime of the data files the run read: a resume over a rewritten
  one is one warning (it continues), over one cut short one sentence before any step (the saved data
  position no longer names the same examples); the checkpoints are untouched."""
  data = fixtures.listops.build(tmp_path / "data")
  train_file = next((tmp_path / "data").rglob("basic_train.tsv"))
  workdir = tmp_path / "run"
  train_and_evaluate(config(data), workdir, stop_at_step=4)
  # the checkpoint names the table of files, kept once under data_files/ (not a copy in every meta)
  meta = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
  table = json.loads((workdir / "data_files" / f"{meta['data_files']}.json").read_text())
  assert str(train_file.resolve()) in table and len(list((workdir / "data_files").iterdir())) == 1
  # Rewritten in place, its size and mtime kept (`touch -r`): the content sample tells.
  stat, content = train_file.stat(), train_file.read_bytes()
  train_file.write_bytes(content.replace(b"MAX", b"MIN", 1))
  os.utime(train_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(config(data, "train.steps=5"), workdir)
  said = [r.getMessage() for r in caplog.records if "data file(s) changed" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith("1 data file(s) changed since checkpoint step 4 was saved ("), said
  caplog.clear()
  with open(train_file, "a") as f:
    f.write(train_file.read_text().splitlines(keepends=True)[1])  # one more example
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(config(data), workdir)
  said = [r.getMessage() for r in caplog.records if "data file(s) changed" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith("1 data file(s) changed since checkpoint step 5 was saved ("), said
  lines = train_file.read_text().splitlines(keepends=True)
  train_file.write_text("".join(lines[: len(lines) // 2]))
  with pytest.raises(DataError, match=rf"^data file {re.escape(str(train_file))} holds [\d,]+ bytes where it held"):
    train_and_evaluate(config(data, "train.steps=8"), workdir)
  assert Checkpointer(workdir, async_save=False).all_steps() == [4, 5, 6]  # 5: a finished length, kept


def test_one_flipped_byte_falls_back_to_the_previous_checkpoint(data, uninterrupted, tmp_path, caplog):
  """A byte flipped in the middle of the largest data file of the newest checkpoint: whether the chunk
  it lands in no longer decompresses or decodes to other values (caught by the saved digests), the
  step is unreadable and the run resumes from the one before, ending where the uninterrupted run did."""
  reference, summary = uninterrupted
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "summary.json").unlink()
  largest = max((p for p in (workdir / "checkpoints" / "6" / "state").rglob("*") if p.is_file()), key=_size)
  raw = bytearray(largest.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  largest.write_bytes(bytes(raw))
  again = train_and_evaluate(config(data), workdir)
  assert "checkpoint step 6" in caplog.text and "resuming from step 4 instead" in caplog.text
  assert again["param_checksum"] == summary["param_checksum"]


def test_data_that_reads_but_differs_from_what_was_saved_is_caught_by_its_digest(data, uninterrupted, tmp_path):
  """Silent corruption: step 6 rewritten with one byte of one Adam moment changed, its saved meta (and
  digests) kept. The restore names the array, and resuming falls back to step 4."""
  reference, summary = uninterrupted
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "summary.json").unlink()
  cfg = config(data)
  abstract = make_state_spec(cfg, layout.make_mesh(cfg.mesh), optim.make_optimizer(cfg)[0]).abstract
  ckpt = Checkpointer(workdir, async_save=False)
  state, meta = ckpt.restore(6, abstract)
  for tree in (state["opt_state"][0].mu, state["params"]):  # an Adam moment, and a parameter
    array = tree["embed"]["embedding"]
    flipped = np.asarray(array).copy()
    flipped.view(np.uint8)[5] ^= 0x01
    tree["embed"]["embedding"] = jax.device_put(flipped, array.sharding)
  shutil.rmtree(workdir / "checkpoints" / "6")
  ckpt.manager.reload()
  args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}  # the old digests
  ckpt.manager.save(6, args=ocp.args.Composite(**args), force=True)
  ckpt.wait()
  corrupted = r"6 holds corrupted data: array \['opt_state'\]\[0\]\.mu\['embed'\]\['embedding'\] does not match"
  with pytest.raises(lra_core.CheckpointError, match=corrupted):
    ckpt.restore(6, abstract)
  ckpt.close()
  # Evaluation, sampling and warm starts read the parameters alone, checked as well.
  with pytest.raises(lra_core.CheckpointError, match=r"6 holds corrupted data: array \['params'\]\['embed'\]"):
    restore_params(workdir, abstract, step=6)
  assert train_and_evaluate(cfg, workdir)["param_checksum"] == summary["param_checksum"]
  assert (workdir / "unreadable_checkpoints" / "6").is_dir()


def test_deleted_checkpoint_files_are_not_called_a_model_mismatch(data, uninterrupted, tmp_path):
  """Every data file of every checkpoint deleted: the one sentence says the files are damaged or missing
  (not that the model or optimizer changed), without TensorStore's printed spec."""
  workdir = tmp_path / "run"
  shutil.copytree(uninterrupted[0], workdir)
  for p in (workdir / "checkpoints").glob("*/state/**/d/*"):
    p.unlink()
  with pytest.raises(lra_core.CheckpointError) as e:
    train_and_evaluate(config(data), workdir)
  message = str(e.value)
  assert "cannot be read: its files are damaged or missing" in message and "does not match" not in message, message
  assert "<bound method" not in message and "\n" not in message


def test_the_reads_left_running_after_a_failed_restore_end_quietly(data, uninterrupted, tmp_path, monkeypatch, caplog):
  """Orbax raises at the first unreadable array and closes its event loop while TensorStore still reads
  the others; as they end, each used to print a traceback (callbacks into the closed loop, errors nobody
  retrieved): over 150 of them, 65 KB, for this small model. The caller's one error is all that remains."""
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  monkeypatch.setattr(read_failures, "_failed", set(read_failures._failed))
  read_failures.install()  # as the first read of a process does (earlier tests' reads may still be ending)
  gc.collect()
  workdir = tmp_path / "run"
  shutil.copytree(uninterrupted[0] / "checkpoints" / "6", workdir / "checkpoints" / "6")
  for p in (workdir / "checkpoints" / "6").glob("state/**/d/*"):  # the arrays' data, not the metadata
    p.write_bytes(b"\x00garbage")
  cfg = config(data)
  abstract = make_state_spec(cfg, layout.make_mesh(cfg.mesh), optim.make_optimizer(cfg)[0]).abstract
  with pytest.raises(lra_core.CheckpointError, match="6 cannot be read: its files are damaged or missing"):
    Checkpointer(workdir, async_save=False).restore_latest(abstract)
  time.sleep(1.0)  # the leftover reads end within a second or two
  gc.collect()
  assert not seen, [str(u.exc_value)[:200] for u in seen[:3]]
  assert "never retrieved" not in caplog.text
  # Later errors about that folder are its leftovers too (in an object store's spec: bucket and path
  # apart); anything else still reaches the hook.
  read_failures.failed("gs://bucket/runs/a/checkpoints")
  leftovers = [f'Error reading "step/.zarray" in "{workdir}/checkpoints/6/state/"', "'path': 'runs/a/checkpoints/6/'"]
  for text in (*leftovers, "something else"):
    sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError(text), object=None))
  assert [str(u.exc_value) for u in seen] == ["something else"]


def _size(path):
  return path.stat().st_size


def test_no_readable_checkpoint_is_a_clear_error(data, uninterrupted, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(uninterrupted[0], workdir)
  for step in (2, 4, 6):
    _corrupt(workdir / "checkpoints" / str(step))
  with pytest.raises(lra_core.CheckpointError, match="cannot be read .* and no older one can"):
    train_and_evaluate(config(data), workdir)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]


def test_a_changed_config_is_refused_unless_forced(data, uninterrupted, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(uninterrupted[0], workdir)
  with pytest.raises(
    ConfigError,
    match=r"holds checkpoints of a different config \(train.seed: 0 -> 1\); "
    r"use another workdir, or --force",
  ):
    train_and_evaluate(config(data, "train.seed=1"), workdir)
  # Settings that do not change what is computed may differ.
  train_and_evaluate(config(data, "train.log_every=1", "train.eval_batches=2"), workdir)
  train_and_evaluate(config(data, "train.seed=1"), workdir, force=True)
  assert json.loads((workdir / "config.json").read_text())["train"]["seed"] == 1
  assert json.loads((workdir / "config.before_force.0.json").read_text())["train"]["seed"] == 0


def test_extending_a_finished_run_keeps_its_schedule_summary_and_final_checkpoint(data, tmp_path):
  """A larger train.steps on a finished run: the cosine schedule keeps its horizon (the extended run
  equals one planned with optim.decay_steps = the old train.steps), and the finished run's summary,
  config and final checkpoint are kept beside the extension's."""
  workdir, cosine = tmp_path / "run", ["optim.schedule=cosine", "optim.warmup_steps=2"]
  finished = train_and_evaluate(config(data, *cosine), workdir)
  extended = train_and_evaluate(config(data, *cosine, "train.steps=10", "train.keep_checkpoints=1"), workdir)
  planned = train_and_evaluate(config(data, *cosine, "train.steps=10", "optim.decay_steps=6"), tmp_path / "planned")
  assert extended["param_checksum"] == planned["param_checksum"]
  assert json.loads((workdir / "summary.step6.json").read_text()) == finished
  assert json.loads((workdir / "config.step6.json").read_text())["train"]["steps"] == 6
  assert json.loads((workdir / "config.json").read_text())["optim"]["decay_steps"] == 6
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [6, 10]
  # The same command again finds nothing changed: the finished extension is evaluated, not refused.
  again = train_and_evaluate(config(data, *cosine, "train.steps=10", "train.keep_checkpoints=1"), workdir)
  assert again["param_checksum"] == extended["param_checksum"]


def test_a_resumed_run_logs_and_times_what_the_uninterrupted_run_does(data, tmp_path):
  """Stopped at step 2 between the logs at 3 and 6: the log at 3 still averages steps 1-3, and the
  summary's training time counts both invocations."""
  every = config(data, "train.log_every=3")
  whole = train_and_evaluate(every, tmp_path / "whole")
  assert train_and_evaluate(every, tmp_path / "split", stop_at_step=2) == {"stopped_at": 2}
  before = Checkpointer(tmp_path / "split").restore(2, None)[1]["train_time_s"]
  resumed = train_and_evaluate(every, tmp_path / "split")
  assert resumed["param_checksum"] == whole["param_checksum"]
  losses = [
    [(r["step"], r["train_loss"]) for r in read_metrics(tmp_path / w) if "train_loss" in r] for w in ("whole", "split")
  ]
  assert losses[0] == losses[1] and [step for step, _ in losses[0]] == [3, 6]
  assert resumed["train_time_s"] > before > 0
  assert resumed["tokens_per_s"] * resumed["train_time_s"] == pytest.approx(
    6 * every.train.batch_size * every.train.seq_len
  )


def test_skip_mode_drops_non_finite_updates_and_counts_them(data, tmp_path):
  # Every update overflows the parameter norm, so all are skipped and nothing changes.
  skip = ["optim.lr=1e30", "optim.schedule=constant", "optim.warmup_steps=0", "train.skip_nonfinite=True"]
  cfg = config(data, *skip, "train.log_every=3")
  assert train_and_evaluate(cfg, tmp_path, stop_at_step=3) == {"stopped_at": 3}
  # Resumed, the count goes on; at the end, all 6 skipped is more than train.max_skipped_fraction (0.1).
  with pytest.raises(lra_core.TrainingDiverged, match=r"^6 of 6 steps were skipped .* train.max_skipped_fraction=0.1 "):
    train_and_evaluate(cfg, tmp_path)
  assert not (tmp_path / "summary.json").exists()
  # The run ended on its sentence with its last save complete, none left half-written.
  names = [p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")]
  assert "6" in names and all(name.isdigit() for name in names), names
  assert [r["skipped_steps"] for r in read_metrics(tmp_path) if "skipped_steps" in r] == [3, 6]
  summary = train_and_evaluate(config(data, *skip, "train.log_every=3", "train.max_skipped_fraction=1.0"), tmp_path)
  initial = make_state_spec(cfg, layout.make_mesh(cfg.mesh), optim.make_optimizer(cfg)[0]).init()
  assert summary["param_checksum"] == param_checksum(initial["params"])


def test_a_store_error_keeps_its_cause_however_long_its_paths(tmp_path, monkeypatch):
  """A sentence quoting a store's error is shortened in the middle, where the paths run: the cause at
  the end stays (cut at 200 characters it read `... ocdbt.proces)`), TensorStore's trailers go."""
  saver = Checkpointer(tmp_path / "run", async_save=False)
  deep = "/".join(["d" * 40] * 12)

  def full_disk(*args, **kwargs):
    raise ValueError(
      f'FAILED_PRECONDITION: Error writing local file "{tmp_path}/{deep}/ocdbt.process_0/d/a1b2": [OS error: '
      "No space left on device] [source locations='file_util_posix.cc:120\nfile_key_value_store.cc:400'] "
      "See full TensorStore details"
    )

  monkeypatch.setattr(saver.manager, "save", full_disk)
  with pytest.raises(StoreFailure) as failed:
    saver.save(1, {"w": np.zeros(2)}, {})
  said = str(failed.value)
  assert "[OS error: No space left on device]); the last complete checkpoint is none yet." in said, said
  assert said.startswith("writing checkpoint step 1 to ") and "source locations" not in said and len(said) < 600


def test_token_ids_outside_the_vocabulary_are_refused():
  cfg = lra_core.load_config(SPEC)
  vocab = cfg.model.vocab_size
  good = {"inputs": np.zeros((2, 4), np.int32), "targets": np.zeros((2,), np.int32)}
  data_setup.check_batch(good, cfg, 0)
  with pytest.raises(
    DataError,
    match=f"training batch 7 holds inputs id {vocab}, outside 0..{vocab - 1} "
    r"\(model.vocab_size\)",
  ):
    data_setup.check_batch(dict(good, inputs=np.full((2, 4), vocab, np.int32)), cfg, 7)
  with pytest.raises(DataError, match=r"targets id -1, outside 0..9 \(model.num_classes\)"):
    data_setup.check_batch(dict(good, targets=np.array([0, -1], np.int32)), cfg, 0)


def _files(workdir) -> dict:
  """Every file under `workdir` with its bytes (a refused start must change none of them)."""
  return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_runs_of_several_lengths_share_a_workdir_and_none_is_trained_back(data, tmp_path, caplog):
  """6 steps, extended to 10, then 12: each finished length is kept (summary, config, checkpoint) and the
  plain command of any of them evaluates it again, changing nothing of the longer runs; a train.steps
  below the last checkpoint that no run finished at is one sentence, every file left as it was."""
  workdir, cosine = tmp_path / "run", ["optim.schedule=cosine", "optim.warmup_steps=2"]
  six = train_and_evaluate(config(data, *cosine), workdir)
  ten = train_and_evaluate(config(data, *cosine, "train.steps=10"), workdir)
  before = _files(workdir)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    again = train_and_evaluate(config(data, *cosine), workdir)  # the first command, as typed the first time
  assert "train.steps=6: evaluating again the run that finished at step 6" in caplog.text
  assert "train.steps 6 -> 6" not in caplog.text and "train.steps 10 -> 6" not in caplog.text
  # Its metrics and its timing (kept from the first evaluation); goodput is the workdir's, over every start.
  assert {k: v for k, v in again.items() if k != "goodput"} == {k: v for k, v in six.items() if k != "goodput"}
  after = _files(workdir)
  assert json.loads(after.pop("summary.step6.json")) == again and set(after) == set(before) - {"summary.step6.json"}
  after.pop("goodput.json")  # this start's ledger added
  assert all(after[name] == before[name] for name in after), "evaluating step 6 changed the 10-step run's files"
  for steps in (8, 5):
    with pytest.raises(
      ConfigError,
      match=rf"holds checkpoints up to step 10, past train.steps={steps}, and a run cannot be trained back: set "
      r"train.steps to 6 to evaluate a run that finished there again, set train.steps=10 to evaluate the run that "
      r"finished there, or more to extend it, or use another workdir.$",
    ):
      train_and_evaluate(config(data, *cosine, f"train.steps={steps}"), workdir)
  assert {k: v for k, v in _files(workdir).items() if k not in ("summary.step6.json", "goodput.json")} == after
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert (
      train_and_evaluate(config(data, *cosine, "train.steps=10"), workdir)["param_checksum"] == ten["param_checksum"]
    )
  assert "train.steps 10 -> 10" not in caplog.text  # nothing changed, nothing said
  # Extended again: the 10-step run's summary is kept beside the 6-step one's, by name, without a clash.
  twelve = train_and_evaluate(config(data, *cosine, "train.steps=12"), workdir)
  assert json.loads((workdir / "summary.step10.json").read_text())["param_checksum"] == ten["param_checksum"]
  assert json.loads((workdir / "summary.json").read_text()) == twelve
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert {6, 10, 12} <= set(steps)
  with pytest.raises(ConfigError, match=r"set train.steps to 6 or 10 to evaluate a run that finished there again"):
    train_and_evaluate(config(data, *cosine, "train.steps=11"), workdir)
  assert train_and_evaluate(config(data, *cosine, "train.steps=10"), workdir)["param_checksum"] == ten["param_checksum"]
  assert json.loads((workdir / "summary.json").read_text()) == twelve


def test_a_start_that_fails_before_its_first_write_leaves_the_workdir_as_it_was(
  data, uninterrupted, tmp_path, monkeypatch
):
  """A Ctrl-C or an error while the steps compile: a new workdir is not created, an existing one (here
  a finished run being extended) keeps every file as it was. Before, config.json, an empty
  checkpoints/ and data_files/ were left (and an extension's summary.json renamed)."""
  from lra_core import train

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(train, "_compile_train_step", interrupted)
  with pytest.raises(KeyboardInterrupt):
    train_and_evaluate(config(data), tmp_path / "new")
  assert not (tmp_path / "new").exists()
  (tmp_path / "empty").mkdir()
  with pytest.raises(KeyboardInterrupt):
    train_and_evaluate(config(data), tmp_path / "empty")
  assert not any((tmp_path / "empty").iterdir())
  workdir = tmp_path / "finished"
  shutil.copytree(uninterrupted[0], workdir)
  before = _files(workdir)
  with pytest.raises(KeyboardInterrupt):
    train_and_evaluate(config(data, "train.steps=8"), workdir)
  assert _files(workdir) == before


def test_ctrl_c_at_the_last_step_or_in_the_final_evaluation_leaves_saved_for_the_same_command(
  data, uninterrupted, tmp_path, monkeypatch
):
  """A Ctrl-C at the last step: that step is saved and the run leaves before its final evaluation
  (before, it evaluated and finished, exit status 0); one during the final evaluation: the run leaves
  with its last step saved. Either way the same command then only evaluates, to the uninterrupted
  run's summary."""
  import os
  import signal

  from lra_core import train

  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are set from the main thread only")
  save = train._Loop.save

  def ctrl_c_at_the_last_step(loop, done):
    save(loop, done)
    if done == loop.t.steps:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)  # the handler runs between bytecodes of the main thread

  with monkeypatch.context() as m:
    m.setattr(train._Loop, "save", ctrl_c_at_the_last_step)
    assert train_and_evaluate(config(data), tmp_path / "last") == {"stopped_at": 6, "interrupted": True}
  assert not (tmp_path / "last" / "summary.json").exists()
  resumed = train_and_evaluate(config(data), tmp_path / "last")
  assert _untimed(resumed) == _untimed(uninterrupted[1]) and resumed["train_time_s"] > 0  # the checkpoint's time

  def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(train, "_final_metrics", ctrl_c)
    assert train_and_evaluate(config(data), tmp_path / "final") == {"stopped_at": 6, "interrupted": True}
  assert Checkpointer(tmp_path / "final", async_save=False).all_steps()[-1] == 6
  assert train_and_evaluate(config(data), tmp_path / "final")["param_checksum"] == uninterrupted[1]["param_checksum"]


def _untimed(summary: dict) -> dict:
  """A summary without its timing (which differs run to run)."""
  return {k: v for k, v in summary.items() if k not in ("train_time_s", "tokens_per_s", "mfu", "goodput")}


def test_a_damaged_config_json_is_one_sentence(data, uninterrupted, tmp_path):
  """Half of config.json and two bytes that are no UTF-8: resuming and reading the workdir's config each
  say so in one sentence (the resume was a UnicodeDecodeError traceback)."""
  workdir = tmp_path / "run"
  shutil.copytree(uninterrupted[0], workdir)
  text = (workdir / "config.json").read_bytes()
  (workdir / "config.json").write_bytes(text[: len(text) // 2] + b"\x00\xff")
  with pytest.raises(ConfigError, match=r"holds checkpoints of a different config \(config.json: unreadable\); "):
    train_and_evaluate(config(data), workdir)
  with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(UnicodeDecodeError: .*\); give --config"):
    load_workdir_config(workdir)


def test_a_save_that_stops_finishing_ends_within_a_bound_from_the_measured_saves_naming_the_cause(
  tmp_path, monkeypatch
):
  """A save that never completes (its writer retrying on a full disk) ends the run between two steps once
  it has taken more than max(the floor, 10 x this run's slowest save), not at the next save nor after
  orbax's 20 minutes, with the cause the store's log lines named."""
  monkeypatch.setattr(save_limit, "FLOOR_S", 0.5)
  ckpt = Checkpointer(tmp_path / "run", save_timeout_s=1800)
  state = {"w": jax.numpy.arange(8.0)}
  ckpt.save(1, state, {})
  ckpt.wait()
  assert ckpt.clock.slowest is not None and ckpt.clock.slowest < 5
  ckpt.poll()  # nothing in flight: nothing to do
  ckpt.save(2, state, {})
  with monkeypatch.context() as m:
    m.setattr(ckpt.manager, "is_saving_in_progress", lambda: True)  # its writer stuck from here on
    full = OSError(28, "No space left on device")
    logging.getLogger("absl").warning("Retrying a write", exc_info=(OSError, full, None))
    start = time.monotonic()
    with pytest.raises(
      StoreFailure,
      match=r"^checkpoint step 2 in .* was still being written after [\d.]+ s \(10 x this run's slowest save, "
      r"[\d.]+ s, and at least 0.5 s\): the store is failing or too slow \(it said: \[Errno 28\] No space left on "
      r"device\); the last complete checkpoint is step 1.$",
    ):
      while time.monotonic() - start < 60:
        ckpt.poll()
        time.sleep(0.01)
    assert time.monotonic() - start <= max(0.5, 10 * ckpt.clock.slowest) + 2
  ckpt.close()
  assert ckpt.store_errors not in logging.getLogger().handlers
  assert Checkpointer(tmp_path / "run").all_steps() == [1, 2]


def test_a_writer_that_died_of_a_full_or_read_only_disk_ends_the_save_at_the_next_step(tmp_path, monkeypatch):
  """orbax logs a writer thread's death as an error and then waits in its barrier for ever: one naming a
  cause no wait mends ends the save at the next poll. A warning (a retry) or an error of another cause
  (a permission a second try may have) leaves it to the limit."""
  ckpt = Checkpointer(tmp_path / "run", save_timeout_s=1800)
  state = {"w": jax.numpy.arange(8.0)}
  ckpt.save(1, state, {})
  ckpt.wait()
  ckpt.save(2, state, {})
  absl = logging.getLogger("absl")
  with monkeypatch.context() as m:
    m.setattr(ckpt.manager, "is_saving_in_progress", lambda: True)
    absl.warning("retrying: [Errno 30] Read-only file system: 'checkpoints/2.orbax-checkpoint-tmp'")
    absl.error("_SignalingThread.run() raised an exception: [Errno 13] Permission denied: 'x'")
    ckpt.poll()
    absl.error("_SignalingThread.run() raised an exception: [Errno 30] Read-only file system: 'x'")
    with pytest.raises(
      StoreFailure,
      match=r"^checkpoint step 2 in .* cannot be written: a writer failed \(it said: \[Errno 30\] Read-only file "
      r"system\); the last complete checkpoint is step 1.$",
    ):
      ckpt.poll()
  ckpt.store_errors.reset()  # the real save behind the stand-in completed; closing waits for it
  ckpt.close()


def test_a_checkpoints_folder_deleted_under_the_run_is_said_and_saved_anew(tmp_path, caplog):
  ckpt = Checkpointer(tmp_path / "run", async_save=False)
  state = {"w": jax.numpy.arange(8.0)}
  ckpt.save(1, state, {})
  ckpt.wait()
  shutil.rmtree(tmp_path / "run" / "checkpoints")
  with caplog.at_level(logging.WARNING):
    ckpt.save(2, state, {})
    ckpt.close()
  assert "checkpoint step 1 is gone from" in caplog.text and "step 2 is saved anew" in caplog.text
  assert Checkpointer(tmp_path / "run").all_steps() == [2]
