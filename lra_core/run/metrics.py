"""Run outputs: metrics.jsonl, TensorBoard events, summary.json and a terminal progress line.

Only process 0 writes files; every process computes the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping

import jax
import numpy as np

from lra_core.errors import StoreFailure, brief
from lra_core.runtime import fs


def _plain(value):
  if isinstance(value, (np.generic, np.ndarray)):
    return value.item() if np.ndim(value) == 0 else value.tolist()
  return value


class MetricWriter:
  """One JSON object per logged step in metrics.jsonl, mirrored to TensorBoard (and a tracker).

  `workdir` is local or an object store (lra_core/runtime/fs.py). A run (re)starting at step `start`
  calls `resume(start)` before its first `write`: records past `start` (logged by an earlier
  attempt after its last checkpoint) are dropped from metrics.jsonl, TensorBoard is told to purge
  its events past `start` (`purge_step`), and metrics already logged at `start` are not logged
  again, so every (step, metric) appears once however often the run was killed and resumed.
  Locally metrics.jsonl is appended to and TensorBoard writes its event file in place; object
  stores cannot append, so there both are rewritten whole at every write from a local copy.
  """

  def __init__(self, workdir, *, enabled: bool | None = None, tracker=None):
    self.workdir = fs.path(workdir, what="workdir")
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.local = fs.local_or_none(self.workdir)
    self.tracker = tracker
    self._tb = None
    self._spool: pathlib.Path | None = None  # object stores: the local TensorBoard folder uploaded on flush
    self._records: list[str] | None = None  # object stores: metrics.jsonl's lines
    self._logged_at_start: tuple[int, set[str]] = (-1, set())
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)

  @property
  def tensorboard_dir(self):
    return self.workdir / "tensorboard"

  def resume(self, start: int) -> None:
    """Keeps the records up to step `start` and opens TensorBoard to continue from there."""
    if not self.enabled:
      return
    with _writing(self.workdir / "metrics.jsonl", "reading"):
      lines = _lines(self.workdir / "metrics.jsonl")
    kept, at_start, later, unreadable = [], set(), [], []
    for number, line in enumerate(lines, 1):
      record = _parse(line)
      if record is None:
        unreadable.append(number)
      elif record["step"] <= start:
        kept.append(line)
        if record["step"] == start:
          at_start.update(k for k in record if k != "step")
      else:
        later.append(record["step"])
    if later:
      steps = f"step {later[0]}" if len(later) == 1 else f"steps {min(later)}-{max(later)}"
      logging.info(
        "metrics.jsonl: dropped %d record(s) past step %d (%s), logged before the restart", len(later), start, steps
      )
    if unreadable:
      # A kill cuts the last line short; a damaged line elsewhere is worth a warning.
      log = logging.info if unreadable == [len(lines)] else logging.warning
      log(
        "metrics.jsonl: dropped %d unreadable line(s) (line %s of %d: cut short, or not UTF-8 JSON)",
        len(unreadable),
        ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else ""),
        len(lines),
      )
    dropped = len(later) + len(unreadable)
    if self.local is None:
      self._records = kept
      self._rewrite()
    elif dropped:
      _atomic_write(self.workdir / "metrics.jsonl", "".join(line + "\n" for line in kept))
    self._logged_at_start = (start, at_start)
    self._open_tensorboard(start)

  def _open_tensorboard(self, start: int) -> None:
    from tensorboardX import SummaryWriter

    if self.local is None:
      self._spool = pathlib.Path(tempfile.mkdtemp(prefix="lra_core_tensorboard_"))
    folder = self._spool or self.local / "tensorboard"
    # A restart writes a new event file whose SessionLog START at `purge_step` makes TensorBoard
    # drop the earlier attempt's events from that step on; the suffix orders files of one second.
    existing = self.tensorboard_dir.exists() and any(self.tensorboard_dir.glob("events.out.tfevents.*"))
    self._tb = SummaryWriter(str(folder), purge_step=start + 1 if existing else None, filename_suffix=f".{start:010d}")

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    if self._tb is None:
      self.resume(0)
    step = int(step)
    if step == self._logged_at_start[0]:
      metrics = {k: v for k, v in metrics.items() if k not in self._logged_at_start[1]}
      if not metrics:
        return
    record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    line = json.dumps(record)
    if self._records is None:
      with _writing(self.workdir / "metrics.jsonl"), (self.workdir / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    else:
      self._records.append(line)
      self._rewrite()
    scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)
    self._flush_tensorboard()
    if self.tracker is not None:
      self.tracker.log(step, scalars)

  def write_images(self, step: int, name: str, image: np.ndarray) -> None:
    """One uint8 [H,W,C] image (e.g. a grid of samples) at `step`, in TensorBoard and the tracker."""
    if not self.enabled:
      return
    if self._tb is None:
      self.resume(0)
    self._tb.add_image(name, np.asarray(image), int(step), dataformats="HWC")
    self._flush_tensorboard()
    if self.tracker is not None:
      self.tracker.log_images(int(step), name, np.asarray(image))

  def _flush_tensorboard(self) -> None:
    with _writing(self.tensorboard_dir):  # a full disk is found here first: one sentence, like metrics.jsonl's
      self._tb.flush()
      if self._spool is not None:
        fs.upload_tree(self._spool, self.tensorboard_dir)

  def _rewrite(self) -> None:
    _atomic_write(self.workdir / "metrics.jsonl", "".join(line + "\n" for line in self._records))

  def write_json(self, name: str, payload: Mapping) -> None:
    if self.enabled:
      _atomic_write(self.workdir / name, json.dumps({k: _plain(v) for k, v in payload.items()}, indent=2) + "\n")

  def close(self, *, failing_ok: bool = False) -> None:
    """Flushes and closes TensorBoard and the tracker. A store that refuses the last events is a
    StoreFailure; with `failing_ok` (a run leaving at a signal, whose exit status says so) a warning."""
    try:
      if self._tb is not None:
        tb, self._tb = self._tb, None
        with _writing(self.tensorboard_dir):
          tb.close()
          if self._spool is not None:
            fs.upload_tree(self._spool, self.tensorboard_dir)
            shutil.rmtree(self._spool, ignore_errors=True)
    except StoreFailure as e:
      if not failing_ok:
        raise
      logging.warning("%s", e)
    finally:
      if self.tracker is not None:
        tracker, self.tracker = self.tracker, None
        tracker.close()


@contextlib.contextmanager
def _writing(path, what: str = "writing"):
  """A run's record the store will not take (a full disk, a folder in the file's place, an object store
  refusing every write) is one sentence naming it, not a traceback; the checkpoints are not touched."""
  try:
    yield
  except Exception as e:  # noqa: BLE001  (local and object-store writes fail in many types)
    raise StoreFailure(
      f"{what} {path} failed ({type(e).__name__}: {brief(e)}); the run stops, its checkpoints kept: run the "
      "same command again once the workdir takes writes."
    ) from e


def _atomic_write(path, text: str) -> None:
  """Readers never see half a file: locally a rename; an object store replaces objects whole."""
  with _writing(path):
    _write_whole(path, text)


def _write_whole(path, text: str) -> None:
  if fs.is_local(path):
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
  else:
    path.write_text(text)


def _lines(path) -> list[str | None]:
  """The file's non-empty lines, None for one that is not UTF-8 (damaged bytes: the rest still read)."""
  if not path.exists():
    return []
  out = []
  for raw in path.read_bytes().splitlines():
    if raw.strip():
      try:
        out.append(raw.decode("utf-8"))
      except UnicodeDecodeError:
        out.append(None)
  return out


def _parse(line: str | None) -> dict | None:
  """One record, or None for a line a killed run left half written or one that is damaged."""
  try:
    record = json.loads(line) if line is not None else None
  except json.JSONDecodeError:
    return None
  return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_metrics(workdir) -> list[dict]:
  """The records of `workdir`'s metrics.jsonl (local or object store), in order; a line a killed
  run left half written is skipped (the next start drops it from the file)."""
  records = (_parse(line) for line in _lines(fs.path(workdir, what="workdir") / "metrics.jsonl"))
  return [r for r in records if r is not None]


class Progress:
  """A tqdm bar with tokens/s on a terminal; plain log lines with rate and ETA otherwise."""

  def __init__(self, start: int, total: int, tokens_per_step: int, *, enabled: bool | None = None):
    self.start, self.total, self.tokens_per_step = start, total, tokens_per_step
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.t0 = time.perf_counter()
    self.bar = None
    if self.enabled and sys.stderr.isatty():
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, smoothing=0.1)
    self.done = start

  def rate(self) -> float:
    """Tokens per second since this run (re)started."""
    elapsed = time.perf_counter() - self.t0
    return (self.done - self.start) * self.tokens_per_step / max(elapsed, 1e-9)

  def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
    if self.bar is not None:
      self.bar.update(step - self.done)
    self.done = step
    if metrics is None or not self.enabled:
      return
    rate = self.rate()
    recent = metrics.get("tokens_per_s", rate)  # over the last log interval (lra_core/cost/throughput.py)
    mfu = f" | MFU {100 * metrics['mfu']:.1f}%" if "mfu" in metrics else ""
    if self.bar is not None:
      postfix = dict(loss=f"{metrics.get('train_loss', float('nan')):.4f}", tok_s=f"{recent:,.0f}")
      if "mfu" in metrics:
        postfix["mfu"] = f"{100 * metrics['mfu']:.1f}%"
      self.bar.set_postfix(postfix)
    else:
      steps_per_s = rate / max(self.tokens_per_step, 1)
      eta = (self.total - step) / steps_per_s if steps_per_s > 0 else float("inf")
      logging.info("%s", progress_line(step, self.total, metrics, f"{recent:,.0f} tokens/s{mfu} | ETA {_clock(eta)}"))

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


# Logged first on a progress line, when present; the other metrics follow in their logged order.
PROGRESS_FIRST = ("train_loss", "train_accuracy", "train_bits_per_byte", "train_bits_per_dim", "learning_rate")
PROGRESS_WIDTH = 120 - len("00:00:00 INFO ")  # columns of a progress line's message (cli.setup_logging's prefix)
NOT_ON_PROGRESS = ("tokens_per_s", "mfu", "step_time_s")  # the line's tail says these


def progress_line(step: int, total: int, metrics: Mapping[str, float], tail: str, width: int = PROGRESS_WIDTH) -> str:
  """'step 100/1000 loss=2.31 accuracy=0.41 ... +6 | <tail>' within `width` columns: the metrics of
  PROGRESS_FIRST, then the rest, without their train_ prefix, as many as fit; '+N' counts those left
  out (metrics.jsonl and TensorBoard have every one)."""
  names = [k for k, v in metrics.items() if isinstance(v, float) and k not in NOT_ON_PROGRESS]
  names.sort(key=lambda k: PROGRESS_FIRST.index(k) if k in PROGRESS_FIRST else len(PROGRESS_FIRST))
  head, shown = f"step {step}/{total}", []
  for i, k in enumerate(names):
    item = f"{k.removeprefix('train_')}={metrics[k]:.4g}"
    left_out = len(names) - i - 1
    more = f" +{left_out}" if left_out else ""
    if len(" ".join([head, *shown, item])) + len(more) + len(" | ") + len(tail) > width:
      break
    shown.append(item)
  left_out = len(names) - len(shown)
  return " ".join([head, *shown] + ([f"+{left_out}"] if left_out else [])) + " | " + tail


def _clock(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
