"""Times our train step against a plain JAX reference of the same model, interleaved in one process.

The peers and what they mirror: lra_core/bench/plain_jax_lm1b.py (Transformer, Transformer+, Transformer++)
and lra_core/bench/plain_jax_vq.py (Transformer-VQ); the harness and examples (also in --help):
lra_core/bench/side_by_side.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.side_by_side")()
