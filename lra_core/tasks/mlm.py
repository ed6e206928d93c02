"""Masked language modelling (BERT-style): predict 15% of the tokens from the rest.

Masking is drawn on device from the step's key, so it is reproducible and free for the host.
Of the chosen positions 80% become the mask id, 10% a random token, 10% stay unchanged
(`config.mlm`). Only chosen positions carry loss weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.tasks.base import TokenTask, apply_model, classification_loss


def mask_tokens(key, tokens, valid, *, mask_rate, replace_mask, replace_random, mask_id, vocab_size):
  """-> (inputs, targets, weights): inputs with chosen positions corrupted, weights 1 there."""
  k_choose, k_kind, k_rand = jax.random.split(key, 3)
  chosen = (jax.random.uniform(k_choose, tokens.shape) < mask_rate) & valid
  kind = jax.random.uniform(k_kind, tokens.shape)
  random_tokens = jax.random.randint(k_rand, tokens.shape, 0, vocab_size, tokens.dtype)
  corrupted = jnp.where(
    kind < replace_mask, mask_id, jnp.where(kind < replace_mask + replace_random, random_tokens, tokens)
  )
  inputs = jnp.where(chosen, corrupted, tokens)
  return inputs, tokens, chosen.astype(jnp.float32)


class MLMTask(TokenTask):
  name = "mlm"

  def __init__(self, config, info):
    super().__init__(config, info)
    cfg = config.mlm
    self.mask_id = cfg.mask_id if cfg.mask_id >= 0 else config.model.vocab_size - 1
    self.kwargs = dict(
      mask_rate=cfg.mask_rate,
      replace_mask=cfg.replace_mask,
      replace_random=cfg.replace_random,
      mask_id=self.mask_id,
      vocab_size=info.vocab_size,
    )

  def prepare(self, batch, key):
    valid = batch["weights"] > 0
    inputs, targets, weights = mask_tokens(key, batch["inputs"], valid, **self.kwargs)
    prepared = {"inputs": inputs, "targets": targets, "weights": weights, "valid": valid}
    if "segment_ids" in batch:
      prepared["segment_ids"] = batch["segment_ids"]
    return prepared

  def loss_and_metrics(self, model, batch, *, normalizer, rngs, carry=None):
    logits, aux = apply_model(model, batch["inputs"], mask=batch["valid"], rngs=rngs, **self.document_kwargs(batch))
    loss, metrics = classification_loss(logits, batch, normalizer, aux)
    return loss, metrics, carry
