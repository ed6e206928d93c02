"""Settings shared by the Long Range Arena configs (Tay et al. 2021 and its public configs)."""

from __future__ import annotations

import ml_collections

from lra_core import optim


def lra_optim(lr: float, warmup: int, weight_decay: float) -> ml_collections.ConfigDict:
  """Adam b1 .9 b2 .98 eps 1e-9, decoupled weight decay, constant * linear_warmup * rsqrt_decay."""
  c = optim.default_config()
  c.update(dict(name="adamw", lr=lr, schedule="rsqrt", warmup_steps=warmup, b1=0.9, b2=0.98, eps=1e-9,
                weight_decay=weight_decay, weight_decay_schedule="lr"))
  return c

