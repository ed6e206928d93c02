"""`context_extension`: Latte Table 4's form, perplexity as the evaluation length grows past the trained
one, for a RoPE transformer read as it is, with each RoPE scaling set at evaluation time, and extended by
a short fine-tune at a longer length; and passkey retrieval at the same lengths.

A causal Transformer++ with rotary positions only (`model.position=none`: no absolute table, as Gemma)
is trained at length L. `python -m lra_core.evaluate --lengths` (lra_core/evaluate.py
`evaluate_lengths`) then reads the same validation tokens in rows of L, 2L and 4L with the model
rebuilt at each length: as trained, and with `model.rope_scaling` of each type (linear, dynamic, yarn,
llama3; factor 4, anchored at L), set only at evaluation; the extension run starts from its weights and
trains briefly at 4L with yarn x4, and is read at the same lengths. `evaluate_passkey` asks every row's
model for a 5-digit key hidden at depths 0, 0.5 and 1 of filler text (lra_core/tasks/passkey.py).

Default size (a 2-core CPU in minutes): 2 layers, d 128, on the bytes of the default experiment's
ListOps set (the README's first command generates it; no download), L = 128. --full: the paper's
setting, Gemma 2 2B at L = 4K read at 4K, 8K and 16K on C4 validation tokens, its published weights
as a checkpoint (one step at learning rate 0), an extension fine-tuned at 16K with yarn x4 and
Gemma-Macchiato trained as Table 6 says (configs/c4/gemma2.py); it needs --data_dir holding the
checkpoint folder `gemma-2-2b/` (config.json, safetensors, tokenizer.model) and `c4/`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from lra_core.config import load_config
from lra_core.data.datasets.lra import listops
from lra_core.errors import DataError
from lra_core.evaluate import evaluate_lengths, evaluate_passkey
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result, data_path, fmt, train

TABLE = "context_extension"
# Table 4, Slim-Pajama row: validation perplexity at 4K, 8K and 16K tokens (trained at 4K).
PAPER_TABLE4 = {"Gemma": (10.97, 36.35, 294.18), "Gemma-Macchiato": (10.14, 9.99, 10.27)}
SCALINGS = ("linear", "dynamic", "yarn", "llama3")
FACTOR = 4
AS_TRAINED = "as trained"
OWN = ("data.", "train.init_from")  # overrides that say where a run reads, not what it is
DEFAULT_LISTOPS = "configs/lra/listops/transformer.py:default"


@dataclasses.dataclass(frozen=True)
class Run:
  name: str  # its folder under the table's workdir and its row
  spec: str
  overrides: tuple[str, ...]
  paper: str = ""  # the Table 4 column it stands for
  from_base: bool = True  # an extension: starts from the base run's weights (else its own train.init_from)


@dataclasses.dataclass(frozen=True)
class Size:
  length: int  # L, the base run's training length
  multiples: tuple[int, ...]  # evaluated at L x each
  base: Run
  extensions: tuple[Run, ...]  # runs started from the base run's weights
  scalings: tuple[str, ...] = SCALINGS
  split: str = "validation"
  tokens: int = 0  # tokens evaluated at every length
  depths: tuple[float, ...] = (0.0, 0.5, 1.0)
  trials: int = 5
  digits: int = 5
  listops: tuple[str, ...] = ()  # the default size's data: overrides of the default ListOps set
  unit: str = "byte"  # what one token of the data is


SMALL_MODEL = (
  "model.d_model=128",
  "model.num_layers=2",
  "model.num_heads=4",
  "model.d_ff=256",
  "model.dropout=0.0",
  "model.position=none",
)
SMALL_TRAIN = (
  "optim.lr=1e-3",
  "train.eval_every=0",
  "train.checkpoint_every=0",
  "train.eval_batches=4",
  "train.log_every=50",
  "mesh.data=1",
)


def default_size(length: int = 128, steps: int = 400, extension_steps: int = 100) -> Size:
  """The CPU size: L = `length`, the base run `steps` x 16 rows, the extension `extension_steps` x 4 rows of 4L."""
  return Size(
    length=length,
    multiples=(1, 2, 4),
    base=Run(
      "base",
      "configs/enwik8/transformer.py:plusplus",
      (
        *SMALL_MODEL,
        *SMALL_TRAIN,
        f"train.seq_len={length}",
        "train.batch_size=16",
        f"train.steps={steps}",
        f"optim.warmup_steps={max(1, steps // 10)}",
      ),
      paper="Gemma",
    ),
    extensions=(
      Run(
        f"extension_yarn_x{FACTOR}",
        "configs/enwik8/transformer.py:plusplus",
        (
          *SMALL_MODEL,
          *SMALL_TRAIN,
          f"train.seq_len={FACTOR * length}",
          "train.batch_size=4",
          f"train.steps={extension_steps}",
          "optim.lr=3e-4",
          f"optim.warmup_steps={max(1, extension_steps // 10)}",
          *scaling("yarn", length),
        ),
      ),
    ),
    tokens=64 * FACTOR * length,
  )


def full_size(ctx: Context) -> Size:
  """The paper's setting: Gemma 2 2B from its published folder under --data_dir, C4 under --data_dir."""
  if ctx.data_dir is None:
    raise DataError(
      "--full reads Gemma 2 2B and C4: pass --data_dir=<folder holding gemma-2-2b/ (the Hugging Face folder, "
      "tokenizer.model included) and c4/>."
    )
  folder, c4 = data_path(ctx, "gemma-2-2b"), data_path(ctx, "c4")
  data = (f"data.dir={c4}", f"data.tokenizer={folder / 'tokenizer.model'}", f"train.init_from=hf:{folder}")
  length = 4096
  return Size(
    length=length,
    multiples=(1, 2, 4),
    # One step at learning rate 0 keeps the published weights, as a checkpoint the evaluation reads.
    base=Run(
      "gemma",
      "configs/c4/gemma2.py:gemma",
      (*data, "train.steps=1", "optim.lr=0.0", "optim.weight_decay=0.0", "optim.warmup_steps=0"),
      paper="Gemma",
    ),
    extensions=(
      Run(
        f"gemma_yarn_x{FACTOR}",
        "configs/c4/gemma2.py:gemma",
        (*data, f"train.seq_len={FACTOR * length}", "train.batch_size=4", "train.steps=1000", "optim.warmup_steps=100")
        + scaling("yarn", length),
      ),
      Run("gemma_macchiato", "configs/c4/gemma2.py", data, paper="Gemma-Macchiato", from_base=False),
    ),
    tokens=16 * FACTOR * length,
    unit="token",
  )


def scaling(kind: str, length: int) -> tuple[str, ...]:
  """The overrides of a RoPE scaling of `kind` by FACTOR, anchored at the trained `length`."""
  return (
    f"model.rope_scaling.type={kind}",
    f"model.rope_scaling.factor={FACTOR}",
    f"model.rope_scaling.original_max_len={length}",
  )


def listops_bytes(overrides) -> pathlib.Path:
  """The default experiment's ListOps training file (generated once into the cache), read as bytes."""
  return listops.ensure_generated(load_config(DEFAULT_LISTOPS, list(overrides)).data) / "basic_train.tsv"


def settings(ctx: Context, size: Size) -> list[tuple[str, str, tuple[str, ...], pathlib.Path]]:
  """(row, spec, overrides, workdir) of every row: the base run as trained and with each scaling, then
  the extensions as they were trained."""
  base_dir = pathlib.Path(ctx.workdir) / size.base.name
  rows = [(AS_TRAINED, size.base.spec, size.base.overrides, base_dir)]
  rows += [
    (f"{k} x{FACTOR}", size.base.spec, size.base.overrides + scaling(k, size.length), base_dir) for k in size.scalings
  ]
  for run in size.extensions:
    rows.append((run.name, run.spec, run.overrides, pathlib.Path(ctx.workdir) / run.name))
  return rows


def context_extension(ctx: Context, size: Size | None = None) -> Result:
  size = size or (full_size(ctx) if ctx.full else default_size())
  data = () if ctx.full else (f"data.path={listops_bytes(size.listops)}",)
  base = dataclasses.replace(size.base, overrides=data + size.base.overrides)
  start = (f"train.init_from={pathlib.Path(ctx.workdir).resolve() / base.name}",)
  extensions = tuple(
    dataclasses.replace(r, overrides=data + (start if r.from_base else ()) + r.overrides) for r in size.extensions
  )
  size = dataclasses.replace(size, base=base, extensions=extensions)
  summaries = {base.name: train(ctx, base.name, base.spec, base.overrides)}
  for run in extensions:
    summaries[run.name] = train(ctx, run.name, run.spec, run.overrides)
  lengths = [m * size.length for m in size.multiples]
  results = {}
  for row, spec, overrides, workdir in settings(ctx, size):
    config = load_config(spec, list(overrides))
    ctx.log(f"evaluating {row} at {lengths}")
    ppl = evaluate_lengths(config, workdir, lengths, split=size.split, tokens=size.tokens)
    keys = evaluate_passkey(config, workdir, lengths, size.depths, trials=size.trials, digits=size.digits)
    results[row] = (ppl, keys)
  return Result(
    setting=setting_text(ctx, size, summaries),
    markdown=tables(size, lengths, results),
    comparison=comparison(size, results),
  )


def tables(size: Size, lengths: list[int], results: dict) -> str:
  heads = [f"{m}L = {n:,}" for m, n in zip(size.multiples, lengths)]
  ppl_rows, key_rows = [], []
  for row, (ppl, keys) in results.items():
    ppl_rows.append([row] + [fmt(r["perplexity"], ".3f") for r in ppl["lengths"]])
    cells = []
    for n in lengths:
      mine = [r for r in keys["rows"] if r["length"] == n]
      exact = sum(r["accuracy"] for r in mine) / len(mine)
      digits = sum(r["digit_accuracy"] for r in mine) / len(mine)
      cells.append(f"{100 * exact:.0f}% ({100 * digits:.0f}%)")
    key_rows.append([row] + cells)
  tokens = next(iter(results.values()))[0]["lengths"][-1]["tokens"]
  paper = [[name] + [fmt(x) for x in values] for name, values in PAPER_TABLE4.items()]
  return "\n\n".join(
    [
      f"**Perplexity per {size.unit} (the same {tokens:,} {size.split} {size.unit}s at every length)**",
      markdown_table(["setting"] + heads, ppl_rows),
      f"**Passkey retrieval: keys given back whole (digits in place), {size.trials} keys of {size.digits} digits "
      f"at each depth {', '.join(f'{d:g}' for d in size.depths)}**",
      markdown_table(["setting"] + heads, key_rows),
      "**Paper, Table 4 (Slim-Pajama validation perplexity, Gemma 2 2B trained at 4K)**",
      markdown_table(["model", "4K", "8K", "16K"], paper),
    ]
  )


def growth(ppl: dict) -> float:
  """Perplexity at the longest length over that at the trained one."""
  first, last = ppl["lengths"][0]["perplexity"], ppl["lengths"][-1]["perplexity"]
  return last / first if first and math.isfinite(first) else float("nan")


def comparison(size: Size, results: dict) -> str:
  """One line: how perplexity grows to the longest length as trained and extended (beside the paper's
  Gemma and Gemma-Macchiato), and the scaling set at evaluation that does best there."""
  most = size.multiples[-1]
  gemma = PAPER_TABLE4["Gemma"]
  ratios = [f"as trained {growth(results[AS_TRAINED][0]):.2f}x (paper's Gemma at 4x: {gemma[-1] / gemma[0]:.2f}x)"]
  for run in size.extensions:
    paper = PAPER_TABLE4.get(run.paper)
    note = f" (paper's {run.paper}: {paper[-1] / paper[0]:.2f}x)" if paper else ""
    ratios.append(f"{run.name} {growth(results[run.name][0]):.2f}x{note}")
  line = f"perplexity at {most}L / L: {', '.join(ratios)}"
  longest = lambda row: results[row][0]["lengths"][-1]["perplexity"]
  scaled = [row for row in results if row.endswith(f" x{FACTOR}")]
  if scaled:
    best = min(scaled, key=longest)
    line += (
      f"; lowest at {most}L of the scalings set at evaluation: {best}, {longest(best):.3f} "
      f"(as trained {longest(AS_TRAINED):.3f})"
    )
  return line


def setting_text(ctx: Context, size: Size, summaries: dict) -> str:
  base = load_config(size.base.spec, list(size.base.overrides))
  m, t = base.model, base.train
  trained = "; ".join(
    f"{name}: {s.get('num_params', 0):,} parameters, {fmt(s.get('train_time_s'), ',.0f')} s"
    for name, s in summaries.items()
  )
  lengths = ", ".join(f"{k * size.length:,}" for k in size.multiples)
  if ctx.full:
    what = (
      f"Gemma 2 2B (`{size.base.spec}`) with its published weights, read on C4 validation tokens "
      "(the paper reads Slim-Pajama's) by its SentencePiece tokenizer"
    )
  else:
    what = (
      f"A causal Transformer++ (`{size.base.spec}`: {m.num_layers} layers, d {m.d_model}, {m.num_heads} heads, "
      f"GLU {m.d_ff}, RoPE only: `model.position=none`) trained {t.steps} steps x {t.batch_size} rows of "
      f"L = {t.seq_len} bytes on the default experiment's ListOps set read as bytes (the training file, "
      "split 90/5/5; no download), so perplexity is per byte"
    )
  own = lambda r: " ".join(f"`{o}`" for o in r.overrides if o not in size.base.overrides and not o.startswith(OWN))
  ext = "; ".join(f"{r.name}: {own(r)}" for r in size.extensions)
  return (
    f"{what}. Each row is read at {lengths} tokens (`python -m lra_core.evaluate --lengths`): the same tokens "
    f"in rows of each length, the model rebuilt at the length. `as trained` is the run as it is; the "
    f"scaling rows set `model.rope_scaling` (type, factor {FACTOR}, original_max_len L) at evaluation only; "
    f"the extension rows start from the base run's weights and train at the longer length ({ext}). Passkey "
    f"(`--passkey`): {size.trials} keys of {size.digits} digits at each depth "
    f"{', '.join(f'{d:g}' for d in size.depths)} of filler text, answered greedily; prompt and answer fill the "
    f"length (chance: 10% of digits in place). Runs: {trained}."
  )
