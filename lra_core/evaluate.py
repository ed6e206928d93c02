"""Evaluate a trained workdir on one split.

  python -m lra_core.evaluate --config=<spec> --workdir=<dir> --split=test [--step=N]

Restores the latest (or given) checkpoint onto the current mesh, runs the task's metrics over
the whole split and writes `eval_<split>_<step>.json` into the workdir.
"""

from __future__ import annotations

import logging
import pathlib

from lra_core import cli, experiment, optim, sharding
from lra_core.checkpoint import restore_params
from lra_core.data import SPLITS
from lra_core.metrics import MetricWriter
from lra_core.state import make_state_spec


def evaluate(config, workdir: str | pathlib.Path, split: str = "test", *, step: int | None = None) -> dict:
  mesh = sharding.make_mesh(config.mesh)
  sources, task = experiment.setup_data(config, [split], mesh)
  tx, _ = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  state, step = restore_params(workdir, spec.abstract, step)
  with sharding.activate(mesh, config.sharding.rules):
    metrics = experiment.Evaluator(config, spec, task, mesh, sources)(state, split)
  result = {"step": step, "split": split, **metrics}
  writer = MetricWriter(workdir)
  writer.write_json(f"eval_{split}_{step}.json", result)
  writer.close()
  return result


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")

  args = cli.parse(argv, extra=flags, prog="python -m lra_core.evaluate")
  result = evaluate(args.config, args.workdir, args.extra.split, step=args.extra.step)
  logging.info("evaluated step %d on %s", result["step"], args.extra.split)
  print(", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
  cli.run(main)
