"""The one trainer: mesh -> data -> shapes -> shardings -> init -> step -> resume -> loop.

  python -m lra_core.train --config=configs/lra/listops/transformer.py:tiny --workdir=/tmp/run
  python -m lra_core.train                       # the embedded default: ListOps on CPU
  python -m lra_core.train ... --coordinator_address=host0:1234 --num_processes=2 --process_id=0
                                                 # one process of a multi-process run (docs/launching.md)

Every model and task goes through this file unchanged: models are found by name
(lra_core.registry), objectives live in lra_core/tasks, datasets in lra_core/data/datasets.
A workdir with a checkpoint resumes automatically; the run ends with summary.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable

import jax
from flax import nnx

from lra_core import cli, layout, sharding
from lra_core.checkpoints import local_tier
from lra_core.checkpoints import workdir as workdir_policy
from lra_core.checkpoints.checkpointer import Checkpointer, SaveAbandoned, check_directory, check_writable
from lra_core.checkpoints.init_from import check_source, warm_start
from lra_core.checkpoints.local_tier import LocalTier
from lra_core.compilation import compile_cache, step_compile
from lra_core.config import log_interval, parse_profile_steps
from lra_core.cost import throughput
from lra_core.data import cache, pipeline
from lra_core.dataset_record import SPLITS
from lra_core.errors import TrainingDiverged
from lra_core.run import data_setup, goodput, image_samples, trackers
from lra_core.run.batches import abstract_batch, row_block, to_device
from lra_core.run.evaluation import Evaluator
from lra_core.run.metrics import MetricWriter, Progress
from lra_core.run.numerics_guard import NumericsGuard
from lra_core.run.profiler import StepProfiler
from lra_core.run.state import eval_params, param_checksum, run_setup
from lra_core.runtime import fs, preemption, process_end
from lra_core.runtime.preemption import PreemptionNotice
from lra_core.runtime.run_lock import RunLock
from lra_core.runtime.watchdog import StepWatchdog

DEFAULT_CONFIG = "configs/lra/listops/transformer.py:default"
DEFAULT_WORKDIR = "runs/listops_default"


def train_and_evaluate(
  config, workdir: str | os.PathLike, *, stop_at_step: int | None = None, force: bool = False
) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the summary.

  stop_at_step: leave after saving a checkpoint at this step (an interrupted run, for tests and
  for splitting a job across allocations); the summary is then {"stopped_at": step}. A SIGTERM
  does the same at the step in flight, with "preempted": True; a Ctrl-C (SIGINT) too, with
  "interrupted": True.
  force: continue a workdir whose checkpoints were made with a different config (else refused).
  `workdir` is a local folder or an object-store URL such as gs://bucket/run (lra_core/runtime/fs.py).
  One run at a time trains in a workdir: its process 0 holds `<workdir>/run.lock` (lra_core/runtime/run_lock.py),
  and a second run is refused with one sentence naming the first.
  """
  workdir = fs.path(workdir, what="workdir")
  ledger = goodput.Ledger(workdir)  # where this invocation's time goes, kept once it may write there
  try:
    return _started(config, workdir, stop_at_step, force, ledger)
  finally:
    ledger.write()


def _started(config, workdir: fs.Path, stop_at_step: int | None, force: bool, ledger) -> dict:
  check_directory(workdir)  # before the lock, the data and the compile
  # train.init_from's source read from its config.json: a start refused for its model settings creates
  # no workdir and changes nothing in one that exists (the lock's file is the run's first write).
  check_source(config, workdir)
  # A start refused or interrupted before its first record (data, compile, Ctrl-C) leaves the workdir as it was.
  with workdir_policy.FirstWrites(workdir) as first_writes:
    with RunLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
      return _train_and_evaluate(config, workdir, stop_at_step, force, first_writes, ledger)


def _train_and_evaluate(config, workdir: fs.Path, stop_at_step: int | None, force: bool, first_writes, ledger) -> dict:
  resumable = workdir_policy.check_resumable(config, workdir, force)
  earlier = resumable.earlier  # a finished length evaluated again: nothing trained, nothing of later runs touched
  compile_cache.setup(config.train.compile_cache, workdir)
  t = config.train

  # ----------------------------------------------------------------------------- Mesh
  mesh = layout.make_mesh(config.mesh)
  rules = config.sharding.rules
  _log_mesh(mesh, config.mesh.get("slices", 1))

  # ----------------------------------------------------------------------------- Data
  sources, task, data_files, train_reader, first = _open_data(config, mesh)
  check_writable(workdir)

  # ----------------------------------------------------------------------------- Shapes, shardings, init
  tx, schedule, spec = run_setup(config, mesh)
  logging.info("model %s: %s parameters", config.model.name, f"{spec.num_params:,}")

  # ----------------------------------------------------------------------------- Steps
  with sharding.activate(mesh, rules):
    with ledger.timing("compile"):
      train_step, flops_per_step = _compile_train_step(config, spec, task, tx, schedule, first, mesh)
    evaluate = Evaluator(config, spec, task, mesh, {s: sources[s] for s in ("validation", "test")})

    # --------------------------------------------------------------------------- Resume
    ckpt, tier, state, start, meta = _resume(config, spec, workdir, mesh, earlier, data_files, ledger)
    first_writes.began()
    ledger.enabled, ledger.trains = jax.process_index() == 0, earlier is None
    writer, data_files_name = _first_writes(config, workdir, resumable, data_files, start)
    loop = _Loop(config, spec, task, mesh, evaluate, writer, ckpt, flops_per_step, data_files_name, ledger)
    loop.resume(state, start, meta, tier)

    # --------------------------------------------------------------------------- Loop
    batches = pipeline.iterate(
      train_reader,
      loop.next_batch,
      loop.next_batch + t.steps - start,
      num_threads=config.data.num_threads,
      prefetch=config.data.prefetch,
    )
    stop = t.steps if stop_at_step is None else min(stop_at_step, t.steps)
    try:  # a save stuck on a failing store gives way to SIGTERM: in the loop, or the last one at its end
      preempted = loop.run(train_step, batches, stop)
      if preempted is not None or stop < t.steps:
        ckpt.close()
        writer.close(failing_ok=preempted is not None)  # leaving at a signal: 75 or 130 says why
        return _stopped(preempted, stop, loop.notice, ckpt)

      loop.guard.check_skipped_share(t.steps)
      # ------------------------------------------------------------------------- Final evaluation
      try:
        with ledger.timing("evaluation"):
          summary = {"step": t.steps, "num_params": spec.num_params, **_final_metrics(config, evaluate, loop.state)}
      except KeyboardInterrupt:  # the last step is saved: the same command evaluates it
        if jax.process_count() > 1:  # the others wait in this evaluation: lra_core.cli.run ends them all
          raise
        ckpt.close()
        writer.close(failing_ok=True)
        return {"stopped_at": t.steps, "interrupted": True}
      with ledger.timing("checkpoint"):
        ckpt.close()
    except SaveAbandoned as e:
      return _abandoned(e, ckpt, writer)
    except TrainingDiverged:  # its sentence ends the run: the save in flight completes first, none half-written
      ckpt.close()
      raise
  summary["param_checksum"] = param_checksum(loop.state["params"])
  summary["goodput"] = ledger.summary()["goodput"]  # the breakdown: python -m lra_core.run.goodput
  _add_timing(summary, workdir / _summary_name(earlier), loop.meter, stop - start, t.steps, loop.total_time)
  _write_summary(summary, writer, earlier)
  return summary


class _Loop:
  """The loop over the train steps and what it does after each (`PERIODIC`): it holds the train state,
  the metrics of the step in flight (read one step late, so the host never waits on the device), the
  sums since the last log and the training time before the checkpoint it resumed from. A resumed run
  carries those sums and that time on: its metrics.jsonl and summary.json are the uninterrupted run's."""

  def __init__(self, config, spec, task, mesh, evaluate, writer, ckpt, flops_per_step: float, data_files_name, ledger):
    self.t, self.ledger = config.train, ledger
    self.config, self.spec, self.task, self.mesh, self.evaluate = config, spec, task, mesh, evaluate
    self.writer, self.ckpt, self.flops_per_step, self.data_files_name = writer, ckpt, flops_per_step, data_files_name
    self.watchdog = StepWatchdog(self.t.watchdog_factor, self.t.watchdog_min_s, cli.EXIT_PREEMPTED)
    self.notice, self.pending, self.train_time = None, None, 0.0

  def resume(self, state: dict, start: int, meta: dict, tier: LocalTier | None) -> None:
    """Starts at `start` from `state` and what its checkpoint's `meta` carried (data position, skipped
    steps, the sums since the last log, the training time before it); `tier`: the local checkpoints'."""
    t, self.tier = self.t, tier
    self.state, self.start, self.next_batch = state, start, meta["next_batch"]
    self.guard = NumericsGuard(t, self.ckpt, skipped=meta.get("skipped_steps", 0))
    self.guard.last_saved = start
    self.log_sums = {k: tuple(v) for k, v in meta.get("log_sums", {}).items()}
    self.time_before = meta.get("train_time_s", 0.0)
    tokens_per_step = t.batch_size * t.seq_len // pipeline.num_windows(self.config)
    self.progress = Progress(start, t.steps, tokens_per_step)
    peak = throughput.peak_flops(list(self.mesh.devices.flat), t.peak_flops)
    self.meter = throughput.Throughput(tokens_per_step, self.flops_per_step, peak, start)
    self.profiler = StepProfiler(parse_profile_steps(t.profile_steps), self.writer.tensorboard_dir)

  def run(self, train_step: Callable, batches, stop: int) -> int | None:
    """Steps up to `stop`; the step a SIGTERM (a scheduler's notice) or a Ctrl-C stopped it after, with
    that step saved, else None."""
    self.t_start = time.perf_counter()
    with PreemptionNotice() as notice, self.watchdog:
      self.notice = notice
      self.ckpt.abandon = notice.asked_to_stop  # a save stuck on a failing store gives way to SIGTERM
      try:
        preempted = self._steps(train_step, batches, stop)
        if preempted is None and notice.received is not None and self.start < stop:
          preempted = stop  # a signal after the last step's check: that step is saved (PERIODIC)
      finally:
        self.profiler.stop()
    self.progress.close()
    self.train_time = time.perf_counter() - self.t_start
    return preempted

  def _steps(self, train_step: Callable, batches, stop: int) -> int | None:
    self.ledger.begin_steps(self.start)
    for step in range(self.start, stop):
      waited = time.perf_counter()
      local = next(batches)
      data_setup.check_batch(local, self.config, self.next_batch + step - self.start)
      stepped = time.perf_counter()
      with self.profiler.step(step):
        self.state, metrics = train_step(self.state, to_device(local, self.mesh, self.config.sharding.rules))
      # Read the previous step's metrics while this one runs: no stall, and a bad step is caught one
      # step late at most, before any checkpoint is written.
      self.flush()
      self.ledger.add("data_wait", stepped - waited)
      self.ledger.add("steps", time.perf_counter() - stepped)
      self.ledger.reached(step + 1)
      self.watchdog.beat()  # the step before this one has finished
      self.ckpt.poll()  # a save in flight past its limit ends the run now, not at the next save
      done = step + 1
      self.pending = (done, metrics)
      self.profiler.after(step, self.state)
      self.progress.update(done)
      for due, action in PERIODIC:
        if due(self.t, done, stop):
          action(self, done)
      if self.notice.reached(done):  # the last step too: saved, the run leaves before its final evaluation
        if self.guard.last_saved != done:
          self.save(done)
        return done
    return None

  @property
  def total_time(self) -> float:
    """The training time of every invocation up to the end of this one's steps."""
    return self.time_before + self.train_time

  def flush(self) -> None:
    """Checks and adds up the metrics of the last dispatched step, if not done yet."""
    if self.pending is not None:
      self.guard.check_and_accumulate(*self.pending, self.log_sums)
      self.pending = None

  def _meta(self, step: int) -> dict:
    """What a checkpoint at `step` carries besides the state (the metrics of its step checked first)."""
    self.flush()
    saved = {"next_batch": self.next_batch + step - self.start, "skipped_steps": self.guard.skipped}
    saved["log_sums"] = dict(self.log_sums)
    saved["train_time_s"] = self.time_before + time.perf_counter() - self.t_start
    saved["data_files"] = self.data_files_name
    return saved

  def save(self, step: int) -> None:
    saved = self._meta(step)
    with self.ledger.timing("checkpoint"):
      self.ckpt.save(step, self.state, saved)
    self.guard.last_saved = step
    self.ledger.write()

  def save_local(self, done: int) -> None:
    """This process's shards to the host's own disk (lra_core/checkpoints/local_tier.py)."""
    saved = self._meta(done)
    with self.ledger.timing("checkpoint"):
      self.tier.save(done, self.state, saved)
    self.ledger.write()

  def log(self, done: int) -> None:
    self.flush()
    guard = self.guard if self.t.skip_nonfinite else None
    logged = _finish_log(self.task, self.log_sums, guard, self.meter, done)
    self.writer.write(done, logged)
    self.progress.update(done, logged)
    self.ledger.write()

  def validate(self, done: int) -> None:
    with self.ledger.timing("evaluation"):
      _validate(self.evaluate, self.state, done, self.t.eval_batches, self.writer)
    self.meter.restart(done)  # the evaluation's time is not the steps'
    self.watchdog.restart()

  def sample(self, done: int) -> None:
    with self.ledger.timing("evaluation"):
      _write_samples(self.config, self.spec, self.state, self.writer, done)
    self.meter.restart(done)
    self.watchdog.restart()

  def checkpoint(self, done: int) -> None:
    self.save(done)
    self.watchdog.restart()


# What the loop does after step `done` of a run that stops at `stop`, in this order: (due, action).
# Not a log at a --stop_at_step between logs: a resumed run's next log averages from the last one, as
# the uninterrupted run's does (the sums since then travel in the checkpoint).
def _persistent_due(t, done: int, stop: int) -> bool:
  return bool(t.checkpoint_every) and done % t.checkpoint_every == 0 or done == stop


PERIODIC = (
  (lambda t, done, stop: done % log_interval(t) == 0 or done == t.steps, _Loop.log),
  (lambda t, done, stop: bool(t.eval_every) and done % t.eval_every == 0 and done < t.steps, _Loop.validate),
  (lambda t, done, stop: bool(t.sample_every) and done % t.sample_every == 0, _Loop.sample),
  (
    lambda t, done, stop: (
      bool(t.local_checkpoint_every) and done % t.local_checkpoint_every == 0 and not _persistent_due(t, done, stop)
    ),
    _Loop.save_local,
  ),
  (_persistent_due, _Loop.checkpoint),
)


def _compile_train_step(config, spec, task, tx, schedule, batch: dict, mesh) -> tuple[Callable, float]:
  """(the compiled train step, its FLOPs). Compiled from shapes alone, before the state exists: a
  config too large for the devices stops here with the estimate (lra_core/compilation/step_compile.py; lra_core.aot
  compiles the same step for TPU slices)."""
  jitted = step_compile.jit_train_step(config, spec, task, tx, schedule)
  batch_shapes = abstract_batch(batch, mesh, config.sharding.rules)
  train_step = step_compile.compile_step(
    jitted, spec.abstract, batch_shapes, name="train step", limit_gib=config.train.memory_limit_gib
  )
  # A GPU program's Pallas (Triton) calls keep no cost: the traced step (jit's cached trace) gives theirs.
  traced = jitted.trace(spec.abstract, batch_shapes) if mesh.devices.flat[0].platform == "gpu" else None
  return train_step, throughput.model_flops(train_step, mesh.devices.size, traced)


def _final_metrics(config, evaluate: Evaluator, state: dict) -> dict[str, float]:
  """val_* over train.eval_batches of the validation split, and test_* over all of the test split
  (where train.test_at_end)."""
  out = {f"val_{k}": v for k, v in evaluate(state, "validation", config.train.eval_batches).items()}
  # What each covers, said beside them: a few validation batches and a whole test split can differ a lot.
  out["val_examples"], out["val_split_examples"] = evaluate.coverage("validation", config.train.eval_batches)
  if config.train.test_at_end:
    out.update({f"test_{k}": v for k, v in evaluate(state, "test").items()})
    out["test_examples"] = evaluate.coverage("test")[0]
  return out


# Counts, not metrics: kept out of metrics.jsonl.
COVERAGE_KEYS = ("val_examples", "val_split_examples", "test_examples")


def coverage(summary: dict) -> str:
  """The line saying what val_* and test_* of a run's summary were computed over."""
  line = f"val_* over {summary['val_examples']} of the {summary['val_split_examples']} validation examples"
  if summary["val_examples"] < summary["val_split_examples"]:
    line += " (train.eval_batches)"
  if "test_examples" in summary:
    line += f", test_* over all {summary['test_examples']} test examples"
  return line


def _validate(evaluate: Evaluator, state: dict, step: int, batches: int, writer: MetricWriter) -> None:
  val = evaluate(state, "validation", batches)
  writer.write(step, {f"val_{k}": v for k, v in val.items()})
  logging.info("step %d validation: %s", step, _fmt(val))


def _open_writer(config, workdir: fs.Path) -> MetricWriter:
  """The run's metric writer (and experiment tracker), with the config recorded in both."""
  tracker = trackers.make_tracker(config, os.fspath(workdir), enabled=jax.process_index() == 0)
  writer = MetricWriter(workdir, tracker=tracker)
  writer.write_json("config.json", config.to_dict())
  tracker.log_config(config.to_dict())
  return writer


def _summary_name(earlier: int | None) -> str:
  """summary.json, or for a finished length evaluated again its own kept summary.step<N>.json."""
  return "summary.json" if earlier is None else f"summary.step{earlier}.json"


def _write_summary(summary: dict, writer: MetricWriter, earlier: int | None) -> None:
  """The final metrics and the run's goodput into metrics.jsonl (not for a finished length evaluated
  again: that file goes on past it) and the summary into its file; logs both."""
  if earlier is None:
    metrics = {k: v for k, v in summary.items() if k.startswith(("val_", "test_")) and k not in COVERAGE_KEYS}
    writer.write(summary["step"], {**metrics, "goodput": summary["goodput"]})
  writer.write_json(_summary_name(earlier), summary)
  writer.close()
  logging.info("done: %s", _fmt(summary))
  logging.info("%s", coverage(summary))


def _open_data(config, mesh) -> tuple:
  """(the sources of every split, the task, the data files read, this process's train batch reader,
  the first train batch): the batch checked, and its shapes compile the step, before anything else runs."""
  with cache.recording_files() as data_files:  # kept with each checkpoint: a resume checks them
    sources, task = data_setup.setup_data(config, SPLITS, mesh)
  # Which rows this process reads (several read the same rows where a sequence is split over hosts).
  block, blocks = row_block(mesh, config.sharding.rules)
  train_reader = pipeline.BatchReader(
    config, sources["train"], train=True, batch_size=config.train.batch_size, process_index=block, process_count=blocks
  )
  first = train_reader(0)
  data_setup.check_batch(first, config, 0)
  _log_document_mask(first, task)
  return sources, task, data_files, train_reader, first


def _resume(config, spec, workdir: fs.Path, mesh, earlier: int | None, data_files: dict, ledger) -> tuple:
  """(the checkpointer, and the state, step and meta to start from), the data files checked against those
  its checkpoint was saved from."""
  t = config.train
  finished = workdir_policy.finished_lengths(workdir)  # their checkpoints are kept by the rotation
  ckpt = Checkpointer(workdir, keep=t.keep_checkpoints, preserve=finished, save_timeout_s=t.save_timeout_s)
  tier = None
  if t.local_checkpoint_every:
    key = local_tier.layout_key(spec.abstract, config)
    tier = LocalTier(local_tier.folder_for(t.local_checkpoint_dir, str(workdir)), key)
  with ledger.timing("restore"):
    state, start, meta = _initial_state(config, spec, ckpt, mesh, earlier, tier)
  data_setup.check_data_files(data_setup.saved_data_files(workdir, meta.get("data_files")), data_files, start)
  return ckpt, tier, state, start, meta


def _first_writes(config, workdir: fs.Path, resumable, data_files: dict, start: int) -> tuple[MetricWriter, str | None]:
  """The run's first writes into its workdir, once its data, compile and checkpoint are found good: what
  it keeps of earlier runs, its config.json and data-file table, its metrics cut back to `start`.
  Returns (the metric writer, the table's name). A finished length evaluated again writes none of it:
  the later run's config.json, metrics.jsonl and TensorBoard events stay as they are."""
  if resumable.earlier is not None:
    return MetricWriter(workdir), None
  workdir_policy.keep_finished(config, workdir, resumable)
  writer = _open_writer(config, workdir)
  data_files_name = data_setup.keep_data_files(workdir, data_files)
  writer.resume(start)
  return writer, data_files_name


def _log_mesh(mesh, slices: int) -> None:
  logging.info(
    "mesh %s over %d %s device(s), %d process(es)%s",
    dict(mesh.shape),
    mesh.size,
    jax.devices()[0].platform,
    jax.process_count(),
    f", {slices} slices" if slices > 1 else "",
  )


def _log_document_mask(batch: dict, task) -> None:
  if "segment_ids" in batch:
    logging.info(
      "document mask %s: %s",
      "on" if task.document_mask else "off",
      "documents of a packed row attend and count positions apart"
      if task.document_mask
      else "attention runs across the documents of a row",
    )


def _initial_state(config, spec, ckpt: Checkpointer, mesh, earlier: int | None, tier) -> tuple[dict, int, dict]:
  """(state, step, meta) to start from: the checkpoint at `earlier` (a finished length evaluated again),
  else the newest local checkpoint every process holds where it is newer than the workdir's latest, else
  the latest checkpoint's, else a fresh state (its parameters from train.init_from's run, if set) at
  step 0 and data position 0."""
  if earlier is not None:
    state, meta = ckpt.restore(earlier, spec.abstract)
    return state, earlier, meta
  local = None if tier is None else local_tier.newest_held(tier, ckpt.latest_step())
  if local is not None:
    state, meta = tier.restore(local, spec.abstract)
    logging.info(
      "resuming at step %d (data position %d) from the local checkpoint in %s", local, meta["next_batch"], tier.folder
    )
    return state, local, meta
  restored = ckpt.restore_latest(spec.abstract)
  if restored is not None:
    state, meta, start = restored
    logging.info("resuming at step %d (data position %d)", start, meta["next_batch"])
    return state, start, meta
  state = spec.init()
  if config.train.init_from:
    state = warm_start(config, spec, state, config.train.init_from, mesh)
  return state, 0, {"next_batch": 0}


def _abandoned(e: SaveAbandoned, ckpt: Checkpointer, writer: MetricWriter) -> dict:
  """The summary of a run stopped (SIGTERM) while a save stuck on a failing store was in flight: it
  leaves without that checkpoint, from the last complete one the same command resumes."""
  writer.close(failing_ok=True)  # the store failing here too is not the end's cause: the signal is
  return {"stopped_at": ckpt.last_complete or 0, "preempted": True, "abandoned": str(e)}


def _stopped(preempted: int | None, stop: int, notice: PreemptionNotice, ckpt: Checkpointer) -> dict:
  """The summary of a run that left before its last step, saved: at --stop_at_step, or at a signal."""
  if preempted is None:
    return {"stopped_at": stop}
  if notice.interrupted:
    return {"stopped_at": preempted, "interrupted": True}
  logging.warning("preempted: saved step %d in %s; the same command continues from there", preempted, ckpt.directory)
  return {"stopped_at": preempted, "preempted": True}


def _add_timing(summary: dict, previous: fs.Path, meter, steps_run: int, steps: int, train_time: float) -> None:
  """Training time, tokens/s and MFU of the run's `steps` steps, over every invocation that trained
  them (`train_time`, which the checkpoints carry on); a finished run evaluated again keeps the timing
  its summary (`previous`) holds."""
  if (steps_run > 0 or not previous.exists()) and train_time > 0:
    summary["train_time_s"] = train_time
    summary.update(meter.overall(steps, train_time))
  elif previous.exists():
    previous = json.loads(previous.read_text())
    summary.update({k: previous[k] for k in ("train_time_s", "tokens_per_s", "mfu") if k in previous})


SAMPLES = 16  # images in each train.sample_every grid


def _write_samples(config, spec, state, writer: MetricWriter, step: int) -> None:
  """A grid of images sampled from the current parameters (their EMA, if kept) into TensorBoard."""
  model = nnx.merge(spec.eval_graphdef, eval_params(state), state["model_state"])
  key = jax.random.fold_in(jax.random.key(config.train.seed), step)
  images = image_samples.training_samples(config, model, key, SAMPLES)
  writer.write_images(step, "samples", image_samples.grid(images))


def _finish_log(task, sums: dict, guard: NumericsGuard | None, meter, step: int) -> dict[str, float]:
  """The metrics logged at `step`: the task's from the sums since the last log (which it empties), the
  count of skipped steps (`guard`, where train.skip_nonfinite), throughput."""
  pairs = {k: v for k, v in sums.items() if v[1] is not None}
  out = {f"train_{k}": v for k, v in task.finalize(pairs).items()}
  out.update({k: v[0] for k, v in sums.items() if v[1] is None})
  if guard is not None:
    out["skipped_steps"] = guard.skipped
  out.update(meter.measure(step))
  sums.clear()
  return out


def _fmt(metrics: dict) -> str:
  """`k=v, ...`, floats to 4 digits but the parameter checksum in full (runs are compared by it)."""
  short = lambda k, v: f"{k}={v:.4g}" if isinstance(v, float) and k != "param_checksum" else f"{k}={v}"
  return ", ".join(short(k, v) for k, v in metrics.items())


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument(
      "--stop_at_step",
      type=int,
      default=None,
      help="leave after the checkpoint at this step (to split a run across job allocations); "
      "the same command without it continues",
    )

    parser.add_argument(
      "--force", action="store_true", help="continue a workdir whose checkpoints were made with a different config"
    )

  args = cli.parse(
    argv, default_config=DEFAULT_CONFIG, default_workdir=DEFAULT_WORKDIR, extra=flags, prog="python -m lra_core.train"
  )
  logging.info("config %s, workdir %s", args.spec, args.workdir)
  summary = train_and_evaluate(args.config, args.workdir, stop_at_step=args.extra.stop_at_step, force=args.extra.force)
  if "stopped_at" in summary:
    why = "interrupted" if summary.get("interrupted") else "preempted" if summary.get("preempted") else "stopped"
    print(f"{why}: {args.spec} saved at step {summary['stopped_at']} in {args.workdir}; run again to continue")
    if summary.get("interrupted"):
      sys.exit(cli.EXIT_INTERRUPTED)
    if summary.get("abandoned"):  # the store's writer threads are stuck: leave without waiting for them
      logging.warning("%s", summary["abandoned"])
      process_end.leave(cli.EXIT_PREEMPTED)
    if summary.get("preempted"):
      sys.exit(cli.EXIT_PREEMPTED)  # a supervisor relaunches the same command
    return
  shown = {k: v for k, v in summary.items() if k.startswith("test_") or k == "param_checksum"}
  print(f"finished {args.spec} in {args.workdir}: {_fmt(shown)}")
  print(coverage(summary))
  if preemption.ctrl_c_seen():  # one raised where it was only printed (a garbage-collection hook) as the run ended
    sys.exit(cli.EXIT_INTERRUPTED)


if __name__ == "__main__":
  cli.run(main)
