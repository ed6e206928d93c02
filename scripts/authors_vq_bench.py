"""Times our Transformer-VQ train step beside the authors' own code, interleaved in one process.

  git clone https://github.com/transformer-vq/transformer_vq /tmp/transformer_vq
  sed -i 's/a_min=/min=/g' /tmp/transformer_vq/src/transformer_vq/nn/*.py   # jnp.clip's renamed argument
  pip install chex
  python scripts/authors_vq_bench.py --authors_src=/tmp/transformer_vq/src --lengths=2048,8192,32768

Their model is built from their modules (nothing of theirs is in this project) at the sizes of
`SIZES` below: single-head GAUs (their n_layer counts layers of two), no dropout, one update window
over the whole sequence, mem_len = block_len, grad_thru_cache and agg_cache on, float32. Their step
is value_and_grad of their `loss_fn` from a fresh cache and our config's optimizer update; ours is
the trainer's full step (lra_core/bench/side_by_side.py's harness: the same batch, the order reversed every
round, medians after warm-up rounds, compiles apart), every length in the same loop. Prints one
JSON line per length; after the first, `ours_growth` and `authors_growth` are each side's time per
token there over its time per token at the first length (1.0: linear in the length).
"""

import importlib.util
import json
import statistics
import sys
import time

# Before JAX: a command imports it with the accelerator plugins' noise dropped (lra_core/runtime/quiet_start.py).
import lra_core  # noqa: F401

# isort: split
import jax.numpy as jnp

from lra_core import cli
from lra_core.bench.side_by_side import Peer, PeerStepRun, interleaved_seconds
from lra_core.bench.train_step import TrainStepRun, bench_config

D_MODEL, D_K, D_V, GAUS, CODES, BLOCK = 256, 128, 512, 4, 512, 512
SIZES = [
  f"model.d_model={D_MODEL}",
  f"model.d_k={D_K}",
  f"model.d_v={D_V}",
  f"model.num_layers={GAUS}",
  f"model.n_code={CODES}",
  f"model.block_len={BLOCK}",
  "model.dropsin=0.0",
  "model.dropres=0.0",
  "model.droplyr=0.0",
]


def authors_peer(seq_len: int, batch_size: int = 1) -> Peer:
  """Their Transformer at SIZES (their modules must be importable: --authors_src)."""
  from transformer_vq.nn.model import Transformer
  from transformer_vq.nn.types import TransformerConfig
  from transformer_vq.nn.vq import VQSpec
  from transformer_vq.ops.loss import loss_fn

  zero_dropout = dict(p_dropemb=0.0, p_dropsin=0.0, p_dropres=0.0, p_droplyr=0.0)
  config = TransformerConfig.create(
    param_dtype="float32",
    dtype="float32",
    global_batch_size=batch_size,
    sequence_len=seq_len,
    update_len=seq_len,
    block_len=BLOCK,
    mem_len=BLOCK,
    grad_thru_cache=1,
    agg_cache=1,
    d_model=D_MODEL,
    d_k=D_K,
    d_v=D_V,
    d_ff=0,
    n_head=1,
    n_code=CODES,
    n_layer=GAUS // 2,
    n_vocab=256,
    pe_abs=0,
    pe_lam=1e5,
    p_nucleus=1.0,
    c_beta=1e-4,
    c_gamma=0.99,
    e_tie=0,
    e_preln=0,
    e_scale=1.0,
    is_train=1,
    **zero_dropout,
  )
  mask = jnp.ones([batch_size, seq_len], jnp.float32)
  spec = VQSpec.create(n_device=jnp.array([1]), n_block_per_update=jnp.array([seq_len // BLOCK]), loss_mask=mask)

  def init(key):
    x = jnp.zeros([batch_size, seq_len], jnp.int32)
    rngs = dict(params=key, ephemeral=key, timeless=key)
    state = Transformer.initial_state(config, batch_size)
    return Transformer(config).init(rngs, inputs=x, doc_ids=x, state=state, vq_spec=spec)["params"], {}

  def loss(params, state, batch, key):
    full = dict(batch, doc_ids=jnp.zeros_like(batch["inputs"]), loss_mask=mask)
    cache = Transformer.initial_state(config, batch_size)
    value, _ = loss_fn(params, config, full, cache, spec, dict(ephemeral=key, timeless=key))
    return value, state

  return Peer("authors", init, loss)


def compare(lengths: list[int], *, steps: int, warmup: int, overrides=()) -> list[dict]:
  """One row per length; every length's two steps are timed in one interleaved loop, so that the
  growth from the first length is measured under the same load as the ratios."""
  runs, compiles = [], []
  for seq_len in lengths:
    config = bench_config("configs/enwik8/transformer_vq.py", [*SIZES, *overrides], seq_len=seq_len)
    start = time.perf_counter()
    ours = TrainStepRun(config).ready()
    middle = time.perf_counter()
    theirs = PeerStepRun(authors_peer(seq_len), ours.tx, ours.host_batches[0])
    compiles.append((middle - start, time.perf_counter() - middle))
    runs += [ours, theirs]
  times = interleaved_seconds(runs, steps=steps, warmup=warmup)
  rows = []
  for i, seq_len in enumerate(lengths):
    ours_s, theirs_s = times[2 * i], times[2 * i + 1]
    row = {
      "tokens": seq_len,
      "ours_ms": 1e3 * statistics.median(ours_s),
      "authors_ms": 1e3 * statistics.median(theirs_s),
      "ours_ms_all": [round(1e3 * t) for t in ours_s],
      "authors_ms_all": [round(1e3 * t) for t in theirs_s],
      "ours_compile_s": compiles[i][0],
      "authors_compile_s": compiles[i][1],
    }
    row["ratio"] = row["ours_ms"] / row["authors_ms"]
    if rows:  # each side's time per token here over its time per token at the first length
      tokens = seq_len / rows[0]["tokens"]
      row["ours_growth"] = row["ours_ms"] / rows[0]["ours_ms"] / tokens
      row["authors_growth"] = row["authors_ms"] / rows[0]["authors_ms"] / tokens
    rows.append(row)
  for run in runs[::2]:
    run.free()
  return rows


def main(argv=None) -> list[dict]:
  parser = cli.doc_parser("python scripts/authors_vq_bench.py", __doc__)
  parser.add_argument("--authors_src", required=True, help="the `src` folder of their repository")
  parser.add_argument("--lengths", default="2048,8192", help="comma-separated sequence lengths")
  parser.add_argument("--steps", type=int, default=5, help="timed steps of each side (the median is reported)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed rounds after compiling")
  parser.add_argument(
    "--override", action="append", default=[], metavar="KEY=VALUE", help="for our config; or --config.KEY=VALUE"
  )
  args = cli.parse_overriding(parser, list(sys.argv[1:] if argv is None else argv))
  sys.path.insert(0, args.authors_src)
  if importlib.util.find_spec("transformer_vq") is None:
    parser.error(f"--authors_src {args.authors_src} holds no transformer_vq package (their repository's src folder).")
  rows = compare(
    [int(x) for x in args.lengths.split(",")], steps=args.steps, warmup=args.warmup, overrides=args.override
  )
  for row in rows:
    print(json.dumps(row), flush=True)
  return rows


if __name__ == "__main__":
  cli.run(main)
