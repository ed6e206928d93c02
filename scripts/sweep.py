"""Runs one config over a grid of override values and gathers the runs' summaries into one table.

  python scripts/sweep.py --config=configs/lra/listops/transformer.py:default \
      --sweep model.d_model=64,128 --sweep optim.lr=1e-4,4e-4 --config.train.steps=500 --workdir=runs/sweep
  python scripts/sweep.py ... --launcher="python scripts/launch_tpu.py --name=x --zone=y"
  python scripts/sweep.py --collect --workdir=runs/sweep

The same command as `lra-sweep`; lra_core/sweep.py documents the runs' names, the modes and the tables.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.sweep")()
