"""Times our train step against a plain JAX reference of the same model, interleaved in one process.

  python scripts/peer_bench.py --config=configs/enwik8/transformer.py \
      --override model.d_model=256 --override model.num_layers=4 --override model.num_heads=4 \
      --override model.d_ff=1024 --override model.dropout=0.0 \
      --variant transformer: --variant transformer+:config=configs/enwik8/transformer.py:plus \
      --shapes=1024x8,256x32 --out=docs/benchmarks.md

The peers and what they mirror: lra_core/bench/peer_lm1b.py (Transformer, Transformer+, Transformer++)
and lra_core/bench/peer_vq.py (Transformer-VQ); the harness: lra_core/bench/peer.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.peer")()
