"""Settings shared by the Long Range Arena configs (Tay et al. 2021 and its public configs)."""

from __future__ import annotations

import ml_collections

from lra_core import optim
from models import transformer


def lra_optim(lr: float, warmup: int, weight_decay: float) -> ml_collections.ConfigDict:
  """Adam b1 .9 b2 .98 eps 1e-9, decoupled weight decay, constant * linear_warmup * rsqrt_decay."""
  c = optim.default_config()
  c.update(dict(name="adamw", lr=lr, schedule="rsqrt", warmup_steps=warmup, b1=0.9, b2=0.98, eps=1e-9,
                weight_decay=weight_decay, weight_decay_schedule="lr"))
  return c



def lra_transformer(parts: set[str], **sizes) -> ml_collections.ConfigDict:
  """The LRA Transformer encoder (dropout 0.1, CLS pooling); args plus / plusplus pick
  Transformer+ / Transformer++. The plain one uses fixed sinusoids, as LRA's encoders do."""
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  model = transformer.model_config(variant, pooling="cls", dropout=0.1, attention_dropout=0.1, **sizes)
  if variant == "transformer":
    model.position = "sinusoid"
  return model
