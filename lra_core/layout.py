"""How a run lays itself on the devices: the mesh, the train state's shardings, and batches.

The mesh has axes lra_core.sharding.MESH_AXES sized from `config.mesh` (-1 = all remaining
devices). Parameters get their PartitionSpecs from their logical axes and `config.sharding.rules`
(`variable_specs`; lra_core.sharding.logical_to_spec). Batches are split over the 'batch' mesh axes
(rows) and the 'length' ones (time steps, `time_fields`):
`to_device` turns each process's rows into global arrays, `abstract_batch` and `config_batch` give
their shapes and shardings for compiling ahead of time. `parameter_layout` tabulates a config's
split without any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core.data import pipeline
from lra_core.errors import ConfigError
from lra_core.layer_stacks import STACKED
from lra_core.registry import build_model
from lra_core.sharding import MESH_AXES, Rules, logical_to_spec


def mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Axis sizes; -1 takes all remaining devices. Fixed sizes may use fewer devices than exist. An
  axis the config lacks (one written before `sequence` existed) has size 1."""
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % fixed:
      raise ConfigError(f"mesh {sizes} cannot use {num_devices} devices: {num_devices} is not a multiple of {fixed}.")
    sizes = {a: (num_devices // fixed if s == -1 else s) for a, s in sizes.items()}
  elif fixed > num_devices:
    raise ConfigError(f"mesh {sizes} needs {fixed} devices, but only {num_devices} are available.")
  return sizes


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if math.prod(shape) < len(devices):
    if jax.process_count() > 1:
      raise ConfigError(
        f"mesh {sizes} uses {math.prod(shape)} of {len(devices)} devices; a multi-process "
        "run must use all of them (set one mesh axis to -1)."
      )
    devices = devices[: math.prod(shape)]
  # make_mesh orders devices by topology on TPU/GPU. Auto axes: GSPMD propagates shardings from
  # the annotations below (the default Explicit axes would not).
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):  # part of a TPU slice has no torus order
    return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def variable_specs(state: nnx.State, rules: Rules, mesh: Mesh) -> dict:
  """Pure dict of PartitionSpecs for an (abstract) nnx.State of Variables with `logical_axes`."""
  flat = {}
  for path, var in nnx.to_flat_state(state):
    axes = var.get_metadata().get("logical_axes")
    flat[path] = P() if axes is None else logical_to_spec(axes, rules, mesh, var.get_value().shape)
  return traverse_util.unflatten_dict(flat)


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


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def match_param_specs(tree, params: dict, param_specs: dict):
  """Specs for a tree that mirrors parameters (e.g. optimizer moments).

  A leaf whose path ends with a parameter's path and has that parameter's shape gets its spec;
  anything else (counters, factored second moments) is replicated. A leaf kept per layer for a
  scanned stack (lra_core.layer_stacks.per_layer_optimizer) gets the stack's spec without its
  layer axis.
  """
  by_path = {}
  for (path, p), (_, s) in zip(
    jax.tree_util.tree_leaves_with_path(params),
    jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, P)),
  ):
    names = tuple(_key_name(k) for k in path)
    by_path[names] = (tuple(p.shape), s)
    if STACKED in names:
      by_path[("<layer>",) + names] = (tuple(p.shape)[1:], P(*s[1:]))

  def spec(path, leaf):
    names = tuple(_key_name(k) for k in path)
    layer_paths = [("<layer>",) + names[:j] + (STACKED,) + names[j + 1 :] for j, n in enumerate(names) if n.isdigit()]
    for start in range(len(names)):
      for key in [names[start:]] + [p[:1] + p[start + 1 :] for p in layer_paths]:
        hit = by_path.get(key)
        if hit is not None and hit[0] == tuple(np.shape(leaf)):
          return hit[1]
    return P()

  return jax.tree_util.tree_map_with_path(spec, tree)


def named(mesh: Mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def parameter_layout(config, num_devices: int) -> list[dict]:
  """How `config`'s parameters would be split on `num_devices` devices, without any device.

  One row per parameter: path, shape, logical axes, PartitionSpec and the elements each device
  holds. Uses an abstract mesh and abstract parameters, so it runs anywhere in a second
  (scripts/shardings.py prints it; docs/launching.md tabulates it per model family).
  """
  sizes = mesh_shape(config.mesh, num_devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  model = nnx.eval_shape(lambda: build_model(config, seed=0))
  rows = []
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = tuple(var.get_value().shape)
    axes = var.get_metadata().get("logical_axes")
    spec = P() if axes is None else logical_to_spec(axes, config.sharding.rules, mesh, shape)
    split = math.prod(mesh.shape[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry))
    rows.append(
      dict(
        path="/".join(map(str, path)),
        shape=shape,
        logical_axes=axes,
        spec=spec,
        size=math.prod(shape),
        per_device=math.prod(shape) // split,
      )
    )
  return rows


def mesh_axes_used(spec: P) -> set[str]:
  return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}


# -- batches ------------------------------------------------------------------------------------------


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
