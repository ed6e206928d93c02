"""train.init_from: a new run's parameters from another run's latest checkpoint, or from a Hugging Face
model folder (`hf:<folder>`, lra_core/hf); the optimizer state starts fresh either way.

`check_source` runs before the trainer writes or compiles anything: it reads the source's config.json
alone and names, in one sentence, every setting of this run's config.model that keeps it from starting
there, so a refused start costs no compile and leaves the workdir as it was. `warm_start` then reads
the weights.
"""

from __future__ import annotations

import json
import logging

import jax
import ml_collections
import numpy as np
from flax import traverse_util

from lra_core import hf, registry
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.checkpoints.saved_config import from_saved
from lra_core.errors import ConfigError, brief
from lra_core.run.state import run_setup
from lra_core.runtime import fs

# Settings of config.model that change how a model computes or trains, not its parameters or what it
# computes once trained: a run starts from another's checkpoint with any of them changed. The kernels
# (impl, attention_impl, chunk_blocks, input_scan, ring_order: the same function, computed in another
# order), the compute dtype, the layer-stacking switches (remat, scan_layers: the parameters are stacked
# to the run's own layout), dropout of every kind, and Transformer-VQ's training rates of its codebook
# and commitment loss and its gradient through the cache. The context too: max_len and rope_scaling,
# since a warm start may extend the length a run reads (where max_len sizes a learned position table,
# the parameter shapes then differ, which `warm_start` names). Every other setting is compared.
# Latte's `chunk` stays compared although it is a kernel setting there: FLASH and the Combiner
# read the same key as the chunk their attention sees.
FREE = (
  *("dtype", "impl", "attention_impl", "chunk_blocks", "input_scan", "ring_order", "remat", "scan_layers"),
  *("dropout", "attention_dropout", "latent_dropout", "droplyr", "dropres", "dropsin"),
  *("commit_coef", "ema_rate", "grad_through_cache", "max_len", "rope_scaling"),
)
# What a family with capability `uptrain` shares with a run it uptrains from (its record's
# `uptrain_source` maps its config.model to that transformer's): the settings a Hugging Face folder is
# checked by, less the norms' epsilon, which no parameter holds: this project's vanilla runs
# (configs/c4/block_transformer.py:<size>,vanilla) keep the norms' own epsilon where the Block
# Transformer's Pythia layers name 1e-5, and a block model uptrains from them as it always has.
UPTRAIN_MATCHED = tuple(k for k in hf.MATCHED if k != "norm_eps")


def check_source(config, workdir: fs.Path) -> None:
  """One sentence where train.init_from cannot start this run, naming every setting that differs from
  the source's (read from its config.json: nothing compiled, nothing written). Nothing to check where
  `workdir` holds a checkpoint: the run resumes it, whatever became of its source since."""
  source = config.train.init_from
  if not source or _resumes(workdir):
    return
  family = registry.family(config.model.name)
  if source.startswith(hf.PREFIX):  # a Hugging Face model folder
    folder = source.removeprefix(hf.PREFIX)
    if family.uptrain_source is not None:
      hf.check_folder(family.uptrain_source(config), folder, uptrains=family.name)
    else:
      hf.check_folder(config.model, folder)
    return
  theirs = source_config(source).get("model")
  if not isinstance(theirs, ml_collections.ConfigDict):
    raise ConfigError(
      f"train.init_from {source!r}: its config.json holds no model section; expected the workdir of a run."
    )
  if family.capabilities.uptrain:
    if family.uptrain_source is None:  # the family's uptrain_params says what it reads
      return
    ours = family.uptrain_source(config)
    if theirs.get("name") != ours.name:
      raise ConfigError(
        f"train.init_from {source!r} holds a {theirs.get('name')} model, not a vanilla {ours.name}; a "
        f"{family.name} run uptrains from the workdir of a {ours.name} run."
      )
    hf.check_settings(ours, theirs, repr(source), UPTRAIN_MATCHED, uptrains=family.name)
    return
  ours = config.model
  if theirs.get("name") != ours.name:
    raise ConfigError(
      f"train.init_from {source!r} holds a {theirs.get('name')} model, whose parameters a {ours.name} run cannot "
      f"start from; give the workdir of a {ours.name} run."
    )
  # A key the source's config lacks (saved before it existed, no upgrade naming its old value) is left
  # to the parameter shapes: nothing says what that run had.
  hf.check_settings(ours, theirs, repr(source), tuple(k for k in ours if k not in FREE and k in theirs))


def source_config(source_workdir: str) -> ml_collections.ConfigDict:
  """The config a run saved in `source_workdir` (train.init_from's run), not validated; one sentence
  where it has none or it cannot be read."""
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
  return from_saved(saved)


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
  source = source_config(source_workdir)
  path = fs.path(source_workdir, what="train.init_from")
  restored, step = restore_params(path, run_setup(source, mesh).spec.abstract)
  family = registry.family(config.model.name)
  params = jax.device_get(state["params"])
  source_params = jax.device_get(restored["params"])
  if family.capabilities.uptrain:
    params = family.uptrain_params(params, source_params, config)
  else:
    differ = _first_difference(params, source_params)
    if differ:
      raise ConfigError(
        f"train.init_from {source_workdir!r} holds a {source.model.name} model whose parameters do not match "
        f"this {config.model.name} model ({differ})."
      )
    params = source_params
  logging.info("parameters initialised from %s (step %d)", path, step)
  return _started_from(state, params, spec)


def _first_difference(ours, theirs) -> str:
  """The first parameter in which two parameter trees differ ("" where none does): its path and shapes."""
  mine = {tuple(map(str, k)): np.shape(v) for k, v in traverse_util.flatten_dict(ours).items()}
  other = {tuple(map(str, k)): np.shape(v) for k, v in traverse_util.flatten_dict(theirs).items()}
  for key in sorted(mine.keys() | other.keys()):
    if mine.get(key) != other.get(key):
      shape = lambda s: "absent" if s is None else f"shape {list(s)}"
      return f"parameter {'.'.join(key)}: {shape(mine.get(key))} here, {shape(other.get(key))} there"
  return ""


def _resumes(workdir: fs.Path) -> bool:
  """Whether `workdir` holds a checkpoint (a step's folder), which the run then resumes."""
  checkpoints = workdir / "checkpoints"
  return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def _started_from(state: dict, params, spec) -> dict:
  state = dict(state, params=jax.device_put(params, spec.shardings["params"]))
  if "ema" in state:  # the average starts at the parameters the run starts from
    state["ema"] = jax.device_put(params, spec.shardings["ema"])
  return state
