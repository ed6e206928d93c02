"""Times the trainer's jitted train step: tokens/s, compile time, memory and FLOP/s per length.

  python scripts/bench.py --config=configs/enwik8/transformer.py \
      --variant base: --variant glu:model.mlp=glu,model.d_ff=1536 \
      --seq_lens=2048,8192,16384 --batch_size=1 --steps=5 --warmup=2 --out=docs/bench.md
  python scripts/bench.py --cores=causal_latte,causal_attention --seq_lens=512,2048   # attention cores alone

The code and what it reports: lra_core/bench/train_step.py (--cores: lra_core/bench/cores.py).
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.train_step")()
