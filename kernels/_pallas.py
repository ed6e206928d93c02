"""Plumbing shared by the Pallas kernels: interpret mode, the two grid drivers, and running a
kernel per device under a mesh.

Every kernel here is a scan over time blocks with a small carried state (a compressive cache,
Latte's (num, den, max), FLASH's running key-value sum). Backends differ in how a carry can
cross blocks, so each kernel has one block step and two drivers:

  "grid"  the block index is the last grid axis; Mosaic (TPU) and interpret mode run the grid
          sequentially, last axis fastest, so the carry lives in scratch memory between grid
          steps and each step sees only its own blocks (the TPU layout: VMEM holds one block).
  "loop"  the grid covers (batch, heads) only and the kernel loops over the blocks itself, the
          carry in loop values (Triton runs grid programs in parallel, so no carry could cross
          them); each program reads its whole [T, D] slice block by block.

`driver()` picks "loop" on GPU and "grid" elsewhere; the tests run both in interpret mode. On GPU
the kernels use Triton (`compiler_params`): the loop driver's whole-[T, D] slices stay in global
memory there, while Mosaic GPU would stage them in shared memory.

The platform is the default backend's unless `target(platform)` says otherwise, which lets a CPU
host lower the kernels for GPU or TPU (scripts/check_lowering.py).

Sharding: the kernels are independent per (batch, head), so under `per_device_mesh(mesh, ...)`
(entered by `lra_core.sharding.activate`) `run_per_device` wraps them in `jax.shard_map` with
batch and heads split over the mesh axes the rules name; the time axis is never split.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jax.sharding import Mesh, PartitionSpec as P

DRIVERS = ("grid", "loop")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernel_target", default=None)


def platform() -> str:
  """The platform the kernels are traced for: 'gpu', 'tpu' or 'cpu'."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target(name: str) -> Iterator[None]:
  """Traces the kernels for `name` ('gpu', 'tpu', 'cpu') whatever the default backend."""
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)


def interpret_default() -> bool:
  """Pallas compiles for GPU and TPU; anywhere else the kernel runs in interpret mode."""
  return platform() not in ("gpu", "tpu")


def driver(name: str | None = None) -> str:
  if name is None:
    return "loop" if platform() == "gpu" else "grid"
  if name not in DRIVERS:
    raise ValueError(f"driver {name!r} is not one of {DRIVERS}.")
  return name


def compiler_params(num_parallel: int, sequential: bool):
  """TPU: the (batch, heads) grid axes may run on either core, the block axis must run in order.
  GPU: Triton, 4 warps per program."""
  if platform() == "tpu":
    semantics = ("parallel",) * num_parallel + (("arbitrary",) if sequential else ())
    return pltpu.CompilerParams(dimension_semantics=semantics)
  if platform() == "gpu":
    return pltriton.CompilerParams(num_warps=4, num_stages=1)
  return None


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0), precision=None) -> jax.Array:
  """2-D matmul in a kernel, accumulated in float32: a's axis contract[0] with b's axis contract[1]
  (so (1, 1) is a b^T and (0, 0) is a^T b, without an explicit transpose)."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def scratch(shape: Sequence[int], dtype):
  """On-chip scratch for the grid driver's carry (VMEM on TPU; plain buffers in interpret mode)."""
  return pltpu.VMEM(tuple(shape), dtype)


# -- per-device execution under a mesh ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _MeshAxes:
  mesh: Mesh
  batch: tuple[str, ...]
  heads: tuple[str, ...]


_ACTIVE: contextvars.ContextVar[_MeshAxes | None] = contextvars.ContextVar("kernel_mesh", default=None)


def _names(axes: str | Sequence[str] | None) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


@contextlib.contextmanager
def per_device_mesh(mesh: Mesh, *, batch: str | Sequence[str] | None,
                    heads: str | Sequence[str] | None) -> Iterator[None]:
  """Within this context the kernels run per device: batch over `batch`, heads over `heads`.

  The context is read while tracing: a function jitted inside it shards its kernels, while one
  traced before (and cached by jit) keeps its unsharded trace.
  """
  token = _ACTIVE.set(_MeshAxes(mesh, _names(batch), _names(heads)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def _split(axes: tuple[str, ...], mesh: Mesh, size: int) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that split `size` evenly, or none."""
  axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
  return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def run_per_device(fn: Callable, args: Sequence, dims: Sequence, out_dims, *, batch: int, heads: int,
                   kv_heads: int | None = None):
  """fn(*args), per device when a kernel mesh is active.

  `dims` gives, per argument (a pytree of arrays, or None), a string with one letter per axis:
  'b' batch, 'h' query heads, 'k' key-value heads, '.' anything else (never split); `out_dims`
  likewise for the outputs. Heads split only when the split keeps query heads with their key-value
  head (kv_heads divisible by the split, or a single shared kv head, replicated).
  """
  active = _ACTIVE.get()
  if active is None or active.mesh.size == 1:
    return fn(*args)
  mesh = active.mesh
  kv_heads = heads if kv_heads is None else kv_heads
  b_axes = _split(active.batch, mesh, batch)
  h_axes = tuple(a for a in _split(active.heads, mesh, heads) if a not in b_axes)
  n_h = math.prod(mesh.shape[a] for a in h_axes)
  if kv_heads % n_h and kv_heads != 1:
    h_axes = ()
  k_axes = h_axes if kv_heads % n_h == 0 and n_h > 1 else ()
  if not b_axes and not h_axes:
    return fn(*args)
  g_axes = h_axes if h_axes and not k_axes else ()
  letters = {"b": b_axes or None, "h": h_axes or None, "k": k_axes or None, "g": g_axes or None, ".": None}

  def spec(d):
    return None if d is None else P(*(letters[c] for c in d))

  is_dims = lambda x: isinstance(x, str) or x is None
  in_specs = tuple(jax.tree.map(spec, d, is_leaf=is_dims) for d in dims)
  out_specs = jax.tree.map(spec, out_dims, is_leaf=is_dims)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
