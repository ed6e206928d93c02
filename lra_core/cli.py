"""Command-line parsing shared by train / evaluate / sample.

  --config=<file>[:arg]   a config file and its argument (ml_collections style)
  --config.<key>=<value>  overrides, parsed with the field's type (as config_flags does)
  --workdir=<dir>
  --distributed / --coordinator_address / --num_processes / --process_id
                          multi-process runs (lra_core/distributed.py, docs/launching.md)

Overrides go through `lra_core.load_config`, so the command line and the Python API give the
same one-sentence errors (an unknown key names the closest valid keys). A `UserError` ends the
program with that sentence and exit status 2, not a traceback.

The console scripts lra-train, lra-eval, lra-sample and lra-aot (pyproject.toml) run those modules
as `python -m` does; lra-sweep and lra-bench run lra_core.sweep and lra_core.bench.train_step, the
commands of scripts/sweep.py and scripts/bench.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import runpy
import sys
from collections.abc import Callable, Sequence

from lra_core import distributed
from lra_core.config import load_config
from lra_core.errors import UserError


@dataclasses.dataclass
class Args:
  config: object
  workdir: str
  spec: str
  overrides: list[str]
  extra: argparse.Namespace


def setup_logging() -> None:
  logging.basicConfig(level=os.environ.get("LRA_CORE_LOG", "INFO"),
                      format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
  for noisy in ("absl", "orbax", "jax._src", "grain"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def parse(argv: Sequence[str] | None, *, default_config: str | None = None, default_workdir: str | None = None,
          extra: Callable[[argparse.ArgumentParser], None] | None = None, prog: str | None = None,
          workdir: bool = True, description: str | None = None) -> Args:
  """The shared flags (`workdir=False` leaves out --workdir, for tools that write no run)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
  rest = [a for a in argv if not a.startswith("--config.")]
  parser = argparse.ArgumentParser(prog=prog, description=description)
  parser.add_argument("--config", default=default_config, required=default_config is None,
                      help="config file, optionally followed by :ARG (e.g. configs/lra/listops/transformer.py:tiny)")
  if workdir:
    parser.add_argument("--workdir", default=default_workdir, required=default_workdir is None,
                        help="output folder: checkpoints, metrics.jsonl, TensorBoard events, summary.json")
  distributed.add_flags(parser)
  if extra is not None:
    extra(parser)
  ns = parser.parse_args(rest)
  setup_logging()
  config = load_config(ns.config, overrides)
  # After the config (a typo fails at once, in every process) and before anything uses a device.
  distributed.initialize_from_args(ns)
  return Args(config=config, workdir=getattr(ns, "workdir", None), spec=ns.config, overrides=overrides, extra=ns)


def run(main: Callable[[], None]) -> None:
  """Calls `main`, turning a UserError into its one sentence on stderr and exit status 2."""
  try:
    main()
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def as_command(module: str) -> Callable[[], None]:
  """A console script that runs `module` as `python -m <module>` does (its exit status included)."""
  def command() -> None:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  return command


train_command = as_command("lra_core.train")
evaluate_command = as_command("lra_core.evaluate")
sample_command = as_command("lra_core.sample")
aot_command = as_command("lra_core.aot")
sweep_command = as_command("lra_core.sweep")
bench_command = as_command("lra_core.bench.train_step")
