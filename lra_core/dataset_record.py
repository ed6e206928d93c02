"""What a dataset module declares: one `Dataset` record of its facts, read everywhere from there.

It sits below the registry, which finds a dataset module by its name and checks its record, and below
lra_core.data.datasets, whose modules declare the records (lra_core/data/__init__.py describes the modules).
"""

from __future__ import annotations

import dataclasses

from lra_core.errors import ConfigError

SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One dataset's facts, declared once in its module as `DATASET` and read from there."""

  name: str  # config.data.name: the stem of the module that declares it
  unit: str  # what one target is (DataInfo.unit): bits-per-<unit> is reported for per-token tasks
  tasks: tuple[str, ...]  # the tasks (config.task, lra_core.task_kinds) it gives examples for
  splits: tuple[str, ...] = SPLITS  # the splits make_source opens
  packed_documents: bool = False  # rows hold documents end to end: examples carry segment_ids (causal: words)

  def check_task(self, task: str) -> None:
    """A one-sentence ConfigError unless this dataset serves `task`."""
    if task not in self.tasks:
      raise ConfigError(f"task {task!r} cannot use the {self.name} dataset; expected one of {list(self.tasks)}.")

  def check_split(self, split: str) -> None:
    """A one-sentence ConfigError unless `split` is one of this dataset's splits."""
    if split not in self.splits:
      raise ConfigError(f"split {split!r} is not one of {self.splits}.")
