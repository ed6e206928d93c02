"""How a config's parameters are split over a mesh, computed without devices.

  python scripts/shardings.py --config=configs/c4/latte.py --devices=256 \
      --config.mesh.data=16 --config.mesh.fsdp=-1 --config.mesh.tensor=4
  python scripts/shardings.py --families --devices=8 --config.mesh.data=2 \
      --config.mesh.fsdp=2 --config.mesh.tensor=2      # every model family's tiny config
  python scripts/shardings.py --families --paper --devices=64 --config.mesh.data=8 \
      --config.mesh.fsdp=4 --config.mesh.tensor=2      # the paper sizes (docs/launching.md)

The code and what it reports: lra_core/bench/shardings.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.shardings")()
