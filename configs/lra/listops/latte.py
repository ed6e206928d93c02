"""LRA ListOps with bidirectional Latte (Dolga et al., Table 7 row ListOps, Table 3).

  python -m lra_core.train --config=configs/lra/listops/latte.py:latte_rglru_swa++ \
      --config.data.dir=/path/to/lra_release/listops-1000/ --workdir=runs/listops_latte

Args (comma-separated): one variant of configs.lra.common.LATTE_ARGS (default latte; Table 3 has
latte, latte_rglru++ and latte_rglru_swa++), tiny for a smoke test.
Table 7: 6 layers, 4 heads, L 40, D 128, lr 1e-3, batch 64, weight decay 0.01, dropout 0.1,
50 epochs of the 96k training expressions, RoPE on the window; length 2000 as LRA.
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.lra.common import LATTE_ARGS, epochs, lra_latte
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets.lra import listops

TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS = 96_000, 64, 50


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + LATTE_ARGS)
  model, opt = lra_latte(
    parts,
    rope=True,
    lr=1e-3,
    weight_decay=0.01,
    dropout=0.1,
    vocab_size=listops.VOCAB_SIZE,
    num_classes=listops.NUM_CLASSES,
    d_model=128,
    num_latents=40,
    classifier_hidden=128,
  )
  config = base_config(task="classify", model=model, data=listops.data_config(), optim=opt)
  config.train.update(seq_len=2000, **epochs(TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS))
  if "tiny" in parts:
    config.data.update(
      dict(generate=True, num_train=200, num_val=40, num_test=40, max_depth=4, max_args=5, min_length=16, max_length=64)
    )
    presets.tiny(config, seq_len=64)
  return config
