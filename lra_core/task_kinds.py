"""Every task (`config.task`) and what kind of task it is: the one home of these facts.

A task is an objective (a class in lra_core/tasks/, named here and imported only by the registry)
and a handful of properties that the models, the data, the sampler and the config checks branch
on. They ask `kind(config.task).causal`, never whether the name is in some tuple of names, so a new
task is one row here and the code that reads a property follows it.

This table sits below the models (it imports nothing of the project but its errors), so a model
can read the kind of its run: `RunInfo.kind` (lra_core/protocol.py).
"""

from __future__ import annotations

import dataclasses

from lra_core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """One task's objective and properties."""

  name: str  # config.task
  objective: str  # "module:Class" of the objective in lra_core/tasks/ (lra_core.registry.task_class)
  causal: bool = False  # position t predicts token t + 1 from tokens <= t: causal masks, decoding, update windows
  classifies: bool = False  # one class per example from a pooled output (model.num_classes)
  image: bool = False  # examples are images: samples are drawn as image grids
  per_token: bool = False  # the model predicts a token at every position (a vocabulary head)
  labelled: bool = False  # examples are (inputs, mask, one label): a class, a match, a class to condition on
  towers: int = 1  # documents per example, each through the same encoder (retrieval: 2)


TASKS: dict[str, TaskKind] = {
  k.name: k
  for k in (
    TaskKind("lm", "lra_core.tasks.lm:LMTask", causal=True, per_token=True),
    TaskKind("image_ar", "lra_core.tasks.lm:ImageARTask", causal=True, per_token=True, image=True),
    TaskKind("mlm", "lra_core.tasks.mlm:MLMTask", per_token=True),
    TaskKind("classify", "lra_core.tasks.classify:ClassifyTask", classifies=True, labelled=True),
    TaskKind("retrieval", "lra_core.tasks.classify:ClassifyTask", classifies=True, labelled=True, towers=2),
    # The label is the class a class-conditional denoiser is given (0 and unused otherwise).
    TaskKind("diffusion", "lra_core.tasks.diffusion:DiffusionTask", image=True, labelled=True),
  )
}


def kind(name: str) -> TaskKind:
  """The record of task `name` (config.task); a one-sentence ConfigError for an unknown one."""
  if name not in TASKS:
    raise ConfigError(f"task {name!r} is not one of {list(TASKS)}.")
  return TASKS[name]


def names(**properties) -> tuple[str, ...]:
  """The tasks with every given property, e.g. names(causal=True): for messages that list them."""
  return tuple(n for n, k in TASKS.items() if all(getattr(k, p) == v for p, v in properties.items()))
