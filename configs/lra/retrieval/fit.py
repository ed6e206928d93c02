"""LRA Retrieval (AAN, two towers of 4000 bytes) with FIT (Chen & Li 2023) as the encoder.

  python -m lra_core.train --config=configs/lra/retrieval/fit.py \
      --config.data.dir=/path/to/lra_release/tsv_data --workdir=runs/lra_retrieval_fit

FIT has no LRA setting; this one is ours. The task's Transformer config (configs/lra/retrieval/transformer.py)
gives the data, optimizer, schedule, dropout, widths and classifier; its N layers become FIT's local
layers around global layers (configs.lra.common.lra_fit). Grouping: each 4000-byte document -> 32 groups of
128, 16 latents per group.

Args: tiny (the Transformer's tiny setting; groups of 16 tokens, 4 latents per group).
"""

from lra_core.configs.lra.common import lra_fit_config
from lra_core.configs.lra.retrieval import transformer


def get_config(arg=None):
  return lra_fit_config(arg, transformer, group=128, latents_per_group=16, tiny=(16, 4))
