"""Models are looked up by name: `config.model.name` -> `models/<name>.py`, class `Model`.

Adding an architecture is one file in models/ (a `Model(config, *, rngs)` nnx.Module, and
optionally `validate_config(config)`) plus configs; the trainer needs no edit.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from lra_core.config import model_module


def build_model(config, seed: int = 0) -> nnx.Module:
  """A freshly initialised model for `config` (parameters float32, from `seed`)."""
  module = model_module(config.model.name)
  return module.Model(config, rngs=nnx.Rngs(params=seed))


def parameter_count(config) -> int:
  """Trainable parameters of the model `config` builds, from shapes only (nothing is allocated)."""
  model = nnx.eval_shape(lambda: build_model(config))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
