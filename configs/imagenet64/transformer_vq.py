"""Transformer-VQ on ImageNet 64x64 (Lingle 2024, Table 10 ImageNet64 columns and appendix C).

  python -m lra_core.train --config=configs/imagenet64/transformer_vq.py \
      --config.data.dir=/data/imagenet64 --workdir=runs/imagenet64_vq

Images are raster-order byte sequences of 64*64*3 = 12288 tokens (after a start token), with an
absolute sinusoid scaled by a learned scalar added to the embeddings (C.2).
  (default)  190M: 48 GAUs of d_model 768, d_k 128, d_v 1536, 512 codes, blocks of 512; batch 16,
             whole images as one update window (W = 12288), 125k steps, AdamW as enwik8 without
             weight decay; sinusoid dropout .1, no residual or layer dropout; untied classifier.
  large      1.2B: d_model 2048, d_v 4096; batch 128, update windows of 2048, 500k steps,
             Adafactor lr 0.01, final norm and tied classifier, logits = (x E^T + b) * 0.005 with a
             learned output bias b (the authors' e_preln=1, e_scale=0.005); sinusoid dropout .1.
The embedding table stores E itself, as the authors' (model.embedding=plain, the family's default).
Args (comma-separated): large, full (unquantized quadratic attention), tiny (8x8 images,
192 tokens in windows of 64, 2 GAUs, d 32).
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.presets import transformer_vq as vq_presets
from lra_core.data.datasets import imagenet64
from lra_core.models import transformer_vq


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "large", "full"))
  large = "large" in parts
  size = vq_presets.PAPER_SIZES["1.2B" if large else "190M"]
  model = transformer_vq.model_config(
    **size,
    vocab_size=imagenet64.START + 1,
    abs_position=True,
    dropsin=0.1,
    final_norm=large,
    tie_embeddings=large,
    output_scale=0.005,
  )
  optim = vq_presets.paper_optim("adafactor") if large else vq_presets.paper_optim("adamw")
  config = base_config(task="image_ar", model=model, data=imagenet64.data_config(), optim=optim)
  seq_len = imagenet64.num_tokens(imagenet64.SIZE)  # 12288
  config.train.update(
    dict(
      steps=500_000 if large else 125_000,
      batch_size=128 if large else 16,
      seq_len=seq_len,
      update_len=2048 if large else 0,
      eval_every=5000,
      eval_batches=50,
      checkpoint_every=5000,
    )
  )
  if "full" in parts:
    config.model.attention = "full"
  if "tiny" in parts:
    config.data.image_size = 8
    vq_presets.tiny(config, seq_len=imagenet64.num_tokens(8), update_len=64)
  return config
