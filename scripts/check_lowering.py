"""Lowers every Pallas kernel for TPU (Mosaic) and GPU (Triton) on any host, without either device.

  python scripts/check_lowering.py                       # paper-like shapes, both platforms
  python scripts/check_lowering.py --platforms=tpu --seq_len=8192

`jax.export` traces each kernel as it would run there (driver, compiler parameters, no interpret
mode; kernels/_pallas.py `target`) and lowers it: Pallas turns the kernel into a Mosaic TPU or a
Triton GPU program, which rejects unsupported operations, block shapes and memory spaces. The TPU
lowering is done for one chip kind (`--tpu`). What this cannot check is the device compiler's last
stage (Mosaic's and Triton's code generation, register and memory limits) and run time: those need
the device (tests/test_*_pallas.py run the kernels' numbers in interpret mode).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import export

try:  # a device kind to lower for, without the device
  from jax.sharding import AbstractDevice
except ImportError:
  from jax._src.mesh import AbstractDevice

from kernels import _pallas, flash_pallas, latte_pallas, vq, vq_pallas

PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def kernels(seq_len: int, width: int, latents: int, block: int, codes: int, chunk: int,
            dtype: str = "float32") -> dict[str, tuple]:
  """name -> (function, example arguments), one head of each kernel at the given sizes."""
  t, d = seq_len, width
  x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
  z = jnp.zeros((1, t, 1), jnp.int32)

  def vq_attention(q, v, codebook):
    carry = vq.init_carry(1, block, 1, codes, d, d, q.dtype)
    return vq_pallas.vq_attention_blocks(q, vq.codewords(z, codebook), z, v, codebook, block_len=block,
                                         carry=carry)[0]

  return {
      "vq_attention": (vq_attention, (x(1, t, 1, d), x(1, t, 1, d), x(1, codes, d))),
      "causal_latte": (lambda q, k, v: latte_pallas.causal_latte(q, k, v, chunk=chunk or None),
                       (x(1, t, 1, latents), x(1, t, 1, latents), x(1, t, 1, d))),
      "bidirectional_latte": (lambda q, k, v: latte_pallas.bidirectional_latte(q, k, v),
                              (x(1, t, 1, latents), x(1, t, 1, latents), x(1, t, 1, d))),
      "mixed_chunk": (lambda q, k, v: flash_pallas.mixed_chunk_attention(q, k, q, k, v, chunk=block, causal=True,
                                                                         quad_scale=1.0, lin_scale=1.0),
                      (x(1, t, 1, d), x(1, t, 1, d), x(1, t, 1, d))),
  }


def lower(fn: Callable, args: tuple, platform: str, tpu_kind: str = "TPU v5e") -> str:
  """The StableHLO text of fn(*args) lowered for 'tpu' or 'gpu' (raises what the lowering raises)."""
  with _pallas.target(platform):
    if platform == "tpu":
      device = AbstractDevice(device_kind=tpu_kind, num_cores=1, platform="tpu")
      with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("d",), abstract_device=device)):
        return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    return export.export(jax.jit(fn), platforms=[PLATFORMS[platform]], disabled_checks=[TRITON])(*args).mlir_module()


def check(platforms, **sizes) -> list[dict]:
  rows = []
  for name, (fn, args) in kernels(**sizes).items():
    for platform in platforms:
      try:
        text = lower(fn, args, platform)
        marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
        rows.append({"kernel": name, "platform": platform, "ok": marker in text, "error": ""})
      except Exception as e:  # the lowering's own message is the result
        rows.append({"kernel": name, "platform": platform, "ok": False,
                     "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"})
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python scripts/check_lowering.py", description=__doc__.splitlines()[0])
  parser.add_argument("--platforms", default="tpu,gpu", help="comma-separated: tpu, gpu")
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--width", type=int, default=128, help="head width (Dk = Dv; FLASH's S = E)")
  parser.add_argument("--latents", type=int, default=128, help="Latte's latent states per head")
  parser.add_argument("--block", type=int, default=512, help="VQ block length and FLASH chunk")
  parser.add_argument("--codes", type=int, default=512, help="VQ codebook size")
  parser.add_argument("--chunk", type=int, default=0, help="causal Latte's time block (0: the kernel's default "
                      "for the platform)")
  parser.add_argument("--dtype", default="float32", help="inputs: float32 or bfloat16")
  args = parser.parse_args(argv)
  platforms = [p for p in args.platforms.split(",") if p]
  unknown = sorted(set(platforms) - set(PLATFORMS))
  if unknown:
    parser.error(f"platforms {unknown} are not among {sorted(PLATFORMS)}.")
  rows = check(platforms, seq_len=args.seq_len, width=args.width, latents=args.latents, block=args.block,
               codes=args.codes, chunk=args.chunk, dtype=args.dtype)
  print("| kernel | platform | lowers | error |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['kernel']} | {r['platform']} | {'yes' if r['ok'] else 'NO'} | {r['error']} |")
  return rows


if __name__ == "__main__":
  sys.exit(0 if all(r["ok"] for r in main()) else 1)
