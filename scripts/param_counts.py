"""Parameter counts of the paper configs, computed from shapes (jax.eval_shape), beside the papers'.

  python scripts/param_counts.py            # markdown table on stdout

The code and what it reports: lra_core/bench/param_counts.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.param_counts")()
