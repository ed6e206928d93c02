"""Runs every Pallas kernel on the default device beside its XLA form: the kernel's output and its
gradients (w.r.t. q and v) against the XLA form's, and the median time of a forward and of a forward
plus gradient. On a GPU the kernels run as Triton calls, on a TPU through Mosaic, on a CPU in interpret
mode (numbers only: interpret-mode times say nothing of a device).

  python scripts/run_kernels.py                                # B 2, T 1024, 2 heads of 64; float32, bfloat16
  python scripts/run_kernels.py --paper=all --seq_len=8192     # each kernel at its paper model's widths
  python scripts/run_kernels.py --estimate=h100 --paper=all --seq_len=8192 --batch=1   # estimated, no GPU
  JAX_DEFAULT_MATMUL_PRECISION=highest python scripts/run_kernels.py   # float32 matmuls without TF32 on a GPU

The same command as `python -m lra_core.bench.kernel_run`; the compile-only check for devices this
host lacks is scripts/check_lowering.py.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from lra_core import cli
from lra_core.bench import common, kernel_estimate
from lra_core.bench.lowering import GPU_MARKER, TPU_MARKER
from lra_core.kernels.catalog import PAPER, gradient, kernels_at
from lra_core.markdown import markdown_table

COLUMNS = (
  "kernel",
  "sizes",
  "dtype",
  "out rel. diff",
  "dq rel. diff",
  "dv rel. diff",
  "forward ms (XLA / Pallas)",
  "forward + grad ms (XLA / Pallas)",
  "kernel call",
)


def relative_difference(a, b) -> float:
  """max |a - b| / max |b|, in float32."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def run(sizes: dict, *, only: tuple[str, ...] = (), steps: int = 10, warmup: int = 1, seed: int = 0) -> list[dict]:
  """One row per kernel (the kernels in `only`, or all) at `sizes` (kernels_at's arguments)."""
  xla, pallas = kernels_at(**sizes, impl="xla"), kernels_at(**sizes, impl="pallas")
  rows = []
  for name, (reference, shapes) in xla.items():
    if only and name not in only:
      continue
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    args = [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype) for k, s in zip(keys, shapes)]
    kernel = pallas[name][0]
    forward = {impl: jax.jit(fn) for impl, fn in (("xla", reference), ("pallas", kernel))}
    step = {impl: jax.jit(gradient(fn)) for impl, fn in (("xla", reference), ("pallas", kernel))}
    (_, grads_xla), (_, grads_pallas) = step["xla"](*args), step["pallas"](*args)
    text = forward["pallas"].lower(*args).as_text()
    ms = {
      f"{what}_ms_{impl}": 1e3 * common.median_seconds(lambda: fns[impl](*args), steps=steps, warmup=warmup)[0]
      for what, fns in (("forward", forward), ("step", step))
      for impl in ("xla", "pallas")
    }
    rows.append(
      dict(
        kernel=name,
        **{k: v for k, v in sizes.items() if k != "segments"},
        out_rel=relative_difference(forward["pallas"](*args), forward["xla"](*args)),
        dq_rel=relative_difference(grads_pallas[0], grads_xla[0]),
        dv_rel=relative_difference(grads_pallas[1], grads_xla[1]),
        call="Triton" if GPU_MARKER in text else "Mosaic" if TPU_MARKER in text else "interpret",
        device=jax.devices()[0].device_kind,
        **ms,
      )
    )
  return rows


def table(rows) -> str:
  def cells(r):
    sizes = f"B {r['batch']} T {r['seq_len']} H {r['heads']} d {r['width']}" + (
      f" dv {r['value_width']}" if r.get("value_width") else ""
    )
    return (
      r["kernel"],
      sizes,
      r["dtype"],
      f"{r['out_rel']:.1e}",
      f"{r['dq_rel']:.1e}",
      f"{r['dv_rel']:.1e}",
      f"{r['forward_ms_xla']:.3f} / {r['forward_ms_pallas']:.3f}",
      f"{r['step_ms_xla']:.3f} / {r['step_ms_pallas']:.3f}",
      r["call"],
    )

  return markdown_table(COLUMNS, [cells(r) for r in rows])


def main(argv=None) -> list[dict]:
  parser = cli.doc_parser("python scripts/run_kernels.py", __doc__)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--width", type=int, default=64, help="head width (Dk = Dv; FLASH's S = E)")
  parser.add_argument("--latents", type=int, default=32, help="Latte's latent states per head")
  parser.add_argument("--block", type=int, default=128, help="VQ block length")
  parser.add_argument("--codes", type=int, default=128, help="VQ codebook size")
  parser.add_argument("--flash_chunk", type=int, default=128, help="FLASH chunk")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated input dtypes")
  parser.add_argument(
    "--paper",
    default="",
    help=f"comma-separated, or 'all': each kernel at the widths of a paper "
    f"model that runs it, overriding the size flags ({', '.join(PAPER)})",
  )
  parser.add_argument("--steps", type=int, default=10, help="timed calls per median")
  parser.add_argument("--json", default="", help="also write the rows to this JSON file")
  parser.add_argument(
    "--estimate",
    default="",
    help="a GPU (h100, a100, ...): compile the rows for it on this host and print the roofline's estimates "
    "instead of running them (lra_core/bench/kernel_estimate.py)",
  )
  args = parser.parse_args(argv)
  papers = list(PAPER) if args.paper == "all" else [p for p in args.paper.split(",") if p]
  if sorted(set(papers) - set(PAPER)):
    parser.error(f"--paper {args.paper!r} names none of {list(PAPER)} (or 'all').")
  if args.estimate and args.estimate not in kernel_estimate.GPUS:
    parser.error(f"--estimate {args.estimate!r} is not one of {sorted(kernel_estimate.GPUS)}.")
  base = dict(
    seq_len=args.seq_len,
    width=args.width,
    latents=args.latents,
    block=args.block,
    codes=args.codes,
    chunk=0,
    flash_chunk=args.flash_chunk,
    batch=args.batch,
    heads=args.heads,
  )
  cases = [(dict(base, **PAPER[p][1]), (PAPER[p][0],)) for p in papers] or [(base, ())]
  if args.estimate:
    rows = [
      row
      for sizes, only in cases
      for dtype in args.dtypes.split(",")
      for row in kernel_estimate.estimate(dict(sizes, dtype=dtype), only=only, gpu=args.estimate)
    ]
    print(f"{rows[0]['device']} (compiled on this host), jax {jax.__version__}\n\n{kernel_estimate.table(rows)}")
  else:
    rows = [
      row
      for sizes, only in cases
      for dtype in args.dtypes.split(",")
      for row in run(dict(sizes, dtype=dtype), only=only, steps=args.steps)
    ]
    print(
      f"{jax.devices()[0].device_kind}, jax {jax.__version__}, matmul precision "
      f"{jax.config.jax_default_matmul_precision or 'default'}\n\n{table(rows)}"
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return rows


if __name__ == "__main__":
  main()
