"""Every Pallas kernel of this package, by name: the core it belongs to (the files it lives in, its drivers),
its public function at example argument shapes (`kernels_at`), and the widths of the paper models that run
it (`PAPER`). scripts/check_lowering.py, scripts/run_kernels.py and the compile tests (tests/test_tpu_kernels.py,
tests/test_gpu_kernels.py) read the kernels from here, and tests/test_kernel_checklist.py checks that every
core is complete: docs/kernels.md, "Adding a kernel".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lra_core.kernels import latte, mixed_chunk, vq


@dataclasses.dataclass(frozen=True)
class Core:
  """An attention core, the folder kernels/<name>/: its __init__.py checks the arguments and dispatches on
  `impl`, reference.py is the jnp reference, pallas.py the kernel's public function and gradient; `drivers`
  names the module of the folder that runs each driver (`toolkit.DRIVERS`; the module's name says the
  backend), `kernels` the core's entries of `kernels_at`, `gpu_tiles` its keys of `toolkit.GPU_TILES`,
  `backward` the modules of its backward kernels (which pallas.py's `jax.custom_vjp` calls)."""

  name: str
  kernels: tuple[str, ...]
  drivers: dict[str, str]
  gpu_tiles: tuple[str, ...]
  backward: tuple[str, ...] = ()

  @property
  def modules(self) -> tuple[str, ...]:
    """The core's modules, as paths under kernels/ without .py (`vq/reference`)."""
    stems = ("__init__", "reference", "pallas", *self.drivers.values(), *self.backward)
    return tuple(f"{self.name}/{stem}" for stem in stems)


CORES = (
  Core(
    "vq",
    kernels=("vq_attention",),
    drivers={"grid": "tpu_grid", "parallel": "gpu_parallel"},
    gpu_tiles=("vq_attention", "vq_attention_backward"),
    backward=("grid_backward", "gpu_backward"),
  ),
  Core(
    "latte",
    kernels=("causal_latte", "bidirectional_latte"),
    drivers={"grid": "tpu_grid", "loop": "gpu_loop"},
    gpu_tiles=("causal_latte", "bidirectional_latte"),
    backward=("backward",),
  ),
  Core(
    "mixed_chunk",
    kernels=("mixed_chunk",),
    drivers={"grid": "tpu_grid", "parallel": "gpu_parallel"},
    gpu_tiles=("mixed_chunk_attention", "mixed_chunk_backward"),
    backward=("grid_backward", "gpu_backward"),
  ),
)

# Each kernel at the per-head widths of the paper models that run it (scripts/check_lowering.py --paper): width
# is Dk (VQ), the value width per head (Latte) or FLASH's s; value_width is VQ's Dv and FLASH's e.
PAPER = {
  "enwik8_vq": ("vq_attention", dict(width=128, value_width=1536, block=512, codes=512)),  # configs/enwik8
  "c4_latte": ("causal_latte", dict(width=96, latents=16, heads=8)),  # d 768, L 128, 8 heads
  "lra_text_latte": ("bidirectional_latte", dict(width=64, latents=64, heads=4)),  # d 256, L 256, 4 heads
  "c4_flash": ("mixed_chunk", dict(width=128, value_width=1536, flash_chunk=256)),  # d 768, expansion 2
  "pg19_flash": ("mixed_chunk", dict(width=128, value_width=2048, flash_chunk=512)),  # d 1024, expansion 2
}


def kernels_at(
  seq_len: int,
  width: int,
  latents: int,
  block: int,
  codes: int,
  chunk: int,
  flash_chunk: int,
  dtype: str = "float32",
  batch: int = 1,
  heads: int = 1,
  value_width: int = 0,
  segments: bool = False,
  impl: str = "pallas",
) -> dict[str, tuple[Callable, tuple]]:
  """name -> (function, argument shapes) of each kernel through its public `impl` path; q is
  argument 0 and v argument 2 of every function (the gradient is taken w.r.t. both). VQ attention
  takes the Transformer-XL position term of the Transformer-VQ models (its [L, 2L] bias blocks are
  part of the kernel's working set). value_width: VQ's Dv and FLASH's e (0: width). chunk: causal Latte's
  time block (0: the kernel's default for the target). segments: each function takes packed-document ids
  int32[B,T] as its last argument (kernels/packed_documents.py)."""
  b, t, h, d, dv = batch, seq_len, heads, width, value_width or width
  x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
  c = min(flash_chunk, t)

  def vq_attention(q, k, v, codebook, table, seg=None):
    z, _ = vq.quantize(jax.lax.stop_gradient(k), jax.lax.stop_gradient(codebook))
    k_hat = k + jax.lax.stop_gradient(vq.codewords(z, codebook) - k)  # straight through, as the models train
    out, _ = vq.vq_attention_blocks(q, k_hat, z, v, codebook, block_len=block, rel=(q, table), impl=impl, segments=seg)
    return out

  table = {
    "vq_attention": (vq_attention, (x(b, t, h, d), x(b, t, h, d), x(b, t, h, dv), x(h, codes, d), x(h, block + 1, d))),
    "causal_latte": (
      lambda q, k, v, seg=None: latte.causal_latte(q, k, v, chunk=chunk or None, impl=impl, segments=seg),
      (x(b, t, h, latents), x(b, t, h, latents), x(b, t, h, d)),
    ),
    "bidirectional_latte": (
      lambda q, k, v, seg=None: latte.bidirectional_latte(q, k, v, impl=impl, segments=seg),
      (x(b, t, h, latents), x(b, t, h, latents), x(b, t, h, d)),
    ),
    "mixed_chunk": (
      # the local and the global part read the same q and k: a compile needs their shapes only
      lambda q, k, v, bias, seg=None: mixed_chunk.mixed_chunk_attention(
        q,
        k,
        q,
        k,
        v,
        chunk=flash_chunk,
        causal=True,
        quad_scale=d**-0.5,
        lin_scale=1.0 / c,
        bias=bias,
        segments=seg,
        impl=impl,
      ),
      (x(b, t, h, d), x(b, t, h, d), x(b, t, h, dv), x(c, c)),
    ),
  }
  if segments:
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    table = {name: (fn, args + (ids,)) for name, (fn, args) in table.items()}
  return table


def gradient(fn: Callable) -> Callable:
  """A training step's use of fn: a scalar of its output (the kernel's forward) and its gradient
  w.r.t. arguments 0 (q), 1 (k) and 2 (v) (the custom_vjp's backward: every backward kernel is live)."""
  return jax.value_and_grad(lambda *args: fn(*args).astype(jnp.float32).sum(), argnums=(0, 1, 2))
