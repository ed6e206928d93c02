"""`long_context`: the longest sequence each family trains on a TPU slice, with and without the
`sequence` mesh axis (docs/long_context.md).

Each family's config (PG-19's where the family has one) is compiled by `python -m lra_core.aot` (the
trainer's train and eval steps, libtpu's compiler, this host) in bfloat16 with full recomputation and scanned layers, at
power-of-two lengths (a multiple of one for a family whose rows split into groups of another size),
until the longest that fits the chip's HBM is pinned between a compile that
fits and one at twice the length that does not:

  whole rows     every device holds whole rows: mesh data = every device, one row each;
  sequence axis  one row split over every device: mesh sequence = every device, batch 1.

Each next length is the one a curve through the compiles so far predicts to be the last that fits
(arguments fixed, the rest growing as a power of the length: 1, a linear-time family's activations,
until two compiles measure it), or else twice the longest fit or half the shortest failure; the
compiles decide, so a poor guess costs compiles, never a wrong answer. Split, it starts where a device holds as many
tokens as whole rows held. Transformer-VQ takes its whole sequence in one update window
(train.update_len 0: with windows it trains any length, a window at a time). The full-attention
baseline is FLASH's Transformer+ on PG-19: whole rows, its attention on splash (model.attention_impl
"auto": the scores never formed, so its memory grows with the length, not its square); split, ring
attention (kernels/softmax/ring.py, model.attention_impl "xla"), each step's slice-pair scores formed
by XLA: the longest rows (splash over the gathered keys is faster, shorter). The Block
Transformer (C4, 302m) and FIT-AR (ImageNet 64x64) have no PG-19 config: theirs are compiled, the
Block Transformer without random-length padding (a row's blocks stay where the split puts them),
FIT-AR at 3 x 2^k tokens (its groups are 192 tokens). Records are kept and reused like tpu_fit's
(`compile_row`).
"""

from __future__ import annotations

import dataclasses
import math

from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, fmt
from lra_core.reproduce.tpu import COMMON, Row, compile_row, compiled_at

TABLE = "long_context"


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  spec: str
  extra: tuple[str, ...] = ()
  start: int = 65536  # tokens per device the whole-rows search starts from
  unit: int = 1  # lengths are unit x a power of two (a row of groups that are not a power of two long)
  slices: tuple[str, ...] = ()  # the slices (SLICES' names) searched; () for all
  split_extra: tuple[str, ...] = ()  # overrides of the split rows only


FAMILIES = (
  Family("Latte", "configs/pg19/latte.py"),
  Family("Transformer-VQ", "configs/pg19/transformer_vq.py", ("train.update_len=0",)),
  Family("FLASH", "configs/pg19/flash.py"),
  # T x T scores per head: a shorter start saves the compiles a linear guess would waste. Split, ring
  # attention: splash over the gathered keys (the default on TPU) is faster but holds shorter rows
  # (its keys whole on every chip, its block lists in scalar memory: docs/long_context.md).
  Family(
    "Transformer+ (full attention)",
    "configs/pg19/transformer.py:flash",
    start=8192,
    split_extra=("model.attention_impl=xla",),
  ),
  # (the v3-32 searches of these two are not compiled yet)
  Family(
    "Block Transformer (C4, 302m)", "configs/c4/block_transformer.py", ("data.block_padding=0",), slices=("v5p-64",)
  ),
  Family("FIT-AR (ImageNet 64x64)", "configs/imagenet64/fit_ar.py", start=3 * 16384, unit=3, slices=("v5p-64",)),
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
    (*mesh, f"train.seq_len={t}", *family.extra, *(family.split_extra if split else ())),
    common=COMMON + ("model.remat=full",),
  )


def _memory(meta: dict) -> tuple[float, float]:
  """(peak, arguments) in GiB of a record, NaN where unknown (JSON null: the compiler refused it and
  reported only what it needed)."""
  report = meta.get("report") or {}
  value = lambda key: report[key] if isinstance(report.get(key), (int, float)) else math.nan
  return value("peak_gib"), value("arguments_gib")


def guess(points: list[tuple[int, dict]], lo: int, hi: int) -> int:
  """The power of two strictly between lo (fits) and hi (does not) that a curve through the compiles
  so far puts last under the chip's limit, or 0 for none: peak(T) = arguments + c T^p, with p from the
  last two compiles (1 from a single one: a linear-time family's activations)."""
  (t, meta), usable = points[-1], (points[-1][1].get("report") or {}).get("usable_gib")
  peak, fixed = _memory(meta)
  fixed = fixed if math.isfinite(fixed) else 0.0
  if not (math.isfinite(peak) and peak > fixed and usable):
    return 0
  power = 1.0
  if len(points) > 1:
    t0, (peak0, _) = points[-2][0], _memory(points[-2][1])
    if math.isfinite(peak0) and peak0 > fixed and t0 != t and peak0 != peak:
      power = min(max(math.log((peak - fixed) / (peak0 - fixed)) / math.log(t / t0), 0.5), 3.0)
  best = t * ((usable - fixed) / (peak - fixed)) ** (1 / power) if usable > fixed else 0.0
  g = min(max(2 ** int(math.floor(math.log2(best))) if best >= 1 else 0, SHORTEST), LONGEST)
  return g if lo < g < hi else 0


def longest(compile_at, start: int, unit: int = 1) -> tuple[int | None, dict | None, list[dict]]:
  """(the longest length unit x 2^k that fits, its report, every compile's record), found by
  compiling: `compile_at(t)` returns a record whose "report" has fits; the answer has a compile that
  fits and one at twice its length that does not (or it is unit x SHORTEST failing, or unit x LONGEST
  fitting). Each next length is `guess`'s where it names one, else twice the longest fit or half the
  shortest failure: every compile narrows the range, so a poor guess costs compiles, never a wrong
  answer. The search runs in units (the curve's fit does not depend on the scale of its lengths)."""
  lo, hi, best, points = 0, LONGEST * 2, None, []  # in units: lo fits (0: none yet), hi does not
  t = max(start // unit, 1)
  while True:
    meta = compile_at(unit * t)
    points.append((t, meta))
    report = meta.get("report")
    if report and report["fits"]:
      lo, best = t, report
    else:
      hi = t
    if hi <= 2 * lo or (not lo and hi <= SHORTEST):
      return (unit * lo or None), best, [m for _, m in points]
    t = guess(points, lo, hi) or (2 * lo if lo else hi // 2)


def _cells(t: int | None, report: dict | None, unit: int) -> list[str]:
  if t is None:
    return [f"< {unit * SHORTEST:,}", "-"]
  est = report.get("est_tokens_per_s")
  return [f"{t:,}", f"{report['peak_gib']:.1f} GiB, {fmt(est, ',.0f')} tokens/s" if est else "-"]


def long_context(ctx: Context) -> Result:
  lines, metas = [], []
  for family in FAMILIES:
    for topology, devices, label in (s for s in SLICES if not family.slices or s[2] in family.slices):
      whole, report, found = longest(
        lambda t: compile_row(ctx, _row(family, topology, devices, False, t), (), TABLE), family.start, family.unit
      )
      metas += found
      cells = _cells(whole, report, family.unit)
      start = (whole or family.unit * SHORTEST) * devices
      split, report, found = longest(
        lambda t: compile_row(ctx, _row(family, topology, devices, True, t), (), TABLE), start, family.unit
      )
      metas += found
      cells += _cells(split, report, family.unit)
      lines.append([family.name, f"{label} ({topology}, {devices} devices)", *cells])
  table = markdown_table(
    [
      "family (config: PG-19's unless named)",
      "slice",
      "whole rows: longest sequence",
      "its peak per device, est. tokens/s",
      "sequence axis: longest sequence",
      "its peak per device, est. tokens/s",
    ],
    lines,
  )
  setting = (
    "The longest sequence each family's config (PG-19's unless named) trains on a TPU slice: "
    "`python -m lra_core.aot` (the trainer's train and eval steps compiled by libtpu's compiler on this CPU "
    "host) in bfloat16 with full recomputation and scanned layers, at power-of-two lengths (FIT-AR: 3 x a "
    "power of two, its groups being 192 tokens): each length shown fits and twice it does not "
    "(both compiled). Whole rows: every device holds whole rows (mesh data = every device, one row each). "
    "Sequence axis: one row split over every device (mesh sequence = every device, batch 1). "
    "Transformer-VQ takes its whole sequence as one update window (with windows it trains any length). "
    "The full-attention baseline is FLASH's Transformer+ (486M parameters, beside FLASH's 496M), its attention "
    "on the splash kernel for whole rows (`model.attention_impl` auto) and ring attention on XLA's scores split "
    "(`model.attention_impl=xla`: splash over every chip's gathered keys, the default on TPU, is faster but "
    "holds shorter rows, docs/long_context.md). "
    "The Block Transformer (302m, without random-length padding) and FIT-AR split their global attention "
    "(the block decoder, the global layers over latents) by ring attention and keep the rest local; "
    f"{' and '.join(f.name.split(' (')[0] for f in FAMILIES if f.slices)} are searched on "
    f"{' and '.join(sorted({s for f in FAMILIES for s in f.slices}))} only so far. "
    f"Estimates of memory and speed, not measurements. The {len(metas)} programs were compiled at "
    f"{compiled_at(metas)}."
  )
  return Result(setting=setting, markdown=table)
