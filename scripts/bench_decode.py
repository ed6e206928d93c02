"""Times autoregressive decoding: milliseconds per generated token as the context grows.

The code, what it reports and examples (also in --help): lra_core/bench/decode.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.decode")()
