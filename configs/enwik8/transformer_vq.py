"""Transformer-VQ on enwik8 (Lingle 2024, Table 10 enwik8 column and appendix C).

  python -m lra_core.train --config=configs/enwik8/transformer_vq.py \
      --config.data.dir=/path/to/enwik8_folder --workdir=runs/enwik8_vq

190M parameters: 48 GAUs of d_model 768, d_k 128, d_v 1536, one head, 512 codes, blocks of 512;
sequences of 8192 bytes trained in update windows of 2048 (the backprop length W) with the cache
carried between windows; batch 128, 125k steps; AdamW lr 4e-4 (b1 .9, b2 .98, eps 1e-9, global
norm clip 0.1), 10k warmup then cosine decay to 0.1x, weight decay 2e-4 (on the projection and embedding
matrices only: not on biases, norm scales or the per-head XL biases, as in the authors' code);
sinusoid dropout .2, residual dropout .5, LayerDrop .3; commitment loss 1e-4, EMA rate .99;
untied classifier without a final norm (C.2: the small model); the embedding table stores E itself,
as the authors' (model.embedding=plain, the family's default). Data split 90/5/5 % by bytes.
Args (comma-separated):
  full         the same model with unquantized quadratic attention (the paper's 'Full').
  tiny         2 GAUs, d 32, 16 codes, blocks of 8, sequences of 64 in windows of 16, 4 steps.
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.presets import transformer_vq as vq_presets
from lra_core.data.datasets import bytes as bytes_data
from lra_core.models import transformer_vq


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "full"))
  model = transformer_vq.model_config(
    **vq_presets.PAPER_SIZES["190M"], vocab_size=256, dropsin=0.2, dropres=0.5, droplyr=0.3
  )
  config = base_config(
    task="lm",
    model=model,
    data=bytes_data.data_config(filename="enwik8.zip"),
    optim=vq_presets.paper_optim("adamw", weight_decay=2e-4),
  )
  config.train.update(
    dict(
      steps=125_000,
      batch_size=128,
      seq_len=8192,
      update_len=2048,
      eval_every=5000,
      eval_batches=50,
      checkpoint_every=5000,
    )
  )
  if "full" in parts:
    config.model.attention = "full"
  if "tiny" in parts:
    vq_presets.tiny(config, seq_len=64, update_len=16)
  return config
