"""Generation throughput (Block Transformer Table 2 / Figure 2 style): generated tokens per second
of whole prompt -> continuation calls, by batch size and (prompt, generated) lengths.

  python scripts/bench_generate.py --config=configs/c4/block_transformer.py:5m \
      --variant block: --variant vanilla:config=configs/c4/block_transformer.py:5m,vanilla \
      --batch_sizes=1,32 --settings=2048:128,128:2048 --out=docs/benchmarks.md

The code and what it reports: lra_core/bench/generate.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.generate")()
