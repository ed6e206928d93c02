"""Reproduces the papers' tables: one command per table, the paper's numbers beside ours.

Examples (also in --help), the tables and how --out rebuilds a results file: lra_core/reproduce/.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.reproduce.cli")()
