"""Sequence classification (`classify`) and two-tower matching (`retrieval`).

Both read inputs / mask / targets / weights; the model decides how towers are encoded
(see models/layers/heads.py), so the objective is the same cross-entropy.
"""

from __future__ import annotations

from lra_core.tasks.base import Task, apply_model, classification_loss


class ClassifyTask(Task):
  name = "classify"

  def loss_and_metrics(self, model, batch, *, normalizer, rngs, carry=None):
    logits, aux = apply_model(model, batch["inputs"], mask=batch["mask"], rngs=rngs)
    loss, metrics = classification_loss(logits, batch, normalizer, aux)
    return loss, metrics, carry
