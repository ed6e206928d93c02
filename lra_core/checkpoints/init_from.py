"""train.init_from: a new run's parameters from another run's latest checkpoint, or from a Hugging Face
model folder (`hf:<folder>`, lra_core/hf); the optimizer state starts fresh either way.
"""

from __future__ import annotations

import json
import logging

import jax
import numpy as np

from lra_core import hf, registry
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.checkpoints.saved_config import from_saved
from lra_core.errors import ConfigError, brief
from lra_core.run.state import run_setup
from lra_core.runtime import fs


def warm_start(config, spec, state: dict, source_workdir: str, mesh) -> dict:
  """`state` with its parameters taken from the latest checkpoint in `source_workdir`.

  The source run's own config.json rebuilds its state for restoring. A family with capability
  `uptrain` maps the source parameters onto its own with its record's `uptrain_params` (e.g. a
  Block Transformer from a vanilla Transformer); otherwise the two models must have the same
  parameter shapes. The optimizer state stays fresh (it starts at zero either way).
  """
  if source_workdir.startswith(hf.PREFIX):  # a Hugging Face model folder
    folder, family = source_workdir.removeprefix(hf.PREFIX), registry.family(config.model.name)
    params = jax.device_get(state["params"])
    if family.uptrain_source is not None:  # uptraining: the family maps a vanilla transformer's parameters
      params = family.uptrain_params(params, hf.source_params(family.uptrain_source(config), folder), config)
    else:
      params = hf.initial_params(config.model, params, folder)
    logging.info("parameters initialised from %s", source_workdir)
    return _started_from(state, params, spec)
  path = fs.path(source_workdir, what="train.init_from")
  try:
    found = (path / "config.json").is_file()
    saved = json.loads((path / "config.json").read_text()) if found else None
  except (OSError, ValueError) as e:  # no permission, a damaged file
    raise ConfigError(
      f"train.init_from {source_workdir!r}: its config.json cannot be read ({type(e).__name__}: {brief(e)})."
    ) from e
  if not found:
    raise ConfigError(f"train.init_from {source_workdir!r} has no config.json; expected the workdir of a run.")
  source_config = from_saved(saved)
  source, step = restore_params(path, run_setup(source_config, mesh).spec.abstract)
  family = registry.family(config.model.name)
  params = jax.device_get(state["params"])
  source_params = jax.device_get(source["params"])
  if family.capabilities.uptrain:
    params = family.uptrain_params(params, source_params, config)
  else:
    mine, theirs = jax.tree.structure(params), jax.tree.structure(source_params)
    shapes = [np.shape(x) for x in jax.tree.leaves(params)] == [np.shape(x) for x in jax.tree.leaves(source_params)]
    if mine != theirs or not shapes:
      raise ConfigError(
        f"train.init_from {source_workdir!r} holds a {source_config.model.name} model whose "
        f"parameters do not match this {config.model.name} model."
      )
    params = source_params
  logging.info("parameters initialised from %s (step %d)", path, step)
  return _started_from(state, params, spec)


def _started_from(state: dict, params, spec) -> dict:
  state = dict(state, params=jax.device_put(params, spec.shardings["params"]))
  if "ema" in state:  # the average starts at the parameters the run starts from
    state["ema"] = jax.device_put(params, spec.shardings["ema"])
  return state
