"""LRA Pathfinder (32 x 32, hard) with bidirectional Latte (Dolga et al., Table 7).

  python -m lra_core.train --config=configs/lra/pathfinder/latte.py:latte_rglru_swa++ \
      --config.data.dir=/path/to/lra_release/pathfinder32/ --workdir=runs/pathfinder_latte

Args: one of configs.lra.common.LATTE_ARGS (default latte), tiny.
Table 7: 6 layers, 4 heads, L 256, D 256, lr 1e-3, batch 64, weight decay 0.03, dropout 0.2,
200 epochs of the 160k training images, absolute positions only (no RoPE on the window).
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.lra.common import LATTE_ARGS, epochs, lra_latte
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets.lra import pathfinder

TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS = 160_000, 64, 200


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + LATTE_ARGS)
  model, opt = lra_latte(
    parts,
    rope=False,
    lr=1e-3,
    weight_decay=0.03,
    dropout=0.2,
    vocab_size=pathfinder.VOCAB_SIZE,
    num_classes=pathfinder.NUM_CLASSES,
    d_model=256,
    num_latents=256,
    classifier_hidden=256,
  )
  config = base_config(
    task="classify", model=model, data=pathfinder.data_config(difficulty="hard", resolution=32), optim=opt
  )
  config.train.update(seq_len=32 * 32, **epochs(TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS, checkpoint_epochs=10))
  if "tiny" in parts:
    config.data.resolution = 16
    presets.tiny(config, seq_len=16 * 16)
  return config
