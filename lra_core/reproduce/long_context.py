"""`long_context`: the longest sequence each family trains on a TPU slice, with and without the
`sequence` mesh axis (docs/long_context.md).

Each family's PG-19 config is compiled by `python -m lra_core.aot` (the trainer's train and eval
steps, libtpu's compiler, this host) in bfloat16 with full recomputation and scanned layers, at
power-of-two lengths, until the longest that fits the chip's HBM is pinned between a compile that
fits and one at twice the length that does not:

  whole rows     every device holds whole rows: mesh data = every device, one row each;
  sequence axis  one row split over every device: mesh sequence = every device, batch 1.

The search starts from a guess and moves by doubling and halving. After the first compile it jumps
to the length a straight line through that compile's memory predicts (its arguments fixed, the rest
growing with the length, as a linear-time family's activations do); the compiles that follow decide,
so a wrong guess costs compiles, never a wrong answer. Split, it starts where a device holds as many
tokens as whole rows held. Transformer-VQ takes its whole sequence in one update window
(train.update_len 0: with windows it trains any length, a window at a time). The full-attention
baseline is FLASH's Transformer+ on PG-19; it cannot split a sequence yet. Records are kept and
reused like tpu_fit's (`compile_row`).
"""

from __future__ import annotations

import dataclasses
import math

from lra_core.reproduce.common import Context, Result, fmt
from lra_core.reproduce.tpu import COMMON, Row, compile_row, compiled_at
from lra_core.tables import markdown_table

TABLE = "long_context"


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  spec: str
  extra: tuple[str, ...] = ()
  start: int = 65536  # tokens per device the whole-rows search starts from
  splits: bool = True  # has a `context_parallel` check


FAMILIES = (
  Family("Latte", "configs/pg19/latte.py"),
  Family("Transformer-VQ", "configs/pg19/transformer_vq.py", ("train.update_len=0",)),
  Family("FLASH", "configs/pg19/flash.py"),
  # T x T scores per head: a shorter start saves the compiles a linear guess would waste.
  Family("Transformer+ (full attention)", "configs/pg19/transformer.py:flash", start=8192, splits=False),
)
# (topology, JAX devices, what the slice is called)
SLICES = (("v5p:4x4x4", 64, "v5p-64"), ("v3:4x4", 32, "v3-32"))
SHORTEST, LONGEST = 1024, 2**26  # no row shorter than 1,024 or longer than 64M tokens is tried


def _row(family: Family, topology: str, devices: int, split: bool, t: int) -> Row:
  mesh = (
    ("mesh.data=1", f"mesh.sequence={devices}", "train.batch_size=1")
    if split
    else ("mesh.data=-1", f"train.batch_size={devices}")
  )
  return Row(
    f"{family.name}, {t:,} tokens",
    family.spec,
    topology,
    (*mesh, f"train.seq_len={t}", *family.extra),
    common=COMMON + ("model.remat=full",),
  )


def guess(t: int, report: dict | None, lo: int, hi: int) -> int:
  """The power of two in (lo, hi) that a straight line through `report`'s memory at length t puts
  last under the chip's limit: peak(T) = arguments + (peak(t) - arguments) T / t."""
  number = lambda key: report.get(key) if report and isinstance(report.get(key), (int, float)) else math.nan
  if not math.isfinite(number("peak_gib")):
    return 0
  fixed = number("arguments_gib")  # NaN (JSON null) where the compiler refused: only what it needed is known
  fixed = fixed if math.isfinite(fixed) else 0.0
  growing = report["peak_gib"] - fixed
  if growing <= 0:
    return 0
  best = t * (report["usable_gib"] - fixed) / growing
  if best <= 0:
    return lo
  g = 2 ** int(math.floor(math.log2(best)))
  return g if lo < g < hi else 0


def longest(compile_at, start: int) -> tuple[int | None, dict | None, list[dict]]:
  """(the longest power-of-two length that fits, its report, every compile's record), found by
  compiling: `compile_at(t)` returns a record whose "report" has fits; the answer has a compile that
  fits and one at twice its length that does not (or it is SHORTEST failing, or LONGEST fitting)."""
  lo, hi, best, metas = 0, LONGEST * 2, None, []  # lo fits (0: none yet), hi does not
  t = start
  while True:
    meta = compile_at(t)
    metas.append(meta)
    report = meta.get("report")
    fits = bool(report and report["fits"])
    if fits:
      lo, best = t, report
    else:
      hi = t
    if hi <= 2 * lo or (not lo and hi <= SHORTEST):
      return (lo or None), best, metas
    jump = guess(t, report, lo, hi) if len(metas) == 1 else 0
    t = jump or (2 * lo if fits else hi // 2)


def _cells(t: int | None, report: dict | None) -> list[str]:
  if t is None:
    return [f"< {SHORTEST:,}", "-"]
  est = report.get("est_tokens_per_s")
  return [f"{t:,}", f"{report['peak_gib']:.1f} GiB, {fmt(est, ',.0f')} tokens/s" if est else "-"]


def long_context(ctx: Context) -> Result:
  lines, metas = [], []
  for family in FAMILIES:
    for topology, devices, label in SLICES:
      whole, report, found = longest(
        lambda t: compile_row(ctx, _row(family, topology, devices, False, t), (), TABLE), family.start
      )
      metas += found
      cells = _cells(whole, report)
      if family.splits:
        start = (whole or SHORTEST) * devices
        split, report, found = longest(
          lambda t: compile_row(ctx, _row(family, topology, devices, True, t), (), TABLE), start
        )
        metas += found
        cells += _cells(split, report)
      else:
        cells += ["- (cannot split a sequence yet)", "-"]
      lines.append([family.name, f"{label} ({topology}, {devices} devices)", *cells])
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
    "recomputation and scanned layers, at power-of-two lengths: each length shown fits and twice it does not "
    "(both compiled). Whole rows: every device holds whole rows (mesh data = every device, one row each). "
    "Sequence axis: one row split over every device (mesh sequence = every device, batch 1). "
    "Transformer-VQ takes its whole sequence as one update window (with windows it trains any length). "
    "The full-attention baseline is FLASH's Transformer+ (486M parameters, beside FLASH's 496M). "
    f"Estimates of memory and speed, not measurements. The {len(metas)} programs were compiled at "
    f"{compiled_at(metas)}."
  )
  return Result(setting=setting, markdown=table)
