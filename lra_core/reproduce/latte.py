"""The Latte paper's tables: the attention core's time and memory (Figures 8-10) and LRA (Table 3).

`latte_runtime` times the attention cores alone with lra_core/bench/cores.py: by sequence length in
Figure 8's setting (B 2, H 4, D 128, L 128) and by number of latent states in Figure 10's (B 4,
H 4, D 512). `latte_lra` trains bidirectional Latte, Latte-Macchiato and the Transformer baseline
(and, at --full, Latte-RGLRU++ too) on the LRA data under --data_dir/lra with the real trainer.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import jax
import numpy as np

from lra_core import data as data_lib
from lra_core.bench import cores
from lra_core.kernels import latte as latte_kernels
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, data_path, figure, fmt, load_config, pyplot, save_plot, train

# =============================================================================== latte_runtime

ATTENTION = "causal_attention"
CAUSAL_LATTE = "causal_latte"
TOKEN_SCAN = "causal_latte:chunk=1"  # the paper's token-by-token recurrence (eq. 12)
BIDIRECTIONAL = "bidirectional_latte"
BY_LENGTH_CORES = (ATTENTION, CAUSAL_LATTE, TOKEN_SCAN, BIDIRECTIONAL)
FIGURE8 = dict(batch_size=2, heads=4, width=128, latents=128)  # Figure 8's caption: B 2, H 4, D 128, L 128
FIGURE10 = dict(batch_size=4, heads=4, width=512)  # Appendix C.1: T 5000, D 512, H 4, B 4
FIGURE10_LATENTS = (64, 128, 256, 512)  # "from 64 to 512"
# Table 8's training complexity (time / memory) of each core; the vectorised causal Latte is O(TLD) in both.
TABLE8 = {
  ATTENTION: "O(T^2 D) / O(T^2 D)",
  CAUSAL_LATTE: "O(TLD) / O(TLD)",
  TOKEN_SCAN: "O(TLD) / O(TLD)",
  BIDIRECTIONAL: "O(TLD) / O(TL + LD)",
}
PAPER_CROSSOVER = 1600  # Appendix C: "Causal Latte is slower than Standard Causal Attention until sequence length 1600"


@dataclasses.dataclass(frozen=True)
class RuntimeSize:
  seq_lens: tuple[int, ...]  # Figures 8-9
  latent_seq_len: int  # Figure 10's T
  steps: int
  warmup: int


# The figures' x values are not in the paper's text: the full lengths span Figure 9's crossover
# (1600) and the long range of Figure 8 (the quadratic core runs out of memory where it must).
FULL_RUNTIME = RuntimeSize((256, 512, 1024, 1600, 2048, 4096, 8192, 16384, 32768, 65536), 5000, steps=100, warmup=5)
DEFAULT_RUNTIME = RuntimeSize((512, 1024, 1600, 2048, 4096, 8192), 2048, steps=3, warmup=1)


def _ok(rows: Sequence[dict], core: str) -> dict[int, dict]:
  return {r["seq_len"]: r for r in rows if r["variant"] == core and r["status"] == "ok"}


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
  """Least-squares slope of log y against log x (the exponent of a power law); None below 2 points."""
  if len(xs) < 2:
    return None
  return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def crossover(rows: Sequence[dict], core: str, base: str = ATTENTION) -> int | None:
  """The shortest length from which `core` is faster than `base` at every longer length measured
  (a `base` that ran out of memory counts as slower); None where `core` is slower at the longest."""
  mine, theirs = _ok(rows, core), _ok(rows, base)
  lengths = sorted({r["seq_len"] for r in rows})
  start = None
  for t in reversed(lengths):
    if t not in mine:
      break
    if t in theirs and theirs[t]["ms"] <= mine[t]["ms"]:
      break
    start = t
  return start


def _crossover_text(rows: Sequence[dict], core: str) -> str:
  lengths = sorted({r["seq_len"] for r in rows})
  mine, theirs = _ok(rows, core), _ok(rows, ATTENTION)
  t = crossover(rows, core)
  if t is None:
    return f"slower at T = {lengths[-1]}, the longest measured"
  speedup = f"{theirs[t]['ms'] / mine[t]['ms']:.1f}x faster" if t in theirs else "attention out of memory"
  if t == lengths[0]:
    return f"faster at every length measured, from T = {t} ({speedup} there)"
  before = lengths[lengths.index(t) - 1]
  slower = f"{mine[before]['ms'] / theirs[before]['ms']:.1f}x slower" if before in mine and before in theirs else "-"
  return f"from T = {t} ({speedup}; {slower} at T = {before})"


def _count_text(rows: Sequence[dict], core: str, key: str) -> str:
  """'yes/no: at n of N lengths (a-b x less)' for `core` beating attention on `key` (ms or memory)."""
  mine, theirs = _ok(rows, core), _ok(rows, ATTENTION)
  both = [t for t in sorted(mine) if t in theirs and mine[t][key] and theirs[t][key]]
  if not both:
    return "-"
  ratios = [theirs[t][key] / mine[t][key] for t in both]
  wins = sum(x > 1 for x in ratios)
  return (
    f"{'yes' if wins == len(both) else 'no'}: at {wins} of {len(both)} lengths "
    f"({min(ratios):.1f}x to {max(ratios):.1f}x less)"
  )


def _slopes(rows: Sequence[dict], core: str) -> tuple[float | None, float | None, str]:
  """Time and memory exponents over the three longest lengths where `core` ran."""
  ok = _ok(rows, core)
  lengths = sorted(ok)[-3:]
  time = loglog_slope(lengths, [ok[t]["ms"] for t in lengths])
  mem = [t for t in lengths if ok[t]["memory_bytes"]]
  memory = loglog_slope(mem, [ok[t]["memory_bytes"] for t in mem])
  where = f"T = {lengths[0]}..{lengths[-1]}" if lengths else "-"
  return time, memory, where


def latent_sweep(size: RuntimeSize, log) -> list[dict]:
  """Figure 10: standard causal attention once (it has no latents), then both Latte cores per L."""
  timing = dict(steps=size.steps, warmup=size.warmup, log=log, seq_lens=[size.latent_seq_len], **FIGURE10)
  rows = [dict(r, latents=None) for r in cores.run([ATTENTION], latents=FIGURE10_LATENTS[0], **timing)]
  for latents in FIGURE10_LATENTS:
    for r in cores.run([CAUSAL_LATTE, BIDIRECTIONAL], latents=latents, **timing):
      rows.append(dict(r, variant=f"{r['variant']}, L={latents}", core=r["variant"], latents=latents))
  return rows


def _latent_claims(rows: Sequence[dict], seq_len: int) -> list[list[str]]:
  attention = next((r for r in rows if r["variant"] == ATTENTION and r["status"] == "ok"), None)
  top = {r["core"]: r for r in rows if r.get("latents") == FIGURE10_LATENTS[-1] and r["status"] == "ok"}
  causal = top.get(CAUSAL_LATTE)
  if attention and causal:
    ratio = attention["ms"] / causal["ms"]
    ours = (f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower") + f" (T = {seq_len})"
  else:
    ours = "-"
  claims = [
    [
      "causal Latte vs standard causal attention at L = D = 512 (Appendix C.1, Figure 10)",
      "slightly slower (T = 5000, GPU)",
      ours,
    ]
  ]
  for core, name in ((CAUSAL_LATTE, "causal"), (BIDIRECTIONAL, "bidirectional")):
    points = [(r["latents"], r["ms"]) for r in rows if r.get("core") == core and r["status"] == "ok"]
    slope = loglog_slope([p[0] for p in points], [p[1] for p in points])
    claims.append([f"{name} Latte time against L, log-log slope (Table 8: O(TLD))", "1 (linear in L)", fmt(slope)])
  return claims


COLORS = {ATTENTION: "C0", CAUSAL_LATTE: "C1", TOKEN_SCAN: "C2", BIDIRECTIONAL: "C3"}


def _runtime_plot(ctx: Context, by_length: Sequence[dict], by_latents: Sequence[dict], seq_len: int):
  fig, (time_ax, mem_ax, lat_ax) = figure(3, width=4.6)
  for core in BY_LENGTH_CORES:
    ok = _ok(by_length, core)
    lengths = sorted(ok)
    time_ax.plot(lengths, [ok[t]["ms"] for t in lengths], "o-", color=COLORS[core], label=core)
    mem = [t for t in lengths if ok[t]["memory_bytes"]]
    mem_ax.plot(mem, [ok[t]["memory_bytes"] / 2**20 for t in mem], "o-", color=COLORS[core], label=core)
  time_ax.axvline(PAPER_CROSSOVER, color="gray", ls=":", label="paper's crossover (GPU)")
  time_ax.set(ylabel="ms (median)", title="time (Figures 8a, 9a)")
  mem_ax.set(ylabel="XLA planned MiB", title="memory (Figures 8b, 9b)")
  for core in (CAUSAL_LATTE, BIDIRECTIONAL):
    points = sorted((r["latents"], r["ms"]) for r in by_latents if r.get("core") == core and r["status"] == "ok")
    lat_ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=COLORS[core], label=core)
  attention = [r["ms"] for r in by_latents if r["variant"] == ATTENTION and r["status"] == "ok"]
  if attention:
    lat_ax.axhline(attention[0], color=COLORS[ATTENTION], ls="--", label=ATTENTION)
  lat_ax.set(ylabel="ms (median)", title=f"time vs L, T = {seq_len} (Figure 10)")
  lengths = sorted({r["seq_len"] for r in by_length})
  for ax, xs, xlabel in (
    (time_ax, lengths, "sequence length T"),
    (mem_ax, lengths, "sequence length T"),
    (lat_ax, FIGURE10_LATENTS, "latent states L"),
  ):
    ax.set(xscale="log", yscale="log", xlabel=xlabel)
    ax.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 4 else 0)
    ax.xaxis.set_minor_locator(pyplot().NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
  return save_plot(ctx, fig, "latte_runtime")


def latte_runtime(ctx: Context) -> Result:
  size = FULL_RUNTIME if ctx.full else DEFAULT_RUNTIME
  timing = dict(steps=size.steps, warmup=size.warmup, log=ctx.log)
  by_length = cores.run(BY_LENGTH_CORES, seq_lens=size.seq_lens, **FIGURE8, **timing)
  by_latents = latent_sweep(size, ctx.log)
  platform, chunk = jax.default_backend(), latte_kernels.default_chunk()

  claims = [
    [
      "length from which causal Latte is faster than standard causal attention (Appendix C, Figure 9)",
      f"{PAPER_CROSSOVER} (slower below; GPU)",
      _crossover_text(by_length, CAUSAL_LATTE),
    ],
    ["the same for the token-by-token scan (`chunk=1`)", f"{PAPER_CROSSOVER}", _crossover_text(by_length, TOKEN_SCAN)],
    [
      "bidirectional Latte faster than standard causal attention at any length (Figure 9)",
      "yes",
      _count_text(by_length, BIDIRECTIONAL, "ms"),
    ],
    [
      "bidirectional Latte uses less memory at any length (Figure 9)",
      "yes",
      _count_text(by_length, BIDIRECTIONAL, "memory_bytes"),
    ],
    [
      "causal Latte uses less memory than standard causal attention (Figure 8b)",
      "yes (linear vs quadratic)",
      _count_text(by_length, CAUSAL_LATTE, "memory_bytes"),
    ],
  ] + _latent_claims(by_latents, size.latent_seq_len)
  growth = []
  for core in BY_LENGTH_CORES:
    time, memory, where = _slopes(by_length, core)
    growth.append([f"`{core}`", TABLE8[core], 2 if core == ATTENTION else 1, fmt(time), fmt(memory), where])
  markdown = "\n\n".join(
    [
      "**Paper's statements (Appendix C) against ours**",
      markdown_table(["claim (where)", "paper", "ours"], claims),
      "**Growth with T: log-log slope of time and memory (Table 8's complexity)**",
      markdown_table(
        ["core", "paper: time / memory (Table 8)", "paper exponent", "ours: time", "ours: memory", "fitted over"],
        growth,
      ),
      f"**By sequence length (Figures 8-9: B {FIGURE8['batch_size']}, H {FIGURE8['heads']}, "
      f"D {FIGURE8['width']}, L {FIGURE8['latents']}; speed-up vs `{ATTENTION}`)**",
      cores.format_table(by_length),
      f"**By latent states (Figure 10: T {size.latent_seq_len}, B {FIGURE10['batch_size']}, H {FIGURE10['heads']}, "
      f"D {FIGURE10['width']}; speed-up vs `{ATTENTION}`, which has no latents)**",
      cores.format_table(by_latents),
    ]
  )
  setting = (
    "The attention core alone, as the paper's Appendix C times it (the transform x~ of the tokens, "
    "forward only), with `scripts/bench.py --cores` on random float32 inputs [B,T,H,*]. Figures 8-9: "
    f"batch 2, 4 heads, D = 128 and L = 128 in total (32 per head), T = "
    f"{', '.join(map(str, size.seq_lens))}. Figure 10: T = {size.latent_seq_len}"
    + ("" if size.latent_seq_len == 5000 else " (the paper: 5000)")
    + f", batch 4, 4 heads, D = 512, L = {', '.join(map(str, FIGURE10_LATENTS))}. Cores: `{ATTENTION}` "
    "(softmax over the masked T x T scores, `kernels.dot_product_attention`), "
    f"`{CAUSAL_LATTE}` (Def. 2 as a scan over chunks of {chunk} tokens, exact inside a chunk; the default "
    f"on {platform}), `{TOKEN_SCAN}` (the paper's token-by-token recurrence; not unrolled, the paper "
    f"unrolls 256 steps) and `{BIDIRECTIONAL}` (Def. 1). Each time is the median of {size.steps} calls after "
    f"{size.warmup} warm-up call(s) (the paper averages 100); memory is XLA's plan for the call. "
    "The paper's sequential (linear-memory) standard attention is not among our cores. "
    + (
      "The default size runs in minutes on a CPU; --full runs T from 256 to 65536 and Figure 10 at "
      "T = 5000 with 100 timed calls (an accelerator's size)."
      if not ctx.full
      else "The figures' x values are not in the paper's text: these lengths span Figure 9's crossover and "
      "Figure 8's range."
    )
  )
  plot = _runtime_plot(ctx, by_length, by_latents, size.latent_seq_len)
  return Result(setting=setting, markdown=markdown, plots=[plot])


# =============================================================================== latte_lra

# Table 3 (test accuracy, %); "Bid. Attention" is the Transformer baseline row.
PAPER_TABLE3 = {
  "Bid. Attention": dict(listops=36.37, text=64.27, retrieval=57.46, image=42.44, pathfinder=71.40),
  "Latte": dict(listops=40.18, text=64.51, retrieval=73.39, image=47.55, pathfinder=75.61),
  "Latte-RGLRU++": dict(listops=56.7, text=83.85, retrieval=81.07, image=57.61, pathfinder=72.13),
  "Latte-RGLRU-SWA++": dict(listops=61.39, text=85.8, retrieval=87.67, image=70.19, pathfinder=73.69),
}


@dataclasses.dataclass(frozen=True)
class LraModel:
  name: str  # ours
  paper_row: str  # Table 3's row
  spec: str  # config, {task} filled in
  small: tuple[str, ...] = ()  # default-size overrides of this model only


LATTE = LraModel("Latte", "Latte", "configs/lra/{task}/latte.py")
RGLRU = LraModel("Latte-RGLRU++", "Latte-RGLRU++", "configs/lra/{task}/latte.py:latte_rglru++")
MACCHIATO = LraModel("Latte-Macchiato", "Latte-RGLRU-SWA++", "configs/lra/{task}/latte.py:latte_rglru_swa++")
TRANSFORMER = LraModel(
  "Transformer",
  "Bid. Attention",
  "configs/lra/{task}/transformer.py",
  ("model.attention_dropout=0.0", "model.head_dim=0"),
)
FULL_MODELS = (LATTE, RGLRU, MACCHIATO, TRANSFORMER)


@dataclasses.dataclass(frozen=True)
class LraTask:
  name: str  # configs/lra/<name>/
  title: str  # Table 3's column
  data: str  # folder under <data_dir>/lra
  latents: int = 0  # L of the default-size Latte models
  small: tuple[str, ...] = ()  # default-size data and length overrides
  steps: int = 0  # default-size steps ...
  batch_size: int = 0  # ... of this many sequences
  models: tuple[LraModel, ...] = ()  # run at the default size (none: --full only)


# Latte-Macchiato runs at the default size on Text only (its step costs about 5x Latte's on a CPU,
# and its ListOps run at this budget stayed at the majority class), so that the tasks fit the budget.
TASKS = (
  LraTask(
    "listops", "ListOps", "listops", 40, ("train.seq_len=512",), steps=60, batch_size=8, models=(LATTE, TRANSFORMER)
  ),
  LraTask(
    "text", "Text", "imdb", 64, ("train.seq_len=256",), steps=100, batch_size=16, models=(LATTE, MACCHIATO, TRANSFORMER)
  ),
  LraTask(
    "image",
    "Image",
    "cifar10",
    40,
    ("data.image_size=16", "train.seq_len=256", "data.test_split=test[:1000]"),
    steps=100,
    batch_size=16,
    models=(LATTE, TRANSFORMER),
  ),
  LraTask("retrieval", "Retrieval", "retrieval"),
  LraTask("pathfinder", "Pathfinder", "pathfinder32"),
)

# The default size: every model the same: 2 layers, d 64, 4 heads, MLP 128, mean pooling, no dropout, AdamW cosine.
SMALL_MODEL = (
  "model.d_model=64",
  "model.num_layers=2",
  "model.num_heads=4",
  "model.d_ff=128",
  "model.classifier_hidden=64",
  "model.dropout=0.0",
  "model.pooling=mean",
)
SMALL_TRAIN = (
  "optim.name=adamw",
  "optim.lr=1e-3",
  "optim.schedule=cosine",
  "optim.decay_steps=0",
  "optim.min_lr_ratio=0.0",
  "optim.b1=0.9",
  "optim.b2=0.999",
  "optim.eps=1e-8",
  "optim.weight_decay=0.01",
  "optim.weight_decay_schedule=lr",
  "train.eval_every=0",
  "train.checkpoint_every=0",
  "train.eval_batches=1",
  "train.eval_batch_size=50",
  "train.log_every=10",
  "mesh.data=1",
)


def lra_overrides(task: LraTask, model: LraModel, lra_dir: pathlib.Path, full: bool) -> list[str]:
  """The config overrides of one run: the data folder, and at the default size the small model and budget."""
  overrides = [f"data.dir={lra_dir / task.data}"]
  if full:
    return overrides
  overrides += [
    *SMALL_MODEL,
    *SMALL_TRAIN,
    *task.small,
    *model.small,
    f"train.steps={task.steps}",
    f"train.batch_size={task.batch_size}",
    f"optim.warmup_steps={max(1, task.steps // 10)}",
  ]
  if model.name != TRANSFORMER.name:
    overrides.append(f"model.num_latents={task.latents}")
  return overrides


def majority_accuracy(spec: str, overrides: Sequence[str]) -> tuple[float, int]:
  """(share of the most common label, examples) of the test split the trainer evaluates."""
  source = data_lib.make_source(load_config(spec, list(overrides)), "test")
  labels = np.asarray([int(source[i]["targets"]) for i in range(len(source))])
  return float(np.bincount(labels).max() / len(labels)), len(labels)


def latte_lra(ctx: Context) -> Result:
  lra_dir = data_path(ctx, "lra")
  if ctx.full:  # every task whose data is there
    tasks = [t for t in TASKS if (lra_dir / t.data).exists()]
  else:
    tasks = [t for t in TASKS if t.models]
    for t in tasks:
      data_path(ctx, f"lra/{t.data}")  # one sentence naming the missing folder, before any training
  results, majority, rows = {}, {}, []
  for task in tasks:
    for model in FULL_MODELS if ctx.full else task.models:
      spec = model.spec.format(task=task.name)
      overrides = lra_overrides(task, model, lra_dir, ctx.full)
      if task.name not in majority:
        majority[task.name] = majority_accuracy(spec, overrides)
      summary = train(ctx, f"{task.name}_{model.name.lower().replace('-', '_')}", spec, overrides)
      results.setdefault(task.name, []).append(dict(model=model.name, summary=summary))
      config = load_config(spec, overrides)
      t = config.train
      rows.append(
        [
          f"{task.title} (T = {t.seq_len})",
          model.name,
          fmt(PAPER_TABLE3[model.paper_row][task.name]),
          fmt(100 * summary.get("test_accuracy", float("nan"))),
          fmt(100 * majority[task.name][0], ".1f"),
          f"{summary.get('num_params', 0):,}",
          f"{t.steps:,} x {t.batch_size}",
          fmt(summary.get("train_time_s"), ",.0f"),
          fmt(summary.get("tokens_per_s"), ",.0f"),
        ]
      )
  table = markdown_table(
    [
      "task (length)",
      "model",
      "paper: Table 3 (%)",
      "ours: test accuracy (%)",
      "majority class (%)",
      "parameters",
      "steps x batch",
      "train s",
      "tokens/s",
    ],
    rows,
  )
  models = [m for m in FULL_MODELS if any(m.name == r["model"] for runs in results.values() for r in runs)]
  names = ", ".join(m.name + ("" if m.name == m.paper_row else f" (Table 3: {m.paper_row})") for m in models)
  if ctx.full:
    setting = (
      f"Table 3's LRA rows on the data under `--data_dir`/lra ({', '.join(t.title for t in tasks)}): "
      f"{names}, each with its config's paper setting: Latte as Table 7 (6 layers, 4 heads, L, D, lr, "
      "batch, weight decay, dropout and epochs per task), the Transformer as LRA's public baseline "
      "configs. Test accuracy on the whole test split after the last step (the paper reports the best "
      "test score)."
    )
  else:
    sizes = "; ".join(
      f"{t.title} T = {dict(s.split('=') for s in t.small)['train.seq_len']}, "
      f"{t.steps} x {t.batch_size} steps, L = {t.latents}" + ("" if MACCHIATO in t.models else ", no Latte-Macchiato")
      for t in tasks
    )
    setting = (
      f"Tiny, short CPU runs of {names} on the LRA samples under `--data_dir`/lra, with the real "
      "trainer: every model 2 layers, d 64, 4 heads, MLP 128, mean pooling, no dropout, AdamW "
      "(lr 1e-3, 10% warmup, cosine decay, weight decay 0.01), the same steps and batch per task "
      f"({sizes}). ListOps expressions (500-2000 tokens) are cut to T; Text reads the first T bytes "
      "of each review; Image is CIFAR-10 box-averaged to 16 x 16 grey pixels and tested on its "
      "first 1,000 test images; Text is tested on all 5,000 test reviews of the sample. "
      "Latte-Macchiato is Latte-RGLRU-SWA++: RG-LRU, a 128-token window on both sides with RoPE, "
      "RMSNorm, GLU. These runs check that the models train on real LRA data at equal cost; they "
      "are far too small to reach the paper's accuracy and are not a reproduction of Table 3 (--full "
      "runs Table 7's settings for every task whose data is there)."
    )
  return Result(setting=setting, markdown=table)
