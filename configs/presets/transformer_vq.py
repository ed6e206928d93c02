"""Transformer-VQ (Lingle 2024): Table 10's sizes, appendix C's optimizers and the `tiny` size."""

from __future__ import annotations

import ml_collections

from lra_core.config import tiny_train
from lra_core.run import optim_settings

PAPER_SIZES = {
  "190M": dict(d_model=768, d_k=128, d_v=1536, num_layers=48, n_code=512, block_len=512),
  "1.3B": dict(d_model=2048, d_k=128, d_v=4096, num_layers=48, n_code=512, block_len=512),
  "1.2B": dict(d_model=2048, d_k=128, d_v=4096, num_layers=48, n_code=512, block_len=512),
}


def paper_optim(name: str, weight_decay: float = 0.0) -> ml_collections.ConfigDict:
  """Appendix C.1: AdamW (b1 .9, b2 .98, eps 1e-9, lr 4e-4, clip 0.1) or Adafactor (lr 0.01);
  10k warmup, cosine decay to 0.1x; weight decay (where used) on a constant schedule."""
  c = optim_settings.default_config()
  c.update(dict(schedule="cosine", warmup_steps=10_000, min_lr_ratio=0.1, weight_decay=weight_decay))
  if name == "adamw":
    c.update(dict(name="adamw", lr=4e-4, b1=0.9, b2=0.98, eps=1e-9, clip_norm=0.1, weight_decay_schedule="constant"))
  else:
    c.update(
      dict(
        name="adafactor",
        lr=0.01,
        momentum=0.0,
        decay_rate=0.8,
        clipping_threshold=1.0,
        multiply_by_parameter_scale=True,
        clip_norm=0.0,
      )
    )
  return c


def tiny(config: ml_collections.ConfigDict, *, seq_len: int, update_len: int) -> None:
  """The `tiny` size: same code paths (cache across windows, all dropouts), seconds on a CPU."""
  config.model.update(dict(d_model=32, d_k=16, d_v=64, num_layers=2, n_code=16, block_len=8))
  tiny_train(config, seq_len=seq_len)
  config.train.update_len = update_len
