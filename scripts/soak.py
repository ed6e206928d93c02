"""SIGKILLs at random moments across a two-process run, each restart checked bit for bit.

  python scripts/soak.py --kills=20 --workdir=runs/soak

What it runs and reports: lra_core/soak.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.soak")()
