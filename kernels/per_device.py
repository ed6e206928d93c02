"""Running a kernel per device under a mesh: the kernel mesh, whole rows, and the time axis's split.

The kernels are independent per (batch, head), so under `per_device_mesh(mesh, ...)`
(entered by `lra_core.sharding.activate`) `run_per_device` wraps them in `jax.shard_map` with
batch and heads split over the mesh axes the rules name; under `jax.set_mesh` alone, as the
arguments' explicit shardings say. A kernel under a mesh of several devices always runs in
shard_map (replicated where nothing splits). The time axis splits only for a caller that passes
its carried state between the slices (kernels/context_parallel.py, dims letter 't').
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class _MeshAxes:
  mesh: Mesh
  batch: tuple[str, ...]
  heads: tuple[str, ...]
  sequence: tuple[str, ...] = ()


_ACTIVE: contextvars.ContextVar[_MeshAxes | None] = contextvars.ContextVar("kernel_mesh", default=None)
_WHOLE_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("whole_rows", default=False)


def _names(axes: str | Sequence[str] | None) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


@contextlib.contextmanager
def per_device_mesh(
  mesh: Mesh,
  *,
  batch: str | Sequence[str] | None,
  heads: str | Sequence[str] | None,
  sequence: str | Sequence[str] | None = None,
) -> Iterator[None]:
  """Within this context the kernels run per device: batch over `batch`, heads over `heads`, and the
  time axis over `sequence` where a caller carries state across the slices (kernels/context_parallel.py).

  The context is read while tracing: a function jitted inside it shards its kernels, while one
  traced before (and cached by jit) keeps its unsharded trace.
  """
  token = _ACTIVE.set(_MeshAxes(mesh, _names(batch), _names(heads), _names(sequence)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def kernel_mesh() -> Mesh | None:
  """The mesh of `per_device_mesh` while one is entered, else None (kernels/toolkit.py reads the target
  devices from it)."""
  active = _ACTIVE.get()
  return None if active is None else active.mesh


@contextlib.contextmanager
def whole_rows() -> Iterator[None]:
  """Traces work over short rows cut from a split sequence along the batch (a block's tokens, a
  group's), each row whole on the chip that holds its steps: the rows' batch axis splits over the
  sequence axes too (here and in `lra_core.sharding.constrain`), their time axis over nothing."""
  token = _WHOLE_ROWS.set(True)
  try:
    yield
  finally:
    _WHOLE_ROWS.reset(token)


def rows_whole() -> bool:
  """Whether the work being traced is over whole rows (`whole_rows`)."""
  return _WHOLE_ROWS.get()


def sequence_axes(length: int) -> tuple[str, ...]:
  """The mesh axes that split a time axis of `length` steps under the kernel mesh: those of
  `per_device_mesh(sequence=...)` not yet manual, when they divide `length`; () otherwise, and
  always () over whole rows."""
  active = _ACTIVE.get()
  if active is None or not active.sequence or rows_whole():
    return ()
  manual = _manual_axes(active.mesh)
  return _split(tuple(a for a in active.sequence if a not in manual), active.mesh, length)


def sequence_slices(length: int) -> int:
  """How many slices `sequence_axes(length)` cuts a time axis of `length` steps into (1: none)."""
  names = sequence_axes(length)
  return math.prod(_ACTIVE.get().mesh.shape[a] for a in names) if names else 1


def _manual_axes(mesh) -> set[str]:
  """The axes of `mesh` already manual: in its own types, or in the context mesh's while tracing
  the body of an enclosing shard_map (which splits them already)."""
  context = jax.sharding.get_abstract_mesh()
  meshes = (mesh,) if context.empty else (mesh, context)
  return {a for m in meshes for a, t in zip(m.axis_names, m.axis_types) if t == AxisType.Manual}


def _split(axes: tuple[str, ...], mesh, size: int) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that split `size` evenly, or none."""
  axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
  return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _typed_axes(args: Sequence, dims: Sequence, letter: str) -> tuple[str, ...]:
  """The mesh axes that shard axis `letter` in the arguments' types (explicit sharding under
  `jax.set_mesh`; none under automatic axes): the first argument's that has any."""
  is_dims = lambda x: isinstance(x, str) or x is None
  for arg, d in zip(args, dims):
    for x, letters in zip(jax.tree.leaves(arg), jax.tree.leaves(d, is_leaf=is_dims)):
      spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
      if letters and letter in letters and spec is not None and letters.index(letter) < len(spec):
        axes = _names(spec[letters.index(letter)])
        if axes:
          return axes
  return ()


def run_per_device(
  fn: Callable,
  args: Sequence,
  dims: Sequence,
  out_dims,
  *,
  batch: int,
  heads: int,
  kv_heads: int | None = None,
  length: int | None = None,
):
  """fn(*args), per device when a mesh of more than one device is set.

  The mesh is the kernel mesh of `per_device_mesh` (batch and heads split over the axes it names) or
  else the context mesh of `jax.set_mesh` (split as the arguments' explicit shardings say). Either
  way the kernel runs in `jax.shard_map`, replicated where nothing splits: a Mosaic kernel cannot
  be partitioned automatically.

  `dims` gives, per argument (a pytree of arrays, or None), a string with one letter per axis:
  'b' batch, 'h' query heads, 'k' key-value heads, 'g' the query heads of one key-value head's group
  (split where one key-value head is shared by all), 't' time (split over `sequence_axes(length)`,
  only for a `fn` that carries its state across the slices: kernels/context_parallel.py), '.' anything else
  (never split); `out_dims` likewise for the outputs. Heads split only when the split keeps query
  heads with their key-value head (kv_heads divisible by the split, or a single shared kv head,
  replicated).
  """
  active = _ACTIVE.get()
  if active is not None:
    mesh, want_b, want_h = active.mesh, active.batch, active.heads
    if rows_whole():  # rows cut from a split sequence: on the chips that hold their steps
      want_b = want_b + tuple(a for a in active.sequence if a not in want_b)
  else:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return fn(*args)
    want_b, want_h = _typed_axes(args, dims, "b"), _typed_axes(args, dims, "h")
  # Axes already manual (inside an enclosing shard_map) are split already: only the others are ours to split.
  manual = _manual_axes(mesh)
  free = tuple(a for a in mesh.axis_names if a not in manual)
  if math.prod(mesh.shape[a] for a in free) == 1:
    return fn(*args)
  kv_heads = heads if kv_heads is None else kv_heads
  b_axes = _split(tuple(a for a in want_b if a in free), mesh, batch)
  h_axes = tuple(a for a in _split(tuple(a for a in want_h if a in free), mesh, heads) if a not in b_axes)
  n_h = math.prod(mesh.shape[a] for a in h_axes)
  if kv_heads % n_h and kv_heads != 1:  # a split that would part query heads from their key-value head
    h_axes = ()
  k_axes = h_axes if kv_heads % n_h == 0 and n_h > 1 else ()  # key-value heads split with their query heads
  g_axes = h_axes if h_axes and not k_axes else ()  # one shared key-value head: split its groups' axis instead
  t_axes = sequence_axes(length) if active is not None and length is not None else ()
  letters = {"b": b_axes or None, "h": h_axes or None, "k": k_axes or None, "g": g_axes or None, "t": t_axes or None}
  letters["."] = None

  def spec(d):
    return None if d is None else P(*(letters[c] for c in d))

  is_dims = lambda x: isinstance(x, str) or x is None
  in_specs = tuple(jax.tree.map(spec, d, is_leaf=is_dims) for d in dims)
  out_specs = jax.tree.map(spec, out_dims, is_leaf=is_dims)
  if AxisType.Explicit in mesh.axis_types:  # explicit shardings must match in_specs: move the arguments there
    args = tuple(
      a if a is None else jax.tree.map(lambda x, s: jax.sharding.reshard(x, s), a, sp) for a, sp in zip(args, in_specs)
    )
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(free), check_vma=False)(
    *args
  )
