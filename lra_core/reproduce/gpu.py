"""The GPU papers' configs compiled for their GPUs on this host (`python -m lra_core.aot`, XLA:GPU).

`gpu_fit` compiles the trainer's own train and eval steps of the GPU papers' configs at the paper's
global batch and length for the paper's GPUs, with the CUDA plugin's compiler on this CPU host (no
GPU, no driver): Latte Table 1 on 4 x A100 80 GB (as the paper trained), with the XLA and the Pallas
(Triton) kernels; the Block Transformer's block, vanilla and MEGABYTE models on 8 x A100 40 GB (the
paper's training machines) and on 8 x H100; FLASH Table 11's Wiki-40B language models on one V100 16 GB
at the table's context lengths and batches, in float32 (the V100 has no bf16) with the XLA kernels
(Triton needs compute capability 8.0; the V100 has 7.0).

It shares lra_core/reproduce/tpu.py's machinery: the same `Row`s, the same ladder of remat and
micro-batch settings until a row fits, one subprocess per compile, and the same cached JSON and HLO
records (under the workdir's `gpu_fit` folder), from which the estimate is recomputed on every run.
"""

from __future__ import annotations

from lra_core.bench import param_counts
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, fmt
from lra_core.reproduce.flash import FLASH, FULL_LATENCY, LABELS, TABLE11_BATCH, TABLE11_MS, TPP
from lra_core.reproduce.tpu import (
  BLOCK_CONFIG,
  Row,
  against_paper,
  compiled_at,
  failed_rows,
  run_row,
  sanity_cell,
  settings_cell,
  utilisation,
)

TABLE = "gpu_fit"
LATTE_CONFIG = "configs/c4/latte.py"
# (topology, mesh, the hardware in words): the paper's machines, and an H100 node for the Block Transformer.
LATTE_GPUS = ("a100x4", ("mesh.data=4",), "4 x A100 80 GB, as Latte trained")
BLOCK_GPUS = (
  ("a100-40gx8", ("mesh.data=8",), "8 x A100 40 GB, as the Block Transformer trained"),
  ("h100x8", ("mesh.data=8",), "8 x H100 80 GB"),
)
V100 = ("v100", ("mesh.data=1",), "one V100 16 GB, as FLASH Table 11 timed")
# The V100 computes no bf16 (XLA would run a bf16 program's matmuls in float32 anyway): float32 throughout.
FLOAT32 = ("model.dtype=float32", "model.scan_layers=True")

# FLASH Table 11 also times Performer (12 attention + 12 MLP layers of d 768, like Transformer++), ms per
# train step on one V100; None: out of memory.
PERFORMER = "performer"
TABLE11_PERFORMER_MS = {512: 823.0, 1024: 827.4, 2048: 799.8, 4096: None}
TABLE11_MODELS = (
  (TPP, next(m.spec for m in FULL_LATENCY.models if m.key == TPP), TABLE11_MS[TPP]),
  (FLASH, next(m.spec for m in FULL_LATENCY.models if m.key == FLASH), TABLE11_MS[FLASH]),
  (PERFORMER, "configs/c4/flash.py:lm,performer", TABLE11_PERFORMER_MS),
)


def latte_rows() -> tuple[Row, ...]:
  """Latte Table 1's configs, each with the XLA and the Pallas (Triton) kernels."""
  topology, mesh, _ = LATTE_GPUS
  return tuple(
    Row(f"{row.source}, impl {impl}", row.config, topology, mesh + (f"model.impl={impl}",))
    for row in param_counts.PAPER
    if row.config.startswith(LATTE_CONFIG)
    for impl in ("xla", "pallas")
  )


def block_rows() -> tuple[Row, ...]:
  """The Block Transformer paper's block, vanilla and MEGABYTE configs, on each of BLOCK_GPUS."""
  return tuple(
    Row(row.source, row.config, topology, mesh)
    for topology, mesh, _ in BLOCK_GPUS
    for row in param_counts.PAPER
    if row.config.startswith(BLOCK_CONFIG)
  )


def flash_rows() -> tuple[Row, ...]:
  """FLASH Table 11: the Wiki-40B LM models (flash_latency's) at each context length and batch, on a V100."""
  topology, mesh, _ = V100
  rows = []
  for seq_len, batch in TABLE11_BATCH.items():
    for key, spec, paper in TABLE11_MODELS:
      ms = paper.get(seq_len)
      rows.append(
        Row(
          f"FLASH Table 11, {LABELS.get(key, 'Performer')}, T={seq_len:,} x batch {batch}",
          spec,
          topology,
          mesh + (f"train.batch_size={batch}", f"train.seq_len={seq_len}"),
          paper_step_ms=ms,
          paper_oom=ms is None,
          common=FLOAT32,
        )
      )
  return tuple(rows)


ROWS = latte_rows() + block_rows() + flash_rows()


def memory_cell(r: dict) -> str:
  """'peak / usable (HBM)' GiB: the larger of the train and eval peaks against what JAX may allocate."""
  peaks = [p for p in (r["peak_gib"], r["eval_peak_gib"]) if p is not None]
  if not peaks:
    return f"refused: {r.get('refusal', '')[:80]}"
  usable = r.get("usable_gib") or r["hbm_gib"]
  return f"{max(peaks):,.2f} / {usable:.1f} ({r['hbm_gib']:.0f})"


def _paper(row: Row) -> str:
  """What the paper measured, to its printed precision (Table 11 gives tenths of a millisecond)."""
  return f"{row.paper_step_ms:,.1f} ms/step" if row.paper_step_ms else row.paper_measured


def _impl(row: Row, r: dict | None = None) -> str:
  """The kernels the row asks for (model.impl), and whether its matmuls fell back to cuBLAS."""
  impl = [o.split("=")[1] for o in row.overrides if o.startswith("model.impl=")]
  return ", ".join(impl + (["cuBLAS GEMMs"] if r and r.get("gemm_fallback") else [])) or "-"


def gpu_fit(ctx: Context) -> Result:
  lines, reports, metas = [], [], []
  fractions = set()
  for row in ROWS:
    meta, rung, wall = run_row(ctx, row, TABLE)
    r = meta.get("report")
    reports.append(r)
    metas.append(meta)
    compute = "float32" if "model.dtype=float32" in row.common else "bf16"
    if r is None:
      lines.append(
        [
          row.paper,
          row.topology,
          "-",
          _impl(row),
          compute,
          settings_cell(row, rung),
          "-",
          f"compile failed: {meta['error'][:80]}",
          "-",
          "-",
          "-",
          "-",
          "-",
          "-",
          f"{wall:.0f}",
          _paper(row),
          "",
          "",
        ]
      )
      continue
    fractions.add(r.get("memory_fraction"))
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    compiled = r["est_step_seconds"] is not None
    as_paper = "yes" if r["fits"] and not rung else "no"  # the first rung is the paper's own setting
    lines.append(
      [
        row.paper,
        f"{row.topology} ({r['num_devices']} x {r['device_kind']})",
        mesh,
        _impl(row, r),
        compute,
        settings_cell(row, rung),
        memory_cell(r),
        "yes" if r["fits"] else "**no**",
        as_paper,
        fmt(r["est_step_seconds"] * 1e3, ",.1f") if compiled else "-",
        fmt(r["est_tokens_per_s"], ",.0f") if compiled else "-",
        utilisation(r) if compiled else "-",
        r.get("pallas_kernels", 0),
        f"{r['num_params'] / 1e6:,.0f}M",
        f"{r['compile_seconds']:.0f} / {wall:.0f}",
        _paper(row),
        against_paper(row, r),
        sanity_cell(row, r),
      ]
    )
  table = markdown_table(
    [
      "setting",
      "GPUs",
      "mesh",
      "impl",
      "compute",
      "remat / scan",
      "GiB per device: peak / usable (HBM)",
      "fits",
      "fits without remat or micro-batches",
      "est. step ms",
      "est. tokens/s",
      "est. MFU / HFU (bound)",
      "Triton kernels",
      "params",
      "compile s: last / all attempts",
      "paper measured",
      "est. / paper",
      "paper's MFU under our count",
    ],
    lines,
  )
  fraction = ", ".join(f"{f:g}" for f in sorted(f for f in fractions if f)) or "0.75"
  setting = (
    "`python -m lra_core.aot` for the GPU papers' configs at the paper's global batch and sequence length: the "
    "trainer's real train step and eval step compiled by XLA:GPU (with Triton for its GEMM fusions and the "
    "Pallas kernels, and ptxas) for the GPUs named, on this CPU host, with no GPU. Latte Table 1 runs on "
    f"{LATTE_GPUS[2]}, with its XLA and its Pallas kernels (`impl`); the Block Transformer's block, vanilla "
    f"and MEGABYTE models on {BLOCK_GPUS[0][2]} and on {BLOCK_GPUS[1][2]}; FLASH Table 11's Wiki-40B LM "
    f"models (those of `flash_latency`) on {V100[2]}, at the table's context lengths and batches. Compute is "
    "bfloat16 (float32 parameters and optimizer state) with scanned layers, except on the V100: it has no "
    "bf16, so those rows compute in float32 with the XLA kernels (Triton, and so Pallas, needs compute "
    "capability 8.0; the V100 has 7.0), and their MFU is against its float32 peak (15.7 TFLOP/s). Memory is "
    "XLA's per-device buffer assignment, the larger peak of the train and eval steps, against what a JAX "
    f"process may allocate: the GPU's memory x XLA_PYTHON_CLIENT_MEM_FRACTION ({fraction}, JAX's "
    "preallocation; the GPU's full memory in brackets). XLA:GPU compiles a step whatever its size, so "
    "\"fits\" is that comparison. A row that does not fit is compiled again with `model.remat=full`, then "
    "also in 4 and in 16 micro-batches of the same global batch, and shows the first setting that fits (or, "
    "if none does, the last); \"fits without\" says whether the paper's own setting (no recomputation, one "
    "batch) fits. The step time is a roofline over the compiled program (lra_core/cost/hlo_cost.py: every "
    "operation at the slower of its FLOPs at the GPU's peak and its memory traffic at its bandwidth, "
    "cuBLAS and Triton GEMMs and the Pallas kernels' declared costs included, loops by their trip counts, "
    "collectives at NVLink bandwidth and overlapped). MFU counts the model's FLOPs, HFU every FLOP run. "
    "These are estimates, not measurements: the paper's measured step time (FLASH Table 11) is beside them "
    "with the ratio estimate / paper, and a roofline is a lower bound on a step's time; the last column is the "
    "MFU the paper's own run would have had under our FLOP count (over 100% fails the row). With no GPU here "
    "XLA cannot autotune its GEMM tiles; that changes speed, not the program's FLOPs or memory. Where its "
    "default Triton tiling fails for a matmul's shape (an XLA:GPU limitation at some of the Block "
    "Transformer's shapes, e.g. 82,080 rows), the step is compiled with cuBLAS GEMMs instead (\"cuBLAS "
    "GEMMs\" in the impl column; on a GPU XLA's autotuner chooses between Triton and cuBLAS per matmul). "
    "Compile s "
    "is the last attempt's train and eval compile, then the wall time of all attempts of the row, on this "
    f"2-core host. The rows' programs were compiled at {compiled_at(metas)}; every estimate is recomputed from "
    "their HLO at the commit below."
  )
  return Result(setting=setting, markdown=table, comparison=failed_rows(ROWS, reports))
