"""Byte-level language modelling on enwik8 with the Linear Transformer (Katharopoulos et al. 2020).

  python -m lra_core.train --config=configs/enwik8/linear_transformer.py \
      --config.data.dir=$DATA/enwik8 --workdir=runs/enwik8_linear

The enwik8 baseline of configs/enwik8/transformer.py (8 layers, d 512, 8 heads, context 1024, its
optimizer) with linear attention as the token mixer.
Args: tiny  2 layers, d 64, context 64, 4 steps.
"""

from lra_core.config import config_arg
from lra_core.configs.enwik8 import transformer


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",))
  config = transformer.get_config("tiny" if "tiny" in parts else None)
  config.model.name = "linear_transformer"
  return config
