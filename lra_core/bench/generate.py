r"""Generation throughput (Block Transformer Table 2 / Figure 2 style): generated tokens per second
of whole prompt -> continuation calls, by batch size and (prompt, generated) lengths.

  python scripts/bench_generate.py --config=configs/c4/block_transformer.py:5m \
      --variant block: --variant vanilla:config=configs/c4/block_transformer.py:5m,vanilla \
      --batch_sizes=1,32 --settings=2048:128,128:2048 --out=docs/benchmarks.md

The same command as `python -m lra_core.bench.generate`.

Each variant is freshly initialised (eval mode) and generates greedily from random prompts (ids
1..V-1, no padding). A model module with its own `generate(model, prompt, ...)` (the Block
Transformer: block decoder once per block, token decoder without prompt prefill) uses it; others
go through `lra_core.decoding.generate` (one-pass prompt prefill where the model has `prefill`,
then one `decode_step` per token with a KV cache). Reported: the median wall time of --repeats
calls after --warmup (the first compiles), generated tokens / s = batch x new tokens / time, and
the size of the decode state at full length (KV caches: what memory per sample measures).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax
import numpy as np

from lra_core import cli, decoding, registry
from lra_core.bench.common import MiB, ints, is_oom, median_seconds, parse_command, publish, variant_config
from lra_core.config import load_config
from lra_core.markdown import markdown_table
from lra_core.registry import build_model, non_embedding_parameter_count


def parse_settings(text: str) -> list[tuple[int, int]]:
  """ "2048:128,128:2048" -> [(prompt, new), ...]."""
  out = []
  for item in text.split(","):
    prompt, _, new = item.partition(":")
    if not (prompt.strip().isdigit() and new.strip().isdigit()) or int(prompt) < 1 or int(new) < 1:
      raise SystemExit(f"--settings item {item!r} is not PROMPT:NEW with two positive integers.")
    out.append((int(prompt), int(new)))
  return out


def time_generate(config, *, batch_size: int, prompt_len: int, new_tokens: int, repeats: int, warmup: int) -> dict:
  model = build_model(config)
  model.eval()
  own = registry.family(config.model.name).generate  # e.g. the Block Transformer's batched generate
  vocab = config.model.vocab_size
  prompt = np.random.default_rng(0).integers(1, vocab, (batch_size, prompt_len)).astype(np.int32)
  key = jax.random.key(0)
  if own is not None:

    def run():
      return own(model, prompt, max_new_tokens=new_tokens, key=key, temperature=0.0)
  else:

    def run():
      return decoding.generate(model, prompt, max_new_tokens=new_tokens, key=key, temperature=0.0)

  median, _ = median_seconds(run, steps=repeats, warmup=warmup)
  state = jax.eval_shape(lambda: model.init_decode_state(batch_size, prompt_len + new_tokens))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return dict(
    batch_size=batch_size,
    prompt=prompt_len,
    new=new_tokens,
    seconds=median,
    tokens_per_s=batch_size * new_tokens / median,
    state_mib=state_bytes / MiB,
    non_embedding=non_embedding_parameter_count(config),
  )


def format_table(rows: Sequence[dict]) -> str:
  header = [
    "variant",
    "non-embedding params",
    "batch",
    "prompt",
    "generated",
    "time (s)",
    "generated tokens/s",
    "speed-up",
    "decode state MiB",
  ]
  lines = []
  base = {}
  for r in rows:  # speed-up against the last variant (the baseline) at the same setting
    base[(r["batch_size"], r["prompt"], r["new"])] = r.get("tokens_per_s")
  for r in rows:
    if "oom" in r:
      lines.append((r["variant"], "", r["batch_size"], f"{r['prompt']:,}", f"{r['new']:,}", "OOM", "", "", ""))
      continue
    ref = base[(r["batch_size"], r["prompt"], r["new"])]
    speedup = f"{r['tokens_per_s'] / ref:.1f}x" if ref else ""
    lines.append(
      (
        r["variant"],
        f"{r['non_embedding']:,}",
        r["batch_size"],
        f"{r['prompt']:,}",
        f"{r['new']:,}",
        f"{r['seconds']:.2f}",
        f"{r['tokens_per_s']:,.0f}",
        speedup,
        f"{r['state_mib']:,.1f}",
      )
    )
  return markdown_table(header, lines)


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--batch_sizes", default="1,32")
  parser.add_argument("--settings", default="2048:128,128:2048", help="PROMPT:NEW pairs")


def main(argv: Sequence[str] | None = None) -> list[dict]:
  argv, args, variants = parse_command(
    argv,
    prog="python scripts/bench_generate.py",
    doc=__doc__,
    flags=add_flags,
    repeats=3,
    variant_help="as scripts/bench.py; the last variant is the baseline of the speed-up column",
  )
  rows = []
  for prompt_len, new in parse_settings(args.settings):
    for batch_size in ints(args.batch_sizes):
      for variant in variants:
        spec, overrides = variant_config(args.config, variant)
        config = load_config(spec, [*args.override, *overrides, f"train.seq_len={prompt_len + new}"])
        row = {"variant": variant.name, "batch_size": batch_size, "prompt": prompt_len, "new": new}
        try:
          row.update(
            time_generate(
              config,
              batch_size=batch_size,
              prompt_len=prompt_len,
              new_tokens=new,
              repeats=args.repeats,
              warmup=args.warmup,
            )
          )
          shown = f"{row['tokens_per_s']:,.0f} generated tokens/s"
        except Exception as error:  # noqa: BLE001 - an out-of-memory row, anything else re-raised
          if not is_oom(error):
            raise
          row["oom"], shown = True, "OOM"
        print(f"{variant.name} batch {batch_size} prompt {prompt_len} new {new}: {shown}", file=sys.stderr, flush=True)
        rows.append(row)
  publish("scripts/bench_generate.py", argv, format_table(rows), rows, args)
  return rows


if __name__ == "__main__":
  cli.run(main)
