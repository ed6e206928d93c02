"""Autoregressive language modelling (`lm`, and `image_ar` over pixel sequences).

A model may carry state between update windows (Transformer-VQ's compressive cache): its family
has capability `carry` (lra_core.protocol.CarryModel: `init_carry(batch_size)` and
`__call__(inputs, carry=..., rngs=...) -> (logits, carry)`).
The trainer keeps the carry between optimizer steps (no gradient flows through it) and resets
it where the data marks the first window of a sequence.

Text corpora mark the tokens that begin a word (`words`); the summed token loss over the number
of words is `word_loss`, whose exponential is the word-level perplexity PG-19 results quote
(Rae et al. 2020).

A model that predicts tokens in blocks of `model.block_len` (capability `block_losses`, e.g. the
Block Transformer) also gets the loss at each position within a block, `block_pos{j}_loss` for j = 1..block_len (the
Block Transformer paper's Figure 3d); windows start on a block boundary.
"""

from __future__ import annotations

import jax.numpy as jnp

from lra_core import registry
from lra_core.tasks.base import TokenTask, apply_model, classification_loss, token_nll


class LMTask(TokenTask):
  name = "lm"

  def __init__(self, config, info):
    super().__init__(config, info)
    block_losses = registry.family(config.model.name).capabilities.block_losses
    self.block_len = config.model.block_len if block_losses else 0

  def loss_and_metrics(self, model, batch, *, normalizer, rngs, carry=None):
    kwargs = self.document_kwargs(batch)
    if carry is not None:
      (logits, carry), aux = apply_model(model, batch["inputs"], carry=carry, rngs=rngs, **kwargs)
    else:
      logits, aux = apply_model(model, batch["inputs"], rngs=rngs, **kwargs)
    block_len = self.block_len
    nll = token_nll(logits, batch["targets"]) if block_len else None  # computed once, used twice
    loss, metrics = classification_loss(logits, batch, normalizer, aux, nll=nll)
    if "words" in batch:  # text corpora: per-word loss = total token loss / number of words
      metrics["word_loss"] = (metrics["loss"][0], (batch["words"] * batch["weights"]).sum())
    if block_len:
      metrics.update(loss_by_block_position(nll, batch, block_len))
    return loss, metrics, carry


class ImageARTask(LMTask):
  """Pixels (x channels) as tokens; bits per dim is the figure of merit."""

  name = "image_ar"


def loss_by_block_position(nll, batch, block_len: int) -> dict:
  """Per-token NLL [B,T] -> (sum, weight) of the loss on targets at each position 1..block_len
  within their block; the target of input position t is token t + 1."""
  nll = nll * batch["weights"]
  position = (jnp.arange(nll.shape[-1]) + 1) % block_len
  out = {}
  for j in range(block_len):
    at = (position == j).astype(nll.dtype)
    out[f"block_pos{j + 1}_loss"] = ((nll * at).sum(), (batch["weights"] * at).sum())
  return out
