"""Runs one config over a grid of override values and gathers the runs' summaries into one table.

The same command as `lra-sweep`; lra_core/sweep.py has examples (also in --help) and documents the
runs' names, the modes and the tables.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.sweep")()
