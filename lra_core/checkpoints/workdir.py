"""What a run finds in its workdir decides what it may do there: resume the checkpoints of its own
config, continue another config's only with --force (the old config.json kept aside), or extend a
finished run (a larger train.steps) with that run's summary and final checkpoint kept.

The trainer asks `check_resumable` before anything else and `keep_finished` once its data is found,
so that a start refused for its config or its data leaves the workdir as it was.
"""

from __future__ import annotations

import json
import logging
import re

import jax

from lra_core.checkpoints.saved_config import resume_conflicts
from lra_core.errors import ConfigError
from lra_core.run import optim_settings
from lra_core.runtime import fs


def check_resumable(config, workdir: fs.Path, force: bool) -> None:
  """A workdir with checkpoints resumes only with the config that made them (RESUMABLE_KEYS may
  differ); otherwise ConfigError, or with `force` a warning and the old config.json kept aside."""
  saved = workdir / "config.json"
  checkpoints = workdir / "checkpoints"
  if not saved.is_file() or not checkpoints.is_dir() or not any(p.name.isdigit() for p in checkpoints.iterdir()):
    return
  try:
    before = json.loads(saved.read_text())
  except json.JSONDecodeError:
    before, conflicts = None, ["config.json: unreadable"]
  if before is not None:
    kept = optim_settings.keep_horizon(config, before)
    if kept:
      logging.info(
        "train.steps %s -> %d: the learning-rate schedule keeps its horizon (%s; steps past it run at its "
        "floor); to stretch it instead, set optim.decay_steps and pass --force",
        before["train"]["steps"],
        config.train.steps,
        ", ".join(kept),
      )
    conflicts = resume_conflicts(before, config)
  if not conflicts:
    return
  more = f" and {len(conflicts) - 1} more difference(s)" if len(conflicts) > 1 else ""
  if not force:
    raise ConfigError(
      f"workdir {workdir} holds checkpoints of a different config ({conflicts[0]}{more}); "
      "use another workdir, or --force to continue these checkpoints with the new config."
    )
  if jax.process_index() == 0:
    kept = workdir / f"config.before_force.{len(list(workdir.glob('config.before_force.*')))}.json"
    saved.rename(kept)
    logging.warning(
      "--force: continuing %s with a changed config (%s%s); the old one is %s", workdir, conflicts[0], more, kept.name
    )


def keep_finished(config, workdir: fs.Path) -> tuple[int, ...]:
  """The final steps of the finished runs this one extends (a larger train.steps), whose checkpoints
  the rotation keeps: a finished run's summary.json and config.json are kept as summary.step<N>.json
  and config.step<N>.json before the extension writes its own."""
  summary = workdir / "summary.json"
  steps = {
    int(m.group(1))
    for p in workdir.glob("summary.step*.json")
    if (m := re.fullmatch(r"summary\.step(\d+)\.json", p.name))
  }
  try:
    done = json.loads(summary.read_text()) if summary.is_file() else {}
  except json.JSONDecodeError:
    done = {}
  step = done.get("step")
  if not isinstance(step, int) or "stopped_at" in done or step >= config.train.steps:
    return tuple(sorted(steps))
  if jax.process_index() == 0:
    kept = workdir / f"summary.step{step}.json"
    summary.rename(kept)
    if (workdir / "config.json").is_file():
      (workdir / f"config.step{step}.json").write_text((workdir / "config.json").read_text())
    logging.info(
      "extending the run finished at step %d to %d: its summary is kept as %s", step, config.train.steps, kept.name
    )
  return tuple(sorted(steps | {step}))
