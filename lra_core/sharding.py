"""Logical-axis sharding as models see it: activation constraints and the platform being traced for.

Parameters and activations carry logical axis names ('batch', 'length', 'embed', 'mlp', 'heads',
'vocab', ...; models/layers/core.py); `config.sharding.rules` maps each to mesh axes of the mesh
MESH_AXES names. A dimension whose size the mesh axes do not divide is replicated instead, so
small models run unchanged on any mesh. Models call `constrain(x, logical_axes)`, a no-op outside
`activate(mesh, rules)`; inside it the Pallas kernels also run per device through `jax.shard_map`
(kernels/toolkit.py). How a run lays its state on the devices is lra_core.layout's, its batches
lra_core.run.batches'.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core.kernels import per_device
from lra_core.kernels.per_device import per_device_mesh

# The mesh's axes, outermost first: data parallel, fully sharded data parallel, context parallel
# (one sequence's time steps split over chips: kernels/context_parallel.py), tensor parallel. Tensor is
# innermost and sequence next: their collectives run every layer, between neighbouring chips.
MESH_AXES = ("data", "fsdp", "sequence", "tensor")
# The axes that may span slices (mesh.slice_axis): their collectives, the gradients' all-reduce and
# FSDP's all-gathers, are few per step and large, so they bear the data-center network's lower bandwidth.
SLICE_AXES = ("data", "fsdp")

Rules = Sequence[tuple[str, str | Sequence[str] | None]]
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("mesh", default=None)


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None) -> P:
  """Maps logical axis names to a PartitionSpec; each mesh axis is used at most once."""
  table = dict((name, target) for name, target in rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    target = table.get(name) if name is not None else None
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    targets = tuple(t for t in targets if t not in used and mesh.shape.get(t, 1) > 1)
    size = math.prod(mesh.shape[t] for t in targets)
    if shape is not None and shape[i] % size:
      targets = ()
    used.update(targets)
    spec.append(targets[0] if len(targets) == 1 else (targets or None))
  return P(*spec)


def whole_row_rules(rules: Rules) -> Rules:
  """The rules for rows cut from a split sequence along the batch (`kernels.per_device.whole_rows`: a
  block's tokens, a group's): their batch axis takes the mesh axes of `length` too, so each row stays
  on the chip holding its steps, and their short time axis splits over nothing."""
  table = dict(rules)
  names = lambda target: (target,) if isinstance(target, str) else tuple(target or ())
  batch, length = names(table.get("batch")), names(table.get("length"))
  rows = batch + tuple(a for a in length if a not in batch)
  return tuple((name, rows if name == "batch" else None if name == "length" else target) for name, target in rules)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Makes `constrain` annotate activations for `mesh` (while tracing inside this context), and runs
  the Pallas kernels per device with batch and heads split as the rules say (and time, for the
  kernels that carry their state across chips: kernels/context_parallel.py)."""
  token = _ACTIVE.set((mesh, tuple(rules)))
  table = dict(rules)
  try:
    with per_device_mesh(mesh, batch=table.get("batch"), heads=table.get("heads"), sequence=table.get("length")):
      yield
  finally:
    _ACTIVE.reset(token)


def target_platform() -> str:
  """The platform of the step being traced: that of the active mesh's devices (lra_core.aot traces
  steps for TPU and GPU targets on a CPU host), else JAX's default backend."""
  active = _ACTIVE.get()
  if active is not None:
    return active[0].devices.flat[0].platform
  return jax.default_backend()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  if mesh.size == 1:
    return x
  if per_device.rows_whole():
    rules = whole_row_rules(rules)
  spec = logical_to_spec(axes, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
