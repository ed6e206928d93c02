"""LRA ListOps (2000 tokens) with FIT (Chen & Li 2023) as the encoder.

  python -m lra_core.train --config=configs/lra/listops/fit.py \
      --config.data.dir=/path/to/lra_release/listops-1000 --workdir=runs/lra_listops_fit

FIT has no LRA setting; this one is ours. The task's Transformer config (configs/lra/listops/transformer.py)
gives the data, optimizer, schedule, dropout, widths and classifier; its N layers become FIT's local
layers around global layers (configs.lra.common.lra_fit). Grouping: 2000 tokens -> 16 groups of 128 (the last
padded), 16 latents per group.

Args: tiny (the Transformer's tiny setting; groups of 16 tokens, 4 latents per group).
"""

from lra_core.configs.lra.common import lra_fit_config
from lra_core.configs.lra.listops import transformer


def get_config(arg=None):
  return lra_fit_config(arg, transformer, group=128, latents_per_group=16, tiny=(16, 4))
