"""FLASH-Quad on C4 (Hua et al. 2022, Tables 6 and 8): a stack of 24 quadratic GAUs, 112M.

  python -m lra_core.train --config=configs/c4/flash_quad.py \
      --config.data.dir=/data/c4/en --config.data.train_files='c4-train.000*-of-01024.json.gz' \
      --workdir=runs/c4_flash_quad_mlm

Settings, data and args (lm, tiny) as configs/c4/flash.py. The 1/n of relu^2(q k / n + b) is fixed
at the training length (model.max_len, default train.seq_len); see models/flash.py.
"""

from lra_core.configs.c4 import flash


def get_config(arg=None):
  return flash.make(arg, default="flash_quad")
