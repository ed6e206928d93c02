"""Latte language models on C4 (Dolga et al., Table 1 variants with the sizes of Table 5).

  python -m lra_core.data.tokenizer --train --input=/data/c4/en --model_prefix=/data/c4/en/spm_bpe50k \
      --vocab_size=50267
  python -m lra_core.train --config=configs/c4/latte.py:latte_rglru_swa++ \
      --config.data.dir=/data/c4/en --workdir=runs/c4_latte

The paper trains on OpenWebText with a 50,267-token BPE (Appendix A.1; Table 5 prints "57K"); C4
is our web corpus, with a SentencePiece BPE of the same size learned on it (first command).
Table 5, OpenWebText column: 12 layers, 8 heads, width 768 (printed 756, which 8 heads do not
divide; Table 1's counts fit 768), feed-forward 3072, L 128, window 128, K 3, no dropout, lr 6e-4
with 2000 warmup steps and cosine decay, 100k steps, weight decay 0.01, T 1024, batch 80, tied
embeddings. The embedding table stores E itself, as the authors' code (`model.embedding=plain`, the
Latte family's default; `scaled` stores E / sqrt(d) and moves it sqrt(d) times faster under Adam).
Parameter counts: `python scripts/param_counts.py`.

Args (comma-separated): one variant of models.latte.VARIANTS (default latte): latte, latte++,
latte_conv++, latte_conv_swa++, latte_rglru++, latte_rglru_swa++ (Table 1), or rglru_swa++ (Table 2's
baseline without Latte: RG-LRU and sliding-window attention); tiny (bytes, 2 layers, d 32).
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets import c4
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.models import latte

VOCAB = 50267
SPM_MODEL = "spm_bpe50k.model"  # relative: resolved under data.dir


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + tuple(latte.VARIANTS))
  model, opt, train = presets.lm_config(
    presets.variant_from_args(parts),
    vocab_size=VOCAB,
    sizes=presets.PAPER_LM,
    lr=6e-4,
    warmup=2000,
    steps=100_000,
    dropout=0.0,
  )
  config = base_config(task="lm", model=model, data=c4.data_config(tokenizer=SPM_MODEL, packing="concat"), optim=opt)
  config.train.update(dict(batch_size=80, seq_len=1024, **train))
  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.vocab_size = ByteTokenizer.vocab_size
    presets.tiny(config, seq_len=64)
  return config
