r"""Our train step side by side with a peer's: a plain JAX implementation of the same model and size.

  python scripts/peer_bench.py --config=configs/enwik8/transformer.py \
      --override model.d_model=256 --override model.num_layers=4 --override model.num_heads=4 \
      --override model.d_ff=1024 --override model.dropout=0.0 \
      --variant transformer: --variant transformer+:config=configs/enwik8/transformer.py:plus \
      --shapes=1024x8,256x32 --out=docs/benchmarks.md

The same command as `python -m lra_core.bench.side_by_side`.

A peer is written the way its public code base writes the model (lra_core/bench/plain_jax_lm1b.py,
plain_jax_vq.py), computing the same function as ours. scripts/peer_bench.py times our trainer's full
train step (lra_core/bench/train_step.py's TrainStepRun: metrics, norms, schedule and all) and the
peer's step in one process, interleaved (the order reversed every round), on the same random batch
shapes, with the same optimizer built from the same config; median of --steps after --warmup rounds,
compiles excluded. Reported beside the times: each step's matrix-product FLOPs (loops counted by
their trip counts: bench.common.cost_flops) and its FLOP/s as a fraction of a float32 matmul's on
the same machine.

  Peer.init(key)                       -> (params, state)   params are trained; state is carried
                                                            (e.g. codebook statistics), may be {}
  Peer.loss(params, state, batch, key) -> (loss, new_state)  batch: {"inputs", "targets"} int32 [B,T]

The peer's step is value_and_grad of `loss` with respect to params, the optimizer update, and the
new state: nothing else.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lra_core import cli
from lra_core.bench.common import Variant, cost_flops, ints, output_flags, parse_variant, publish, variant_config
from lra_core.bench.train_step import TrainStepRun, bench_config, matmul_peak_flops
from lra_core.errors import ConfigError
from lra_core.markdown import markdown_table


class Peer(NamedTuple):
  name: str
  init: Callable[[jax.Array], tuple[Any, Any]]
  loss: Callable[[Any, Any, dict, jax.Array], tuple[jax.Array, Any]]


# Which peer each family is compared with: module path (with make_peer(config) -> Peer).
PEERS = {"transformer": "lra_core.bench.plain_jax_lm1b", "transformer_vq": "lra_core.bench.plain_jax_vq"}


def make_peer(config) -> Peer:
  """The peer of config.model.name's family at this config."""
  name = config.model.name
  if name not in PEERS:
    raise ConfigError(f"no peer implementation for model {name!r}; peers exist for {sorted(PEERS)}.")
  return importlib.import_module(PEERS[name]).make_peer(config)


class PeerStepRun:
  """The peer's train step (value_and_grad of its loss, the optimizer `tx`, its new state), compiled
  for `host_batch`'s shapes on the default device; each call runs one step on that batch."""

  def __init__(self, peer: Peer, tx: optax.GradientTransformation, host_batch: dict, *, seed: int = 0):
    def step(params, opt_state, state, batch, key):
      (loss, state), grads = jax.value_and_grad(peer.loss, has_aux=True)(params, state, batch, key)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, state, loss

    self.batch = {name: jnp.asarray(host_batch[name]) for name in ("inputs", "targets")}
    params, self.state = jax.jit(peer.init)(jax.random.key(seed))
    self.params, self.opt_state = params, jax.jit(tx.init)(params)
    self.key = jax.random.key(seed + 1)
    self.num_params = sum(x.size for x in jax.tree.leaves(params))
    self.compiled = (
      jax.jit(step, donate_argnums=(0, 1, 2))
      .lower(self.params, self.opt_state, self.state, self.batch, self.key)
      .compile()
    )
    self.loss = None

  def __call__(self):
    self.params, self.opt_state, self.state, self.loss = self.compiled(
      self.params, self.opt_state, self.state, self.batch, self.key
    )
    return self.loss


def interleaved_seconds(fns: Sequence[Callable[[], object]], *, steps: int, warmup: int) -> list[list[float]]:
  """Times of `steps` calls of each fn after `warmup` untimed rounds, called in turns (the order
  reversed every round, so neither side always runs first); each call is waited for."""
  times = [[] for _ in fns]
  for rep in range(warmup + steps):
    order = range(len(fns)) if rep % 2 == 0 else reversed(range(len(fns)))
    for i in order:
      start = time.perf_counter()
      jax.block_until_ready(fns[i]())
      if rep >= warmup:
        times[i].append(time.perf_counter() - start)
  return times


def compare(config, *, steps: int = 5, warmup: int = 2, peer: Peer | None = None) -> dict:
  """Our train step and the peer's at `config` (its seq_len and batch_size), timed interleaved."""
  if steps < 1 or warmup < 0:
    raise ConfigError(f"steps {steps} / warmup {warmup}: expected steps >= 1 and warmup >= 0.")
  peer = peer or make_peer(config)
  ours = TrainStepRun(config).ready()
  theirs = PeerStepRun(peer, ours.tx, ours.host_batches[0], seed=config.train.seed)
  ours_times, peer_times = interleaved_seconds([ours, theirs], steps=steps, warmup=warmup)
  ours_s, peer_s = statistics.median(ours_times), statistics.median(peer_times)
  ours_flops, peer_flops = cost_flops(ours.compiled), cost_flops(theirs.compiled)
  row = {
    "seq_len": config.train.seq_len,
    "batch_size": config.train.batch_size,
    "peer": peer.name,
    "steps": steps,
    "warmup": warmup,
    "ours_ms": 1e3 * ours_s,
    "peer_ms": 1e3 * peer_s,
    "ratio": ours_s / peer_s,
    "ours_ms_all": [1e3 * t for t in ours_times],
    "peer_ms_all": [1e3 * t for t in peer_times],
    "ours_flops": ours_flops,
    "peer_flops": peer_flops,
    "ours_params": ours.num_params,
    "peer_params": theirs.num_params,
    "ours_loss": float(jax.device_get(ours.metrics["objective"])),
    "peer_loss": float(jax.device_get(theirs.loss)),
  }
  ours.free()
  return row


COLUMNS = (
  "variant",
  "T x batch",
  "ours ms/step",
  "peer ms/step",
  "ours / peer",
  "ours GFLOP/step",
  "peer GFLOP/step",
  "ours % of matmul peak",
  "peer % of matmul peak",
)


def shapes(text: str) -> list[tuple[int, int]]:
  """'1024x8,256x32' -> [(1024, 8), (256, 32)]: sequence length x batch size."""
  out = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    t, sep, b = item.partition("x")
    if not sep:
      raise ConfigError(f"shape {item!r} is not of the form TxB, e.g. 1024x8.")
    out.append(tuple(ints(f"{t},{b}")))
  if not out:
    raise ConfigError(f"{text!r} names no shape; expected e.g. 1024x8,256x32.")
  return out


def set_peak_fractions(rows: Sequence[dict], peak: float) -> None:
  for row in rows:
    row["peak_flops"] = peak
    for side in ("ours", "peer"):
      flops = row.get(f"{side}_flops")
      row[f"{side}_peak_fraction"] = None if flops is None else flops / (row[f"{side}_ms"] / 1e3) / peak


def format_table(rows: Sequence[dict]) -> str:
  lines = []
  num = lambda x, scale, fmt: "-" if x is None else format(x * scale, fmt)
  for r in rows:
    cells = [
      r["variant"],
      f"{r['seq_len']} x {r['batch_size']}",
      f"{r['ours_ms']:,.0f}",
      f"{r['peer_ms']:,.0f}",
      f"{r['ratio']:.2f}",
      num(r["ours_flops"], 1e-9, ",.1f"),
      num(r["peer_flops"], 1e-9, ",.1f"),
      num(r.get("ours_peak_fraction"), 100, ".1f"),
      num(r.get("peer_peak_fraction"), 100, ".1f"),
    ]
    lines.append(cells)
  return markdown_table(COLUMNS, lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.doc_parser("python scripts/peer_bench.py", __doc__)
  parser.add_argument(
    "--config", required=True, help=f"config file[:arg] of a family with a peer ({', '.join(sorted(PEERS))})"
  )
  parser.add_argument(
    "--override",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override for every variant (repeatable); --config.KEY=VALUE, as lra_core.train takes it, too",
  )
  parser.add_argument(
    "--variant",
    action="append",
    default=[],
    metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
    help="a named set of overrides (repeatable); config=<spec> gives it its own config file",
  )
  parser.add_argument("--shapes", default="1024x8,256x32", help="comma-separated TxB (sequence length x batch)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps of each side (the median is reported)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed rounds after compiling")
  parser.add_argument("--matmul_size", type=int, default=0, help="matmul yardstick size (0: 2048 on CPU, 8192 else)")
  output_flags(parser)
  args = cli.parse_overriding(parser, argv)
  cli.setup_logging()
  variants = [parse_variant(v) for v in args.variant] or [Variant("default")]
  rows = []
  for variant in variants:
    spec, variant_overrides = variant_config(args.config, variant)
    for seq_len, batch_size in shapes(args.shapes):
      config = bench_config(spec, [*args.override, *variant_overrides], seq_len=seq_len, batch_size=batch_size)
      row = {"variant": variant.name, **compare(config, steps=args.steps, warmup=args.warmup)}
      rows.append(row)
      print(
        f"{variant.name} {seq_len}x{batch_size}: ours {row['ours_ms']:,.0f} ms, peer {row['peer_ms']:,.0f} ms, "
        f"ratio {row['ratio']:.2f}",
        file=sys.stderr,
        flush=True,
      )
      gc.collect()
  peak = matmul_peak_flops(args.matmul_size, steps=args.steps, warmup=args.warmup)
  set_peak_fractions(rows, peak)
  publish("scripts/peer_bench.py", argv, format_table(rows), rows, args, peak=peak, matmul_size=args.matmul_size)
  return rows


if __name__ == "__main__":
  cli.run(main)
