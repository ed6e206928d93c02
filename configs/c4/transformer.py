"""C4 (English) causal and masked language modelling with the Transformer baselines.

  python -m lra_core.train --config=configs/c4/transformer.py:mlm \
      --config.data.dir=/data/c4/en --config.data.train_files='c4-train.000*-of-01024.json.gz' \
      --workdir=runs/c4_mlm

Data: allenai/c4 `en/` json.gz shards in data.dir (or data.source=tfds for tfds c4/en); C4 has
no test split, so test reads the validation shards. Text is tokenized with T5's SentencePiece
vocabulary (32000 pieces; put gs://t5-data/vocabs/cc_all.32000/sentencepiece.model in data.dir,
or set data.tokenizer). FLASH does not name its vocabulary, but its Table 8 parameter counts
(110M at d 768, 12 layers) fit a ~32k vocabulary with tied embeddings. The embedding has T5's
padded size 32128, which leaves id 32127 free for the masked-LM [MASK] token.

Args (comma-separated):
  (none), lm      causal LM. FLASH trains causal LMs on Wiki-40B and PG-19, not on C4; this
                  applies its Wiki-40B LM setting (Hua et al. 2022, Tables 7 and 9) to C4:
                  Transformer 12 layers, d 768, 12 heads, MLP 3072, LayerNorm, learned positions,
                  tied embeddings (~110M); context 512 (the paper sweeps 512-8192 at 2^18 tokens
                  per batch: batch 512 here), 125k steps, AdamW (b1 .9, b2 .999, eps 1e-6,
                  weight decay 0.01) lr 7e-4 with 10k warmup and linear decay, no dropout,
                  gradient clipping 0.1 for Transformer+/++ only (the paper clips locally, here
                  by global norm). Documents are concatenated with eos into consecutive windows.
  mlm             FLASH's C4 masked-LM setting (Tables 6 and 8): the same sizes and optimizer,
                  ScaleNorm for Transformer+/++ (Table 8), BERT masking of 15% of the tokens
                  (80% [MASK], 10% random, 10% kept), bidirectional; rows of whole documents
                  packed up to 512 tokens.
  plus, plusplus  Transformer+ (scaled sinusoid + RoPE) / Transformer++ (+ GLU, width 2048 =
                  2/3 x 3072, which keeps Table 8's 110M parameters; our reading).
  tiny            bytes tokenizer, 2 layers, d 64, context 64, 4 steps.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.presets import flash as flash_presets
from lra_core.data.datasets import c4
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.errors import ConfigError
from lra_core.models import transformer

T5_VOCAB_MODEL = "sentencepiece.model"  # relative: resolved under data.dir
EMBED_VOCAB = 32128  # T5's padded embedding size for its 32000-piece vocabulary


def flash_setting(model, *, mlm: bool, clip: bool = True):
  """FLASH's C4 setting around `model` (Tables 6-7): MLM on whole documents packed per row, or causal
  LM on concatenated ones; context 512 at 2^18 tokens per step, 125k steps, the paper's optimizer."""
  data = c4.data_config(tokenizer=T5_VOCAB_MODEL, packing="pack" if mlm else "concat")
  config = base_config(task="mlm" if mlm else "lm", model=model, data=data, optim=flash_presets.paper_optim(clip=clip))
  config.train.update(
    dict(steps=125_000, batch_size=2**18 // 512, seq_len=512, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )
  return config


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus", "mlm", "lm"))
  if {"mlm", "lm"} <= parts:
    raise ConfigError("config args 'mlm' and 'lm' are two different tasks; give one of them.")
  mlm = "mlm" in parts
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  model = transformer.model_config(
    variant,
    vocab_size=EMBED_VOCAB,
    d_model=768,
    num_layers=12,
    num_heads=12,
    d_ff=2 * 3072 // 3 if variant == "transformer++" else 3072,
    dropout=0.0,
    tie_embeddings=True,
  )
  if mlm and variant != "transformer":
    model.norm = "scale"  # Table 8: ScaleNorm for every MLM model except the vanilla Transformer
  config = flash_setting(model, mlm=mlm, clip=variant != "transformer")

  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.update(
      dict(vocab_size=ByteTokenizer.vocab_size + mlm, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    )
    tiny_train(config, seq_len=64)
  return config
