"""The trainer's loop against its bare step: what data loading, metrics and checkpoints cost.

  python scripts/bench_loop.py                                   # the embedded default (ListOps)
  python scripts/bench_loop.py --config=configs/enwik8/transformer.py:tiny --override train.steps=40

Runs `lra_core.train.train_and_evaluate` on the config in a fresh workdir (a temporary folder unless
--workdir): the data pipeline, the numerics guard, metric logging, evaluations and checkpoints as the
config has them. The trainer logs tokens/s for each interval of train.log_every steps (its meter leaves
evaluations out; checkpoint saves and everything else on the host stay in). Then the same train step
runs bare (lra_core.bench.train_step.TrainStepRun: the trainer's jitted step at the config's batch
shapes on random tokens, no host work between steps), --bare_steps calls after --warmup.

Reported: the loop's median interval tokens/s (the first interval, which starts the data pipeline,
left out when there are others), the whole run's (summary.json: evaluations included), the bare
step's median tokens/s, and loop / bare.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Sequence

from lra_core import cli
from lra_core.bench.common import median_seconds, output_flags, publish
from lra_core.bench.train_step import TrainStepRun
from lra_core.config import load_config, log_interval
from lra_core.errors import ConfigError
from lra_core.train import DEFAULT_CONFIG, train_and_evaluate


def loop_tokens_per_s(workdir: pathlib.Path) -> list[float]:
  """tokens/s of each logged training interval of the run in `workdir`, in order."""
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  return [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and "step" in row]


def measure(config, workdir: pathlib.Path, *, bare_steps: int = 50, warmup: int = 5) -> dict:
  """Trains `config` in `workdir` (which must hold no run), then times the bare step; -> a row."""
  if bare_steps < 1 or warmup < 0:
    raise ConfigError(f"bare_steps {bare_steps} / warmup {warmup}: expected bare_steps >= 1 and warmup >= 0.")
  if (workdir / "metrics.jsonl").exists():
    raise ConfigError(f"workdir {workdir} already holds a run; the loop is timed from a fresh start.")
  summary = train_and_evaluate(config, workdir)
  intervals = loop_tokens_per_s(workdir)
  if not intervals:
    raise ConfigError(
      f"the run logged no tokens/s; train.steps {config.train.steps} must reach "
      f"train.log_every {log_interval(config.train)}."
    )
  steady = intervals[1:] or intervals
  run = TrainStepRun(config).ready()
  median, _ = median_seconds(run, steps=bare_steps, warmup=warmup)
  run.free()
  tokens = config.train.batch_size * config.train.seq_len
  loop = statistics.median(steady)
  return {
    "steps": config.train.steps,
    "log_every": log_interval(config.train),
    "batch_size": config.train.batch_size,
    "seq_len": config.train.seq_len,
    "loop_tokens_per_s": loop,
    "loop_intervals": intervals,
    "run_tokens_per_s": summary.get("tokens_per_s"),
    "bare_tokens_per_s": tokens / median,
    "bare_step_ms": 1e3 * median,
    "ratio": loop / (tokens / median),
  }


def format_table(row: dict) -> str:
  run = row["run_tokens_per_s"]
  return "\n".join(
    [
      "| T x batch | steps | loop tokens/s (median interval) | whole run tokens/s (with evals) | "
      "bare step tokens/s | bare step ms | loop / bare |",
      "|---|---|---|---|---|---|---|",
      f"| {row['seq_len']} x {row['batch_size']} | {row['steps']} | {row['loop_tokens_per_s']:,.0f} | "
      f"{'-' if run is None else format(run, ',.0f')} | {row['bare_tokens_per_s']:,.0f} | {row['bare_step_ms']:.1f} | "
      f"{row['ratio']:.3f} |",
    ]
  )


def main(argv: Sequence[str] | None = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.doc_parser("python scripts/bench_loop.py", __doc__)
  parser.add_argument("--config", default=DEFAULT_CONFIG, help="config file[:arg] (default: the embedded default)")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="config override")
  parser.add_argument("--workdir", default="", help="a fresh folder for the run (default: a temporary one)")
  parser.add_argument("--bare_steps", type=int, default=50, help="timed bare steps (the median is reported)")
  parser.add_argument("--warmup", type=int, default=5, help="untimed bare steps first")
  output_flags(parser)
  args = parser.parse_args(argv)
  cli.setup_logging()
  config = load_config(args.config, args.override)
  with tempfile.TemporaryDirectory(prefix="bench_loop_") as tmp:
    row = measure(config, pathlib.Path(args.workdir or tmp), bare_steps=args.bare_steps, warmup=args.warmup)
  publish("scripts/bench_loop.py", argv, format_table(row), [row], args)
  return row


if __name__ == "__main__":
  cli.run(main)
