"""LRA Image (CIFAR-10, 32x32 grayscale pixels) with FIT (Chen & Li 2023) as the encoder.

  python -m lra_core.train --config=configs/lra/image/fit.py \
      --config.data.dir=/path/to/folder_with_cifar-10-python.tar.gz --workdir=runs/lra_image_fit

FIT has no LRA setting; this one is ours. The task's Transformer config (configs/lra/image/transformer.py)
gives the data, optimizer, schedule, dropout, widths and classifier; its N layers become FIT's local
layers around global layers (configs.lra.common.lra_fit). Grouping: the 32x32 image -> 16 blocks of 8x8
pixels, 8 latents per group.

Args: tiny (the Transformer's tiny setting; blocks of 4 x 4 pixels, 2 latents per group).
"""

from lra_core.configs.lra.common import lra_fit_config
from lra_core.configs.lra.image import transformer


def get_config(arg=None):
  return lra_fit_config(arg, transformer, group=8, latents_per_group=8, tiny=(4, 2), image=True)
