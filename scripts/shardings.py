"""How a config's parameters are split over a mesh, computed without devices.

The code, what it reports and examples (also in --help): lra_core/bench/shardings.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.shardings")()
