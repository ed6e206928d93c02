"""The train state as a plain pytree, its shapes and shardings, and its fingerprint.

  state = {"step": int32[], "rng": uint32[2] (root key data), "params": {...},
           "opt_state": optax state, "model_state": {...} (non-parameter variables),
           "carry": {...} (only for models that carry state between update windows),
           "ema": {...} (only with optim.ema_decay > 0: the moving average of "params", same tree)}

Plain dicts of arrays keep checkpoints readable without the model code and let orbax restore
onto any mesh from an abstract target.

With `model.scan_layers` a stack of N layers is stored as one entry {STACKED: tree of [N, ...]}
in place of {0: tree, ..., N-1: tree}; `unscan_params` / `scan_params` convert between the two
layouts (any tree that mirrors the parameters: params, optimizer moments, model state).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lra_core import layout, registry
from lra_core.layer_stacks import STACKED, map_dicts, unscan_params  # noqa: F401  (unscan_params re-exported)
from lra_core.registry import build_model
from lra_core.run import optim
from lra_core.run.batches import batch_spec


@dataclasses.dataclass
class StateSpec:
  """Everything static about a model's train state."""

  train_graphdef: Any  # module structure in train mode (dropout on)
  eval_graphdef: Any  # the same in eval mode
  abstract: dict  # ShapeDtypeStructs of the state
  shardings: dict  # NamedShardings of the state
  init: Callable[[], dict]  # jitted: builds a fresh, sharded state
  has_carry: bool
  num_params: int


def split_model(model: nnx.Module):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest


def make_state_spec(config, mesh: Mesh, tx: optax.GradientTransformation, *, seed: int | None = None) -> StateSpec:
  """Shapes by eval_shape, shardings from logical axes, and a jitted sharded initializer."""
  seed = config.train.seed if seed is None else seed
  rules = config.sharding.rules
  batch_size = config.train.batch_size

  abstract_model = nnx.eval_shape(lambda: build_model(config, seed=seed))
  has_carry = registry.family(config.model.name).keeps_carry(config)
  has_ema = optim.ema_decay(config) > 0
  abstract_model.train()
  train_graphdef, abs_params, abs_rest = split_model(abstract_model)
  abstract_model.eval()
  eval_graphdef, _, _ = split_model(abstract_model)

  param_specs = layout.variable_specs(abs_params, rules, mesh)
  rest_specs = layout.variable_specs(abs_rest, rules, mesh)
  params_pure = nnx.to_pure_dict(abs_params)

  def init() -> dict:
    model = build_model(config, seed=seed)
    _, params, rest = split_model(model)
    params = nnx.to_pure_dict(params)
    state = {
      "step": jnp.zeros((), jnp.int32),
      "rng": jax.random.key_data(jax.random.key(seed)),
      "params": params,
      "opt_state": tx.init(params),
      "model_state": nnx.to_pure_dict(rest),
    }
    if has_carry:
      state["carry"] = model.init_carry(batch_size)
    if has_ema:  # the average starts at the initial parameters
      state["ema"] = jax.tree.map(jnp.copy, params)
    return state

  abstract = jax.eval_shape(init)
  specs = {
    "step": P(),
    "rng": P(),
    "params": param_specs,
    "model_state": rest_specs,
    "opt_state": layout.match_param_specs(abstract["opt_state"], params_pure, param_specs),
  }
  if has_carry:
    specs["carry"] = jax.tree.map(lambda x: batch_spec(rules, mesh, x.shape), abstract["carry"])
  if has_ema:
    specs["ema"] = param_specs
  shardings = layout.named(mesh, specs)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_pure))
  init_fn = jax.jit(init, out_shardings=shardings)  # traced (and constrained) on first call
  return StateSpec(train_graphdef, eval_graphdef, abstract, shardings, init_fn, has_carry, num_params)


class RunSetup(NamedTuple):
  """What every command builds from a config before its steps: the optimizer, its main learning-rate
  schedule (for logging; None where no optimizer is built) and the train state's spec over a mesh."""

  tx: optax.GradientTransformation
  schedule: optax.Schedule | None
  spec: StateSpec


def run_setup(config, mesh: Mesh, *, params_only: bool = False) -> RunSetup:
  """The run setup of `config` over `mesh`, the one the trainer, the compile targets, the bench, evaluation,
  sampling and warm starts share. params_only: for a command that restores parameters alone (evaluation,
  sampling): no optimizer state is built or restored (optax.identity)."""
  if params_only:
    tx, schedule = optax.identity(), None
  else:
    tx, schedule = optim.make_optimizer(config)
  return RunSetup(tx, schedule, make_state_spec(config, mesh, tx))


def eval_params(state: dict) -> dict:
  """The parameters to evaluate and sample with: the EMA when the state keeps one, else "params"."""
  return state["ema"] if "ema" in state else state["params"]


def to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def param_checksum(params) -> float:
  """A float fingerprint of all parameters, equal for equal parameters on any mesh.

  Computed on the host in float64 in a fixed leaf order, so device count and reduction order
  do not change it; each leaf is weighted by its position so swapped tensors differ. Computed on
  the layout of per-layer entries (see unscan_params), so a model with scanned layers has the
  checksum of the same model without.
  """
  total = 0.0
  for i, leaf in enumerate(jax.tree.leaves(unscan_params(jax.tree.map(to_host, params)))):
    x = leaf.astype(np.float64)
    total += (i + 1) * (float(x.sum()) + float(np.square(x).sum()))
  return total


# -- scanned and unscanned layer stacks ----------------------------------------------------------------


def stacked_paths(config) -> set[tuple]:
  """Dict-key paths of the stacks that `config` with model.scan_layers=True scans."""
  config = config.copy_and_resolve_references() if hasattr(config, "copy_and_resolve_references") else config
  with config.unlocked():
    config.model.scan_layers = True
  model = nnx.eval_shape(lambda: build_model(config))
  paths = set()
  map_dicts(nnx.to_pure_dict(nnx.state(model)), lambda p, d: paths.add(p) if STACKED in d else None)
  return paths


def _same_path(a: tuple, b: tuple) -> bool:
  return len(a) == len(b) and all(str(x) == str(y) for x, y in zip(a, b))


def scan_params(tree, config):
  """The inverse of unscan_params for `config`'s model: the per-layer entries {0: .., N-1: ..} of
  each stack it scans become {STACKED: tree of [N, ...]}. `tree` mirrors the parameters (params,
  optimizer moments, model state); a stack is matched by the end of its path."""
  paths = stacked_paths(config)

  def stack(path, d: dict):
    if not d or not any(_same_path(path[len(path) - len(p) :], p) for p in paths):
      return d
    if {str(k) for k in d} != {str(i) for i in range(len(d))}:  # int keys, or str ones as orbax reads them
      return d
    layers = [v for _, v in sorted(d.items(), key=lambda kv: int(kv[0]))]
    return {STACKED: jax.tree.map(lambda *xs: jnp.stack(xs) if np.ndim(xs[0]) else xs[0], *layers)}

  return map_dicts(tree, stack)
