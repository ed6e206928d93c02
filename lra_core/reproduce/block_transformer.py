"""The `block_throughput` table: Block Transformer Table 2's throughput columns, Figure 2 and the
MEGABYTE comparison of Figure 5b / Figure 19.

Generated tokens per second of whole prompt -> continuation calls (scripts/bench_generate.py) for
the Block Transformer, the MEGABYTE-style model of Table 4 (the same family: a lookup embedder that
concatenates the patch's token embeddings, a larger block decoder and a small summation token
decoder) and the vanilla (Pythia) model at equal non-embedding parameters, in the paper's
prefill-heavy (long prompt, short continuation) and decode-heavy (short prompt, long continuation)
settings, by batch size. Figure 2 plots throughput against quality; models are not trained here, so
the plot shows throughput against non-embedding parameters, the quantity printed next to each point
of the paper's figure.
"""

from __future__ import annotations

import dataclasses

from lra_core.bench import generate
from lra_core.bench.common import is_oom
from lra_core.config import load_config
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, figure, fmt, save_plot

CONFIG = "configs/c4/block_transformer.py"
# Table 2 (one H100, Section 3.1; maximum batch per model): non-embedding size -> (prefill-heavy, decode-heavy)
# throughput in 1K generated tokens/s. The paper prints no MEGABYTE numbers: Figure 5b / Figure 19 plot
# them, and Section 4.1 reads Block as over 1.5x MEGABYTE's throughput.
PAPER = {
  "vanilla": {"5m": (10.8, 41.6), "19m": (6.9, 19.1), "85m": (2.3, 6.2), "302m": (0.8, 2.1)},
  "block": {"5m": (272.3, 809.5), "19m": (175.3, 421.4), "85m": (59.0, 134.7), "302m": (21.0, 44.1)},
}
PAPER_BLOCK_OVER_MEGABYTE = 1.5

NON_EMBEDDING = {"5m": 4.7e6, "19m": 18.9e6, "85m": 85.1e6, "302m": 302e6}  # Tables 2-3
# model kind -> (config arg suffix, label, sizes the paper has it in)
MODELS = {
  "block": ("", "Block", ("5m", "19m", "85m", "302m")),
  "megabyte": (",megabyte", "MEGABYTE-style", ("5m", "19m", "85m")),  # Table 4
  "vanilla": (",vanilla", "vanilla", ("5m", "19m", "85m", "302m")),
}


@dataclasses.dataclass(frozen=True)
class Size:
  models: tuple[str, ...]  # size names of configs/c4/block_transformer.py
  settings: tuple[tuple[str, int, int], ...]  # (name, prompt, generated)
  batch_sizes: tuple[int, ...]
  repeats: int
  warmup: int


DEFAULT = Size(("5m", "19m"), (("prefill-heavy", 2048, 128), ("decode-heavy", 128, 512)), (1, 8), 1, 1)
FULL = Size(
  ("5m", "19m", "85m", "302m"), (("prefill-heavy", 2048, 128), ("decode-heavy", 128, 2048)), (1, 32, 256), 3, 1
)  # the paper's fixed batch sizes (Section 3.2, Appendix I)


def _time(ctx: Context, size_name: str, kind: str, batch: int, prompt: int, new: int, size: Size) -> dict:
  config = load_config(f"{CONFIG}:{size_name}{MODELS[kind][0]}", [f"train.seq_len={prompt + new}"])
  row = {"model": kind, "size": size_name, "batch_size": batch, "prompt": prompt, "new": new}
  try:
    row.update(
      generate.time_generate(
        config, batch_size=batch, prompt_len=prompt, new_tokens=new, repeats=size.repeats, warmup=size.warmup
      )
    )
  except Exception as error:  # noqa: BLE001 - running out of memory is a row; anything else is a bug
    if not is_oom(error):
      raise
    row["oom"] = True
  ctx.log(
    f"{kind} {size_name} batch {batch} {prompt}:{new}: "
    f"{'OOM' if row.get('oom') else format(row['tokens_per_s'], ',.0f') + ' tokens/s'}"
  )
  return row


def _speed(row: dict | None) -> float | None:
  return None if row is None or row.get("oom") else row["tokens_per_s"]


def _ratio(a: float | None, b: float | None) -> str:
  return "-" if not a or not b else f"{a / b:.1f}x"


def block_throughput(ctx: Context) -> Result:
  size = FULL if ctx.full else DEFAULT
  rows = [
    _time(ctx, m, kind, b, p, n, size)
    for name, p, n in size.settings
    for b in size.batch_sizes
    for m in size.models
    for kind in MODELS
    if m in MODELS[kind][2]
  ]
  by = {(r["model"], r["size"], r["batch_size"], r["prompt"]): r for r in rows}
  lines, over_vanilla, over_megabyte = [], [], []
  for name, p, n in size.settings:
    column = 0 if name == "prefill-heavy" else 1
    for b in size.batch_sizes:
      for m in size.models:
        vanilla, block = _speed(by.get(("vanilla", m, b, p))), _speed(by.get(("block", m, b, p)))
        megabyte = _speed(by.get(("megabyte", m, b, p)))
        if block and vanilla:
          over_vanilla.append(block / vanilla)
        if block and megabyte:
          over_megabyte.append(block / megabyte)
        paper_v = PAPER["vanilla"].get(m, (None,) * 2)[column]
        for kind, (_, label, _) in MODELS.items():
          row = by.get((kind, m, b, p))
          if row is None:
            continue
          paper = PAPER.get(kind, {}).get(m, (None,) * 2)[column]
          lines.append(
            [
              f"{name} ({p:,} -> {n:,})",
              b,
              m,
              label,
              "OOM" if row.get("oom") else fmt(row["tokens_per_s"], ",.0f"),
              _ratio(_speed(row), _speed(by.get(("vanilla", m, b, p)))),
              _ratio(block, _speed(row)),
              fmt(row.get("state_mib"), ",.1f"),
              fmt(paper, ".1f"),
              _ratio(paper, paper_v) if paper else "-",
            ]
          )
  table = markdown_table(
    [
      "setting (prompt -> generated)",
      "batch",
      "non-embedding size",
      "model",
      "tokens/s",
      "vs vanilla",
      "Block / this",
      "decode state MiB",
      "paper (1K tokens/s)",
      "paper vs vanilla",
    ],
    lines,
  )
  comparison = ""
  if over_vanilla and over_megabyte:
    comparison = (
      f"Block / vanilla {min(over_vanilla):.1f}x-{max(over_vanilla):.1f}x (paper Table 2: 19-25x at "
      f"each model's largest batch); Block / MEGABYTE-style {min(over_megabyte):.1f}x-"
      f"{max(over_megabyte):.1f}x (paper Section 4.1: over {PAPER_BLOCK_OVER_MEGABYTE}x)"
    )
  plots = [_plot(ctx, size, by)]
  setting = (
    f"Random-weight models from `{CONFIG}` at equal non-embedding parameters ({', '.join(size.models)}: "
    "Block = block decoder + token decoder with L_B 4, MEGABYTE-style = Table 4's larger block decoder with a "
    "small summation token decoder (config arg `megabyte`), vanilla = Pythia of the same size, all with the "
    "paper's 50,304-token head), float32, greedy decoding from random prompts, through "
    "`scripts/bench_generate.py` (Block and MEGABYTE-style: `models.block_transformer.generate`, the prompt read "
    "once by the block decoder; vanilla: one-pass prefill, then one cached step per token). Time is the median "
    f"of {size.repeats} call(s) after {size.warmup} warm-up call(s) that compile. The paper's columns are "
    "Table 2's maximum throughput on one H100 with each model at its largest batch (it prints no MEGABYTE "
    "numbers; Figure 5b plots them); ours are at the batches shown. The default shortens the decode-heavy "
    f"continuation to {dict((s[0], s[2]) for s in size.settings)['decode-heavy']:,} tokens (paper: 2,048) to "
    "fit the CPU budget. Figure 2 plots throughput against loss for trained models; nothing is trained here, "
    "so the plot puts throughput against non-embedding parameters (the labels of the paper's points)."
  )
  return Result(setting=setting, markdown=table, plots=plots, comparison=comparison)


def _plot(ctx: Context, size: Size, by: dict):
  fig, axes = figure(len(size.settings))
  colors = {"vanilla": "tab:blue", "block": "tab:red", "megabyte": "tab:green"}
  for ax, (name, p, n) in zip(axes, size.settings):
    b = max(size.batch_sizes)
    for kind, color in colors.items():
      points = [
        (by[(kind, m, b, p)]["non_embedding"], by[(kind, m, b, p)]["tokens_per_s"])
        for m in size.models
        if (kind, m, b, p) in by and not by[(kind, m, b, p)].get("oom")
      ]
      if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", color=color, label=f"{MODELS[kind][1]} (ours, batch {b})")
    for kind in PAPER:
      paper = [(NON_EMBEDDING[m], PAPER[kind][m][0 if name == "prefill-heavy" else 1] * 1e3) for m in PAPER[kind]]
      xs, ys = zip(*paper)
      ax.plot(xs, ys, "x--", color=colors[kind], alpha=0.5, label=f"{MODELS[kind][1]} (paper Table 2, H100)")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="non-embedding parameters",
      ylabel="generated tokens/s",
      title=f"{name}: prompt {p:,}, generate {n:,}",
    )
    ax.legend(fontsize=7)
  return save_plot(ctx, fig, "block_throughput")
