"""LRA Path-X (Pathfinder at 128x128, hard = curv_contour_length_14) with the Transformer baselines.

  python -m lra_core.train --config=configs/lra/pathx/transformer.py \
      --config.data.dir=/path/to/lra_release/pathfinder128/ --workdir=runs/pathx

Each image is a sequence of 16384 pixel tokens (0..255, raster order). The LRA paper (Tay et
al. 2021, Table 1) reports that every model it tried fails here (chance accuracy).
Args (comma-separated):
  (none)          the LRA setting, from the public config lra_benchmarks/image/configs/
                  pathfinder128/transformer_base.py, which keeps base_pathfinder128_config.py:
                  1 layer, d 32, 2 heads with qkv width 16 (head dim 8), MLP 32, classifier MLP
                  32, mean pooling, learned positions, dropout 0.1, attention dropout 0.1;
                  batch 64, 200 epochs of 160k images = 500000 steps, Adam (b2 .98, eps 1e-9)
                  lr 1e-3 with one epoch (2500 steps) of linear warmup and cosine decay, no
                  weight decay, gradient clipping at global norm 1; evaluation every epoch on
                  312 batches (20k images).
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU) at the same sizes.
  tiny            a smoke-test size: 16x16 images (seq 256), 4 steps; point data.dir at small
                  images and set data.resolution / train.seq_len to match.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import pathfinder

TRAIN_EXAMPLES = 160_000  # 80% of the 200k images of one difficulty
VALID_EXAMPLES = 20_000
BATCH_SIZE = 64
EPOCH = TRAIN_EXAMPLES // BATCH_SIZE  # 2500 steps


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus"))
  # LRA's qkv_dim 16 is the width of all heads together: 2 heads of 8.
  model = lra_transformer(
    parts,
    vocab_size=pathfinder.VOCAB_SIZE,
    num_classes=pathfinder.NUM_CLASSES,
    d_model=32,
    num_layers=1,
    num_heads=2,
    head_dim=8,
    d_ff=32,
    classifier_hidden=32,
  )
  model.update(dict(pooling="mean", dropout=0.1, attention_dropout=0.1))
  if not parts & {"plus", "plusplus"}:
    model.position = "learned"  # base_pathfinder128_config: learn_pos_emb = True
  config = base_config(
    task="classify",
    model=model,
    data=pathfinder.data_config(difficulty="hard", resolution=128),
    optim=lra_optim(lr=1e-3, warmup=EPOCH, weight_decay=0.0),
  )
  config.optim.update(dict(schedule="cosine", clip_norm=1.0))  # LRA: constant * linear_warmup * cosine_decay
  config.train.update(
    dict(
      steps=200 * EPOCH,
      batch_size=BATCH_SIZE,
      seq_len=128 * 128,
      eval_every=EPOCH,
      eval_batches=VALID_EXAMPLES // BATCH_SIZE,
      checkpoint_every=10 * EPOCH,
    )
  )
  if "tiny" in parts:
    config.data.resolution = 16
    tiny_train(config, seq_len=16 * 16)
  return config
