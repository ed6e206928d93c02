"""What a run finds in its workdir decides what it may do there: resume the checkpoints of its own
config, continue another config's only with --force (the old config.json kept aside), extend a
finished run (a larger train.steps) with that run's summary and final checkpoint kept, or evaluate
again a finished length that a later extension went past. Fewer steps than the last checkpoint
otherwise is refused: a run cannot be trained back.

The trainer asks `check_resumable` (which only reads) before anything else, holds `FirstWrites`
around its start and calls `keep_finished` only once its data, its compile and its checkpoint have
been found good, so that a start refused or interrupted before that leaves the workdir as it was.
"""

from __future__ import annotations

import json
import logging
import re
from typing import NamedTuple

import jax

from lra_core.checkpoints.saved_config import resume_conflicts
from lra_core.errors import ConfigError
from lra_core.run import optim_settings
from lra_core.runtime import fs, run_lock


def checkpoint_steps(workdir: fs.Path) -> list[int]:
  """The steps of the checkpoints in `<workdir>/checkpoints/` (a save in progress is named otherwise)."""
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def finished_lengths(workdir: fs.Path) -> set[int]:
  """The train.steps of the runs that finished in `workdir`: summary.json's, and those kept as
  summary.step<N>.json by the extensions that followed them."""
  kept = {int(m.group(1)) for p in workdir.glob("summary.step*.json") if (m := SUMMARY.fullmatch(p.name))}
  step = _finished_step(workdir)
  return kept | ({step} if step is not None else set())


SUMMARY = re.compile(r"summary\.step(\d+)\.json")


def _finished_step(workdir: fs.Path) -> int | None:
  """The last step of the finished run whose summary.json the workdir holds (None: none finished)."""
  summary = workdir / "summary.json"
  try:
    done = json.loads(summary.read_text()) if summary.is_file() else {}
  except ValueError:  # damaged (not JSON, or not text at all): no finished run to keep
    return None
  step = done.get("step") if isinstance(done, dict) else None
  return step if isinstance(step, int) and "stopped_at" not in done else None


class Resumable(NamedTuple):
  """What `check_resumable` found a start may do in its workdir."""

  earlier: int | None = None  # a finished length below the last checkpoint, evaluated again
  forced: str | None = None  # the differences --force continues past (the old config.json is kept aside)


def check_resumable(config, workdir: fs.Path, force: bool) -> Resumable:
  """A workdir with checkpoints resumes only with the config that made them (RESUMABLE_KEYS may
  differ); otherwise ConfigError, or with `force` a continuation (`forced`). `earlier` is N where
  train.steps = N is below the last checkpoint and a run finished there (its checkpoint kept): this
  start evaluates that length again and leaves the later run's files alone; below the last
  checkpoint otherwise is a ConfigError. Reads only: `keep_finished` makes what it decides happen."""
  steps = checkpoint_steps(workdir)
  if not steps:
    return Resumable()
  earlier = _earlier_length(config, workdir, steps)
  saved = workdir / "config.json"
  if earlier is not None and (workdir / f"config.step{earlier}.json").is_file():
    saved = workdir / f"config.step{earlier}.json"  # that run's own config, not the extension's
  if not saved.is_file():
    return Resumable(earlier)
  try:
    before = json.loads(saved.read_text())
  except ValueError:  # damaged (not JSON, or not text at all: UnicodeDecodeError)
    before = None
  if not isinstance(before, dict) or not isinstance(before.get("train"), dict):
    before, conflicts = None, [f"{saved.name}: unreadable"]
  else:
    kept = optim_settings.keep_horizon(config, before)
    if kept and before["train"]["steps"] != config.train.steps:
      logging.info(
        "train.steps %s -> %d: the learning-rate schedule keeps its horizon (%s; steps past it run at its "
        "floor); to stretch it instead, set optim.decay_steps and pass --force",
        before["train"]["steps"],
        config.train.steps,
        ", ".join(kept),
      )
    conflicts = resume_conflicts(before, config)
  if not conflicts:
    return Resumable(earlier)
  more = f" and {len(conflicts) - 1} more difference(s)" if len(conflicts) > 1 else ""
  if not force:
    raise ConfigError(
      f"workdir {workdir} holds checkpoints of a different config ({conflicts[0]}{more}); "
      "use another workdir, or --force to continue these checkpoints with the new config."
    )
  if earlier is not None:
    raise ConfigError(
      f"workdir {workdir}: the run that finished there at step {earlier} had a different config "
      f"({conflicts[0]}{more}); --force continues a run, it does not evaluate a finished one with "
      "another config: use another workdir."
    )
  return Resumable(forced=conflicts[0] + more)


def _earlier_length(config, workdir: fs.Path, steps: list[int]) -> int | None:
  """train.steps where it is below the last checkpoint: a finished length (see check_resumable)."""
  wanted, last = config.train.steps, steps[-1]
  if wanted >= last:
    return None
  finished = finished_lengths(workdir)
  lengths = sorted(n for n in finished if n in steps and n < last)
  if wanted in lengths:
    logging.info(
      "train.steps=%d: evaluating again the run that finished at step %d (checkpoints go on to step %d; "
      "nothing of the later run is changed)",
      wanted,
      wanted,
      last,
    )
    return wanted
  again = (
    f"set train.steps to {' or '.join(map(str, lengths))} to evaluate a run that finished there again, "
    if lengths
    else ""
  )
  on = (
    "to evaluate the run that finished there, or more to extend it"
    if last in finished
    else "or more to go on from there"
  )
  raise ConfigError(
    f"workdir {workdir} holds checkpoints up to step {last}, past train.steps={wanted}, and a run cannot be "
    f"trained back: {again}set train.steps={last} {on}, or use another workdir."
  )


def keep_finished(config, workdir: fs.Path, resumable: Resumable) -> None:
  """What a start keeps of the workdir's earlier files before it writes its own (process 0): with
  --force the old config.json as config.before_force.<K>.json; where it extends a finished run (a
  larger train.steps), that run's summary.json and config.json as summary.step<N>.json and
  config.step<N>.json (its checkpoint is kept by the rotation: `finished_lengths`)."""
  if jax.process_index() != 0:
    return
  if resumable.forced:
    kept = workdir / f"config.before_force.{len(list(workdir.glob('config.before_force.*')))}.json"
    (workdir / "config.json").rename(kept)
    logging.warning(
      "--force: continuing %s with a changed config (%s); the old one is %s", workdir, resumable.forced, kept.name
    )
  step = _finished_step(workdir)
  if step is None or step >= config.train.steps:
    return
  kept = workdir / f"summary.step{step}.json"
  (workdir / "summary.json").replace(kept)  # the same run's summary, should an earlier copy be there
  if (workdir / "config.json").is_file():
    (workdir / f"config.step{step}.json").write_text((workdir / "config.json").read_text())
  logging.info(
    "extending the run finished at step %d to %d: its summary is kept as %s", step, config.train.steps, kept.name
  )


class FirstWrites:
  """`with FirstWrites(workdir) as start: ... start.began() ...`: a start that fails before `began()`
  (its data refused, its compile out of memory, a Ctrl-C while it compiles) takes back what it made in
  the workdir until then (the folder itself, `checkpoints/` with its write probe), so that the workdir
  is left as it was. The trainer calls `began()` just before it first writes the run's own records;
  from there on a failure leaves them for the same command to resume. Process 0 undoes; the others
  make nothing there that it does not."""

  def __init__(self, workdir: fs.Path):
    self.workdir = workdir
    self.before = {p.name for p in workdir.iterdir()} if workdir.is_dir() else None
    self.armed = True

  def began(self) -> None:
    self.armed = False

  def __enter__(self) -> FirstWrites:
    return self

  def __exit__(self, kind, error, trace) -> None:
    if kind is None or not self.armed or jax.process_index() != 0 or not self.workdir.is_dir():
      return
    try:
      for made in self.workdir.iterdir():
        # The lock is its holder's: gone with a run that ended, another run's if one has started since.
        if made.name not in (self.before or ()) and made.name != run_lock.NAME:
          made.rmtree() if made.is_dir() else made.unlink()
      if self.before is None and not any(self.workdir.iterdir()):
        self.workdir.rmdir()
    except OSError as e:  # the start's own error is the one to report
      logging.warning("could not remove what the failed start made in %s (%s)", self.workdir, e)
