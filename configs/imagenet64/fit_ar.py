"""Pixel-level autoregressive ImageNet 64x64 with FIT-AR (Chen & Li 2023, section 4.3, Table 4).

  python -m lra_core.train --config=configs/imagenet64/fit_ar.py \
      --config.data.dir=/path/to/imagenet64_npz --workdir=runs/imagenet64_fit_ar

Section 4.3: pixels x channels are tokens (0..255, 12288 per image), grouped by 8x8 patches into
64 groups of 192 tokens (data.order "patches"), 32 latents per group, data tokens 512-d, latents
768-d, layers L(8)G(2)L(8)G(2)L(8)G(2)L(8): 153M parameters in Table 4. Not stated in the paper
and taken from pix2seq's FIT-AR: MLP ratio 4, biases, LayerNorm, tied input / output embedding; the
head counts (8 and 12, head width 64) are ours. FIT gives no batch, steps or optimizer: those are
configs/imagenet64/transformer.py's (batch 16, 125k steps, Transformer-VQ's AdamW recipe), so FIT-AR
and the Transformer baselines there train under one budget.

Args (comma-separated):
  (none)     the Table 4 model.
  overlap    Appendix D: each group also sees the last 8*3 = 24 tokens (one pixel row of its left
             neighbour patch, in patch order) of the previous group as prefix tokens.
  tiny       images box-averaged to 8x8, 4x4 patches (4 groups of 48 tokens), 4 latents per group,
             L(1)G(1)L(1) at d 64: a smoke test.
"""

from lra_core.config import config_arg
from lra_core.configs.imagenet64 import transformer as baseline
from lra_core.models import fit


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "overlap"))
  config = baseline.get_config(",".join(sorted({"fit"} | (parts & {"tiny"}))))
  vocab = config.model.vocab_size
  patch = config.data.patch_size
  config.model = fit.model_config(
    vocab_size=vocab,
    layers="L(8)G(2)L(8)G(2)L(8)G(2)L(8)",
    group_size=patch * patch * 3,
    latents_per_group=32,
    d_model=512,
    num_heads=8,
    d_ff=2048,
    d_latent=768,
    latent_heads=12,
    latent_d_ff=3072,
  )
  if "overlap" in parts:
    config.model.overlap = 8 * 3
  if "tiny" in parts:
    config.model.update(
      dict(
        layers="L(1)G(1)L(1)",
        latents_per_group=4,
        d_model=64,
        num_heads=4,
        d_ff=128,
        d_latent=64,
        latent_heads=4,
        latent_d_ff=128,
      )
    )
    if "overlap" in parts:
      config.model.overlap = patch * 3
  return config
