"""LRA Pathfinder (32x32, hard = curv_contour_length_14) with the Transformer baselines.

  python -m lra_core.train --config=configs/lra/pathfinder/transformer.py \
      --config.data.dir=/path/to/lra_release/pathfinder32/ --workdir=runs/pathfinder

Each image is a sequence of 1024 pixel tokens (0..255, raster order); the model says whether a
dashed path joins the two dots. data.difficulty=easy|intermediate picks the other folders.
Args (comma-separated):
  (none)          the LRA setting, from the public config lra_benchmarks/image/configs/
                  pathfinder32/transformer_base.py on base_pathfinder32_config.py (the paper's
                  Table 1 "Pathfinder" column): 4 layers, d 32, 4 heads with qkv width 16 (head
                  dim 4), MLP 32, classifier MLP 32, mean pooling, fixed sinusoids, dropout 0.2,
                  attention dropout 0.1; batch 512, 200 epochs of 160k images = 62400 steps,
                  Adam (b2 .98, eps 1e-9) lr 1e-3 with one epoch (312 steps) of linear warmup and
                  cosine decay, no weight decay, no clipping; evaluation every epoch on 39
                  batches (20k images).
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU) at the same sizes.
  tiny            a smoke-test size: 16x16 images (seq 256), 2 layers, 4 steps; point
                  data.dir at small images and set data.resolution / train.seq_len to match.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import pathfinder

TRAIN_EXAMPLES = 160_000  # 80% of the 200k images of one difficulty
VALID_EXAMPLES = 20_000
BATCH_SIZE = 512
EPOCH = TRAIN_EXAMPLES // BATCH_SIZE  # 312 steps


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus"))
  # LRA's qkv_dim 16 is the width of all heads together: 4 heads of 4.
  model = lra_transformer(
    parts,
    vocab_size=pathfinder.VOCAB_SIZE,
    num_classes=pathfinder.NUM_CLASSES,
    d_model=32,
    num_layers=4,
    num_heads=4,
    head_dim=4,
    d_ff=32,
    classifier_hidden=32,
  )
  model.update(dict(pooling="mean", dropout=0.2, attention_dropout=0.1))
  config = base_config(
    task="classify",
    model=model,
    data=pathfinder.data_config(difficulty="hard", resolution=32),
    optim=lra_optim(lr=1e-3, warmup=EPOCH, weight_decay=0.0),
  )
  config.optim.schedule = "cosine"  # LRA: constant * linear_warmup * cosine_decay
  config.train.update(
    dict(
      steps=200 * EPOCH,
      batch_size=BATCH_SIZE,
      seq_len=32 * 32,
      eval_every=EPOCH,
      eval_batches=VALID_EXAMPLES // BATCH_SIZE,
      checkpoint_every=10 * EPOCH,
    )
  )
  if "tiny" in parts:
    config.data.resolution = 16
    config.model.update(dict(d_model=32, num_layers=2, num_heads=2, head_dim=0, d_ff=64, classifier_hidden=32))
    tiny_train(config, seq_len=16 * 16)
  return config
