"""LRA Text (IMDB, byte level) with bidirectional Latte (Dolga et al., Table 7 row Text, Table 3).

  python -m lra_core.train --config=configs/lra/text/latte.py:latte_rglru_swa++ \
      --config.data.dir=/path/to/folder_with_aclImdb_v1.tar.gz --workdir=runs/text_latte

Args (comma-separated): one variant of configs.lra.common.LATTE_ARGS (default latte), tiny.
Table 7: 6 layers, 4 heads, L 256, D 256, lr 1e-3, batch 32, weight decay 0.05, dropout 0.1,
32 epochs of the 25k reviews, RoPE on the window; 4000 bytes (Appendix A.2.2).
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.lra.common import LATTE_ARGS, epochs, lra_latte
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets.lra import imdb

TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS = 25_000, 32, 32


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + LATTE_ARGS)
  model, opt = lra_latte(
    parts,
    rope=True,
    lr=1e-3,
    weight_decay=0.05,
    dropout=0.1,
    vocab_size=imdb.VOCAB_SIZE,
    num_classes=imdb.NUM_CLASSES,
    d_model=256,
    num_latents=256,
    classifier_hidden=256,
  )
  config = base_config(task="classify", model=model, data=imdb.data_config(), optim=opt)
  config.train.update(seq_len=4000, **epochs(TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS))
  if "tiny" in parts:
    presets.tiny(config, seq_len=64)
  return config
