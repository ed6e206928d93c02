"""How the host batches are laid on the devices: each process's rows become global arrays.

Batches are split over the 'batch' mesh axes (rows, `batch_spec`) and the 'length' ones (time steps
of the fields `time_fields` names). `row_block` says which rows a process reads, `to_device` turns
them into global arrays, and `abstract_batch` and `config_batch` give their shapes and shardings for
compiling ahead of time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core.data import pipeline
from lra_core.errors import ConfigError
from lra_core.layout import mesh_axes_used
from lra_core.sharding import Rules, logical_to_spec


def batch_spec(rules: Rules, mesh: Mesh, shape: Sequence[int], *, time: bool = False) -> P:
  """Leading axis over the 'batch' mesh axes; with `time`, the second over the 'length' ones (the
  `sequence` axis: each chip holds a slice of every row's time steps); the rest replicated."""
  axes = ("batch", "length") if time else ("batch",)
  return logical_to_spec(axes + (None,) * (len(shape) - len(axes)), rules, mesh, shape)


def time_fields(shapes: dict[str, Sequence[int]]) -> set[str]:
  """The batch fields with a time axis, as long as the inputs' [B,T] (tokens, targets, weights,
  segment ids, ...): those a sequence split cuts. None where the inputs are not [B,T] (two towers)."""
  inputs = shapes.get("inputs")
  if inputs is None or len(inputs) != 2:
    return set()
  return {name for name, shape in shapes.items() if len(shape) >= 2 and shape[1] == inputs[1]}


def row_block(mesh, rules) -> tuple[int, int]:
  """(index, count): this process reads block `index` of `count` equal blocks of every global batch's
  rows, those its devices hold. Processes whose devices hold the same rows (a sequence split over
  several hosts: mesh.sequence) read the same block, each keeping its own time steps (`to_device`)."""
  if jax.process_count() == 1:
    return 0, 1
  spec = logical_to_spec(("batch",), rules, mesh)
  n = math.prod(mesh.shape[a] for a in mesh_axes_used(spec))  # one row per place along the batch axes
  held = sorted(
    {index[0].start or 0 for index in NamedSharding(mesh, spec).addressable_devices_indices_map((n,)).values()}
  )
  if held != list(range(held[0], held[0] + len(held))) or n % len(held) or held[0] % len(held):
    raise ConfigError(f"this process's devices hold rows {held} of {n}, not one block of a batch's rows.")
  return held[0] // len(held), n // len(held)


def _global_layouts(batch: dict[str, np.ndarray], mesh, rules):
  """(name, global shape, sharding, the part of this process's `local` its devices hold) of each field
  of a batch of which this process holds all of its block's rows (`row_block`), every time step."""
  timed = time_fields({name: np.shape(x) for name, x in batch.items()})
  blocks = row_block(mesh, rules)[1]
  for name, local in batch.items():
    local = np.asarray(local)
    if not local.ndim:
      yield name, (), NamedSharding(mesh, P()), local
      continue
    shape = (local.shape[0] * blocks,) + local.shape[1:]
    named = NamedSharding(mesh, batch_spec(rules, mesh, shape, time=name in timed))
    if name in timed and jax.process_count() > 1:  # a sequence split over hosts: this host's time steps
      steps = [index[1] for index in named.addressable_devices_indices_map(shape).values()]
      start = min(s.start or 0 for s in steps)
      stop = max(shape[1] if s.stop is None else s.stop for s in steps)
      local = local[:, start:stop]
    yield name, shape, named, local


def to_device(batch: dict[str, np.ndarray], mesh, rules) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over the batch mesh axes (and their time steps
  over the sequence axis)."""
  return {
    name: jax.make_array_from_process_local_data(named, held, shape)
    for name, shape, named, held in _global_layouts(batch, mesh, rules)
  }


def abstract_batch(batch: dict[str, np.ndarray], mesh, rules) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes, dtypes and shardings `to_device(batch, ...)` gives, for compiling ahead of time."""
  return {
    name: jax.ShapeDtypeStruct(shape, held.dtype, sharding=named)
    for name, shape, named, held in _global_layouts(batch, mesh, rules)
  }


def config_batch(config, mesh, rules, *, batch_size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract global batch of `config` (train.batch_size rows unless `batch_size`), laid out
  as `to_device` lays out real batches: for compiling ahead of time without any data."""
  fields = pipeline.batch_fields(config, batch_size or config.train.batch_size)
  timed = time_fields({name: shape for name, (shape, _) in fields.items()})
  out = {}
  for name, (shape, dtype) in fields.items():
    spec = batch_spec(rules, mesh, shape, time=name in timed) if shape else P()
    out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  return out
