"""Times the trainer's jitted train step: tokens/s, compile time, memory and FLOP/s per length.

The code, what it reports and examples (also in --help): lra_core/bench/train_step.py (--cores:
lra_core/bench/cores.py).
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.train_step")()
