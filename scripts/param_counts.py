"""Parameter counts of the paper configs, computed from shapes (jax.eval_shape), beside the papers'.

The code, what it reports and examples (also in --help): lra_core/bench/param_counts.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.param_counts")()
