"""Plumbing shared by the Pallas kernels: the target, interpret mode, the grid drivers, tile sizes per
target and the refs a kernel declares by name.

Every kernel here is a scan over time blocks with a small carried state (a compressive cache,
Latte's (num, den, max), FLASH's running key-value sum). Backends differ in how a carry can
cross blocks, so each kernel has one block step and two of these drivers, one per backend:

  "grid"  the block index is the last grid axis; Mosaic (TPU) and interpret mode run the grid
          sequentially, last axis fastest, so the carry lives in scratch memory between grid
          steps and each step sees only its own blocks (the TPU layout: VMEM holds one block).
  "loop"  the grid covers (batch, heads) and tiles of the state (Latte: value columns, latents), and
          the kernel loops over the blocks itself, the carry in loop values (Triton runs grid
          programs in parallel, so no carry could cross them); each program reads its whole [T, .]
          slices block by block (Latte on GPU, whose state is small).
  "parallel" (GPU, VQ and FLASH) no carry at all: XLA computes the state at the start of every block
          as a prefix over the blocks (as the reference does), and the grid covers (batch, heads,
          blocks, query tiles, value tiles), each program one tile of one block's attention with an
          online softmax over key (and code) tiles. A GPU needs that parallelism, and Triton keeps a
          program's working set in registers, where neither the VQ cache nor a whole block fits.

`driver()` picks "grid" off GPU and the kernel's GPU driver on GPU; the tests run every driver in
interpret mode. Each driver is one module of its core (kernels/catalog.py names them) holding its
pallas_call, whose inputs, outputs and scratch it declares by name (`Inputs`, `Outputs`, `Scratch`); the
kernel reads its refs by those names (`named_refs`), never by position. On GPU the kernels use Triton
(`compiler_params`, tiles in `GPU_TILES`): blocks stay in global memory and are read tile by tile, while
Mosaic GPU would stage them in shared memory.

Everything platform-dependent (interpret mode, driver, block sizes, compiler parameters) is read
from the TARGET devices, never from the host's: see `current` for the order (an explicit `target`,
the kernel mesh, the `jax.set_mesh` mesh, the default backend). A CPU host thus traces the compiled
TPU kernels under a mesh of TPU devices (lra_core.compilation.topologies.tpu_devices) and compiles them with libtpu
(scripts/check_lowering.py). Pallas's own Mosaic lowering reads the chip kind from the context mesh
when lowering: the kernels use no operation whose lowering depends on it (integer floor division,
which lowers through `sign`, would).

Running a kernel per device under a mesh (`run_per_device`) is kernels/per_device.py's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jax.sharding import Mesh

from lra_core.kernels import per_device

DRIVERS = ("grid", "loop", "parallel")
_GPU_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices the kernels are traced for: platform 'tpu', 'gpu' or 'cpu', and the JAX device kind
  ("TPU v5 lite", "TPU v3", ...; None where only the platform is known)."""

  platform: str
  device_kind: str | None = None


_OVERRIDE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("kernel_target", default=None)


@contextlib.contextmanager
def target(platform: str, device_kind: str | None = None) -> Iterator[None]:
  """Traces the kernels for `platform` ('gpu', 'tpu', 'cpu') whatever the mesh and the default backend
  (scripts/check_lowering.py lowers for TPU and GPU on a CPU host this way)."""
  token = _OVERRIDE.set(Target(_GPU_PLATFORMS.get(platform, platform), device_kind))
  try:
    yield
  finally:
    _OVERRIDE.reset(token)


def _target_of(mesh) -> Target | None:
  """A mesh's devices as a Target: a concrete mesh's first device, or an abstract mesh's device."""
  if mesh is None or mesh.empty:
    return None
  if isinstance(mesh, Mesh):
    device = mesh.devices.flat[0]
    return Target(_GPU_PLATFORMS.get(device.platform, device.platform), device.device_kind)
  device = mesh.abstract_device
  if device is None:
    return None
  return Target(_GPU_PLATFORMS.get(device.platform, device.platform), device.device_kind)


def current() -> Target:
  """The target of the kernels traced now, first found of:

    1. `target(...)`, the explicit override (its device kind, or the mesh's when that has the same platform);
    2. the devices of the kernel mesh (`per_device_mesh`, entered by `lra_core.sharding.activate`);
    3. the devices of the context mesh (`jax.set_mesh`, `jax.sharding.use_mesh` / `use_abstract_mesh`);
    4. the default backend.

  So a TPU program traced on a CPU host under `jax.set_mesh` of TPU devices gets the compiled
  kernels (grid driver, Mosaic), and CPU devices get interpret mode whatever the host has.
  """
  override = _OVERRIDE.get()
  from_mesh = _target_of(per_device.kernel_mesh()) or _target_of(jax.sharding.get_abstract_mesh())
  if override is not None:
    if override.device_kind is None and from_mesh is not None and from_mesh.platform == override.platform:
      return from_mesh
    return override
  if from_mesh is not None:
    return from_mesh
  device = jax.devices()[0]
  return Target(_GPU_PLATFORMS.get(device.platform, device.platform), device.device_kind)


def platform() -> str:
  """The platform the kernels are traced for: 'gpu', 'tpu' or 'cpu' (see `current`)."""
  return current().platform


def interpret_default() -> bool:
  """Pallas compiles for GPU and TPU; anywhere else the kernel runs in interpret mode."""
  return platform() not in ("gpu", "tpu")


def driver(name: str | None = None, *, gpu: str = "loop", drivers: Sequence[str] = DRIVERS[:2]) -> str:
  """`name`, checked against the drivers a kernel has; by default "grid", or `gpu` on GPU."""
  if name is None:
    return gpu if platform() == "gpu" else "grid"
  if name not in drivers:
    raise ValueError(f"driver {name!r} is not one of {tuple(drivers)}.")
  return name


def bf16_matmuls() -> bool:
  """Whether the target's kernels may multiply bfloat16 operands: Mosaic rejects them on TPU v2 and v3
  (their MXU is fed float32 there); any other target takes them."""
  kind = current().device_kind or ""
  return not (platform() == "tpu" and kind in ("TPU v2", "TPU v3"))


# JAX device kind -> the chip generation pltpu describes (per-TensorCore VMEM and lanes).
_CHIP_VERSIONS = {
  "TPU v2": pltpu.ChipVersion.TPU_V2,
  "TPU v3": pltpu.ChipVersion.TPU_V3,
  "TPU v4": pltpu.ChipVersion.TPU_V4,
  "TPU v4 lite": pltpu.ChipVersion.TPU_V4I,
  "TPU v5 lite": pltpu.ChipVersion.TPU_V5E,
  "TPU v5e": pltpu.ChipVersion.TPU_V5E,
  "TPU v5": pltpu.ChipVersion.TPU_V5P,
  "TPU v5p": pltpu.ChipVersion.TPU_V5P,
  "TPU v6 lite": pltpu.ChipVersion.TPU_V6E,
  "TPU v6e": pltpu.ChipVersion.TPU_V6E,
  "TPU7x": pltpu.ChipVersion.TPU_7X,
}
SMALLEST_VMEM = 16 * 2**20  # TPU v2-v4: 16 MiB per TensorCore, also assumed for a kind pltpu does not know
SCOPED_VMEM = 16 * 2**20  # the VMEM a Mosaic kernel may use by default; more must be asked for


def vmem_capacity(device_kind: str | None = None) -> int | None:
  """VMEM bytes of one TensorCore of the target TPU (of `device_kind`, by default the target's), from
  pltpu's chip table; 16 MiB, the smallest, for a kind it does not name; None off TPU."""
  if device_kind is None:
    if platform() != "tpu":
      return None
    device_kind = current().device_kind
  version = _CHIP_VERSIONS.get(device_kind or "")
  if version is None:
    return SMALLEST_VMEM
  return pltpu.get_tpu_info_for_chip(version, 1).vmem_capacity_bytes


def vmem_limit(device_kind: str | None = None) -> int | None:
  """The VMEM a kernel asks for on the target TPU: 3/4 of a TensorCore's VMEM where that exceeds the
  compiler's default 16 MiB (v5e, v5p, v6e: the rest is left to the compiler's own buffers), else None
  (the default, all of a 16 MiB chip's)."""
  capacity = vmem_capacity(device_kind)
  if capacity is None or capacity * 3 // 4 <= SCOPED_VMEM:
    return None
  return capacity * 3 // 4


def vmem_budget(device_kind: str | None = None) -> int | None:
  """The bytes a kernel's working set may take on the target TPU: its VMEM limit (`vmem_limit`, or the
  default 16 MiB); None off TPU."""
  if device_kind is None and platform() != "tpu":
    return None
  return vmem_limit(device_kind) or min(SCOPED_VMEM, vmem_capacity(device_kind))


# Tile sizes and Triton launch parameters of each kernel on GPU, in one place. Triton keeps a program's
# tiles in registers and stages matmul operands (and layout changes) in shared memory: the tiles are
# chosen so that, compiled for the H100 (and the A100's smaller shared memory), no kernel exceeds shared
# memory and ptxas spills little or nothing at the papers' sizes (lra_core/bench/gpu_compile.py reports
# both; docs/kernels.md has the table). Every size is a power of two, as Triton needs.
GPU_TILES: dict[str, dict[str, int]] = {
  # query rows x key rows (and codes) per step of the online softmax, value columns per program
  "vq_attention": dict(query_block=64, key_block=64, code_block=64, value_block=128, num_warps=8, num_stages=2),
  # its backward (kernels/vq/gpu_backward.py): dq and dk sum g . v over every value column a tile at a time;
  # 16 query rows, 32 keys and codes: no spill at the enwik8 head on the H100 or the A100, batch 1 or 8,
  # float32 or bfloat16, with documents or not. ptxas gives these 8-warp programs at most 128 registers: with
  # 32 query rows dq spilled 8 bytes at batch 8 in bfloat16, and 64 rows spilled in dq and dv everywhere.
  "vq_attention_backward": dict(
    query_block=16, key_block=32, code_block=32, value_block=128, num_warps=8, num_stages=2
  ),
  "mixed_chunk_attention": dict(
    query_block=64, key_block=64, value_block=128, state_block=32, num_warps=8, num_stages=2
  ),  # state_block: rows of the [S, Et] state per step of lin_q KV
  # its backward (kernels/mixed_chunk/gpu_backward.py): g . v sums every value column a tile at a time;
  # state_block: value columns per step of the [S, E] states' products; 32 rows, 64 columns: no spill at the
  # papers' widths (C4 causal and not, with documents, and PG-19; float32 and bfloat16)
  "mixed_chunk_backward": dict(query_block=32, key_block=32, value_block=64, state_block=32, num_warps=8, num_stages=2),
  # Latte: time blocks (chunk; the reduction's block), value columns per program, latents per group
  # (per program for the reduction); every float32 matmul contracts a block or a latent group; span: the
  # tokens of one chunk-parallel pass (kernels/latte/spans.py), 16 blocks: at B 8, T 8,192 and C4 Latte's
  # widths 8,192 programs, 62 per SM of an H100, where the unsplit scans launch 256
  "causal_latte": dict(chunk=16, value_block=32, latent_block=16, span=256, num_warps=8, num_stages=1),
  "bidirectional_latte": dict(block=16, chunk=16, value_block=32, latent_block=16, span=256, num_warps=4, num_stages=1),
}


def gpu_tiles(kernel: str) -> dict[str, int]:
  """The GPU tile sizes and launch parameters of `kernel` (a key of GPU_TILES)."""
  return dict(GPU_TILES[kernel])


def compiler_params(num_parallel: int, sequential: bool, num_sequential: int = 1, kernel: str | None = None):
  """TPU: the first `num_parallel` grid axes (batch, heads, ...) may run on either core, the last
  `num_sequential` (the blocks) must run in order; the VMEM limit is `vmem_limit()` of the target chip.
  GPU: Triton with the warps and pipeline stages of `GPU_TILES[kernel]` (4 warps, 1 stage without one)."""
  if platform() == "tpu":
    semantics = ("parallel",) * num_parallel + (("arbitrary",) * num_sequential if sequential else ())
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit())
  if platform() == "gpu":
    tiles = GPU_TILES.get(kernel, {})
    return pltriton.CompilerParams(num_warps=tiles.get("num_warps", 4), num_stages=tiles.get("num_stages", 1))
  return None


def cost_estimate(flops: int, transcendentals: int, moved: Sequence) -> pl.CostEstimate:
  """A kernel's declared cost, for XLA's and lra_core.cost.hlo_cost's rooflines (a custom call is opaque to them):
  its FLOPs and transcendentals, and the bytes of `moved`, the arrays (or `jax.ShapeDtypeStruct`s) it reads
  or writes once each."""
  moved_bytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in moved)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(moved_bytes))


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0), precision=None) -> jax.Array:
  """2-D matmul in a kernel, accumulated in float32: a's axis contract[0] with b's axis contract[1]
  (so (1, 1) is a b^T and (0, 0) is a^T b, without an explicit transpose)."""
  return jax.lax.dot_general(
    a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


def picked(run: Callable, names: Sequence[str], *args):
  """run(*args)'s outputs `names` (a dict's keys), in order, from one call: a tuple for `per_device.run_per_device`."""
  out = run(*args)
  return tuple(out[n] for n in names)


class _Declared:
  """Names declared once each, in the order pallas_call passes their refs."""

  def __init__(self):
    self.names: list[str] = []

  def _declare(self, name: str) -> None:
    if name in self.names:
      raise ValueError(f"kernel {type(self).__name__.lower()} {name!r} is declared twice.")
    self.names.append(name)


class Inputs(_Declared):
  """The inputs of one pallas_call, each declared in one place: its name, its array and its block spec.
  An optional input is simply not added; the kernel reads its refs by name (`named_refs`), so adding an
  input touches its declaration and the line that reads it."""

  def __init__(self):
    super().__init__()
    self.arrays: list[jax.Array] = []
    self.specs: list = []

  def add(self, name: str, array: jax.Array, spec) -> None:
    self._declare(name)
    self.arrays.append(array)
    self.specs.append(spec)


class Outputs(_Declared):
  """The outputs of one pallas_call: name, shape (a `jax.ShapeDtypeStruct`) and block spec of each.
  `named` turns the call's results into {name: array}."""

  def __init__(self):
    super().__init__()
    self.shapes: list[jax.ShapeDtypeStruct] = []
    self.specs: list = []

  def add(self, name: str, shape: jax.ShapeDtypeStruct, spec) -> None:
    self._declare(name)
    self.shapes.append(shape)
    self.specs.append(spec)

  def named(self, results: Sequence[jax.Array]) -> dict[str, jax.Array]:
    return dict(zip(self.names, results))


class Scratch(_Declared):
  """The scratch of one pallas_call, the grid driver's carry: name, shape and dtype of each buffer (VMEM
  on TPU; plain buffers in interpret mode)."""

  def __init__(self):
    super().__init__()
    self.shapes: list = []

  def add(self, name: str, shape: Sequence[int], dtype) -> None:
    self._declare(name)
    self.shapes.append(pltpu.VMEM(tuple(shape), dtype))


def ref_names(*groups: _Declared) -> tuple[tuple[str, ...], ...]:
  """The names of a call's refs, group by group (inputs, outputs, then scratch), as `named_refs` takes
  them: static, so a kernel gets them through functools.partial."""
  return tuple(tuple(group.names) for group in groups)


def named_refs(refs: Sequence, *groups: Sequence[str]) -> tuple[dict, ...]:
  """A kernel's refs by name: pallas_call passes the inputs', the outputs' and the scratch's refs one group
  after the other, each in its declared order -> one {name: ref} per group of names."""
  if len(refs) != sum(map(len, groups)):
    raise ValueError(f"the kernel got {len(refs)} refs; its names declare {sum(map(len, groups))}: {groups}.")
  out, start = [], 0
  for names in groups:
    out.append(dict(zip(names, refs[start : start + len(names)])))
    start += len(names)
  return tuple(out)
