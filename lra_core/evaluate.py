"""Evaluate a trained workdir on one split, or as the evaluation length grows.

  python -m lra_core.evaluate --workdir=<dir> [--split=test] [--step=N] [--config.KEY=VALUE ...]
  python -m lra_core.evaluate --config=<spec> --workdir=<dir> ...
  python -m lra_core.evaluate --workdir=<dir> --lengths=256,512,1024 [--tokens=N] \
      [--config.model.rope_scaling.type=yarn --config.model.rope_scaling.factor=4]
  python -m lra_core.evaluate --workdir=<dir> --passkey --lengths=256,512,1024 --depths=0,0.5,1 --trials=5

Without --config the run's own config is used (`<workdir>/config.json`, written by the trainer),
with any overrides on top (e.g. --config.train.eval_batch_size=64, or --config.data.dir=... on
another machine). Restores the parameters and model state of the latest (or given) checkpoint
onto the current mesh (not the optimizer state), runs the task's metrics over the whole split and
writes `eval_<split>_<step>.json` into the workdir. The workdir may be local or gs://. A run that
kept an EMA of its weights (optim.ema_decay > 0) is evaluated with it, and its raw weights' metrics
are reported beside, suffixed `_raw` (`loss` and `loss_raw`).

--lengths evaluates a causal model (lm, image_ar) at each length: the model is rebuilt with
train.seq_len (and model.max_len, where the family has one) = the length, and reads the same tokens of
the split at every length: the first --tokens of it (0: all) in rows of the longest length, each cut
into rows of the shorter ones (which must divide it). It prints loss, perplexity and bits per byte (from
the loss where the data's unit is a byte, else from the bytes the text codec decodes the tokens to;
n/a for data without text) per length, and adds them to `eval_lengths_<split>_<step>.json` under the
run's overrides (another setting's entry there stays). A model whose parameters change shape with the
length (a learned position table) is refused past the length it was trained at. Where
model.rope_scaling has a type and no original_max_len, the trained length is filled in.
--passkey instead asks each length's model for a number hidden at each of --depths of filler text
(lra_core/tasks/passkey.py) and prints the accuracy by length and depth (`eval_passkey_<step>.json`).
"""

from __future__ import annotations

import json
import logging
import math

import jax
import ml_collections
import numpy as np
from flax import nnx

from lra_core import cli, layout, registry, sharding, task_kinds
from lra_core import data as data_lib
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.checkpoints.saved_config import load_workdir_config
from lra_core.config import apply_overrides, validate
from lra_core.dataset_record import SPLITS
from lra_core.errors import ConfigError, DataError
from lra_core.markdown import markdown_table
from lra_core.run import data_setup
from lra_core.run.evaluation import Evaluator
from lra_core.run.state import eval_params, run_setup
from lra_core.runtime import fs
from lra_core.tasks import make_task, passkey

EXAMPLE = "python -m lra_core.evaluate --workdir runs/listops_tiny --split validation --config.train.eval_batch_size 64"
AS_TRAINED = "as trained"  # the key of a length or passkey entry made without overrides


def evaluate(config, workdir, split: str = "test", *, step: int | None = None, write: bool = True) -> dict:
  """The metrics of the latest (or given) checkpoint in `workdir` on `split`; with `write`, also written
  to `<workdir>/eval_<split>_<step>.json` (see write_result)."""
  mesh = layout.make_mesh(config.mesh)
  sources, task = data_setup.setup_data(config, [split], mesh)
  spec = run_setup(config, mesh, params_only=True).spec
  state, step = restore_params(workdir, spec.abstract, step)
  with sharding.activate(mesh, config.sharding.rules):
    metrics = Evaluator(config, spec, task, mesh, sources)(state, split)
  result = {"step": step, "split": split, **metrics}
  if write:
    write_result(workdir, result)
  return result


def write_result(workdir, result: dict) -> None:
  """`<workdir>/eval_<split>_<step>.json` (process 0); a workdir that cannot take it (read-only, full) is
  a warning: the metrics were computed and the caller has them."""
  if jax.process_index() != 0:
    return
  path = fs.path(workdir, what="workdir") / f"eval_{result['split']}_{result['step']}.json"
  try:
    path.write_text(json.dumps(result, indent=2) + "\n")
  except OSError as e:
    logging.warning("could not write %s (%s); the metrics are only printed", path, e.strerror or type(e).__name__)


# -- evaluation lengths ---------------------------------------------------------------------------------


def trained_length(config) -> int:
  """The longest position the run trained: model.max_len where set, else train.seq_len."""
  return int(config.model.get("max_len", 0) or config.train.seq_len)


def config_at(config, length: int, trained: int, *, eval_rows: int = 0) -> ml_collections.ConfigDict:
  """`config` for rows of `length` tokens: train.seq_len the length, model.max_len (where the family has
  one) the longer of it and the trained length, an update window no longer than a row, a RoPE scaling
  anchored at the trained length unless it names its own, and `eval_rows` rows per batch (0: as set)."""
  overrides = [f"train.seq_len={length}"]
  if "max_len" in config.model:
    overrides.append(f"model.max_len={max(trained, length)}")
  if config.train.update_len >= length:
    overrides.append("train.update_len=0")  # a row no longer than a window is one window
  scaling = config.model.get("rope_scaling")
  if scaling is not None and scaling.get("type", "none") != "none" and not scaling.get("original_max_len", 0):
    overrides.append(f"model.rope_scaling.original_max_len={trained}")
  if eval_rows:
    overrides.append(f"train.eval_batch_size={eval_rows}")
  out = ml_collections.ConfigDict(config.to_dict())
  apply_overrides(out, overrides)
  validate(out)
  out.lock()
  return out


def parse_lengths(config, lengths) -> list[int]:
  """The lengths in increasing order, each dividing the longest, for a causal task; else one sentence."""
  if not task_kinds.kind(config.task).causal:
    raise ConfigError(
      f"evaluation lengths need a causal task {list(task_kinds.names(causal=True))}, not {config.task!r}."
    )
  lengths = sorted({int(n) for n in lengths})
  if not lengths or lengths[0] < 1:
    raise ConfigError(f"--lengths {lengths} must name positive lengths.")
  uneven = [n for n in lengths if lengths[-1] % n]
  if uneven:
    raise ConfigError(f"--lengths {uneven[0]} does not divide the longest, {lengths[-1]}: rows are cut from its rows.")
  return lengths


def shapes(config) -> dict:
  """path -> shape of every parameter and state variable the model of `config` builds (none allocated)."""
  model = nnx.eval_shape(lambda: registry.build_model(config))
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in flat}


def check_positions(config, lengths) -> None:
  """One sentence where the model's variables change shape with the length (a learned position table):
  its positions stop at the trained length."""
  trained = trained_length(config)
  reference = shapes(config_at(config, trained, trained))
  for length in lengths:
    mine = shapes(config_at(config, length, trained))
    changed = [path for path in reference if mine.get(path) != reference[path]]
    if changed or mine.keys() != reference.keys():
      where = changed[0] if changed else "its variables"
      raise ConfigError(
        f"{config.model.name}'s {where} holds {trained} positions (it changes shape with the length), so it "
        f"cannot read {length} tokens; give --lengths up to {trained}."
      )


class RowsOfLength:
  """The first `count` rows of `source` (each `longest` tokens) cut into rows of `length`: the same tokens
  in shorter rows. Fields along time ([T, ...]) are cut; any other field repeats."""

  def __init__(self, source, count: int, longest: int, length: int):
    self.source, self.count, self.longest, self.length = source, count, longest, length
    self.per_row = longest // length
    self.info = source.info

  def __len__(self) -> int:
    return self.count * self.per_row

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    row, part = divmod(data_lib.check_index(index, len(self)), self.per_row)
    cut = slice(part * self.length, (part + 1) * self.length)
    return {k: v[cut] if v.ndim and v.shape[0] == self.longest else v for k, v in self.source[row].items()}

  def tokens(self) -> int:
    """The weighted (evaluated) tokens of every row."""
    return int(sum(float(self[i]["weights"].sum()) for i in range(len(self))))


def text_bytes(config, rows: RowsOfLength) -> int | None:
  """UTF-8 bytes of the evaluated targets: the tokens where the unit is a byte, the decoded text where the
  dataset has a text codec, else None (bits per byte do not apply)."""
  if rows.info.unit == "byte":
    return rows.tokens()
  if registry.dataset_module(config.data.name).codec is None:
    return None
  _, decode = data_lib.text_codec(config)
  total = 0
  for i in range(len(rows)):
    row = rows[i]
    total += len(decode(row["targets"][row["weights"] > 0]).encode("utf-8"))
  return total


def restored(config, workdir, mesh, step: int | None):
  """(spec, state, step) of `workdir`'s checkpoint read into the model `config` builds."""
  spec = run_setup(config, mesh, params_only=True).spec
  state, step = restore_params(workdir, spec.abstract, step)
  return spec, state, step


def evaluate_lengths(
  config, workdir, lengths, *, split: str = "test", step: int | None = None, tokens: int = 0
) -> dict:
  """Loss, perplexity and bits per byte of the checkpoint at each length, over the same tokens of
  `split` (the first `tokens` of it, whole rows of the longest length; 0: all)."""
  lengths = parse_lengths(config, lengths)
  check_positions(config, lengths)
  trained, longest = trained_length(config), lengths[-1]
  mesh = layout.make_mesh(config.mesh)
  sources, _ = data_setup.setup_data(config_at(config, longest, trained), [split], mesh)
  base = sources[split]
  count = len(base) if not tokens else min(len(base), tokens // longest)
  if count < 1:
    raise DataError(f"--tokens {tokens} is less than one row of the longest length, {longest}.")
  nbytes = text_bytes(config, RowsOfLength(base, count, longest, longest))
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  per_batch = (config.train.eval_batch_size or config.train.batch_size) * trained  # tokens, as at the trained length
  rows = []
  for length in lengths:
    eval_rows = max(1, math.ceil(per_batch / length / shards)) * shards
    cfg = config_at(config, length, trained, eval_rows=eval_rows)
    source = RowsOfLength(base, count, longest, length)
    spec, state, step = restored(cfg, workdir, mesh, step)
    with sharding.activate(mesh, cfg.sharding.rules):
      metrics = Evaluator(cfg, spec, make_task(cfg, source.info), mesh, {split: source})(state, split)
    evaluated = source.tokens()
    bpb = metrics["loss"] * evaluated / nbytes / math.log(2.0) if nbytes else None
    rows.append(
      dict(
        length=length,
        rows=len(source),
        tokens=evaluated,
        loss=metrics["loss"],
        perplexity=metrics["perplexity"],
        bits_per_byte=bpb,
      )
    )
    logging.info("length %d: loss %.4f over %d tokens", length, metrics["loss"], evaluated)
  return dict(step=step, split=split, trained_length=trained, rows_of_longest=count, lengths=rows)


def evaluate_passkey(
  config,
  workdir,
  lengths,
  depths,
  *,
  trials: int = 5,
  digits: int = 5,
  seed: int = 0,
  step: int | None = None,
) -> dict:
  """Passkey accuracy of the checkpoint by length and depth (lra_core/tasks/passkey.py): at each length
  the model is rebuilt as for the length evaluation and decodes greedily."""
  lengths = parse_lengths(config, lengths)
  check_positions(config, lengths)
  trained = trained_length(config)
  encode, decode = data_lib.text_codec(config)
  for length in lengths:
    passkey.check_length(encode, length, digits)  # before any checkpoint is read
  mesh = layout.make_mesh(config.mesh)
  family_generate = registry.family(config.model.name).generate
  rows = []
  for length in lengths:
    cfg = config_at(config, length, trained)
    spec, state, step = restored(cfg, workdir, mesh, step)
    model = nnx.merge(spec.eval_graphdef, eval_params(state), state["model_state"])
    generate = passkey.model_generate(model, family_generate, seed=seed)
    batch = cfg.train.eval_batch_size or cfg.train.batch_size
    rows += passkey.passkey_rows(
      generate, encode, decode, length, depths, trials, digits=digits, seed=seed, batch_size=batch
    )
  return dict(step=step, trained_length=trained, digits=digits, rows=rows)


def length_table(result: dict) -> str:
  """The printed table of `evaluate_lengths` and the sentence saying which tokens every row read."""
  rows = [
    [
      f"{r['length']:,}",
      f"{r['rows']:,}",
      f"{r['tokens']:,}",
      f"{r['loss']:.4f}",
      f"{r['perplexity']:.3f}",
      "n/a" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.4f}",
    ]
    for r in result["lengths"]
  ]
  table = markdown_table(["length", "rows", "tokens", "loss", "perplexity", "bits/byte"], rows)
  longest = result["lengths"][-1]
  return (
    f"{table}\n\nEvery length reads the same {longest['tokens']:,} tokens of the {result['split']} split "
    f"({result['rows_of_longest']:,} rows of {longest['length']:,} cut into rows of each length); step "
    f"{result['step']}, trained at {result['trained_length']:,} positions."
  )


def passkey_table(result: dict) -> str:
  rows = [
    [
      f"{r['length']:,}",
      f"{r['depth']:g}",
      f"{r['key_depth']:.2f}",
      r["trials"],
      f"{r['accuracy']:.2f}",
      f"{r['digit_accuracy']:.2f}",
    ]
    for r in result["rows"]
  ]
  header = ["length", "depth", "key at", "trials", "accuracy", f"digits in place (of {result['digits']})"]
  return f"{markdown_table(header, rows)}\n\nStep {result['step']}, trained at {result['trained_length']:,} positions."


def write_keyed(workdir, name: str, key: str, entry: dict) -> str | None:
  """Puts `entry` under `key` in `<workdir>/<name>.json` (process 0), keeping its other keys; a file there
  that is not such a table is left alone and the entry goes to `<name>_1.json` (or _2, ...). Returns the
  path written, or None where the workdir cannot take it (a warning: the caller printed the numbers)."""
  if jax.process_index() != 0:
    return None
  folder = fs.path(workdir, what="workdir")
  for n in range(100):
    path = folder / (f"{name}.json" if not n else f"{name}_{n}.json")
    table = {}
    if path.exists():
      try:
        table = json.loads(path.read_text())
      except (OSError, ValueError):
        continue
      if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        continue
    try:
      path.write_text(json.dumps({**table, key: entry}, indent=2) + "\n")
    except OSError as e:
      logging.warning("could not write %s (%s); the numbers are only printed", path, e.strerror or type(e).__name__)
      return None
    return str(path)
  return None


def parse_numbers(text: str, kind, flag: str) -> list:
  try:
    return [kind(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ConfigError(f"{flag} {text!r} is not a comma-separated list of numbers.") from None


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--lengths", default="", help="comma-separated evaluation lengths (causal models)")
    parser.add_argument("--tokens", type=int, default=0, help="--lengths: tokens of the split read (0: all)")
    parser.add_argument("--passkey", action="store_true", help="--lengths: passkey retrieval instead of the loss")
    parser.add_argument("--depths", default="0,0.5,1", help="--passkey: where the key sits in the filler, 0..1")
    parser.add_argument("--trials", type=int, default=5, help="--passkey: keys per length and depth")
    parser.add_argument("--digits", type=int, default=5, help="--passkey: digits of a key")
    parser.add_argument("--seed", type=int, default=0, help="--passkey: draws the keys")

  args = cli.parse(
    argv, extra=flags, prog="python -m lra_core.evaluate", config_from_workdir=load_workdir_config, example=EXAMPLE
  )
  e = args.extra
  if e.passkey and not e.lengths:
    raise ConfigError("--passkey needs --lengths, the lengths to hide the key in.")
  if e.lengths:
    lengths = parse_numbers(e.lengths, int, "--lengths")
    key = " ".join(args.overrides) or AS_TRAINED
    if e.passkey:
      depths = parse_numbers(e.depths, float, "--depths")
      result = evaluate_passkey(
        args.config, args.workdir, lengths, depths, trials=e.trials, digits=e.digits, seed=e.seed, step=e.step
      )
      print(passkey_table(result), flush=True)
      write_keyed(args.workdir, f"eval_passkey_{result['step']}", key, result)
    else:
      result = evaluate_lengths(args.config, args.workdir, lengths, split=e.split, step=e.step, tokens=e.tokens)
      print(length_table(result), flush=True)
      write_keyed(args.workdir, f"eval_lengths_{e.split}_{result['step']}", key, result)
    return
  result = evaluate(args.config, args.workdir, e.split, step=e.step, write=False)
  logging.info("evaluated step %d on %s", result["step"], e.split)
  print(", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
  write_result(args.workdir, result)  # after printing: a workdir that cannot take it loses nothing


if __name__ == "__main__":
  cli.run(main)
