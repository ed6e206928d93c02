"""Class-conditional pixel-space diffusion on ImageNet 64x64 with the FIT denoiser (Chen & Li 2023,
section 4.2) and RIN (its one-group case).

  python -m lra_core.train --config=configs/imagenet64/fit_denoiser.py \
      --config.data.dir=/path/to/imagenet64_npz --workdir=runs/imagenet64_fit_denoiser

data.dir holds the Imagenet64_*_npz release (train_data_batch_<N>.npz, val_data.npz). The metric
is the MSE of the denoiser's prediction (FIT Table 3 compares architectures by it); samples come
from `lra_core.diffusion.sample_from_config`, which reads `diffusion.sampler`, `sample_steps`,
`sample_schedule` and `x0_clip`.

FIT gives no ImageNet64 denoiser setting (Table 3 is at 512 and 1024 pixels), so the sizes are
pix2seq's RIN ImageNet64 sweep (configs/config_diffusion_imagenet64.py, arch 'tape', with
config_diffusion_base.py): 8x8 patches, 128 latents of 768-d with 16 heads, data tokens 512-d
with 16 read/write heads, MLP ratio 4, four read / 4 latent layers / write blocks, class
conditioning, eps prediction, gamma(t) = 1 - t ('simple_linear') for training, latent
self-conditioning by masking with rate 0.9, batch 1024, 150k steps, LAMB at lr 2e-3 with 10k
warmup steps, weight decay 1e-2 (not on biases and norm scales), b2 0.999, eps 1e-8,
cosine@0.7 (the decay curve spans (steps - warmup) / 0.7, so decay_steps = 210k), an EMA of the
weights with decay 0.9999 for evaluation and sampling, left-right flips of the training images,
and for sampling DDPM ('large' variance) with a cosine schedule and 100 steps. pix2seq hands
its global-norm clip to AdamW only, so its LAMB runs unclipped: clip_norm 0. RIN's write unit
(cross-attention + MLP on the data) is FIT's x2l followed by the next block's MLP-only local
layer, hence layers L(0)G(4)L(1)G(4)L(1)G(4)L(1)G(4)L(1). Differences: time and label enter as
condition tokens the latents read (FITDenoiser's l2c), not as extra latents as in RIN's tape;
the labels are dropped to a null class for 10% of the training examples (diffusion.cond_dropout
0.1, the usual classifier-free guidance rate; pix2seq's public ImageNet64 config leaves it and
the guidance at 0), so samples can be guided (diffusion.guidance, 0 by default as in pix2seq).

Args (comma-separated):
  (none)  FIT: 4 groups (2x2 sub-images of 4x4 patches), 32 latents per group (128 in all).
  rin     RIN: one group of 128 latents, the same layers.
  tiny    8x8 images (box-averaged), 2x2 patches, 4 groups of 2x2 patches with 4 latents each
          (16 with rin), L(1)G(1)L(1)G(1)L(1) at width 128 (~1M parameters), 4 steps: a smoke test.
"""

from lra_core import diffusion
from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data.datasets import imagenet64
from lra_core.models.fit import denoiser as fit_denoiser
from lra_core.run import optim_settings


def rin_optim():
  """pix2seq's RIN ImageNet64 optimizer: LAMB, its schedule and regularisation, EMA 0.9999."""
  c = optim_settings.default_config()
  c.update(
    dict(
      name="lamb",
      lr=2e-3,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      clip_norm=0.0,
      schedule="cosine",
      warmup_steps=10_000,
      decay_steps=210_000,
      min_lr_ratio=0.0,
      weight_decay=1e-2,
      weight_decay_schedule="lr",
      ema_decay=0.9999,
    )
  )
  return c


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "rin"))
  model = fit_denoiser.model_config(
    image_size=imagenet64.SIZE,
    image_channels=imagenet64.CHANNELS,
    patch_size=8,
    num_groups=4,
    latents_per_group=32,
    layers="L(0)G(4)L(1)G(4)L(1)G(4)L(1)G(4)L(1)",
    d_model=512,
    num_heads=16,
    d_ff=2048,
    d_latent=768,
    latent_heads=16,
    latent_d_ff=3072,
    num_classes=imagenet64.NUM_CLASSES,
  )
  config = base_config(task="diffusion", model=model, data=imagenet64.data_config(flip=True), optim=rin_optim())
  config.diffusion = diffusion.default_config()
  config.diffusion.update(
    dict(
      schedule="linear",
      pred_type="eps",
      self_cond_rate=0.9,
      sampler="ddpm",
      sample_steps=100,
      sample_schedule="cosine",
      cond_dropout=0.1,
      guidance=0.0,
    )
  )
  config.train.update(
    dict(
      steps=150_000,
      batch_size=1024,
      seq_len=imagenet64.num_tokens(imagenet64.SIZE),
      eval_every=5000,
      eval_batches=10,
      checkpoint_every=10_000,
    )
  )
  if "rin" in parts:
    config.model.update(dict(num_groups=1, latents_per_group=128))

  if "tiny" in parts:
    config.data.image_size = 8
    config.model.update(
      dict(
        image_size=8,
        patch_size=2,
        latents_per_group=16 if "rin" in parts else 4,
        layers="L(1)G(1)L(1)G(1)L(1)",
        d_model=128,
        num_heads=4,
        d_ff=256,
        d_latent=128,
        latent_heads=4,
        latent_d_ff=256,
      )
    )
    config.diffusion.sample_steps = 4
    config.optim.ema_warmup = True  # a few hundred steps: the average follows recent weights
    tiny_train(config, seq_len=imagenet64.num_tokens(8))
  return config
