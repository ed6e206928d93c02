"""Evaluate a trained workdir on one split.

  python -m lra_core.evaluate --workdir=<dir> [--split=test] [--step=N] [--config.KEY=VALUE ...]
  python -m lra_core.evaluate --config=<spec> --workdir=<dir> ...

Without --config the run's own config is used (`<workdir>/config.json`, written by the trainer),
with any overrides on top (e.g. --config.train.eval_batch_size=64, or --config.data.dir=... on
another machine). Restores the parameters and model state of the latest (or given) checkpoint
onto the current mesh (not the optimizer state), runs the task's metrics over the whole split and
writes `eval_<split>_<step>.json` into the workdir. The workdir may be local or gs://. A run that
kept an EMA of its weights (optim.ema_decay > 0) is evaluated with it, and its raw weights' metrics
are reported beside, suffixed `_raw` (`loss` and `loss_raw`).
"""

from __future__ import annotations

import json
import logging

import jax

from lra_core import cli, layout, sharding
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.checkpoints.saved_config import load_workdir_config
from lra_core.dataset_record import SPLITS
from lra_core.run import data_setup
from lra_core.run.evaluation import Evaluator
from lra_core.run.state import run_setup
from lra_core.runtime import fs

EXAMPLE = "python -m lra_core.evaluate --workdir runs/listops_tiny --split validation --config.train.eval_batch_size 64"


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


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")

  args = cli.parse(
    argv, extra=flags, prog="python -m lra_core.evaluate", config_from_workdir=load_workdir_config, example=EXAMPLE
  )
  result = evaluate(args.config, args.workdir, args.extra.split, step=args.extra.step, write=False)
  logging.info("evaluated step %d on %s", result["step"], args.extra.split)
  print(", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
  write_result(args.workdir, result)  # after printing: a workdir that cannot take it loses nothing


if __name__ == "__main__":
  cli.run(main)
