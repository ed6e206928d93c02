"""Generation throughput (Block Transformer Table 2 / Figure 2 style): generated tokens per second
of whole prompt -> continuation calls, by batch size and (prompt, generated) lengths.

The code, what it reports and examples (also in --help): lra_core/bench/generate.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.generate")()
