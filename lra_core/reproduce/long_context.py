"""`long_context`: the longest sequence each family trains on a TPU slice, with and without the
`sequence` mesh axis (docs/long_context.md).

Each family's PG-19 config is compiled by `python -m lra_core.aot` (the trainer's train and eval
steps, libtpu's compiler, this host) in bfloat16 with full recomputation and scanned layers, at
sequence lengths doubling until the step no longer fits the chip's HBM (whole rows from 8,192
tokens; split, from the whole rows' longest times the devices, the same tokens per device):

  whole rows     every device holds whole rows: mesh data = every device, one row each;
  sequence axis  one row split over every device: mesh sequence = every device, batch 1.

So both columns hold one row per device's worth of tokens; the second is the longest single sequence
the slice trains. Transformer-VQ takes its whole sequence in one update window (train.update_len 0:
with windows it trains any length, a window at a time). The full-attention Transformer+ is the
baseline; it cannot split a sequence yet. Records are kept and reused like tpu_fit's (`compile_row`).
"""

from __future__ import annotations

from lra_core.reproduce.common import Context, Result, fmt
from lra_core.reproduce.tpu import COMMON, Row, compile_row, compiled_at
from lra_core.tables import markdown_table

TABLE = "long_context"
FAMILIES = (
  ("Latte", "configs/pg19/latte.py", ()),
  ("Transformer-VQ", "configs/pg19/transformer_vq.py", ("train.update_len=0",)),
  ("FLASH", "configs/pg19/flash.py", ()),
  ("Transformer+ (full attention)", "configs/pg19/transformer.py", ()),
)
SPLITS = {"Latte", "Transformer-VQ", "FLASH"}  # the families with a `context_parallel` check
# (topology, JAX devices, what the slice is called): the default run compiles the first, --full both
SLICES = (("v5p:4x4x4", 64, "v5p-64"), ("v3:4x4", 32, "v3-32"))
START, CAP = 8192, 2**25  # tokens per device to start from; no sequence longer than 32M is tried


def _search(ctx: Context, name: str, spec: str, extra, topology: str, devices: int, split: bool, start: int):
  """((the longest fitting length from `start` on, or None; its report), the records of every compile)."""
  mesh = (
    ("mesh.data=1", f"mesh.sequence={devices}", "train.batch_size=1")
    if split
    else ("mesh.data=-1", f"train.batch_size={devices}")
  )
  t, best, metas = start, (None, None), []
  while t <= CAP:
    overrides = (*mesh, f"train.seq_len={t}", *extra)
    row = Row(f"{name}, {t:,} tokens", spec, topology, overrides, common=COMMON + ("model.remat=full",))
    meta = compile_row(ctx, row, (), TABLE)
    metas.append(meta)
    report = meta.get("report")
    if report is None or not report["fits"]:
      break
    best, t = (t, report), 2 * t
  return best, metas


def long_context(ctx: Context) -> Result:
  slices = SLICES if ctx.full else SLICES[:1]
  lines, metas = [], []
  for name, spec, extra in FAMILIES:
    for topology, devices, label in slices:
      cells, whole = [], None
      for split in (False, True):
        if split and name not in SPLITS:
          cells += ["- (cannot split a sequence yet)", "-"]
          continue
        # Split, a device holds as many tokens of the one row as it held whole: start there.
        start = (whole or START) * devices if split else START
        (t, report), found = _search(ctx, name, spec, extra, topology, devices, split, start)
        metas += found
        whole = t if not split else whole
        if t is None:
          cells += [f"< {start:,}", "-"]
          continue
        est = report["est_tokens_per_s"]
        cells += [f"{t:,}", f"{report['peak_gib']:.1f} GiB, {fmt(est, ',.0f')} tokens/s" if est else "-"]
      lines.append([name, f"{label} ({topology}, {devices} devices)", *cells])
  table = markdown_table(
    [
      "family (PG-19 config)",
      "slice",
      "whole rows: longest sequence",
      "its peak per device, est. tokens/s",
      "sequence axis: longest sequence",
      "its peak per device, est. tokens/s",
    ],
    lines,
  )
  setting = (
    "The longest sequence each family's PG-19 config trains on a TPU slice: `python -m lra_core.aot` (the "
    "trainer's train and eval steps compiled by libtpu's compiler on this CPU host) in bfloat16 with full "
    "recomputation and scanned layers, the length doubled from 8,192 tokens per device until the step no "
    "longer fits HBM. Whole rows: every device holds whole rows (mesh data = every device, one row each). "
    "Sequence axis: one row split over every device (mesh sequence = every device, batch 1). "
    "Transformer-VQ takes its whole sequence as one update window (with windows it trains any length). "
    "Estimates of memory and speed, not measurements. The rows' programs were compiled at "
    f"{compiled_at(metas)}."
  )
  return Result(setting=setting, markdown=table)
