"""Transformer-VQ's tables: throughput (Tables 6-9), codebook size (Table 1), compressive cache (Table 2).

vq_throughput times the trainer's step (scripts/bench.py) of full attention and VQ attention with
each cache reduction and head type at equal width and depth; the two ablations train small models
on the enwik8 sample with the real trainer and report validation bits per byte and step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lra_core.bench import train_step
from lra_core.bench.common import Variant
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, data_path, figure, fmt, save_plot, train

CONFIG = "configs/enwik8/transformer_vq.py"
# Tables 6-9 (8 TPU v3 cores, tokens/s): reduction -> head type -> {T: (full, vq)}; None = OOM.
PAPER_THROUGHPUT = {
  "serial": {
    "shga": {2048: (65.5e3, 63.0e3), 8192: (23.9e3, 77.2e3), 32768: (6.5e3, 82.1e3)},
    "mqa": {2048: (58.9e3, 63.0e3), 8192: (10.4e3, 74.8e3), 32768: (None, 79.7e3)},
    "mha": {2048: (52.0e3, 49.6e3), 8192: (9.5e3, 57.8e3), 32768: (None, 60.7e3)},
  },
  "matmul": {
    "shga": {2048: (65.5e3, 62.5e3), 8192: (23.9e3, 75.2e3), 32768: (6.5e3, 80.0e3)},
    "mqa": {2048: (58.9e3, 62.5e3), 8192: (10.4e3, 74.9e3), 32768: (None, 80.2e3)},
    "mha": {2048: (52.0e3, 48.2e3), 8192: (9.5e3, 58.2e3), 32768: (None, 61.6e3)},
  },
  "assoc": {
    "shga": {2048: (65.5e3, 58.9e3), 8192: (23.9e3, 62.2e3), 32768: (6.5e3, 63.4e3)},
    "mqa": {2048: (58.9e3, 62.8e3), 8192: (10.4e3, 74.2e3), 32768: (None, 79.0e3)},
    "mha": {2048: (52.0e3, 49.1e3), 8192: (9.5e3, 55.4e3), 32768: (None, 57.8e3)},
  },
  "input_scan": {
    "shga": {2048: (32.0e3, 40.8e3), 8192: (12.7e3, 47.4e3), 32768: (None, 49.4e3)},
    "mqa": {2048: (36.2e3, 54.8e3), 8192: (14.5e3, 64.9e3), 32768: (None, 68.3e3)},
    "mha": {2048: (30.0e3, 43.7e3), 8192: (11.4e3, 50.7e3), 32768: (None, 53.1e3)},
  },
}
# Table 1 (codebook size) and Table 2 (compressive cache): setting -> (validation bits/byte, latency rel.).
PAPER_CODEBOOK = {256: (1.010, 0.927), 512: (1.005, 1.0), 1024: (1.000, 1.109)}
PAPER_CACHE = {False: (1.026, 0.836), True: (1.010, 0.927)}


@dataclasses.dataclass(frozen=True)
class ThroughputSize:
  model: tuple[str, ...]  # overrides of the enwik8 config
  seq_lens: tuple[int, ...]
  head_types: tuple[str, ...]
  reductions: tuple[str, ...]  # serial / matmul / assoc / input_scan
  steps: int
  warmup: int


DEFAULT_THROUGHPUT = ThroughputSize(
  (
    "model.d_model=128",
    "model.d_k=64",
    "model.d_v=256",
    "model.num_layers=2",
    "model.n_code=128",
    "model.block_len=256",
    "model.num_heads=2",
  ),
  (1024, 4096),
  ("shga", "mqa", "mha"),
  ("serial", "matmul", "assoc", "input_scan"),
  2,
  1,
)
FULL_THROUGHPUT = ThroughputSize(
  ("model.num_heads=8",), (2048, 8192, 32768), ("shga", "mqa", "mha"), ("serial", "matmul", "assoc", "input_scan"), 5, 2
)


def _head_overrides(head_type: str) -> list[str]:
  return [f"model.head_type={head_type}"] + (["model.num_heads=1"] if head_type == "shga" else [])


def _variant(name: str, reduction: str, head_type: str, attention: str) -> Variant:
  items = [f"model.attention={attention}", *_head_overrides(head_type)]
  if reduction == "input_scan" and attention == "vq":  # full attention has no per-block form to scan
    items.append("model.input_scan=True")
  elif attention == "vq":
    items.append(f"model.reduction={reduction}")
  return Variant(name, tuple(items))


def vq_throughput(ctx: Context) -> Result:
  size = FULL_THROUGHPUT if ctx.full else DEFAULT_THROUGHPUT
  variants = []
  for head in size.head_types:
    variants.append(_variant(f"full/{head}", "serial", head, "full"))
    variants += [_variant(f"vq-{r}/{head}", r, head, "vq") for r in size.reductions]
  rows, peak = train_step.run(
    CONFIG,
    overrides=size.model,
    variants=variants,
    seq_lens=size.seq_lens,
    steps=size.steps,
    warmup=size.warmup,
    log=ctx.log,
  )
  by = {(r["variant"], r["seq_len"]): r for r in rows}

  def tps(name, t):
    r = by.get((name, t))
    return r["tokens_per_s"] if r and r["status"] == "ok" else None

  paper_lengths = _paired_lengths(size.seq_lens)
  lines = []
  for reduction in size.reductions:
    for head in size.head_types:
      full_name = f"full/{head}"
      for t in size.seq_lens:
        full, vq = tps(full_name, t), tps(f"vq-{reduction}/{head}", t)
        paper_t = paper_lengths[t]
        p_full, p_vq = PAPER_THROUGHPUT[reduction][head][paper_t]
        lines.append(
          [
            reduction,
            head.upper(),
            f"{t:,}",
            fmt(full, ",.0f") if full else "OOM",
            fmt(vq, ",.0f") if vq else "OOM",
            "-" if not (full and vq) else f"{vq / full:.2f}x",
            f"{paper_t:,}",
            fmt(p_full, ",.0f") if p_full else "OOM",
            fmt(p_vq, ",.0f"),
            "-" if not p_full else f"{p_vq / p_full:.2f}x",
          ]
        )
  table = markdown_table(
    [
      "reduction",
      "heads",
      "T",
      "ours: full tokens/s",
      "ours: VQ tokens/s",
      "ours: VQ / full",
      "paper T",
      "paper full",
      "paper VQ",
      "paper VQ / full",
    ],
    lines,
  )
  detail = train_step.format_table(rows)
  plots = [_throughput_plot(ctx, size, tps)]
  setting = (
    f"The trainer's train step (forward, backward, AdamW) of `{CONFIG}` with {', '.join(size.model)}: full "
    "attention (`model.attention=full`: unquantized softmax attention with the same XL biases, equal width and "
    "depth, the codebook being the only difference) against VQ attention with each cache reduction "
    "(`model.reduction=serial|matmul|assoc`) and with input scanning (`model.input_scan=True`, the whole "
    "stack one block at a time; full attention has no per-block form here, so these rows compare with plain "
    "full attention, where the paper's Table 9 scans both), for single-head gated "
    "attention (SHGA), multi-query and multi-head attention (`model.head_type`). Batch 1, one update window "
    f"= the whole sequence, median of {size.steps} steps after {size.warmup} warm-up step(s), compile apart "
    f"(`scripts/bench.py`); the float32 matmul yardstick measured {peak / 1e9:,.1f} GFLOP/s. The paper's "
    "numbers are Tables 6-9 (190M-class models on 8 TPU v3 cores) at its nearest length."
  )
  return Result(setting=setting, markdown=table + "\n\nEvery row as the harness measured it:\n\n" + detail, plots=plots)


def _paired_lengths(seq_lens: Sequence[int]) -> dict[int, int]:
  """Our lengths, shortest first, against the paper's (2048, 8192, 32768, ...) in the same order."""
  paper = sorted(PAPER_THROUGHPUT["serial"]["shga"])
  return {t: paper[min(i, len(paper) - 1)] for i, t in enumerate(sorted(seq_lens))}


def _throughput_plot(ctx: Context, size: ThroughputSize, tps):
  fig, axes = figure(len(size.head_types))
  for ax, head in zip(axes, size.head_types):
    names = [f"full/{head}"] + [f"vq-{r}/{head}" for r in size.reductions]
    for name in names:
      points = [(t, tps(name, t)) for t in size.seq_lens if tps(name, t)]
      if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", label=name.split("/")[0])
    ax.set(xscale="log", xlabel="sequence length T", ylabel="training tokens/s", title=head.upper())
    ax.legend(fontsize=7)
  return save_plot(ctx, fig, "vq_throughput")


# ----------------------------------------------------------------------------- Tables 1 and 2: enwik8 runs


@dataclasses.dataclass(frozen=True)
class TrainSize:
  overrides: tuple[str, ...]
  codebooks: tuple[int, ...]


DEFAULT_TRAIN = TrainSize(
  (
    "model.d_model=64",
    "model.d_k=32",
    "model.d_v=128",
    "model.num_layers=4",
    "model.block_len=32",
    "train.seq_len=256",
    "train.update_len=128",
    "train.batch_size=8",
    "train.steps=300",
    "train.eval_every=0",
    "train.eval_batches=8",
    "train.log_every=50",
    "train.checkpoint_every=0",
    "optim.lr=2e-3",
    "optim.warmup_steps=30",
  ),
  (32, 64, 128),
)
FULL_TRAIN = TrainSize((), (256, 512, 1024))  # the paper's enwik8 model and schedule (Table 10)


def _enwik8(ctx: Context, name: str, overrides: Sequence[str]) -> dict:
  folder = data_path(ctx, "enwik8")
  return train(ctx, name, CONFIG, [f"data.dir={folder}", *overrides])


def _step_ms(summary: dict) -> float | None:
  t = summary.get("train_time_s")
  return None if not t else 1e3 * t / summary["step"]


def vq_codebook(ctx: Context) -> Result:
  size = FULL_TRAIN if ctx.full else DEFAULT_TRAIN
  runs = {s: _enwik8(ctx, f"codebook_{s}", [*size.overrides, f"model.n_code={s}"]) for s in size.codebooks}
  base = runs[size.codebooks[len(size.codebooks) // 2]]
  paper = list(PAPER_CODEBOOK.items())
  rows = []
  for i, (s, summary) in enumerate(runs.items()):
    p_s, (p_bpb, p_lat) = paper[i] if i < len(paper) else (None, (None, None))
    rows.append(
      [
        f"{s:,}",
        fmt(summary.get("val_bits_per_byte"), ".3f"),
        fmt(summary.get("val_codebook_perplexity"), ".1f"),
        fmt(_step_ms(summary), ",.1f"),
        fmt(_step_ms(summary) / _step_ms(base), ".3f"),
        f"{p_s:,}" if p_s else "-",
        fmt(p_bpb, ".3f"),
        fmt(p_lat, ".3f"),
      ]
    )
  table = markdown_table(
    [
      "codebook size S",
      "ours: val bits/byte",
      "ours: code perplexity",
      "ours: ms / step",
      "ours: latency (rel.)",
      "paper S",
      "paper val bits/byte",
      "paper latency (rel.)",
    ],
    rows,
  )
  return Result(setting=_train_setting(size, "model.n_code"), markdown=table)


def vq_cache(ctx: Context) -> Result:
  size = FULL_TRAIN if ctx.full else DEFAULT_TRAIN
  s = size.codebooks[0]
  runs = {
    c: _enwik8(ctx, f"cache_{c}", [*size.overrides, f"model.n_code={s}", f"model.compressive={c}"])
    for c in (False, True)
  }
  rows = []
  for c, summary in runs.items():
    p_bpb, p_lat = PAPER_CACHE[c]
    rows.append(
      [
        "yes" if c else "no",
        fmt(summary.get("val_bits_per_byte"), ".3f"),
        fmt(_step_ms(summary), ",.1f"),
        fmt(_step_ms(summary) / _step_ms(runs[True]), ".3f"),
        fmt(p_bpb, ".3f"),
        fmt(p_lat / PAPER_CACHE[True][1], ".3f"),
      ]
    )
  table = markdown_table(
    [
      "compressive cache",
      "ours: val bits/byte",
      "ours: ms / step",
      "ours: latency (rel. to with cache)",
      "paper val bits/byte",
      "paper latency (rel. to with cache)",
    ],
    rows,
  )
  return Result(setting=_train_setting(size, "model.compressive", codebook=s), markdown=table)


def _train_setting(size: TrainSize, varied: str, codebook: int | None = None) -> str:
  what = " ".join(size.overrides) if size.overrides else "the paper's enwik8 model and schedule (Table 10)"
  extra = f", S = {codebook}" if codebook else ""
  return (
    f"Byte-level LM on the enwik8 sample under --data_dir/enwik8 (split 90/5/5 by bytes), trained with the "
    f"real trainer from `{CONFIG}` with {what}{extra}, varying `{varied}`. Validation bits/byte on the "
    "validation split at the end; ms / step is the trainer's training time over its steps (compile apart). "
    "The paper's numbers are its 190M enwik8 model after 125k steps."
  )
