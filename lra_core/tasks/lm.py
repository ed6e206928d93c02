"""Autoregressive language modelling (`lm`, and `image_ar` over pixel sequences).

A model may carry state between update windows (Transformer-VQ's compressive cache): it then
defines `init_carry(batch_size)` and `__call__(inputs, carry=..., rngs=...) -> (logits, carry)`.
The trainer keeps the carry between optimizer steps (no gradient flows through it) and resets
it where the data marks the first window of a sequence.
"""

from __future__ import annotations

from lra_core.tasks.base import TokenTask, classification_loss


class LMTask(TokenTask):
  name = "lm"

  def loss_and_metrics(self, model, batch, *, normalizer, rngs, carry=None):
    if carry is not None:
      logits, carry = model(batch["inputs"], carry=carry, rngs=rngs)
    else:
      logits = model(batch["inputs"], rngs=rngs)
    loss, metrics = classification_loss(model, logits, batch, normalizer)
    return loss, metrics, carry


class ImageARTask(LMTask):
  """Pixels (x channels) as tokens; bits per dim is the figure of merit."""
  name = "image_ar"
