"""Times autoregressive decoding: milliseconds per generated token as the context grows.

  python scripts/bench_decode.py --config=configs/imagenet64/fit_ar.py:tiny \
      --variant fit_ar: --variant transformer++:config=configs/imagenet64/transformer.py:tiny,plusplus \
      --context_lens=768,3072,12288 --tokens=96 --batch_size=1 --out=docs/benchmarks.md

The code and what it reports: lra_core/bench/decode.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.decode")()
