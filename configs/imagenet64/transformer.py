"""Pixel-level autoregressive ImageNet 64x64 (bits per dim) with the Transformer baselines.

  python -m lra_core.train --config=configs/imagenet64/transformer.py:vq \
      --config.data.dir=/path/to/imagenet64_npz --workdir=runs/imagenet64_vq

data.dir holds the Imagenet64_*_npz release (train_data_batch_<N>.npz, val_data.npz); with
--config.data.source=tfds it is the tfds data_dir of a prepared `imagenet_resized/64x64`.
Each image is 12288 tokens (64x64 pixels, R,G,B per pixel, intensities 0..255) after a START
token (vocabulary 257); the validation split is the official validation set, also used as
"test" since the test labels are not public (as both papers report).

Args (comma-separated):
  (none)          our baseline size, not a paper table: 8 layers, d 512, 8 heads, MLP 2048,
                  whole images (T 12288), batch 16, 125k steps, with the optimizer of `vq`.
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU).
  vq              Transformer-VQ (Lingle 2024) Table 10, ImageNet64 190M column: batch 16,
                  sequence 12288, backprop (update) length 12288, 125k steps, AdamW lr 4e-4
                  b1 .9 b2 .98 eps 1e-9, clip 0.1, 10k warmup then cosine to 0.1x (C.1),
                  weight decay 0, residual dropout 0, absolute scaled sinusoid positions (C.2);
                  d_model 768 as the table. Its block length 512 and 512 codes are settings of
                  the VQ model, not of this baseline (which attends over all 12288 tokens); the
                  layer shape (24 layers, 6 heads of 128 = d_k, MLP 3072, ~190M parameters) is ours.
                  The 1.2B column (batch 128, update length 2048, Adafactor lr 0.01, 500k steps)
                  needs a model that carries a cache across update windows, so it is not here.
  fit             FIT (Chen & Li 2023) section 4.3 / Table 4 data setting: 12288 tokens grouped
                  by 8x8 patches (64 groups of 192 contiguous tokens, data.order=patches); d 512
                  as FIT's data tokens. FIT's 32 latents per group (768-d) and its
                  L(8)G(2)L(8)G(2)L(8)G(2)L(8) stack belong to the FIT model; FIT states no batch,
                  steps or optimizer, so those are the (none) setting's.
  tiny            images box-averaged to 8x8 (192 tokens; 4x4 patches with fit), a 2-layer d 64
                  model and 4 steps: a smoke test, not a benchmark.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data.datasets import imagenet64
from lra_core.errors import ConfigError
from lra_core.models import transformer
from lra_core.run import optim_settings


def vq_optim():
  """Transformer-VQ's AdamW recipe (appendix C.1; Table 10 ImageNet64 190M: weight decay 0)."""
  c = optim_settings.default_config()
  c.update(
    dict(
      name="adamw",
      lr=4e-4,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      clip_norm=0.1,
      schedule="cosine",
      warmup_steps=10_000,
      min_lr_ratio=0.1,
      weight_decay=0.0,
      weight_decay_schedule="constant",
    )
  )
  return c


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus", "vq", "fit"))
  if parts >= {"vq", "fit"}:
    raise ConfigError("config args vq and fit are different paper settings; pick one of them.")
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  model = transformer.model_config(
    variant, vocab_size=imagenet64.START + 1, d_model=512, num_layers=8, num_heads=8, d_ff=2048
  )
  data = imagenet64.data_config()
  config = base_config(task="image_ar", model=model, data=data, optim=vq_optim())
  seq_len = imagenet64.num_tokens(imagenet64.SIZE)  # 12288
  config.train.update(
    dict(steps=125_000, batch_size=16, seq_len=seq_len, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )

  if "vq" in parts:  # Transformer-VQ Table 10, ImageNet64 190M column
    config.model.update(dict(d_model=768, num_layers=24, num_heads=6, d_ff=3072, dropout=0.0))
    if variant == "transformer":
      config.model.position = "scaled_sinusoid"  # C.2: absolute sinusoid times a learned scalar
    config.train.update(dict(batch_size=16, seq_len=12288, update_len=12288, steps=125_000))
  if "fit" in parts:  # FIT section 4.3: 8x8 pixel patches -> groups of 192 tokens
    config.data.update(dict(order="patches", patch_size=8))
    config.model.d_model = 512

  if "tiny" in parts:
    config.data.image_size = 8
    if "fit" in parts:
      config.data.patch_size = 4
    config.model.update(dict(d_model=64, num_layers=2, num_heads=4, d_ff=128))
    tiny_train(config, seq_len=imagenet64.num_tokens(8))
    config.train.update_len = 0
  return config
