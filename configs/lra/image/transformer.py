"""LRA Image (CIFAR-10 as 1024 grayscale pixels) with the Transformer baselines.

  python -m lra_core.train --config=configs/lra/image/transformer.py \
      --config.data.dir=/path/to/folder_with_cifar-10-python.tar.gz --workdir=runs/lra_image
  # or from tfds: --config.data.source=tfds [--config.data.dir=/path/to/tensorflow_datasets]

Args (comma-separated):
  (none)          the LRA Image task (Tay et al. 2021, 'Image classification on sequences of
                  pixels'): grayscale pixels 0..255 as tokens (vocabulary 256), length 1024,
                  splits train[:90%] / train[90%:] / test (LRA image/input_pipeline.py).
                  Model from LRA's image/configs/cifar10/transformer_base.py: 1 layer, d 128,
                  8 heads with qkv 64 (head dim 8), MLP 128, CLS pooling; from its
                  base_cifar10_config.py: learned positions, dropout 0.3, attention dropout
                  0.2, batch 256, 200 epochs of 45000 images (35000 steps), Adam b1 .9 b2 .98
                  eps 1e-9, lr 5e-4 with 1 epoch (175 steps) of linear warmup then cosine
                  decay, no weight decay, evaluation every epoch.
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU).
  tiny            a smoke-test size: images box-averaged to 16x16 (256 tokens), 1 layer, d 32,
                  4 steps.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import cifar10

TRAIN_EXAMPLES = 45000  # train[:90%] of CIFAR-10's 50000
BATCH_SIZE = 256
STEPS_PER_EPOCH = TRAIN_EXAMPLES // BATCH_SIZE  # 175, as LRA's base config computes it
EPOCHS = 200


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus"))
  # LRA's classifier head is Dense(mlp_dim) -> ReLU -> Dense(classes): hidden = MLP width.
  model = lra_transformer(
    parts,
    vocab_size=cifar10.VOCAB_SIZE,
    num_classes=cifar10.NUM_CLASSES,
    d_model=128,
    num_layers=1,
    num_heads=8,
    head_dim=8,
    d_ff=128,
    classifier_hidden=128,
  )
  model.update(dict(dropout=0.3, attention_dropout=0.2))
  if not parts & {"plus", "plusplus"}:
    model.position = "learned"  # LRA's cifar10 base config: learn_pos_emb=True
  optim = lra_optim(lr=5e-4, warmup=STEPS_PER_EPOCH, weight_decay=0.0)
  # LRA: constant * linear_warmup * cosine_decay, progress = (step - warmup) / steps_per_cycle with
  # steps_per_cycle = all 35000 steps; ours is (step - warmup) / (decay_steps - warmup): the same.
  optim.update(dict(schedule="cosine", min_lr_ratio=0.0, decay_steps=STEPS_PER_EPOCH * (EPOCHS + 1)))
  config = base_config(task="classify", model=model, data=cifar10.data_config(), optim=optim)
  config.train.update(
    dict(
      steps=STEPS_PER_EPOCH * EPOCHS,
      batch_size=BATCH_SIZE,
      seq_len=cifar10.PIXELS,
      eval_every=STEPS_PER_EPOCH,
      checkpoint_every=STEPS_PER_EPOCH * 10,
    )
  )
  if "tiny" in parts:
    config.data.image_size = 16
    config.model.update(dict(d_model=32, num_layers=1, num_heads=2, head_dim=0, d_ff=64, classifier_hidden=32))
    tiny_train(config, seq_len=16 * 16)
  return config
