"""FLASH on PG-19 books (Hua et al. 2022, Tables 3, 7 and 10): causal LM with 72 GAUs of d 1024.

  python -m lra_core.data.tokenizer --train --input=/data/pg19/train \
      --model_prefix=/data/pg19/spm_bpe32k --vocab_size=32000
  python -m lra_core.train --config=configs/pg19/flash.py --config.data.dir=/data/pg19 \
      --workdir=runs/pg19_flash

Table 10: 72 GAUs, d 1024, expansion 2, s 128, SiLU, LayerNorm, scaled sinusoid + RoPE, chunk 512,
tied embeddings: 496M parameters with a 32k vocabulary (`python scripts/param_counts.py`).
Table 7 (PG-19 column): context 8192 at 2^18 tokens per batch (batch 32; Table 3 also runs
1024 / 2048 / 4096 with batch 256 / 128 / 64), 125k steps, AdamW (b1 .9, b2 .999, eps 1e-6,
weight decay 0.01), lr 7e-4 with 10k warmup and linear decay, gradient clipping 0.1 (local in the
paper, global norm here), no dropout. FLASH does not name its vocabulary; the BPE 32k of
configs/pg19/transformer.py is used (first command). The Transformer+ / ++ rows of Table 10 are
configs/pg19/transformer.py:flash(,plusplus). Evaluation reports word-level perplexity.

Args (comma-separated): a variant of models.flash.VARIANTS (default flash; flash_quad for
FLASH-Quad; flash_global with chunk 64, as the paper's global-only ablation), tiny (bytes
tokenizer, 2 layers, d 32, context 64, chunk 16).
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.c4.flash import tiny
from lra_core.configs.pg19.transformer import SPM_MODEL, SPM_VOCAB
from lra_core.configs.presets import flash as flash_presets
from lra_core.data.datasets import pg19
from lra_core.errors import ConfigError
from lra_core.models import flash


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + tuple(flash.VARIANTS))
  named = parts & set(flash.VARIANTS)
  if len(named) > 1:
    raise ConfigError(f"config args {sorted(named)} are different FLASH variants; give one of them.")
  variant = named.pop() if named else "flash"
  chunk = flash.GLOBAL_ONLY_CHUNK if variant == "flash_global" else 512
  model = flash.model_config(variant, vocab_size=SPM_VOCAB, d_model=1024, num_heads=16, norm="layer", chunk=chunk)
  if flash.VARIANTS[variant]["gau"]:
    model.num_layers = 72
  else:  # 36 attention + 36 MLP layers, like the Transformer+ / ++ of Table 10
    model.update(dict(num_layers=36, d_ff=4096 * 2 // 3 if model.mlp == "glu" else 4096))
  opt = flash_presets.paper_optim()
  config = base_config(task="lm", model=model, data=pg19.data_config(tokenizer=SPM_MODEL), optim=opt)
  config.train.update(
    dict(steps=125_000, batch_size=2**18 // 8192, seq_len=8192, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )
  if "tiny" in parts:
    tiny(config, mlm=False)
  return config
