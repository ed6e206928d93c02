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


def non_embedding_parameter_count(config) -> int:
  """Parameters outside the layers that map tokens in and out, as papers size language models.

  A model module names its embedding parameters (top-level attributes) in EMBEDDING_PARAMS; the
  default covers the transformer baselines (token embedding, position table, output head).
  """
  names = getattr(model_module(config.model.name), "EMBEDDING_PARAMS", ("embed", "positions", "head"))
  model = nnx.eval_shape(lambda: build_model(config))
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return sum(math.prod(v.shape) for path, v in flat if str(path[0]) not in names)
