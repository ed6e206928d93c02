"""The FLASH paper's tables: train-step latency by context length (Table 11) and quality against
training cost (Figure 6, small).

`flash_latency` times the trainer's causal-LM train step (scripts/bench.py) of FLASH, FLASH-Quad,
Transformer++ and Transformer+ of about equal size at a fixed number of tokens per step, so the
batch is N / T, as the paper trains every length at 2^18 tokens per step. `flash_quality` trains
FLASH, FLASH-Quad and Transformer++ of equal size on the C4 sample under --data_dir/c4 with the real
trainer and compares their loss against training wall time, as Figure 6 plots quality against
TPU-core-days.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

from lra_core.bench import train_step
from lra_core.bench.common import Variant
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, curve, data_path, figure, fmt, ratio, save_plot, train

FLASH, QUAD, TPP, TP = "flash", "flash_quad", "transformer++", "transformer+"
LABELS = {FLASH: "FLASH", QUAD: "FLASH-Quad", TPP: "Transformer++", TP: "Transformer+"}
COLORS = {FLASH: "tab:red", QUAD: "tab:orange", TPP: "tab:blue", TP: "tab:cyan"}
PAPER_LENGTHS = (512, 1024, 2048, 4096, 8192)  # Tables 12-13, Figures 5-6
PAPER_TOKENS_PER_STEP = 2**18  # Table 7: 2^18 tokens per batch at every length
# At the paper's sizes one device accumulates micro-batches of at most this many tokens (one sequence
# at T = 8192); the paper's 64 TPU-v4 cores hold 4,096 tokens each and need none.
MICRO_TOKENS = 8192

# Table 11: ms per train step, LM on Wiki-40B, one V100; the batch falls with the length. None: OOM.
TABLE11_BATCH = {512: 4, 1024: 2, 2048: 1, 4096: 1}
TABLE11_MS = {
  TPP: {512: 222.4, 1024: 243.9, 2048: 315.0, 4096: None},
  FLASH: {512: 254.4, 1024: 235.0, 2048: 242.8, 4096: 452.9},
}
# Table 13: LM on Wiki-40B, 110M models, 2^18 tokens per step: training latency per step on 64
# TPU-v4 cores and the best validation perplexity (per token) after 125k steps, at PAPER_LENGTHS.
TABLE13_LATENCY = {
  TP: (55.6, 70.3, 96.1, 149.3, 261.9),
  TPP: (54.7, 70.9, 96.6, 149.2, 261.0),
  QUAD: (54.1, 59.5, 71.3, 96.1, 141.3),
  FLASH: (57.2, 56.9, 56.7, 57.0, 62.5),
}
TABLE13_PPLX = {
  TP: (16.907, 15.999, 15.653, 15.515, 15.478),
  TPP: (16.835, 15.943, 15.489, 15.282, 15.254),
  QUAD: (16.633, 15.879, 15.305, 14.955, 14.998),
  FLASH: (16.581, 15.935, 15.525, 15.259, 15.109),
}
# Figure 1: FLASH's training speed-up over Transformer++ at equal quality (Wiki-40B, TPU-v4).
FIGURE1_SPEEDUP = dict(zip(PAPER_LENGTHS, (1.2, 1.3, 1.6, 2.7, 4.9)))
FIGURE6_CLAIM = (
  "\"FLASH-Quad reduces the training time of Transformer++ by 1.2x to 2.5x and FLASH cuts the "
  "compute cost by 1.2x to 4.9x while reaching a similar perplexity as Transformer++\" "
  "(Section 4.2, on Figures 6(b)-6(f))"
)


def table13(values: dict[str, tuple[float, ...]], model: str, seq_len: int) -> float | None:
  if model not in values or seq_len not in PAPER_LENGTHS:
    return None
  return values[model][PAPER_LENGTHS.index(seq_len)]


def nearest_paper_length(seq_len: int) -> int:
  return min(PAPER_LENGTHS, key=lambda t: abs(np.log2(t / seq_len)))


def load_average() -> str:
  try:
    one, five, _ = os.getloadavg()
  except OSError:
    return "unknown"
  return f"{one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def accumulation(tokens_per_step: int, devices: int) -> int:
  """Micro-batches per step so that no device holds more than MICRO_TOKENS tokens at a time."""
  return max(1, tokens_per_step // (MICRO_TOKENS * devices))


@dataclasses.dataclass(frozen=True)
class Model:
  key: str  # FLASH, QUAD, TPP or TP
  spec: str  # config file[:arg]
  overrides: tuple[str, ...] = ()
  size: str = ""  # its size in words, for the setting


# =============================================================================== flash_latency


@dataclasses.dataclass(frozen=True)
class LatencySize:
  seq_lens: tuple[int, ...]
  tokens_per_step: int
  steps: int
  warmup: int
  overrides: tuple[str, ...]
  models: tuple[Model, ...]
  what: str  # the models in words, for the setting


# Table 9's Wiki-40B LM models (110M-112M, LayerNorm), timed at 2^18 tokens per step as Table 13,
# on one device (32 micro-batches of MICRO_TOKENS).
FULL_LATENCY = LatencySize(
  PAPER_LENGTHS,
  PAPER_TOKENS_PER_STEP,
  steps=5,
  warmup=2,
  overrides=(),
  models=(
    Model(FLASH, "configs/c4/flash.py:lm", size="24 GAUs, d 768, e 1536, s 128, chunk 256"),
    Model(QUAD, "configs/c4/flash_quad.py:lm", size="24 GAUs, d 768, e 1536, s 128"),
    Model(TPP, "configs/c4/transformer.py:lm,plusplus", size="12+12 layers, d 768, 12 heads, GLU 2048"),
    Model(TP, "configs/c4/transformer.py:lm,plus", size="12+12 layers, d 768, 12 heads, MLP 3072"),
  ),
  what="Table 9's Wiki-40B LM models (110M-112M parameters, vocabulary 32128)",
)
# CPU-sized models (about 1.78M parameters each, two GAUs per transformer layer),
# at 4,096 tokens per step: batch 8 at T = 512 down to 1 at T = 4096, Table 11's batch 1.
DEFAULT_LATENCY = LatencySize(
  (512, 1024, 2048, 4096),
  4096,
  steps=3,
  warmup=1,
  overrides=("model.vocab_size=256", "model.d_model=256"),
  models=(
    Model(FLASH, "configs/c4/flash.py:lm", ("model.num_layers=4",), "4 GAUs, d 256, e 512, s 128, chunk 256"),
    Model(QUAD, "configs/c4/flash_quad.py:lm", ("model.num_layers=4",), "4 GAUs, d 256, e 512, s 128"),
    Model(
      TPP,
      "configs/c4/transformer.py:lm,plusplus",
      ("model.num_layers=2", "model.num_heads=4", "model.d_ff=768"),
      "2 layers, d 256, 4 heads, GLU 768",
    ),
    Model(
      TP,
      "configs/c4/transformer.py:lm,plus",
      ("model.num_layers=2", "model.num_heads=4", "model.d_ff=1152"),
      "2 layers, d 256, 4 heads, MLP 1152",
    ),
  ),
  what="CPU-sized models (about 1.77M parameters each, vocabulary 256)",
)


def flash_latency(ctx: Context) -> Result:
  size = FULL_LATENCY if ctx.full else DEFAULT_LATENCY
  load = load_average()
  overrides = list(size.overrides)
  accum = accumulation(size.tokens_per_step, 1)  # the harness times one device
  if accum > 1:
    overrides.append(f"train.grad_accum_steps={accum}")
  variants = [Variant(m.key, (f"config={m.spec}", *m.overrides)) for m in size.models]
  rows, peak = train_step.run(
    size.models[0].spec,
    overrides=overrides,
    variants=variants,
    seq_lens=size.seq_lens,
    tokens_per_batch=size.tokens_per_step,
    steps=size.steps,
    warmup=size.warmup,
    log=ctx.log,
  )
  load = f"{load} at the start and {load_average()} at the end"
  ctx.workdir.mkdir(parents=True, exist_ok=True)
  (ctx.workdir / "rows.json").write_text(json.dumps({"matmul_flops_per_s": peak, "rows": rows}, indent=1) + "\n")
  by = {(r["variant"], r["seq_len"]): r for r in rows}
  ms = {k: r["step_ms"] for k, r in by.items() if r["status"] == "ok"}
  keys = [m.key for m in size.models]

  table = []
  for t in size.seq_lens:
    for key in keys:
      r = by[(key, t)]
      ok = r["status"] == "ok"
      t11 = TABLE11_MS.get(key, {}).get(t)
      t11_cell = (
        "OOM"
        if t in TABLE11_BATCH and key in TABLE11_MS and t11 is None
        else None
        if t11 is None
        else f"{t11:.1f} (batch {TABLE11_BATCH[t]})"
      )
      table.append(
        [
          t,
          r["batch_size"],
          LABELS[key],
          f"{r['num_params']:,}",
          fmt(r["step_ms"], ",.1f") if ok else r["status"],
          fmt(r["tokens_per_s"], ",.0f") if ok else None,
          ratio(ms.get((TPP, t)), ms.get((key, t))),
          fmt(table13(TABLE13_LATENCY, key, t), ".1f"),
          ratio(table13(TABLE13_LATENCY, TPP, t), table13(TABLE13_LATENCY, key, t)),
          t11_cell,
          ratio(TABLE11_MS[TPP].get(t), t11) if key in TABLE11_MS else None,
        ]
      )
  header = [
    "T",
    "batch",
    "model",
    "params",
    "ours: ms / step",
    "ours: tokens/s",
    "ours: speed-up vs Transformer++",
    "paper Table 13 latency (64 TPU-v4 cores)",
    "Table 13 speed-up",
    "paper Table 11 ms (V100)",
    "Table 11 speed-up",
  ]
  first, last = size.seq_lens[0], size.seq_lens[-1]
  growth_rows = []
  for key in keys:
    t11 = TABLE11_MS.get(key, {})
    growth_rows.append(
      [
        LABELS[key],
        ratio(ms.get((key, last)), ms.get((key, first))),
        ratio(table13(TABLE13_LATENCY, key, last), table13(TABLE13_LATENCY, key, first)),
        ratio(t11.get(last), t11.get(first)),
      ]
    )
  t11 = "paper Table 11"
  if first in TABLE11_BATCH and last in TABLE11_BATCH and TABLE11_BATCH[first] * first != TABLE11_BATCH[last] * last:
    t11 += (
      f" ({TABLE11_BATCH[first] * first:,} -> {TABLE11_BATCH[last] * last:,} tokens per step, batch "
      f"{TABLE11_BATCH[first]} -> {TABLE11_BATCH[last]})"
    )
  growth = markdown_table([f"step time at T = {last} / at T = {first}", "ours", "paper Table 13", t11], growth_rows)
  markdown = markdown_table(header, table) + "\n\n" + growth

  setting = (
    f"Causal-LM train steps (forward, backward, AdamW update) of the trainer's jitted step "
    f"(`scripts/bench.py`, random tokens) at {size.tokens_per_step:,} tokens per step: the batch is "
    f"{size.tokens_per_step:,} / T"
    + (f", accumulated over {accum} micro-batches on one device" if accum > 1 else "")
    + f". Each time is the median of {size.steps} steps after {size.warmup} warm-up step(s), compile apart. "
    f"Models: {size.what}: "
    + "; ".join(f"{LABELS[m.key]} `{m.spec}` ({m.size})" for m in size.models)
    + ". "
    + (
      "The paper's Table 13 trains 110M models at 2^18 tokens per step on 64 TPU-v4 cores; Table 11 "
      "times FLASH and Transformer++ on one V100 at batch 4, 2, 1, 1 for T = 512-4096. Absolute "
      "times do not compare across machines; the speed-up columns (Transformer++'s step time / the "
      "model's) do. "
      f"Load average: {load}; float32 matmul yardstick {peak / 1e9:,.1f} GFLOP/s."
    )
  )
  return Result(setting=setting, markdown=markdown, plots=[latency_plot(ctx, size, ms, keys)])


def latency_plot(ctx: Context, size: LatencySize, ms: dict, keys: Sequence[str]):
  fig, (ax_ms, ax_speed) = figure(2)
  for key in keys:
    lens = [t for t in size.seq_lens if (key, t) in ms]
    ax_ms.plot(lens, [ms[(key, t)] for t in lens], "o-", color=COLORS[key], label=LABELS[key])
    if key == TPP:
      continue  # 1 by definition: the gray line
    both = [t for t in lens if (TPP, t) in ms]
    ax_speed.plot(
      both, [ms[(TPP, t)] / ms[(key, t)] for t in both], "o-", color=COLORS[key], label=f"{LABELS[key]} (ours)"
    )
    paper = [t for t in PAPER_LENGTHS if size.seq_lens[0] <= t <= size.seq_lens[-1]]
    ax_speed.plot(
      paper,
      [table13(TABLE13_LATENCY, TPP, t) / table13(TABLE13_LATENCY, key, t) for t in paper],
      "s--",
      color=COLORS[key],
      alpha=0.6,
      label=f"{LABELS[key]} (Table 13)",
    )
  for ax in (ax_ms, ax_speed):
    ax.set_xscale("log", base=2)
    ax.set_xticks(size.seq_lens, [str(t) for t in size.seq_lens])
    ax.set_xlabel(f"context length T ({size.tokens_per_step:,} tokens per step)")
    ax.grid(alpha=0.3)
  ax_ms.set_yscale("log")
  ax_ms.set_ylabel("train step, ms (ours)")
  ax_ms.legend(fontsize=8)
  ax_speed.axhline(1.0, color="gray", lw=0.8)
  ax_speed.set_ylabel("speed-up vs Transformer++")
  ax_speed.legend(fontsize=7, ncol=2)
  return save_plot(ctx, fig, "flash_latency")


# =============================================================================== flash_quality


@dataclasses.dataclass(frozen=True)
class QualitySize:
  seq_lens: tuple[int, ...]
  tokens_per_step: int
  steps: int
  overrides: tuple[str, ...]  # training settings for every model
  models: tuple[Model, ...]
  warmup_fraction: float = 0.0  # > 0: warm-up steps as a fraction of the steps (else the config's)


# Figure 6's setting (Table 7, Table 9's models): 2^18 tokens per step, 125k steps, the configs'
# optimizer (lr 7e-4, 10k warm-up, linear decay) and evaluation every 5,000 steps.
FULL_QUALITY = QualitySize(
  PAPER_LENGTHS,
  PAPER_TOKENS_PER_STEP,
  steps=125_000,
  overrides=("train.test_at_end=False",),
  models=FULL_LATENCY.models[:3],
)
# ~0.18M parameters each, 240 steps of 8 x 256 bytes (about a quarter of the sample's training split,
# so no batch is seen twice). s = 32 = d / 2 (the paper has s <= d): two GAUs then score with the same
# width as one Transformer++ layer's four heads of 16. No evaluation inside the loop, so the
# trainer's train time is training alone.
DEFAULT_QUALITY = QualitySize(
  (256,),
  2048,
  steps=240,
  overrides=(
    "model.d_model=64",
    "optim.lr=3e-3",
    "train.log_every=10",
    "train.eval_every=0",
    "train.eval_batches=16",
    "train.checkpoint_every=0",
    "train.test_at_end=False",
  ),
  models=(
    Model(
      FLASH,
      "configs/c4/flash.py:lm",
      ("model.num_layers=6", "model.qk_dim=32", "model.chunk=64"),
      "6 GAUs, d 64, e 128, s 32, chunk 64",
    ),
    Model(QUAD, "configs/c4/flash_quad.py:lm", ("model.num_layers=6", "model.qk_dim=32"), "6 GAUs, d 64, e 128, s 32"),
    Model(
      TPP,
      "configs/c4/transformer.py:lm,plusplus",
      ("model.num_layers=3", "model.num_heads=4", "model.d_ff=200"),
      "3 layers, d 64, 4 heads, GLU 200",
    ),
  ),
  warmup_fraction=0.1,
)


def c4_data(ctx: Context, full: bool) -> tuple[list[str], str]:
  """Data overrides for the C4 folder under ctx.data_dir, and a sentence saying what they read."""
  folder = data_path(ctx, "c4")
  overrides = [f"data.dir={folder}"]
  if full and any(folder.glob("c4-train.*.json.gz")):
    what = "C4's train shards, validated on its validation shards"
  else:  # the validation-only sample: split by document
    overrides += [
      "data.train_files=c4-validation.*.json.gz[:90%]",
      "data.validation_files=c4-validation.*.json.gz[90%:]",
      "data.test_files=c4-validation.*.json.gz[90%:]",
    ]
    what = (
      "the C4 validation shard(s) under --data_dir/c4, split by document: the first 90% for training, "
      "the last 10% for validation"
    )
  if full and (folder / "sentencepiece.model").exists():
    what += ", T5's SentencePiece vocabulary (32128 embedding rows)"
  else:
    overrides += ["data.tokenizer=bytes", "model.vocab_size=258"]
    what += ", UTF-8 bytes (258 ids with pad and eos)"
  return overrides, what


def loss_at_time(times: Sequence[float], losses: Sequence[float], target: float) -> float | None:
  """The first time the curve reaches `target` or below (linear between points); None if never."""
  for i, (t, loss) in enumerate(zip(times, losses)):
    if loss <= target:
      if i == 0:
        return t
      t0, l0 = times[i - 1], losses[i - 1]
      return t0 + (t - t0) * (l0 - target) / (l0 - loss)
  return None


def flash_quality(ctx: Context) -> Result:
  size = FULL_QUALITY if ctx.full else DEFAULT_QUALITY
  data, data_text = c4_data(ctx, ctx.full)
  accum = accumulation(size.tokens_per_step, jax.device_count()) if ctx.full else 1
  if accum > 1:
    data.append(f"train.grad_accum_steps={accum}")
  load = load_average()
  runs = {}  # (key, T) -> summary, times, train losses, val steps / losses
  for t in size.seq_lens:
    batch = size.tokens_per_step // t
    for m in size.models:
      name = f"{m.key.replace('+', 'p')}_T{t}"
      overrides = [
        *data,
        *size.overrides,
        f"train.seq_len={t}",
        f"train.batch_size={batch}",
        f"train.steps={size.steps}",
        *m.overrides,
      ]
      if size.warmup_fraction:
        overrides.append(f"optim.warmup_steps={max(1, round(size.warmup_fraction * size.steps))}")
      summary = train(ctx, name, m.spec, overrides)
      per_step = summary.get("train_time_s", float("nan")) / size.steps
      steps, losses = curve(ctx, name, "train_loss")
      val_steps, val_losses = curve(ctx, name, "val_loss")
      runs[(m.key, t)] = dict(
        summary=summary,
        batch=batch,
        times=[s * per_step for s in steps],
        losses=losses,
        val_times=[s * per_step for s in val_steps],
        val_losses=val_losses,
      )

  unit = next(
    (
      k.removeprefix("val_bits_per_") for k in runs[(TPP, size.seq_lens[0])]["summary"] if k.startswith("val_bits_per_")
    ),
    "token",
  )
  rows = []
  for t in size.seq_lens:
    base = runs[(TPP, t)]
    target = base["losses"][-1]
    for m in size.models:
      r = runs[(m.key, t)]
      s = r["summary"]
      # Transformer++ reaches its own final loss at its end by definition (a noisy earlier window may dip below).
      reach = s.get("train_time_s") if m.key == TPP else loss_at_time(r["times"], r["losses"], target)
      rows.append(
        [
          t,
          LABELS[m.key],
          f"{s['num_params']:,}",
          f"{size.steps:,} x {r['batch']} x {t}",
          fmt(s.get("train_time_s"), ",.0f"),
          fmt(s.get("tokens_per_s"), ",.0f"),
          fmt(s.get("val_loss"), ".3f"),
          fmt(s.get(f"val_bits_per_{unit}"), ".3f"),
          fmt(s["val_loss"] - base["summary"]["val_loss"], "+.3f"),
          fmt(r["losses"][-1], ".3f"),
          fmt(reach, ",.0f") if reach is not None else "not reached",
          ratio(base["summary"].get("train_time_s"), reach) if reach else "-",
        ]
      )
  ours = markdown_table(
    [
      "T",
      "model",
      "params",
      "steps x batch x T",
      "train time s",
      "tokens/s",
      f"val loss (nats/{unit})",
      f"bits/{unit}",
      "val loss - Transformer++",
      "final train loss",
      "s to reach Transformer++'s final train loss",
      "speed-up at equal loss",
    ],
    rows,
  )
  paper_rows = []
  for t in size.seq_lens:
    pt = nearest_paper_length(t)
    for m in size.models:
      speed = {FLASH: f"{FIGURE1_SPEEDUP[pt]}x (Figure 1)", QUAD: "1.2x-2.5x over 512-8192 (Section 4.2)", TPP: "1x"}[
        m.key
      ]
      paper_rows.append(
        [
          pt,
          LABELS[m.key],
          fmt(table13(TABLE13_PPLX, m.key, pt), ".3f"),
          fmt(table13(TABLE13_LATENCY, m.key, pt), ".1f"),
          speed,
        ]
      )
  paper = markdown_table(
    [
      "paper T",
      "model",
      "Table 13 perplexity (per token)",
      "Table 13 latency (64 TPU-v4 cores)",
      "speed-up over Transformer++ at equal quality",
    ],
    paper_rows,
  )
  markdown = "Ours:\n\n" + ours + "\n\nThe paper (Wiki-40B, 110M models, 125k steps of 2^18 tokens):\n\n" + paper

  setting = (
    f"Causal LM on {data_text}, with the real trainer (`lra_core.train`). Models of about "
    "equal size: "
    + "; ".join(f"{LABELS[m.key]} `{m.spec}` ({m.size})" for m in size.models)
    + f". Each trains {size.steps:,} steps of {size.tokens_per_step:,} tokens"
    + (f" ({accum} accumulated micro-batches)" if accum > 1 else "")
    + " with the configs' optimizer "
    "(the paper's AdamW, b2 .999, eps 1e-6, weight decay 0.01, clipping 0.1, linear decay to 0)"
    + (
      ""
      if ctx.full
      else f", lr 3e-3 with {round(size.warmup_fraction * size.steps)} warm-up steps, one "
      "after the other on the whole machine"
    )
    + ". Training time is the trainer's `train_time_s` (compile apart); a logged training loss is placed "
    "at step x train_time_s / steps. The figure of merit of Figure 6 is quality against training cost; "
    f"the paper's claim: {FIGURE6_CLAIM}. Load average when the table started: {load}."
  )
  return Result(setting=setting, markdown=markdown, plots=[quality_plot(ctx, size, runs, unit)])


def quality_plot(ctx: Context, size: QualitySize, runs: dict, unit: str):
  fig, axes = figure(len(size.seq_lens))
  for ax, t in zip(axes, size.seq_lens):
    for m in size.models:
      r = runs[(m.key, t)]
      ax.plot(r["times"], r["losses"], "-", color=COLORS[m.key], label=f"{LABELS[m.key]} train")
      ax.plot(r["val_times"], r["val_losses"], "o", color=COLORS[m.key], label=f"{LABELS[m.key]} validation")
    ax.set_xlabel("training wall time, s")
    ax.set_ylabel(f"loss, nats/{unit}")
    ax.set_title(f"T = {t}, {size.tokens_per_step:,} tokens per step", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return save_plot(ctx, fig, "flash_quality")
