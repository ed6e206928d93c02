"""Latte language models on PG-19 books (Dolga et al., Table 5, long-sequence column of Figure 6).

  python -m lra_core.data.tokenizer --train --input=/data/pg19/train \
      --model_prefix=/data/pg19/spm_bpe50k --vocab_size=50267
  python -m lra_core.train --config=configs/pg19/latte.py:latte_rglru_swa++ \
      --config.data.dir=/data/pg19 --workdir=runs/pg19_latte

The paper's long-context runs (Figures 5b and 6) train on BookCorpus; PG-19 is our book corpus.
Table 5, Figure 6 column: 12 layers, 8 heads, width 512, feed-forward 2048, L 128, window 128,
K 3, dropout 0.2 (also on p(l|t): model.latent_dropout), lr 2.5e-4 with 2000 warmup steps and cosine decay,
300k steps, weight decay
0.01, sequences of 5000 tokens, batch 4; BPE of 50,267 pieces (first command), tied embeddings.
Evaluate longer sequences (the paper extrapolates to 16K) with --config.train.seq_len at eval.

Args (comma-separated): one variant of models.latte.VARIANTS (default latte; rglru_swa++ is Table 2's
baseline without Latte), tiny.
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets import pg19
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.models import latte

VOCAB = 50267
SPM_MODEL = "spm_bpe50k.model"  # relative: resolved under data.dir
SIZES = dict(d_model=512, num_layers=12, num_heads=8, d_ff=2048, num_latents=128, conv_kernel=3)


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + tuple(latte.VARIANTS))
  model, opt, train = presets.lm_config(
    presets.variant_from_args(parts), vocab_size=VOCAB, sizes=SIZES, lr=2.5e-4, warmup=2000, steps=300_000, dropout=0.2
  )
  config = base_config(task="lm", model=model, data=pg19.data_config(tokenizer=SPM_MODEL), optim=opt)
  config.train.update(dict(batch_size=4, seq_len=5000, **train))
  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.vocab_size = ByteTokenizer.vocab_size
    presets.tiny(config, seq_len=64)
  return config
