r"""Times autoregressive decoding: milliseconds per generated token as the context grows.

  python scripts/bench_decode.py --config=configs/imagenet64/fit_ar.py:tiny \
      --variant fit_ar: --variant transformer++:config=configs/imagenet64/transformer.py:tiny,plusplus \
      --context_lens=768,3072,12288 --tokens=96 --batch_size=1 --out=docs/benchmarks.md

The same command as `python -m lra_core.bench.decode`.

For each (variant, context length L) the config gets train.seq_len=L (and model.max_len=L where
the model pins one), a freshly initialised model in eval mode, and a decode state for L
positions. One jitted call decodes --tokens tokens with `decode_step` in a `lax.scan`, starting
at position L - tokens: the last tokens of a full context. Every model here computes on
fixed-size caches (a KV cache of L slots, or FIT-AR's group cache, latents and global cache over
L / n groups), so the work of a step depends on L and on where the step falls inside a group,
not on the cached values; the timed window spans whole groups. Reported: the median over
--repeats calls after --warmup, divided by --tokens, and the size of the decode state.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lra_core import cli
from lra_core.bench.common import MiB, ints, median_seconds, parse_command, publish, variant_config
from lra_core.config import load_config
from lra_core.errors import ConfigError
from lra_core.markdown import markdown_table
from lra_core.registry import build_model


def decode_config(spec: str, overrides: Sequence[str], context: int):
  base = load_config(spec, overrides)
  fixed = [f"train.seq_len={context}"] + ([f"model.max_len={context}"] if base.model.get("max_len", 0) else [])
  return load_config(spec, [*overrides, *fixed])


def time_decode(config, *, tokens: int, batch_size: int, repeats: int, warmup: int) -> dict:
  context = config.train.seq_len
  if tokens > context:
    raise ConfigError(f"--tokens {tokens} exceeds the context length {context}.")
  model = build_model(config)
  model.eval()
  graphdef, params = nnx.split(model)
  state = model.init_decode_state(batch_size, context)
  state["index"] = jnp.asarray(context - tokens, jnp.int32)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (tokens, batch_size, 1)), jnp.int32)

  @jax.jit
  def decode(params, state, ids):
    model = nnx.merge(graphdef, params)

    def step(state, token):
      logits, state = model.decode_step(token, state)
      return state, logits[:, 0, 0]

    return jax.lax.scan(step, state, ids)

  median, _ = median_seconds(lambda: decode(params, state, ids), steps=repeats, warmup=warmup)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return dict(
    context=context,
    batch_size=batch_size,
    tokens=tokens,
    ms_per_token=1e3 * median / tokens,
    state_mib=state_bytes / MiB,
    params=sum(x.size for x in jax.tree.leaves(params)),
  )


def format_table(rows: Sequence[dict]) -> str:
  header = ["variant", "context L", "batch", "ms / token", "decode state MiB", "parameters"]
  return markdown_table(
    header,
    [
      (
        r["variant"],
        f"{r['context']:,}",
        r["batch_size"],
        f"{r['ms_per_token']:.2f}",
        f"{r['state_mib']:,.1f}",
        f"{r['params']:,}",
      )
      for r in rows
    ],
  )


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--context_lens", default="1024,4096", help="comma-separated context lengths L")
  parser.add_argument("--tokens", type=int, default=64, help="decoded (timed) tokens per call")
  parser.add_argument("--batch_size", type=int, default=1)


def main(argv: Sequence[str] | None = None) -> list[dict]:
  argv, args, variants = parse_command(
    argv,
    prog="python scripts/bench_decode.py",
    doc=__doc__,
    flags=add_flags,
    repeats=5,
    variant_help="as scripts/bench.py: named overrides, config=<spec> for another config file",
  )
  rows = []
  for variant in variants:
    spec, overrides = variant_config(args.config, variant)
    for context in ints(args.context_lens):
      config = decode_config(spec, [*args.override, *overrides], context)
      row = {
        "variant": variant.name,
        **time_decode(config, tokens=args.tokens, batch_size=args.batch_size, repeats=args.repeats, warmup=args.warmup),
      }
      print(f"{variant.name} L={context}: {row['ms_per_token']:.2f} ms/token", file=sys.stderr, flush=True)
      rows.append(row)
  publish("scripts/bench_decode.py", argv, format_table(rows), rows, args)
  return rows


if __name__ == "__main__":
  cli.run(main)
