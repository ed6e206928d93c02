"""The papers' configs compiled for their TPU slices on this host (`python -m lra_core.aot`, libtpu).

`tpu_fit` compiles the trainer's own train and eval steps of every paper config of
scripts/param_counts.py at the paper's global batch and length for a TPU slice: the paper's
hardware where it says (Transformer-VQ and FIT: TPU v3; FLASH: 64 TPU v4 cores), and for the GPU
papers a TPU v5p slice with about their GPUs' memory (Latte: 4 x 80 GB A100; Block Transformer:
8 x 40 GB A100; v5p:2x2x1 is 4 chips of 95 GiB).

A row that does not fit is compiled again with the next rung of `LADDER` (more recomputation),
so the settings in the table are the first that fit, found by the compiler rather than guessed.
Each compile is one subprocess (a 1B model's compile takes GBs of host memory); its JSON report and
the compiled train step's HLO are kept under the workdir and reused while the command is unchanged
(the estimate is recomputed from the HLO each time). `Row`, `run_row` and the cell formatters here
are shared with the GPU papers' table on their GPUs (lra_core/reproduce/gpu.py, `gpu_fit`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence

from lra_core.bench import param_counts
from lra_core.compilation import aot_report
from lra_core.errors import ConfigError, brief
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import ROOT, Context, Result, commit, fmt, load_config
from lra_core.reproduce.transformer_vq import PAPER_THROUGHPUT

VQ = "configs/enwik8/transformer_vq.py"
# Every row computes in bfloat16 (parameters and optimizer stay float32) with its layers scanned.
COMMON = ("model.dtype=bfloat16", "model.scan_layers=True")
# Tried in order until the train and eval steps fit the chip's HBM: no recomputation, then all of it,
# then the same global batch in 4 and 16 micro-batches (gradient accumulation, as the GPU papers trained).
LADDER = (
  (),
  ("model.remat=full",),
  ("model.remat=full", "train.grad_accum_steps=4"),
  ("model.remat=full", "train.grad_accum_steps=16"),
)

# Transformer-VQ Tables 6-9 at 131,072 tokens (the module's PAPER_THROUGHPUT stops at 32,768):
# (full, VQ) tokens/s, None = out of memory.
PAPER_131072 = {
  "serial": {"shga": (None, None), "mqa": (None, None), "mha": (None, None)},
  "matmul": {"shga": (None, 69.5e3), "mqa": (None, 67.7e3), "mha": (None, None)},
  "assoc": {"shga": (None, None), "mqa": (None, 67.0e3), "mha": (None, None)},
  "input_scan": {"shga": (None, None), "mqa": (None, None), "mha": (None, None)},
}
# FLASH Tables 12 (C4 MLM, 512 tokens) and 3 (PG-19, 8,192 tokens): step latency on 64 TPU v4 cores, ms.
FLASH_LATENCY_MS = {
  "configs/c4/flash.py": 51.2,
  "configs/c4/flash_quad.py": 43.7,
  "configs/c4/flash.py:performer": 37.2,
  "configs/c4/transformer.py:mlm": 47.7,
  "configs/c4/transformer.py:mlm,plus": 48.8,
  "configs/c4/transformer.py:mlm,plusplus": 47.6,
  "configs/pg19/flash.py": 250,
  "configs/pg19/flash.py:flash_quad": 560,
  "configs/pg19/transformer.py:flash": 1292,
  "configs/pg19/transformer.py:flash,plusplus": 1272,
}


@dataclasses.dataclass(frozen=True)
class Row:
  paper: str
  spec: str
  topology: str
  overrides: tuple[str, ...] = ()
  paper_tokens_per_s: float | None = None  # what the paper measured for this setting, if anything
  paper_step_ms: float | None = None
  paper_oom: bool = False
  common: tuple[str, ...] = COMMON  # the compute settings every rung keeps (float32 on a V100)

  @property
  def paper_measured(self) -> str:
    if self.paper_oom:
      return "out of memory"
    if self.paper_tokens_per_s:
      return f"{self.paper_tokens_per_s:,.0f} tokens/s"
    return f"{self.paper_step_ms:,.0f} ms/step" if self.paper_step_ms else ""

  def command(self, rung: tuple[str, ...], report: str, hlo: str) -> list[str]:
    return [
      "-m",
      "lra_core.aot",
      f"--config={self.spec}",
      f"--topology={self.topology}",
      *(f"--config.{o}" for o in self.common + self.overrides + rung),
      f"--json={report}",
      f"--hlo={hlo}",
    ]

  def rungs(self) -> tuple[tuple[str, ...], ...]:
    """The LADDER rungs this row can take: micro-batches must still split evenly over the batch axes."""
    out = []
    for rung in LADDER:
      try:
        config = load_config(self.spec, list(self.common + self.overrides + rung))
      except ConfigError:  # e.g. a batch of 8 in 16 micro-batches
        continue
      t, mesh = config.train, config.mesh
      split = max(mesh.data, 1) * mesh.fsdp
      if t.batch_size % t.grad_accum_steps == 0 and (t.batch_size // t.grad_accum_steps) % split == 0:
        out.append(rung)
    return tuple(out)

  def slug(self, rung: tuple[str, ...]) -> str:
    """A readable file name, unique per setting (long names are cut, so a hash of the whole ends it)."""
    common = "" if self.common == COMMON else "_".join(self.common) + "_"
    text = f"{self.spec}_{self.topology}_{common}{'_'.join(self.overrides + rung)}"
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:100] + "_" + digest


def table6(attention: str, head_type: str, t: int) -> Row:
  """Transformer-VQ Table 6 (serial reduction): 8 TPU v3 cores, batch 8, backprop through all t tokens."""
  full, vq = (PAPER_131072["serial"] if t == 131072 else {h: v[t] for h, v in PAPER_THROUGHPUT["serial"].items()})[
    head_type
  ]
  heads = ("model.num_heads=1",) if head_type == "shga" else ("model.num_heads=8",)
  name = "Full" if attention == "full" else "VQ"
  measured = full if attention == "full" else vq
  return Row(
    f"Transformer-VQ Table 6, {name} {head_type.upper()}, T={t:,}",
    VQ,
    "v3:2x2",
    (
      f"model.attention={attention}",
      f"model.head_type={head_type}",
      *heads,
      "train.batch_size=8",
      f"train.seq_len={t}",
      f"train.update_len={t}",
      "mesh.data=8",
    ),
    paper_tokens_per_s=measured,
    paper_oom=measured is None,
  )


# (path prefix of a paper config, topology, mesh and other overrides, why that slice)
PLACEMENT = (
  ("configs/enwik8/transformer_vq.py", "v3:4x8", ("mesh.data=64",), "TPU v3 (the paper's pod slices)"),
  ("configs/pg19/transformer_vq.py", "v3:8x8", ("mesh.data=8", "mesh.fsdp=16"), "TPU v3"),
  ("configs/imagenet64/transformer_vq.py:large", "v3:8x8", ("mesh.data=8", "mesh.fsdp=16"), "TPU v3"),
  ("configs/imagenet64/transformer_vq.py", "v3:2x2", ("mesh.data=8",), "TPU v3"),
  ("configs/c4/latte.py", "v5p:2x2x1", ("mesh.data=4",), "4 x 80 GB A100 -> 4 v5p chips"),
  ("configs/c4/", "v4:2x4x4", ("mesh.data=32",), "64 TPU v4 cores"),
  ("configs/pg19/", "v4:2x4x4", ("mesh.data=32",), "64 TPU v4 cores"),
  ("configs/imagenet64/fit_ar.py", "v3:2x2", ("mesh.data=8",), "TPU v3"),
)
BLOCK_CONFIG = "configs/c4/block_transformer.py"  # vanilla and MEGABYTE rows too: the Block paper's setup
BLOCK_PLACEMENT = ("v5p:2x2x1", ("mesh.data=4",), "8 x 40 GB A100 -> 4 v5p chips")


def paper_rows() -> tuple[Row, ...]:
  """Every paper config of the families' paper rows (lra_core.bench.param_counts) at its paper batch and length."""
  rows = []
  for spec, source in ((row.config, row.source) for row in param_counts.PAPER):
    if spec.startswith(BLOCK_CONFIG):
      topology, overrides, _ = BLOCK_PLACEMENT
    else:
      topology, overrides, _ = next(p[1:] for p in PLACEMENT if spec.startswith(p[0]))
    rows.append(Row(source, spec, topology, overrides, paper_step_ms=FLASH_LATENCY_MS.get(spec)))
  return tuple(rows)


# The acceptance rows first, then every paper config; --full adds all of Table 6.
DEFAULT_ROWS = (table6("vq", "shga", 8192), table6("full", "shga", 131072)) + paper_rows()
FULL_ROWS = DEFAULT_ROWS + tuple(
  table6(a, h, t)
  for h in ("shga", "mqa", "mha")
  for t in (2048, 8192, 32768, 131072)
  for a in ("vq", "full")
  if (a, h, t) not in (("vq", "shga", 8192), ("full", "shga", 131072))
)


def compile_row(ctx: Context, row: Row, rung: tuple[str, ...], table: str = "tpu_fit") -> dict:
  """One compile's record (reusing an unchanged earlier one) under ctx.workdir/`table`: command, status,
  wall time, report. A reused record's estimate is recomputed from the HLO it kept, so a change of
  lra_core/cost/hlo_cost.py needs no compile."""
  folder = ctx.workdir / table
  folder.mkdir(parents=True, exist_ok=True)
  slug = row.slug(rung)
  report_path, meta_path, hlo_path = (folder / f"{slug}{suffix}" for suffix in (".json", ".meta.json", ".hlo.gz"))
  command = row.command(rung, str(report_path), str(hlo_path))
  if meta_path.exists():
    meta = json.loads(meta_path.read_text())
    if meta["command"] == command:
      ctx.log(f"{table}: {row.paper} {' '.join(rung)}: reusing {meta_path.name}")
      if meta.get("report") and hlo_path.exists():
        report = aot_report.estimate_from_hlo(
          aot_report.Report.from_json(meta["report"]), aot_report.read_hlo(hlo_path)
        )
        meta["report"] = report.to_json()
      return meta
  ctx.log(f"{table}: {row.paper} {' '.join(rung)}: compiling for {row.topology} ...")
  report_path.unlink(missing_ok=True)
  hlo_path.unlink(missing_ok=True)
  start = time.perf_counter()
  done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
  meta = {"command": command, "status": done.returncode, "wall_s": time.perf_counter() - start, "commit": commit()}
  if report_path.exists():
    meta["report"] = json.loads(report_path.read_text())
  else:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:") or "Error" in line]
    meta["error"] = brief(errors[-1]) if errors else f"exit status {done.returncode}"
  meta_path.write_text(json.dumps(meta, indent=2) + "\n")
  return meta


def run_row(ctx: Context, row: Row, table: str = "tpu_fit") -> tuple[dict, tuple[str, ...], float]:
  """The row's final record, the rung it took, and the compile wall time of all attempts."""
  wall = 0.0
  for rung in row.rungs():
    meta = compile_row(ctx, row, rung, table)
    wall += meta["wall_s"]
    if "report" not in meta or meta["report"]["fits"]:
      break
  return meta, rung, wall


def utilisation(r: dict) -> str:
  """'MFU / HFU (bound; memory-bound share)'."""
  return (
    f"{100 * r['est_mfu']:.0f}% / {100 * r['est_hfu']:.0f}% ({r['bound']}; "
    f"{100 * r['memory_bound_share']:.0f}% memory-bound)"
  )


def split_cell(r: dict) -> str:
  """Where the estimated step goes, by kind of work (lra_core.cost.hlo_cost.SPLIT)."""
  return aot_report.Report.from_json(r).split_text()


def memory_cell(r: dict) -> str:
  """'peak / HBM' GiB; a refusal that names no size (e.g. a kernel over its on-chip VMEM) says so."""
  peaks = [p for p in (r["peak_gib"], r["eval_peak_gib"]) if p is not None]
  if not peaks:
    return f"refused: {r.get('refusal', '')[:80]}"
  return f"{max(peaks):,.2f} / {r['hbm_gib']:.1f}"


def settings_cell(row: Row, rung: tuple[str, ...]) -> str:
  remat = next((o.split("=")[1] for o in rung if o.startswith("model.remat")), "none")
  accum = next((f", {o.split('=')[1]} micro-batches" for o in rung if o.startswith("train.grad_accum")), "")
  return f"remat {remat}, scan{accum}"


def against_paper(row: Row, r: dict) -> str:
  """The estimate over what the paper measured, for a row that compiled and fits: tokens/s or step time."""
  if r["est_step_seconds"] is None or not r["fits"]:
    return ""
  if row.paper_tokens_per_s:
    return f"{r['est_tokens_per_s'] / row.paper_tokens_per_s:.2f}x tokens/s"
  if row.paper_step_ms:
    return f"{r['est_step_seconds'] * 1e3 / row.paper_step_ms:.2f}x step time"
  return ""


def paper_mfu(row: Row, r: dict) -> float | None:
  """The MFU the paper's own measured run would have had under our FLOP count: the model FLOPs of our
  compiled step over the paper's step time and the chip's peak (our MFU x our step time / the paper's).
  None where the paper measured nothing or our step has no estimate (a refused compile)."""
  seconds, mfu = r.get("est_step_seconds"), r.get("est_mfu")
  if seconds is None or mfu is None or not math.isfinite(seconds * mfu):
    return None
  if row.paper_tokens_per_s:  # the same tokens per step: the paper's time is ours x our rate / its rate
    return mfu * row.paper_tokens_per_s / r["est_tokens_per_s"]
  if row.paper_step_ms:
    return mfu * seconds * 1e3 / row.paper_step_ms
  return None


def sanity_cell(row: Row, r: dict) -> str:
  """The paper's implied MFU; over 100% fails the row (the setting, the hardware or our count is wrong)."""
  implied = paper_mfu(row, r)
  if implied is None:
    return ""
  return f"**fails: {100 * implied:.0f}%**" if implied > 1 else f"{100 * implied:.0f}%"


def failed_rows(rows: Sequence[Row], reports: Sequence[dict | None]) -> str:
  """The one comparison line both fit tables print: which rows imply a paper MFU over 100%."""
  implied = [(row.paper, paper_mfu(row, r)) for row, r in zip(rows, reports) if r]
  failed = [paper for paper, mfu in implied if mfu is not None and mfu > 1]
  measured = sum(mfu is not None for _, mfu in implied)
  return f"paper runs over 100% MFU under our FLOP count: {len(failed)} of {measured} measured rows" + (
    f" ({'; '.join(failed)})" if failed else ""
  )


def compiled_at(metas: Sequence[dict]) -> str:
  """Which commits compiled the rows' records (a record is reused while its command is unchanged)."""
  counts = collections.Counter(meta.get("commit", "unrecorded") for meta in metas)
  return "; ".join(f"`{c}` ({n} row{'s' if n > 1 else ''})" for c, n in counts.items())


def tpu_fit(ctx: Context) -> Result:
  rows = FULL_ROWS if ctx.full else DEFAULT_ROWS
  lines, reports, metas = [], [], []
  for row in rows:
    meta, rung, wall = run_row(ctx, row)
    r = meta.get("report")
    reports.append(r)
    metas.append(meta)
    if r is None:
      lines.append(
        [
          row.paper,
          row.topology,
          "-",
          settings_cell(row, rung),
          "-",
          f"compile failed: {meta['error'][:80]}",
          "-",
          "-",
          "-",
          "-",
          "-",
          f"{wall:.0f}",
          row.paper_measured,
          "",
          "",
        ]
      )
      continue
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    compiled = r["est_step_seconds"] is not None  # None: the compiler refused the step for memory
    lines.append(
      [
        row.paper,
        f"{row.topology} ({r['num_devices']} x {r['device_kind']})",
        mesh,
        settings_cell(row, rung),
        memory_cell(r),
        "yes" if r["fits"] else "**no**",
        fmt(r["est_step_seconds"] * 1e3, ",.0f") if compiled else "-",
        fmt(r["est_tokens_per_s"], ",.0f") if compiled else "-",
        utilisation(r) if compiled else "-",
        split_cell(r) if compiled else "-",
        f"{r['num_params'] / 1e6:,.0f}M",
        f"{wall:.0f}",
        row.paper_measured,
        against_paper(row, r),
        sanity_cell(row, r),
      ]
    )
  table = markdown_table(
    [
      "setting",
      "topology",
      "mesh",
      "remat / scan",
      "GiB per device (peak / HBM)",
      "fits",
      "est. step ms",
      "est. tokens/s",
      "est. MFU / HFU (bound)",
      "where the step goes",
      "params",
      "compile s (this host)",
      "paper measured",
      "est. / paper",
      "paper's MFU under our count",
    ],
    lines,
  )
  setting = (
    "`python -m lra_core.aot` for each paper config at the paper's global batch and sequence length: the "
    "trainer's real train step and eval step compiled by libtpu's TPU compiler for the slice named, on "
    "this CPU host, in bfloat16 compute (float32 parameters and optimizer state) with scanned layers. "
    "Memory is XLA's per-device buffer assignment (the larger peak of the train and eval steps, against "
    "the chip's HBM per JAX device); a row that does not fit without recomputation is compiled again with "
    "`model.remat=full`, then also in 4 and in 16 micro-batches of the same global batch, and shows the "
    "first setting that fits (or, if none does, the last). The step time is a roofline over the compiled program "
    "(lra_core/cost/hlo_cost.py: every operation at the slower of its FLOPs at bf16 peak and its HBM "
    "traffic, loops by their trip counts, collectives overlapped). MFU counts the model's FLOPs (the "
    "program's less what remat recomputes), HFU every FLOP the chip runs, both over that time and the "
    "chip's bf16 peak; the share of the step spent in operations bound by HBM bandwidth follows, and "
    "where the step goes: its time split into matrix products at the chip's peak or waiting on HBM, "
    "Pallas kernels, in-place updates (a scanned stack storing its residuals, a cache) and elementwise "
    "work (activations, norms, their gradients, casts, copies). Estimates, not measurements. "
    "Where the paper measured the run, the last column is the MFU its own run would have had under our "
    "count (our model FLOPs per step over the paper's step time and the chips' peak); over 100% fails the "
    "row, for then the setting, the hardware mapping or the count is wrong. Compile s is "
    "the wall time of all attempts of the row on this 2-core host. The rows' programs were compiled at "
    f"{compiled_at(metas)}; every estimate is recomputed from their HLO at the commit below."
  )
  return Result(setting=setting, markdown=table, comparison=failed_rows(rows, reports))
