"""LRA ListOps with the Transformer baselines, and the embedded default experiment.

  python -m lra_core.train --config=configs/lra/listops/transformer.py \
      --config.data.dir=/path/to/lra_release/listops-1000/ --workdir=runs/listops
  python -m lra_core.train      # = --config=configs/lra/listops/transformer.py:default

Args (comma-separated):
  (none)          the LRA setting (public listops config): 4 layers, d 512, 8 heads, MLP 1024,
                  CLS pooling, fixed sinusoids, length 2000, batch 32, 5000 steps, Adam with
                  lr factor 0.05 * linear warmup 1000 * rsqrt decay, weight decay 0.1,
                  dropout 0.1; data from data.dir (the official basic_*.tsv).
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU).
  default         the CPU demo: a ListOps set drawn with the official generator at shorter
                  lengths (depth <= 4, <= 5 arguments, 17..64 tokens; 20000/1000/2000 examples,
                  seed 0) generated once into the cache, and a 2-layer d 128 model trained for
                  1000 steps of 64 sequences (AdamW, cosine lr 1e-3) in a few minutes on two
                  CPU cores.
  tiny            a smoke-test size (generated data, 2 layers, d 32, 4 steps).
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import listops


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "default", "plus", "plusplus"))
  model = lra_transformer(
    parts,
    vocab_size=listops.VOCAB_SIZE,
    num_classes=listops.NUM_CLASSES,
    d_model=512,
    num_layers=4,
    num_heads=8,
    d_ff=1024,
    classifier_hidden=1024,
  )
  config = base_config(
    task="classify", model=model, data=listops.data_config(), optim=lra_optim(lr=0.05, warmup=1000, weight_decay=0.1)
  )
  config.train.update(dict(steps=5000, batch_size=32, seq_len=2000, eval_every=500, checkpoint_every=1000))

  if parts & {"default", "tiny"}:
    config.data.update(
      dict(
        generate=True,
        num_train=20000,
        num_val=1000,
        num_test=2000,
        max_depth=4,
        max_args=5,
        min_length=16,
        max_length=65,
      )
    )
  if "default" in parts:
    config.model.update(
      dict(d_model=128, num_layers=2, num_heads=4, d_ff=256, classifier_hidden=128, dropout=0.0, attention_dropout=0.0)
    )
    config.optim.update(dict(lr=1e-3, schedule="cosine", warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.0))
    # Expressions have 17..64 tokens (median 22), so seq_len 64 truncates none.
    config.train.update(
      dict(steps=1000, batch_size=64, seq_len=64, eval_every=250, eval_batches=0, checkpoint_every=250, log_every=50)
    )
    config.mesh.data = 1  # one device: the demo must not depend on the host's device count
  if "tiny" in parts:
    config.data.update(dict(num_train=200, num_val=40, num_test=40, max_length=64))
    config.model.update(dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, classifier_hidden=32))
    tiny_train(config, seq_len=64)
  return config
