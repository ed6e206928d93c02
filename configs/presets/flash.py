"""FLASH (Hua et al. 2022): the optimizer every model of Tables 6-7 trains with."""

from __future__ import annotations

import ml_collections

from lra_core.run import optim_settings


def paper_optim(*, clip: bool = True) -> ml_collections.ConfigDict:
  """The optimizer of Tables 6-7 (MLM on C4, LM on Wiki-40B and PG-19), for every model compared:
  AdamW (b1 .9, b2 .999, eps 1e-6, weight decay 0.01), lr 7e-4 with 10k warm-up steps and linear
  decay to 0, gradient clipping 0.1 for all but the vanilla Transformer (`clip=False`); the paper
  clips locally, here by global norm."""
  c = optim_settings.default_config()
  c.update(
    dict(
      name="adamw",
      lr=7e-4,
      b1=0.9,
      b2=0.999,
      eps=1e-6,
      weight_decay=0.01,
      weight_decay_schedule="lr",
      clip_norm=0.1 if clip else 0.0,
      schedule="linear",
      warmup_steps=10_000,
      min_lr_ratio=0.0,
    )
  )
  return c
