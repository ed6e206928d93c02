"""FIT (Chen & Li 2023) tables: FIT vs ViT as the image grows (Table 2b), interleave patterns (Table 6).

`fit_scaling` times the trainer's train step of a FIT encoder and a ViT (the same layers with full
attention) on LRA Image-style pixel sequences at the paper's token counts; a ViT step that cannot
run here is compiled from shapes only, so its row says what XLA would have needed.
`fit_interleave` trains one FIT encoder per Table 6 layer pattern (L, L-G-L, ...) on CIFAR-10 and
compares validation loss, accuracy and steps per second.
"""

from __future__ import annotations

import gc
import os

import jax
import numpy as np

from lra_core import sharding
from lra_core.bench import train_step
from lra_core.bench.common import cost_flops, xla_memory_bytes
from lra_core.errors import ConfigError
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, curve, data_path, figure, fmt, save_plot, train
from lra_core.run.batches import to_device
from lra_core.run.state import run_setup
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task

GiB = 2**30
FIT_SPEC = "configs/lra/image/fit.py"
VIT_SPEC = "configs/lra/image/transformer.py"

# FIT Table 2b (Pix2Seq on Objects365, one example per TPUv3 core): resolution, patches, FLOPs (G)
# of ViT-B and FIT-B, steps per second of ViT-B (None: OOM) and FIT-B, FIT-B's speed-up as printed.
PAPER_2B = (
  (640, 1600, 368, 332, 8.2, 9.2, "1.1x"),
  (1024, 4096, 1326, 815, 2.5, 5.8, "2.3x"),
  (1536, 9216, 4750, 1900, 0.6, 2.8, "4.7x"),
  (2048, 16384, 12840, 3627, None, 1.4, "n/a"),
)
# FIT Table 6: interleave pattern -> (NLL, params M, steps per sec.) on Objects365 (Pix2Seq) and
# bits/dim on ImageNet-64x64 (autoregressive); the pattern's number of global blocks is its index.
PAPER_6 = {
  "Object365 (Pix2Seq), NLL": ((2.66, 138, 2.1), (2.52, 157, 2.0), (2.51, 161, 2.0), (2.50, 173, 1.9)),
  "ImageNet-64x64 (AR), bits/dim": ((3.80, 45, 1.9), (3.51, 48, 2.4), (3.50, 49, 2.4), (3.49, 52, 2.3)),
}
PAPER_6_LABELS = ("L", "L→G→L", "L→G→L→G→L", "L→G→L→G→L→G→L")

# -- fit_scaling --------------------------------------------------------------------------------------

# Widths of the two encoders: a CPU-sized default and the paper's ViT-B / FIT-B (Table 2).
SCALING_WIDTHS = {
  False: dict(layers="L(2)G(1)L(2)G(1)L(2)", num_layers=6, d=64, heads=4, d_ff=256, latents=8),
  True: dict(layers="L(4)G(2)L(4)G(2)L(4)", num_layers=12, d=768, heads=12, d_ff=3072, latents=32),
}
# Image sides whose pixel counts are Table 2b's patch counts (1600 ... 16384 tokens).
SCALING_SIDES = (40, 64, 96, 128)
# CPU default: ViT runs at these sides only; at the others its step is compiled, not run (quadratic).
DEFAULT_VIT_SIDES = (40, 64)
DEFAULT_GROUP_SIDE = 8  # CPU default: 8x8-pixel groups, more of them as the image grows
FULL_GROUPS_PER_SIDE = 4  # the paper: 16 sub-images (4 x 4) whatever the resolution
SLOW_STEP_S = 10.0  # a row projected slower than this is timed once after one warm-up step


def scaling_overrides(model: str, side: int, full: bool) -> tuple[str, list[str]]:
  """(config spec, overrides) of the ViT or FIT encoder at image side `side`."""
  w = SCALING_WIDTHS[full]
  common = [
    f"model.d_model={w['d']}",
    f"model.num_heads={w['heads']}",
    f"model.d_ff={w['d_ff']}",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    f"model.classifier_hidden={w['d']}",
  ]
  if model == "ViT":
    return VIT_SPEC, [f"model.num_layers={w['num_layers']}", "model.head_dim=0", *common]
  group_side = side // FULL_GROUPS_PER_SIDE if full else DEFAULT_GROUP_SIDE
  if side % group_side:
    raise ConfigError(f"image side {side} is not a multiple of the group side {group_side}.")
  return FIT_SPEC, [
    f"model.layers={w['layers']}",
    f"model.d_latent={w['d']}",
    f"model.latent_heads={w['heads']}",
    f"model.latent_d_ff={w['d_ff']}",
    f"model.group_side={group_side}",
    f"model.latents_per_group={w['latents']}",
    *common,
  ]


def memory_limit_bytes() -> int:
  """The device's allocator limit on accelerators, else the machine's physical memory."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_step(config) -> dict:
  """XLA's FLOPs and memory for the train step of `config`, compiled from shapes (nothing runs)."""
  mesh = train_step.one_device_mesh()
  rules = config.sharding.rules
  info = train_step.data_info(config)
  task = make_task(config, info)
  tx, schedule, spec = run_setup(config, mesh)
  with sharding.activate(mesh, rules):
    step = jax.jit(
      make_train_step(config, spec, task, tx, schedule), donate_argnums=0, out_shardings=(spec.shardings, None)
    )
    batch = to_device(train_step.random_batch(config, info, np.random.default_rng(0)), mesh, rules)
    compiled = step.lower(spec.abstract, batch).compile()
  return dict(
    num_params=spec.num_params, flops_per_step=cost_flops(compiled), xla_memory_bytes=xla_memory_bytes(compiled)
  )


def _steps_for(previous: dict | None, seq_len: int, full: bool) -> tuple[int, int]:
  """(timed steps, warm-up steps): fewer when the last row of the model, grown quadratically, is slow."""
  if full:
    return 5, 2
  if previous and previous.get("status") == "ok":
    projected = previous["step_ms"] / 1e3 * (seq_len / previous["seq_len"]) ** 2
    if projected > SLOW_STEP_S:
      return 1, 1
  return 3, 1


def scaling_rows(ctx: Context) -> tuple[list[dict], float]:
  """Every (model, side) row, FIT first so that its memory marks are not hidden by ViT's."""
  rows = []
  limit = memory_limit_bytes()
  for model in ("FIT", "ViT"):
    previous = None
    for side in SCALING_SIDES:
      spec, overrides = scaling_overrides(model, side, ctx.full)
      config = train_step.bench_config(spec, overrides, seq_len=side * side, batch_size=1)
      row = dict(variant=model, side=side)
      if ctx.full or model == "FIT" or side in DEFAULT_VIT_SIDES:
        steps, warmup = _steps_for(previous, side * side, ctx.full)
        row.update(train_step.time_train_step(config, steps=steps, warmup=warmup))
      else:
        row.update(seq_len=side * side, batch_size=1, **planned_step(config))
        fits = row["xla_memory_bytes"] is not None and row["xla_memory_bytes"] <= limit
        row.update(status="planned" if fits else "OOM", stage="plan", limit_bytes=limit)
      ctx.log(_log_line(row))
      rows.append(row)
      previous = row
      gc.collect()
  peak = train_step.matmul_peak_flops()
  train_step.set_peak_fractions(rows, peak)
  return rows, peak


def _log_line(row: dict) -> str:
  if row["status"] == "ok":
    return train_step.format_row_log(row)
  planned = row.get("xla_memory_bytes")
  return (
    f"{row['variant']} T={row['seq_len']}: {row['status']} ({row.get('stage')}; XLA plans "
    f"{fmt(None if planned is None else planned / GiB)} GiB)"
  )


def _gib(value: int | None) -> str:
  return "-" if value is None else f"{value / GiB:,.2f} GiB"


def _step_cell(row: dict) -> str:
  if row["status"] == "ok":
    return f"{row['step_ms']:,.0f} ms"
  planned = row.get("xla_memory_bytes")
  if row["status"] == "planned":
    return f"not run (quadratic; XLA plans {_gib(planned)})"
  if row.get("stage") == "plan":
    return f"OOM (XLA plans {_gib(planned)}; {_gib(row['limit_bytes'])} here)"
  return f"OOM at {row.get('stage')}" + (f" (XLA plans {_gib(planned)})" if planned else "")


def fit_scaling(ctx: Context) -> Result:
  rows, peak = scaling_rows(ctx)
  by = {(r["variant"], r["seq_len"]): r for r in rows}
  paper = {p[1]: p for p in PAPER_2B}
  table_rows = []
  for side in SCALING_SIDES:
    tokens = side * side
    vit, fit_row = by[("ViT", tokens)], by[("FIT", tokens)]
    ours = None
    if vit["status"] == "ok" and fit_row["status"] == "ok":
      ours = vit["step_ms"] / fit_row["step_ms"]
    gflop = lambda r: fmt(None if r.get("flops_per_step") is None else r["flops_per_step"] / 1e9, ",.1f")
    res, _, f_vit, f_fit, s_vit, s_fit, paper_speedup = paper.get(tokens, (None,) * 7)
    paper_cells = (
      [
        f"{tokens:,} ({res}² / {side}²)",
        "OOM" if s_vit is None else f"{s_vit}",
        f"{s_fit} ({paper_speedup})",
        f"{f_vit:,} / {f_fit:,}",
      ]
      if res
      else [f"{tokens:,} (- / {side}²)", "-", "-", "-"]
    )
    table_rows.append(
      [
        *paper_cells,
        _step_cell(vit),
        _step_cell(fit_row),
        "-" if ours is None else f"{ours:.2f}x",
        f"{gflop(vit)} / {gflop(fit_row)}",
        f"{_gib(vit.get('xla_memory_bytes'))} / {_gib(fit_row.get('xla_memory_bytes'))}",
      ]
    )
  header = [
    "tokens (paper res. / our side)",
    "paper ViT-B steps/s",
    "paper FIT-B steps/s (speed-up)",
    "paper GFLOPs ViT-B / FIT-B",
    "ours ViT step",
    "ours FIT step",
    "ours FIT speed-up",
    "ours XLA GFLOP/step ViT / FIT",
    "ours XLA memory plan ViT / FIT",
  ]
  timed = [r for r in rows if r["status"] == "ok" or r.get("stage") != "plan"]
  markdown = (
    markdown_table(header, table_rows)
    + "\n\nEvery timed row, as `scripts/bench.py` prints it:\n\n"
    + train_step.format_table(timed)
  )
  plot = _scaling_plot(ctx, rows)
  return Result(setting=_scaling_setting(ctx, rows, peak), markdown=markdown, plots=[plot])


def _scaling_plot(ctx: Context, rows: list[dict]):
  fig, (ax,) = figure(width=6.0, height=4.2)
  for model, colour in (("ViT", "tab:red"), ("FIT", "tab:blue")):
    ours = [(r["seq_len"], r["step_ms"] / 1e3) for r in rows if r["variant"] == model and r["status"] == "ok"]
    if ours:
      ax.plot(*zip(*ours), "o-", color=colour, label=f"ours {model} (this machine)")
    column = 4 if model == "ViT" else 5
    paper = [(p[1], 1 / p[column]) for p in PAPER_2B if p[column]]
    ax.plot(*zip(*paper), "s--", color=colour, alpha=0.6, label=f"paper {model}-B (TPUv3, 1 / steps per s)")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("tokens (pixels / patches)")
  ax.set_ylabel("train step time (s)")
  ax.set_title("FIT vs ViT: step time as the image grows")
  ax.legend(fontsize=7)
  ax.grid(True, which="both", alpha=0.3)
  return save_plot(ctx, fig, "fit_scaling")


def _scaling_setting(ctx: Context, rows: list[dict], peak: float) -> str:
  w = SCALING_WIDTHS[ctx.full]
  params = {r["variant"]: r.get("num_params") for r in rows if r["seq_len"] == SCALING_SIDES[0] ** 2}
  groups = (
    f"{FULL_GROUPS_PER_SIDE**2} groups (the paper's 16 sub-images), so a group grows with the image"
    if ctx.full
    else f"{DEFAULT_GROUP_SIDE}x{DEFAULT_GROUP_SIDE}-pixel groups, more of them as the image grows"
  )
  size = "the paper's ViT-B / FIT-B widths" if ctx.full else "a CPU-sized pair"
  vit_runs = (
    "every side"
    if ctx.full
    else f"sides {', '.join(map(str, DEFAULT_VIT_SIDES))}; at the larger sides its step is only compiled "
    "from shapes, and the row gives XLA's memory plan (OOM when it exceeds this machine's memory)"
  )
  warmup = "5 after 2 at --full" if ctx.full else f"one step where a row is projected past {SLOW_STEP_S:.0f} s"
  return (
    f"FIT Table 2b: a full train step (forward, backward, AdamW) of a ViT and a FIT encoder on "
    f"grayscale images of side {', '.join(map(str, SCALING_SIDES))} with one pixel per token, i.e. the "
    f"paper's 1,600 to 16,384 patches as tokens, batch 1 (the paper: one example per TPUv3 core), "
    f"random pixels, one device; {size}. ViT: {w['num_layers']} layers, d {w['d']}, {w['heads']} heads, "
    f"MLP {w['d_ff']}, learned positions, full attention ({VIT_SPEC}), {fmt(params.get('ViT'), ',.0f')} "
    f"parameters at the first side. FIT: the same layers as local layers, `{w['layers']}`, latents of "
    f"width d {w['d']}, {w['latents']} per group, {groups} ({FIT_SPEC}), "
    f"{fmt(params.get('FIT'), ',.0f')} parameters at the first side (the latent table grows with the "
    f"number of groups). ViT runs at {vit_runs}. The step time is the median of 3 steps after one "
    f"warm-up step ({warmup}); "
    f"the speed-up is ViT's step time over FIT's (the paper's is FIT-B's steps/s over ViT-B's). "
    f"Float32 matmul yardstick here: {peak / 1e9:,.1f} GFLOP/s."
  )


# -- fit_interleave -----------------------------------------------------------------------------------

# Table 6 keeps the local and global layer totals fixed across the interleaved patterns; these
# totals split into 1, 2 and 3 global blocks (global layers evenly, local layers as evenly as they go).
INTERLEAVE = {
  # CPU default: CIFAR-10 box-averaged to 16x16, 16 groups of 4x4 pixels, narrow layers.
  False: dict(
    image_size=16,
    group_side=4,
    latents=4,
    d=32,
    heads=4,
    d_ff=128,
    num_local=6,
    num_global=6,
    steps=200,
    batch=32,
    lr=1e-3,
    warmup=20,
    eval_batch=250,
    eval_batches=10,
  ),
  # --full: FIT-B's widths and Table 2's grouping (16 sub-images, 32 latents each) on the full LRA
  # Image task (32x32, its schedule, dropout and batch from configs/lra/image/fit.py); 12 local
  # layers as FIT-B's L(4)G(2)L(4)G(2)L(4), 6 global layers so that 1, 2 and 3 blocks split them evenly.
  True: dict(image_size=32, group_side=8, latents=32, d=768, heads=12, d_ff=3072, num_local=12, num_global=6),
}


def split_layers(total: int, parts: int) -> list[int]:
  """`total` layers in `parts` segments as evenly as possible, extra layers on the outer segments."""
  if parts < 1 or total < parts:
    raise ConfigError(f"{total} layers cannot fill {parts} segments; expected at least one layer each.")
  sizes = [total // parts] * parts
  outside_in = [i for pair in zip(range(parts), reversed(range(parts))) for i in pair]
  for i in list(dict.fromkeys(outside_in))[: total % parts]:
    sizes[i] += 1
  return sizes


def layer_pattern(num_local: int, num_global: int, blocks: int) -> str:
  """The layer string with `blocks` global blocks: 0 -> 'L(n)', 1 -> 'L(a)G(g)L(b)', ..."""
  local = split_layers(num_local, blocks + 1)
  glob = split_layers(num_global, blocks) if blocks else []
  return "".join(f"L({a})" + (f"G({g})" if i < blocks else "") for i, (a, g) in enumerate(zip(local, [*glob, 0])))


def interleave_overrides(ctx: Context, layers: str) -> list[str]:
  s = INTERLEAVE[ctx.full]
  overrides = [
    f"data.dir={data_path(ctx, 'lra/cifar10')}",
    f"model.layers={layers}",
    f"model.group_side={s['group_side']}",
    f"model.latents_per_group={s['latents']}",
    f"model.d_model={s['d']}",
    f"model.d_latent={s['d']}",
    f"model.num_heads={s['heads']}",
    f"model.latent_heads={s['heads']}",
    f"model.d_ff={s['d_ff']}",
    f"model.latent_d_ff={s['d_ff']}",
    f"model.classifier_hidden={s['d']}",
  ]
  if ctx.full:
    return overrides
  size = s["image_size"]
  return overrides + [
    f"data.image_size={size}",
    f"train.seq_len={size * size}",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    f"train.steps={s['steps']}",
    f"train.batch_size={s['batch']}",
    f"train.eval_batch_size={s['eval_batch']}",
    f"train.eval_batches={s['eval_batches']}",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.log_every=10",
    "train.test_at_end=False",
    "mesh.data=1",
    f"optim.lr={s['lr']}",
    f"optim.warmup_steps={s['warmup']}",
    f"optim.decay_steps={s['steps']}",
  ]


def _run_name(layers: str) -> str:
  return layers.replace("(", "").replace(")", "")


def fit_interleave(ctx: Context) -> Result:
  s = INTERLEAVE[ctx.full]
  patterns = [layer_pattern(s["num_local"], s["num_global"], blocks) for blocks in range(4)]
  runs = []
  for layers in patterns:
    summary = train(ctx, _run_name(layers), FIT_SPEC, interleave_overrides(ctx, layers))
    steps = summary["step"]
    runs.append(
      dict(
        layers=layers,
        summary=summary,
        steps_per_s=steps / summary["train_time_s"] if summary.get("train_time_s") else None,
      )
    )
  split = "test" if ctx.full else "val"
  papers = list(PAPER_6)
  rows = []
  for blocks, (label, run) in enumerate(zip(PAPER_6_LABELS, runs)):
    out = run["summary"]
    paper_cells = [f"{PAPER_6[p][blocks][0]} / {PAPER_6[p][blocks][1]}M / {PAPER_6[p][blocks][2]}" for p in papers]
    rows.append(
      [
        label,
        *paper_cells,
        f"`{run['layers']}`",
        fmt(out.get(f"{split}_loss"), ".4f"),
        fmt(None if out.get(f"{split}_accuracy") is None else 100 * out[f"{split}_accuracy"], ".2f"),
        f"{out['num_params'] / 1e6:.3f}M",
        fmt(run["steps_per_s"], ".2f"),
      ]
    )
  header = [
    "pattern",
    *[f"paper {p} / params / steps/s" for p in papers],
    "ours: layers",
    f"ours {split} loss (nats)",
    f"ours {split} accuracy %",
    "ours params",
    "ours steps/s",
  ]
  plot = _interleave_plot(ctx, runs)
  return Result(setting=_interleave_setting(ctx), markdown=markdown_table(header, rows), plots=[plot])


def _interleave_setting(ctx: Context) -> str:
  s = INTERLEAVE[ctx.full]
  size = s["image_size"]
  groups = (size // s["group_side"]) ** 2
  if ctx.full:
    train_text = (
      "the LRA Image schedule of configs/lra/image/fit.py (batch 256, 35,000 steps, Adam b2 .98, "
      "lr 5e-4, dropout 0.3 / 0.2), evaluated on the full validation and test splits"
    )
  else:
    train_text = (
      f"{s['steps']} steps of {s['batch']} images, AdamW lr {s['lr']:g} ({s['warmup']} warm-up steps, "
      f"cosine to 0), no dropout, evaluated on {s['eval_batch'] * s['eval_batches']:,} validation "
      "images (LRA's train[90%:])"
    )
  return (
    f"FIT Table 6: one FIT encoder per interleave pattern, with {s['num_local']} local layers in all "
    f"and {s['num_global']} global layers in every interleaved one (the paper also keeps both totals; "
    f"local layers that do not split evenly go to the outer blocks). The paper's rows are Pix2Seq on "
    f"Objects365 (NLL) and autoregressive ImageNet-64x64 (bits/dim), neither of which is here; ours is "
    f"the closest encoder task with data: CIFAR-10 classification from grayscale pixels (LRA Image, "
    f"{FIT_SPEC}), images {size}x{size} ({size * size} tokens{', box-averaged' if size < 32 else ''}), "
    f"{groups} groups of {s['group_side']}x{s['group_side']} pixels with {s['latents']} latents each, "
    f"d {s['d']} for data and latents (the same width, as in Table 6), {s['heads']} heads, MLP "
    f"{s['d_ff']}, mean pooling; {train_text}. Steps/s is the trainer's (steps over training wall "
    f"time, data pipeline included)."
  )


def _interleave_plot(ctx: Context, runs: list[dict]):
  fig, (ax,) = figure(width=6.0, height=4.0)
  for label, run in zip(PAPER_6_LABELS, runs):
    steps, values = curve(ctx, _run_name(run["layers"]), "train_loss")
    if steps:
      ax.plot(steps, values, label=f"{label}: {run['layers']}")
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (nats)")
  ax.set_title("FIT interleave patterns on CIFAR-10")
  ax.legend(fontsize=7)
  ax.grid(True, alpha=0.3)
  return save_plot(ctx, fig, "fit_interleave")
