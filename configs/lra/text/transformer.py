"""LRA Text (IMDB reviews, byte level) with the Transformer baselines.

  python -m lra_core.train --config=configs/lra/text/transformer.py \
      --config.data.dir=/path/to/folder_with_aclImdb_v1.tar.gz --workdir=runs/lra_text
  # or from tfds: --config.data.source=tfds [--config.data.dir=/path/to/tensorflow_datasets]

Args (comma-separated):
  (none)          the LRA Text setting: reviews as UTF-8 bytes (vocabulary 257 with padding),
                  truncated to 4000 bytes, the length of the LRA paper (Tay et al. 2021, 'Byte-level
                  text classification'); LRA's public base config (text_classification/configs/
                  base_tc_config.py) says max_length 1000, which users flagged as not the paper's.
                  Model and optimizer from that base config: 4 layers, d 256, 4 heads (qkv 256),
                  MLP 1024, CLS pooling, fixed sinusoids (LRA's default learn_pos_emb=False),
                  dropout 0.1; batch 32, 20000 steps, Adam b1 .9 b2 .98 eps 1e-9, lr factor 0.05 *
                  linear warmup 8000 * rsqrt decay, weight decay 0.1. LRA evaluates every 100 steps
                  on the whole test set; here every 1000.
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU).
  tiny            a smoke-test size (2 layers, d 32, 64 bytes, 4 steps).
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import imdb


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus"))
  # LRA's classifier head is Dense(mlp_dim) -> ReLU -> Dense(classes): hidden = MLP width.
  model = lra_transformer(
    parts,
    vocab_size=imdb.VOCAB_SIZE,
    num_classes=imdb.NUM_CLASSES,
    d_model=256,
    num_layers=4,
    num_heads=4,
    d_ff=1024,
    classifier_hidden=1024,
  )
  config = base_config(
    task="classify", model=model, data=imdb.data_config(), optim=lra_optim(lr=0.05, warmup=8000, weight_decay=0.1)
  )
  config.train.update(dict(steps=20000, batch_size=32, seq_len=4000, eval_every=1000, checkpoint_every=1000))
  if "tiny" in parts:
    config.model.update(dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, classifier_hidden=32))
    tiny_train(config, seq_len=64)
  return config
