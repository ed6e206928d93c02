"""FLASH on C4: masked language modelling as in Hua et al. 2022 (Tables 6 and 8), or causal LM.

  python -m lra_core.train --config=configs/c4/flash.py \
      --config.data.dir=/data/c4/en --config.data.train_files='c4-train.000*-of-01024.json.gz' \
      --workdir=runs/c4_flash_mlm

Data and vocabulary as configs/c4/transformer.py (T5's SentencePiece model in data.dir, embedding
of 32128 rows, the last one the [MASK] token).
Table 6 (MLM): context 512 (the paper sweeps 512-8192 at 2^18 tokens per batch: batch 512 here,
set train.seq_len and train.batch_size together), 125k steps, AdamW (b1 .9, b2 .999, eps 1e-6,
weight decay 0.01), lr 7e-4 with 10k warmup and linear decay, gradient clipping 0.1 (the paper
clips locally, here by global norm), no dropout, chunk 256.
Table 8: 24 GAUs of d 768, expansion 2, s 128, SiLU, ScaleNorm, scaled sinusoid + RoPE, tied
embeddings: 112M parameters (`python scripts/param_counts.py`); Performer and MC-TFM++ are
12 attention + 12 MLP layers of d 768 with 12 heads, like Transformer+ / Transformer++.

Args (comma-separated):
  a variant of models.flash.VARIANTS (default flash): flash, flash_local, flash_global (chunk 64,
                  as the paper's global-only ablation), mc_transformer++, performer
                  (configs/c4/flash_quad.py: flash_quad)
  lm              causal LM with the Wiki-40B setting of Tables 7 and 9 (LayerNorm; documents
                  concatenated with eos into consecutive windows) instead of MLM
  c512            chunk 512 (the paper finds it better beyond 1024 tokens; also for flash_global)
  tiny            bytes tokenizer, 2 layers, d 32, context 64, chunk 16, 4 steps.
"""

from lra_core.config import config_arg, tiny_train
from lra_core.configs.c4.transformer import EMBED_VOCAB, flash_setting
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.errors import ConfigError
from lra_core.models import flash


def make(arg, default: str):
  """The C4 config for `arg`; `default` is the variant when arg names none."""
  parts = config_arg(arg, ("tiny", "lm", "c512") + tuple(flash.VARIANTS))
  named = parts & set(flash.VARIANTS)
  if len(named) > 1:
    raise ConfigError(f"config args {sorted(named)} are different FLASH variants; give one of them.")
  variant = named.pop() if named else default
  mlm = "lm" not in parts
  chunk = 512 if "c512" in parts else flash.GLOBAL_ONLY_CHUNK if variant == "flash_global" else 256
  model = flash.model_config(
    variant, vocab_size=EMBED_VOCAB, d_model=768, num_heads=12, norm="scale" if mlm else "layer", chunk=chunk
  )
  config = flash_setting(model, mlm=mlm)
  if "tiny" in parts:
    tiny(config, mlm=mlm)
  return config


def tiny(config, *, mlm: bool) -> None:
  """The `tiny` size of every FLASH variant (and Combiner): bytes, several chunks per sequence,
  seconds on a CPU; masked LM adds the mask id to the byte vocabulary."""
  config.data.tokenizer = "bytes"
  config.model.update(dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, qk_dim=16, chunk=16, classifier_hidden=32))
  tiny_train(config, seq_len=64)
  config.model.vocab_size = ByteTokenizer.vocab_size + mlm


def get_config(arg=None):
  return make(arg, default="flash")
