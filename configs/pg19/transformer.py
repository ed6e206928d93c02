"""PG-19 language modelling with the Transformer baselines.

  python -m lra_core.data.tokenizer --train --input=/data/pg19/train \
      --model_prefix=/data/pg19/spm_bpe32k --vocab_size=32000
  python -m lra_core.train --config=configs/pg19/transformer.py:vq \
      --config.data.dir=/data/pg19 --workdir=runs/pg19_vq

Data: the release layout under data.dir (or data.source=tfds with data.tfds_dir), tokenized with
the SentencePiece BPE 32k model `spm_bpe32k.model` in data.dir (the first command; Transformer-VQ
learned this vocabulary on PG-19), books concatenated with eos and cut into consecutive windows.
Evaluation reports `word_perplexity`: total token loss / number of words (Rae et al. 2020).

Args (comma-separated):
  (none)          not a paper setting: 12 layers, d 768, 12 heads, MLP 3072, tied embeddings,
                  context 1024, batch 64, 100k steps, AdamW (b2 .98, eps 1e-9, clip 0.1)
                  lr 4e-4 with 4k warmup and cosine decay to 0.1x, dropout 0.1.
  vq              Transformer-VQ's PG-19 setting (Lingle 2024, Table 10, appendix C.1-C.2):
                  sequences of 8192 tokens trained in update windows of 2048 (backprop length),
                  batch 128, 500k steps, Adafactor (relative step sizes, update clip 1.0,
                  lr 0.01, beta1 0, beta2_t = 1 - t^-0.8) with 10k warmup and cosine decay to
                  0.1x, no weight decay, residual dropout 0.1, RMS norm, tied embeddings. The
                  paper's model is a 1.3B Transformer-VQ (d_model 2048, 48 GAUs, d_k 128); the
                  baseline here has the same width and budget: 24 layers of attention + MLP
                  (one layer ~ two GAUs), 16 heads of 128, MLP 8192, 1.29B parameters. It has no
                  cache across update windows, so its context is the 2048-token window, and no
                  LayerDrop or sinusoid dropout (Table 10: 0.1 each) to apply.
  flash           FLASH's PG-19 setting (Hua et al. 2022, Tables 7 and 10): Transformer+
                  (no vanilla Transformer was run on PG-19) with 36 layers, d 1024, 16 heads,
                  expansion 4, GELU, LayerNorm, scaled sinusoid + RoPE, tied embeddings: 486M
                  parameters as in Table 10; 2^18 tokens per batch at context 8192 (batch 32;
                  Table 3 also has 1024/2048/4096 with batch 256/128/64), 125k steps, AdamW
                  (b1 .9, b2 .999, eps 1e-6, weight decay 0.01) lr 7e-4 with 10k warmup and
                  linear decay, gradient clipping 0.1 (the paper clips locally, here by global
                  norm), no dropout. FLASH does not name its vocabulary; the BPE 32k one is used.
  plus, plusplus  Transformer+ (scaled sinusoid + RoPE) / Transformer++ (+ GLU). The GLU width
                  is 2/3 of the MLP width (flash: 2730), which keeps the parameter count: FLASH's
                  Table 10 lists 486M for both at expansion 4 (our reading).
  tiny            bytes tokenizer, 2 layers, d 64, context 64 (vq: windows of 16), 4 steps.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.presets import flash as flash_presets
from lra_core.data.datasets import pg19
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.errors import ConfigError
from lra_core.models import transformer
from lra_core.run import optim_settings

SPM_VOCAB = 32000
SPM_MODEL = "spm_bpe32k.model"  # relative: resolved under data.dir


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus", "vq", "flash"))
  if {"vq", "flash"} <= parts:
    raise ConfigError("config args 'vq' and 'flash' are two different paper settings; give one of them.")
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  model = transformer.model_config(
    variant, vocab_size=SPM_VOCAB, d_model=768, num_layers=12, num_heads=12, d_ff=3072, dropout=0.1, tie_embeddings=True
  )
  opt = optim_settings.default_config()
  opt.update(
    dict(
      name="adamw",
      lr=4e-4,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      clip_norm=0.1,
      schedule="cosine",
      warmup_steps=4000,
      min_lr_ratio=0.1,
      weight_decay=0.0,
    )
  )
  config = base_config(task="lm", model=model, data=pg19.data_config(tokenizer=SPM_MODEL), optim=opt)
  config.train.update(
    dict(steps=100_000, batch_size=64, seq_len=1024, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )

  if "vq" in parts:  # Transformer-VQ, Table 10 (PG-19 column) and appendix C
    config.model.update(dict(d_model=2048, num_layers=24, num_heads=16, d_ff=8192, norm="rms", dropout=0.1))
    config.optim.update(
      dict(
        name="adafactor",
        lr=0.01,
        momentum=0.0,
        decay_rate=0.8,
        clipping_threshold=1.0,
        multiply_by_parameter_scale=True,
        clip_norm=0.0,
        schedule="cosine",
        warmup_steps=10_000,
        min_lr_ratio=0.1,
        weight_decay=0.0,
      )
    )
    config.train.update(dict(steps=500_000, batch_size=128, seq_len=8192, update_len=2048))
  if "flash" in parts:  # FLASH, Table 7 (PG-19 column) and Table 10 (Transformer+ / ++)
    if variant == "transformer":
      config.model.update(transformer.VARIANTS["transformer+"], variant="transformer+")
    config.model.update(dict(d_model=1024, num_layers=36, num_heads=16, d_ff=4096, norm="layer", dropout=0.0))
    config.optim = flash_presets.paper_optim()
    config.train.update(dict(steps=125_000, batch_size=2**18 // 8192, seq_len=8192))

  if variant == "transformer++":
    config.model.d_ff = 2 * config.model.d_ff // 3  # GLU has three matrices, the MLP two

  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.update(dict(vocab_size=ByteTokenizer.vocab_size, d_model=64, num_layers=2, num_heads=4, d_ff=128))
    tiny_train(config, seq_len=64)
    config.train.update_len = 16 if "vq" in parts else 0
  return config
