"""Goodput: how much of a run's wall time went to training that counted.

Each start of the trainer in a workdir (an invocation) keeps a ledger of where its wall time went, in
seconds (`BUCKETS`):

  startup      from its start to its first step: mesh, data, shapes, init (less what follows)
  compile      compiling the train step
  restore      reading the checkpoint it resumes from
  steps        the train steps as the host sees them (dispatch, and the wait for the step before)
  data_wait    waiting for the next batch
  checkpoint   checkpoint saves, as long as they hold the loop (and the last one's wait)
  evaluation   periodic validation and samples, and the final evaluation
  other        the rest: logging, the progress line, the end

Process 0 keeps the ledgers of every invocation in `<workdir>/goodput.json`, rewritten whole at each
log, each checkpoint and the invocation's end, so a killed invocation keeps its ledger up to its last
write. Across invocations, the steps an invocation trained past the step the next one resumed from
were trained again: `lost_steps`, and `lost_s` their share of that invocation's step time. Goodput is
(steps - lost) / wall, over every invocation; the time between invocations (a relaunch's wait) is no
process's and is not counted.

  python -m lra_core.run.goodput --workdir=runs/listops_default

prints the breakdown: a row per invocation (the steps it trained, then each bucket's seconds) and the
total, with the goodput and the steps trained again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence

from lra_core import cli
from lra_core.errors import ConfigError
from lra_core.markdown import markdown_table
from lra_core.runtime import fs

FILE = "goodput.json"
BUCKETS = ("startup", "compile", "restore", "steps", "data_wait", "checkpoint", "evaluation")


class Ledger:
  """This invocation's ledger: `timing(bucket)` around what it measures, `add` for what is measured
  elsewhere, `reached(step)` as the steps go, `write()` to keep it (process 0, once `enabled`)."""

  def __init__(self, workdir: fs.Path):
    self.path = workdir / FILE
    self.enabled = False  # set once the run may write into its workdir (its first writes have begun)
    self.t0, self.started = time.monotonic(), time.time()
    self.seconds = dict.fromkeys(BUCKETS, 0.0)
    self.first_step: float | None = None  # monotonic time of the loop's start
    self.start_step: int | None = None
    self.last_step: int | None = None
    self.trains = True  # False for a finished length evaluated again: no steps, none lost
    self.failed = False  # a write failed (said once)
    self.earlier: list[dict] | None = None

  @contextlib.contextmanager
  def timing(self, bucket: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[bucket] += time.perf_counter() - start

  def add(self, bucket: str, seconds: float) -> None:
    self.seconds[bucket] += seconds

  def begin_steps(self, step: int) -> None:
    self.first_step, self.start_step, self.last_step = time.monotonic(), step, step

  def reached(self, step: int) -> None:
    self.last_step = step

  def record(self) -> dict:
    """This invocation's ledger as kept: wall time so far and each bucket, `other` the remainder."""
    now = time.monotonic()
    seconds = dict(self.seconds)
    before_steps = (self.first_step if self.first_step is not None else now) - self.t0
    seconds["startup"] = max(0.0, before_steps - seconds["compile"] - seconds["restore"])
    wall = now - self.t0
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    return dict(
      started=self.started,
      wall_s=wall,
      start_step=self.start_step,
      last_step=self.last_step,
      trains=self.trains,
      seconds=seconds,
    )

  def _earlier(self) -> list[dict]:
    """The earlier invocations' ledgers, read once: one run at a time writes a workdir (its lock)."""
    if self.earlier is None:
      self.earlier = [r for r in read(self.path.parent) if r.get("started") != self.started]
    return self.earlier

  def summary(self) -> dict:
    """`summarize` over the earlier invocations kept in the workdir and this one as it is now."""
    return summarize([*self._earlier(), self.record()])

  def write(self) -> None:
    """Rewrites goodput.json: the earlier invocations' ledgers as read, this one's as it is now."""
    if not self.enabled:
      return
    text = json.dumps({"invocations": [*self._earlier(), self.record()]}, indent=1) + "\n"
    try:
      if fs.is_local(self.path):
        staged = self.path.parent / f".{FILE}.tmp"
        staged.write_text(text)
        staged.replace(self.path)
      else:  # an object store replaces objects whole
        self.path.write_text(text)
    except OSError as e:  # an account of the run, not the run: the run's own writes say a full disk
      if not self.failed:
        logging.warning("could not write %s (%s); the run goes on", self.path, e.strerror or type(e).__name__)
      self.failed = True


def read(workdir) -> list[dict]:
  """The ledgers kept in `workdir`, oldest first ([] where there are none or the file is damaged)."""
  path = fs.path(workdir, what="workdir") / FILE
  try:
    kept = json.loads(path.read_text()) if path.is_file() else {}
  except (OSError, ValueError):
    return []
  records = kept.get("invocations", []) if isinstance(kept, dict) else []
  return sorted((r for r in records if isinstance(r, dict) and "wall_s" in r), key=lambda r: r.get("started", 0))


def summarize(records: list[dict]) -> dict:
  """Totals over the invocations: wall_s, each bucket's seconds, lost_steps, lost_s, productive_s and
  goodput (productive / wall), and the count of invocations."""
  totals = dict.fromkeys((*BUCKETS, "other"), 0.0)
  for r in records:
    for k, v in r["seconds"].items():
      totals[k] = totals.get(k, 0.0) + v
  training = [r for r in records if r.get("trains", True) and r.get("start_step") is not None]
  lost_steps, lost_s = 0, 0.0
  for r, after in zip(training, training[1:]):
    lost = max(0, r["last_step"] - after["start_step"])
    trained = r["last_step"] - r["start_step"]
    lost_steps += lost
    lost_s += r["seconds"]["steps"] * min(lost, trained) / trained if trained > 0 else 0.0
  wall = sum(r["wall_s"] for r in records)
  productive = max(0.0, totals["steps"] - lost_s)
  return dict(
    invocations=len(records),
    wall_s=wall,
    **{f"{k}_s": v for k, v in totals.items()},
    lost_steps=lost_steps,
    lost_s=lost_s,
    productive_s=productive,
    goodput=productive / wall if wall > 0 else 0.0,
  )


COLUMNS = ("wall", "startup", "compile", "restore", "steps", "data_wait", "checkpoint", "evaluation", "other")


def table(records: list[dict]) -> str:
  """The breakdown as a markdown table (seconds), and a line with the goodput and the lost steps."""
  rows = []
  for i, r in enumerate(records, 1):
    steps = "-" if r.get("start_step") is None else f"{r['start_step']}-{r['last_step']}"
    seconds = {"wall": r["wall_s"], **r["seconds"]}
    rows.append([i, steps, *(f"{seconds.get(c, 0.0):.1f}" for c in COLUMNS)])
  total = summarize(records)
  rows.append(["all", "", *(f"{total[f'{c}_s']:.1f}" for c in COLUMNS)])
  header = ["start", "steps", *(f"{c} s" for c in COLUMNS)]
  return (
    f"{markdown_table(header, rows)}\n\ngoodput {total['goodput']:.1%}: {total['productive_s']:.1f} s of "
    f"{total['wall_s']:.1f} s trained steps that counted; {total['lost_steps']} step(s) trained again after a "
    f"restart ({total['lost_s']:.1f} s)."
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.doc_parser("python -m lra_core.run.goodput", __doc__)
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  workdir = fs.path(args.workdir, what="workdir")
  records = read(workdir)
  if not records:
    raise ConfigError(f"workdir {args.workdir!r} holds no {FILE}; give the workdir of a run the trainer wrote.")
  print(table(records))


if __name__ == "__main__":
  cli.run(main)
