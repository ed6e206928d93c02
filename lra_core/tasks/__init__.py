"""Objectives by `config.task` (named in lra_core.task_kinds.TASKS); tasks/base.py has the interface."""

from __future__ import annotations

from lra_core import registry
from lra_core.tasks.base import Task


def make_task(config, info) -> Task:
  return registry.task_class(config.task)(config, info)
