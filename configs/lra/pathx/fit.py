"""LRA Path-X (128x128 pixels) with FIT (Chen & Li 2023) as the encoder.

  python -m lra_core.train --config=configs/lra/pathx/fit.py \
      --config.data.dir=/path/to/lra_release/pathfinder128 --workdir=runs/lra_pathx_fit

FIT has no LRA setting; this one is ours. The task's Transformer config (configs/lra/pathx/transformer.py)
gives the data, optimizer, schedule, dropout, widths and classifier; its N layers become FIT's local
layers around global layers (configs.lra.common.lra_fit). Grouping: the 128x128 image -> 64 blocks of 16x16
pixels, 16 latents per group.

Args: tiny (the Transformer's tiny setting; blocks of 4 x 4 pixels, 2 latents per group).
"""

from lra_core.configs.lra.common import lra_fit_config
from lra_core.configs.lra.pathx import transformer


def get_config(arg=None):
  return lra_fit_config(arg, transformer, group=16, latents_per_group=16, tiny=(4, 2), image=True)
