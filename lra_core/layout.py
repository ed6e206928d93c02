"""How a run lays its state on the devices: the mesh and the train state's shardings.

The mesh has axes lra_core.sharding.MESH_AXES sized from `config.mesh` (-1 = all remaining
devices). Parameters get their PartitionSpecs from their logical axes and `config.sharding.rules`
(`variable_specs`; lra_core.sharding.logical_to_spec); a tree that mirrors them (optimizer moments)
gets theirs from `match_param_specs`. How host batches are laid on the devices is
lra_core.run.batches'; the table of a config's parameter split is lra_core.bench.shardings'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core.errors import ConfigError
from lra_core.layer_stacks import STACKED
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
    fits = " ".join(f"--config.mesh.{axis}={size}" for axis, size in fitting_sizes(sizes, num_devices).items())
    raise ConfigError(
      f"mesh {sizes} needs {fixed} devices, but only {num_devices} are available; with {fits} the mesh fits them."
    )
  return sizes


def fitting_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
  """The axes to shrink, and their new sizes, for a mesh of fixed `sizes` to fit `num_devices`: each axis
  in MESH_AXES order keeps as much of its size as the devices left over by the axes before it allow."""
  left, changed = num_devices, {}
  for axis in MESH_AXES:
    size = min(sizes[axis], max(left, 1))
    if size != sizes[axis]:
      changed[axis] = size
    left //= max(size, 1)
  return changed


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if int(mesh_config.get("slices", 1)) > 1:
    return _sliced_mesh(sizes, int(mesh_config.slices), mesh_config.get("slice_axis", "data"), devices)
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


def slice_of(device: jax.Device) -> int:
  """The slice a device belongs to: a TPU's `slice_index` (several slices joined over the data-center
  network); elsewhere its process, each process standing for one slice (CPU and GPU hosts)."""
  return device.slice_index if _tpu(device) else device.process_index


def _tpu(device: jax.Device) -> bool:
  return device.platform == "tpu" and getattr(device, "slice_index", None) is not None


def _sliced_mesh(sizes: dict[str, int], slices: int, axis: str, devices: list[jax.Device]) -> Mesh:
  """A mesh whose `axis` spans `slices` slices, outermost, and whose other axes stay inside one: the
  slow data-center network then carries only `axis`'s collectives (mesh_utils.create_hybrid_device_mesh
  lays each slice's devices by its own torus as jax.make_mesh would)."""
  found = sorted({slice_of(d) for d in devices})
  what = "slices" if _tpu(devices[0]) else "processes (one slice each here)"
  if len(found) != slices:
    raise ConfigError(f"mesh.slices={slices}, but the {len(devices)} devices are in {len(found)} {what}.")
  if math.prod(sizes.values()) != len(devices):
    raise ConfigError(
      f"mesh {sizes} uses {math.prod(sizes.values())} of {len(devices)} devices; a mesh over slices must use all "
      "of them (set one mesh axis to -1)."
    )
  if sizes[axis] % slices:
    raise ConfigError(
      f"mesh.{axis} {sizes[axis]} does not split over mesh.slices={slices} (mesh.slice_axis={axis!r}): make it a "
      f"multiple of {slices}."
    )
  ici = tuple(sizes[a] // slices if a == axis else sizes[a] for a in MESH_AXES)
  dcn = tuple(slices if a == axis else 1 for a in MESH_AXES)
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=not _tpu(devices[0]))
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def variable_specs(state: nnx.State, rules: Rules, mesh: Mesh) -> dict:
  """Pure dict of PartitionSpecs for an (abstract) nnx.State of Variables with `logical_axes`."""
  flat = {}
  for path, var in nnx.to_flat_state(state):
    axes = var.get_metadata().get("logical_axes")
    flat[path] = P() if axes is None else logical_to_spec(axes, rules, mesh, var.get_value().shape)
  return traverse_util.unflatten_dict(flat)


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


def mesh_axes_used(spec: P) -> set[str]:
  return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
