"""Reproduces the papers' tables: one command per table, the paper's numbers beside ours.

  python scripts/reproduce.py --list
  python scripts/reproduce.py --table vq_throughput                  # CPU size, minutes
  python scripts/reproduce.py --table vq_codebook --data_dir=/data   # tables that train read data
  python scripts/reproduce.py --table flash_latency --full           # the paper's size (TPU / GPU)
  python scripts/reproduce.py --table params --out=docs/results.md   # replace its section there

The tables and how --out rebuilds a results file: lra_core/reproduce/.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.reproduce.cli")()
