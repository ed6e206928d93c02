"""The trainer's tokens/s against its bare jitted step's at the same shapes (data, metrics, checkpoints).

  python scripts/bench_loop.py                   # the embedded default: ListOps, as python -m lra_core.train runs it

What it runs and reports: lra_core/bench/loop.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.loop")()
