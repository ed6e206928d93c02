"""Objectives by `config.task`; see tasks/base.py for the interface the trainer uses."""

from __future__ import annotations

from lra_core.errors import ConfigError
from lra_core.tasks.base import Task
from lra_core.tasks.classify import ClassifyTask
from lra_core.tasks.diffusion import DiffusionTask
from lra_core.tasks.lm import ImageARTask, LMTask
from lra_core.tasks.mlm import MLMTask

TASKS: dict[str, type[Task]] = {
    "lm": LMTask,
    "image_ar": ImageARTask,
    "mlm": MLMTask,
    "classify": ClassifyTask,
    "retrieval": ClassifyTask,
    "diffusion": DiffusionTask,
}


def make_task(config, info) -> Task:
  if config.task not in TASKS:
    raise ConfigError(f"task {config.task!r} has no objective yet; available: {sorted(TASKS)}.")
  return TASKS[config.task](config, info)
