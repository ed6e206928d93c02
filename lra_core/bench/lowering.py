"""Compiles every Pallas kernel for a TPU slice (Mosaic, with libtpu) and for an NVIDIA GPU (Triton and
ptxas, with the CUDA plugin), on any host, without either device.

  python scripts/check_lowering.py                                  # T 2048: TPU v5e and H100 compiles
  python scripts/check_lowering.py --platforms=tpu --seq_len=8192 --dtype=bfloat16
  python scripts/check_lowering.py --platforms=gpu --gpu=a100 --segments   # packed documents, on an A100
  python scripts/check_lowering.py --paper=all --topology=v3:2x2 --dtype=bfloat16   # the paper models' widths

The same command as `python -m lra_core.bench.lowering`.

TPU: with libtpu installed (`pip install -e ".[test]"`), each kernel is traced under
`jax.set_mesh` of the devices of `--topology` (lra_core.compilation.topologies.tpu_devices), forward and gradient
w.r.t. q and v, lowered (the program must hold a `tpu_custom_call`: the kernel, not interpret mode)
and compiled by the real TPU compiler, Mosaic included; the compile time is reported per row.
Without libtpu the TPU rows are lowered only (`jax.export` for one chip of the topology's kind).
GPU: with the CUDA plugin installed (the `gpu-compile` extra, in `.[test]`), the same under a mesh of
`--gpu` devices (lra_core.compilation.topologies.gpu_devices): XLA:GPU, Triton (shared-memory allocation included) and
ptxas compile the program, which must hold the Pallas kernel as a Triton call; each row also gives the
kernel's shared memory, registers and spills (lra_core/bench/gpu_compile.py). Without the plugin the GPU
rows lower the forward only (`jax.export`). Run time and numbers need the device (tests/test_*_pallas.py
check the numbers in interpret mode). The kernels, their example shapes and the paper models' widths are
lra_core.kernels.catalog's.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:  # a device kind to lower for, without the device
  from jax.sharding import AbstractDevice
except ImportError:
  from jax._src.mesh import AbstractDevice

from lra_core import cli
from lra_core.bench import gpu_compile
from lra_core.compilation import topologies
from lra_core.kernels import toolkit
from lra_core.kernels.catalog import PAPER, gradient, kernels_at

PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}
PASSES = ("forward", "grad")
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
TPU_MARKER, GPU_MARKER = "tpu_custom_call", "xla.gpu.triton"
KERNEL_FIELDS = ("shared_kib", "registers", "spill_stores", "spill_loads")  # GPU rows: the dearest kernel's


def compile_for_tpu(fn: Callable, args: tuple, devices):
  """fn(*args) jitted under `jax.set_mesh` of `devices`, lowered and compiled by the TPU compiler:
  the lowered text, the compile seconds and the compiled program (raises what lowering or compiling raises)."""
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  replicated = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    lowered = jax.jit(fn).lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args))
    start = time.perf_counter()
    compiled = lowered.compile()
    return lowered.as_text(), time.perf_counter() - start, compiled


def lower(fn: Callable, args: tuple, platform: str, tpu_kind: str = "TPU v5 lite") -> str:
  """The StableHLO text of fn(*args) exported for 'tpu' (one chip of `tpu_kind`) or 'gpu'."""
  with toolkit.target(platform, tpu_kind if platform == "tpu" else None):
    if platform == "tpu":
      device = AbstractDevice(device_kind=tpu_kind, num_cores=1, platform="tpu")
      with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("d",), abstract_device=device)):
        return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    return export.export(jax.jit(fn), platforms=[PLATFORMS[platform]], disabled_checks=[TRITON])(*args).mlir_module()


def _error(e: Exception) -> str:
  lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
  detail = next((ln for ln in lines if "MLIR operation" in ln), None)  # Mosaic: the op on the next line
  text = lines[0] if lines else ""
  if detail is not None and lines.index(detail) + 1 < len(lines):
    text += " " + lines[lines.index(detail) + 1].strip()
  return f"{type(e).__name__}: {text[:300]}"  # Mosaic puts the cause first, a long index map after


def check(
  platforms,
  *,
  topology: str = "v5e:2x2",
  gpu: str = "h100",
  passes=PASSES,
  compile_tpu: bool | None = None,
  compile_gpu: bool | None = None,
  log=None,
  only: tuple[str, ...] = (),
  **sizes,
) -> list[dict]:
  """One row per kernel (those named in `only`, or all), platform and pass: ok, how ('compiled' /
  'lowered'), compile seconds, error; for compiled rows the kernel calls in the program ("calls": Mosaic
  calls on TPU, Triton kernels on GPU) and its temporaries (MiB, the compiler's memory analysis), and for
  GPU rows the kernel's shared memory (KiB), registers and spill bytes (the largest over its Pallas kernels)."""
  compile_tpu = topologies.libtpu_installed() if compile_tpu is None else compile_tpu
  compile_gpu = topologies.cuda_plugin_installed() if compile_gpu is None else compile_gpu
  devices = topologies.tpu_devices(topology) if "tpu" in platforms and compile_tpu else None
  gpu_devices = topologies.gpu_devices(gpu) if "gpu" in platforms and compile_gpu else None
  tpu_kind = devices[0].device_kind if devices else "TPU v5 lite"
  rows = []
  for name, (fn, args) in kernels_at(**sizes).items():
    if only and name not in only:
      continue
    for platform in platforms:
      compiled = devices if platform == "tpu" else gpu_devices
      for pass_ in passes if compiled else ("forward",):
        f = fn if pass_ == "forward" else gradient(fn)
        row = {
          "kernel": name,
          "shapes": " ".join("x".join(map(str, a.shape)) for a in args),
          "platform": platform,
          "target": (tpu_kind if platform == "tpu" else compiled[0].device_kind if compiled else "cuda"),
          "pass": pass_,
          "dtype": str(args[0].dtype),
          "ok": False,
          "how": "compiled" if compiled else "lowered",
          "seconds": None,
          "error": "",
          "calls": None,
          "temporaries_mib": None,
          **dict.fromkeys(KERNEL_FIELDS),
        }
        try:
          if platform == "tpu" and compiled:
            text, row["seconds"], program = compile_for_tpu(f, args, devices)
            row["calls"] = program.as_text().count(f'custom_call_target="{TPU_MARKER}"')
            row["temporaries_mib"] = program.memory_analysis().temp_size_in_bytes / 2**20
          elif compiled:
            program, row["seconds"], found = gpu_compile.compile_for_gpu(f, args, gpu_devices)
            text = program.as_text()
            row["calls"] = len(found)
            row["temporaries_mib"] = program.memory_analysis().temp_size_in_bytes / 2**20
            if found:
              row.update(
                shared_kib=max(k.shared_bytes for k in found) / 1024,
                **{k: _largest(found, k) for k in KERNEL_FIELDS[1:]},
              )
          else:
            text = lower(f, args, platform, tpu_kind)
          marker = TPU_MARKER if platform == "tpu" else GPU_MARKER
          row["ok"] = marker in text
          row["error"] = "" if row["ok"] else f"no {marker} in the program (interpret mode or no kernel)"
        except Exception as e:  # the compiler's own message is the result
          row["error"] = _error(e)
        rows.append(row)
        if log:
          log(row)
  return rows


def _largest(found, field: str):
  values = [getattr(k, field) for k in found if getattr(k, field) is not None]
  return max(values) if values else None


def main(argv=None) -> list[dict]:
  parser = cli.doc_parser("python scripts/check_lowering.py", __doc__)
  parser.add_argument("--platforms", default="tpu,gpu", help="comma-separated: tpu, gpu")
  parser.add_argument(
    "--topology", default="v5e:2x2", help="TPU slice to compile for (lra_core.compilation.topologies)"
  )
  parser.add_argument(
    "--gpu",
    default="h100",
    help=f"GPU to compile for (lra_core.compilation.topologies.GPUS: {', '.join(topologies.GPUS)})",
  )
  parser.add_argument(
    "--passes",
    default="forward,grad",
    help="comma-separated forward, grad (rows that are only lowered take the forward)",
  )
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--width", type=int, default=128, help="head width (Dk = Dv; FLASH's S = E)")
  parser.add_argument("--latents", type=int, default=128, help="Latte's latent states per head")
  parser.add_argument("--block", type=int, default=512, help="VQ block length")
  parser.add_argument("--codes", type=int, default=512, help="VQ codebook size")
  parser.add_argument(
    "--chunk", type=int, default=0, help="causal Latte's time block (0: the kernel's default for the target)"
  )
  parser.add_argument("--flash_chunk", type=int, default=256, help="FLASH chunk (the c4 configs' 256)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=1)
  parser.add_argument("--value_width", type=int, default=0, help="VQ's Dv and FLASH's e (0: --width)")
  parser.add_argument("--dtype", default="float32", help="inputs: float32 or bfloat16")
  parser.add_argument(
    "--paper",
    default="",
    help=f"comma-separated, or 'all': each kernel at the widths of a paper "
    f"model that runs it, overriding the size flags ({', '.join(PAPER)})",
  )
  parser.add_argument("--segments", action="store_true", help="the kernels' packed-document forms")
  parser.add_argument("--json", default="", help="also write the rows to this JSON file")
  args = parser.parse_args(argv)
  platforms = [p for p in args.platforms.split(",") if p]
  passes = [p for p in args.passes.split(",") if p]
  unknown = sorted(set(platforms) - set(PLATFORMS)) + sorted(set(passes) - set(PASSES))
  if unknown:
    parser.error(f"{unknown} are not among the platforms {sorted(PLATFORMS)} or passes {list(PASSES)}.")
  papers = list(PAPER) if args.paper == "all" else [p for p in args.paper.split(",") if p]
  if sorted(set(papers) - set(PAPER)):
    parser.error(f"--paper {args.paper!r} names none of {list(PAPER)} (or 'all').")
  print(
    "| kernel | shapes (q k v ...) | target | dtype | pass | result | compile s | kernel calls | temporaries MiB | "
    "shared KiB | registers | spill B (stores / loads) | error |\n" + "|---" * 13 + "|",
    flush=True,
  )

  def log(r):
    result = r["how"] if r["ok"] else "FAILED"
    seconds = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
    shared = "" if r["shared_kib"] is None else f"{r['shared_kib']:.0f}"
    registers = "" if r["registers"] is None else r["registers"]
    spills = "" if r["spill_stores"] is None else f"{r['spill_stores']} / {r['spill_loads']}"
    calls = "" if r["calls"] is None else r["calls"]
    temporaries = "" if r["temporaries_mib"] is None else f"{r['temporaries_mib']:.1f}"
    print(
      f"| {r['kernel']} | {r['shapes']} | {r['target']} | {r['dtype']} | {r['pass']} | {result} | {seconds} | "
      f"{calls} | {temporaries} | {shared} | {registers} | {spills} | {r['error']} |",
      flush=True,
    )

  sizes = dict(
    seq_len=args.seq_len,
    width=args.width,
    latents=args.latents,
    block=args.block,
    codes=args.codes,
    chunk=args.chunk,
    flash_chunk=args.flash_chunk,
    dtype=args.dtype,
    batch=args.batch,
    heads=args.heads,
    value_width=args.value_width,
    segments=args.segments,
  )
  where = dict(topology=args.topology, gpu=args.gpu, passes=passes, log=log)
  if not papers:
    rows = check(platforms, **where, **sizes)
  else:
    rows = [row for p in papers for row in check(platforms, **where, only=(PAPER[p][0],), **dict(sizes, **PAPER[p][1]))]
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return rows


if __name__ == "__main__":
  sys.exit(0 if all(r["ok"] for r in main()) else 1)
