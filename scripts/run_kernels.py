"""Runs every Pallas kernel on this machine's device beside its XLA form: outputs, gradients, times.

The code, what it reports and examples (also in --help): lra_core/bench/kernel_run.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.kernel_run")()
