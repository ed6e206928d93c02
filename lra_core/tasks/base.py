"""The task interface: what the trainer needs from an objective.

The trainer never branches on the task or the model. A task
  - `prepare(batch, key)`: per-step preprocessing on device (e.g. MLM masking), before the batch
    is split into micro-batches;
  - `normalizer(batch)`: the total loss weight of the whole batch, so that summing gradients of
    micro-batch losses `sum / normalizer` gives exactly the full-batch gradient;
  - `loss_and_metrics(model, batch, *, normalizer, rngs, carry)`: scalar loss, metric sums and the
    model state carried to the next update window (None for models without one).
Metrics are (sum, weight) pairs, summed over batches and devices, and turned into values by
`finalize`, so an evaluation over many batches is exact.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.data import DataInfo, document_mask

Array = jax.Array
Metrics = dict[str, tuple[Array, Array]]


@jax.custom_vjp
def token_nll(logits: Array, targets: Array) -> Array:
  """-log p(target) per token, float32 [...]; logits [..., V] in any float type (the arithmetic is float32).

  The [..., V] arrays are the largest of a long sequence's step (50,267 x 131,072 float32 are 25 GiB), so
  none is kept for the backward pass, which forms softmax - one-hot from the logits themselves, and the
  target's score is a masked sum, not a gather: a gather's transpose is a scatter-add into a whole
  float32 [..., V] buffer, which XLA materialises when the time axis is split over chips."""
  return _nll(logits, targets)[0]


def _shifted(logits: Array) -> Array:
  """The logits less their maximum, float32 (as jax.nn.log_softmax shifts them)."""
  return logits.astype(jnp.float32) - jnp.max(logits, -1, keepdims=True).astype(jnp.float32)


def _one_hot(targets: Array, vocab: int) -> Array:
  return jax.lax.broadcasted_iota(jnp.int32, (*targets.shape, vocab), targets.ndim) == targets[..., None]


def _nll(logits: Array, targets: Array) -> tuple[Array, Array]:
  """(-log p(target), the sum of exp(shifted logits)): log_softmax's arithmetic, read at the target."""
  shifted = _shifted(logits)
  total = jnp.exp(shifted).sum(-1)
  return jnp.log(total) - jnp.where(_one_hot(targets, logits.shape[-1]), shifted, 0.0).sum(-1), total


def _nll_forward(logits: Array, targets: Array):
  nll, total = _nll(logits, targets)
  return nll, (logits, targets, total)


def _nll_backward(saved, g: Array):
  logits, targets, total = saved
  softmax = jnp.exp(_shifted(logits)) / total[..., None]
  grad = g[..., None] * (softmax - _one_hot(targets, logits.shape[-1]))
  return grad.astype(logits.dtype), None  # no cotangent for the integer targets


token_nll.defvjp(_nll_forward, _nll_backward)


def weighted_cross_entropy(
  logits: Array, targets: Array, weights: Array, *, nll: Array | None = None
) -> tuple[Array, Array, Array]:
  """Sums of token NLL, of correct argmax predictions, and of weights. logits [..., V] (any float type);
  `nll`: the per-token NLL if the caller has it already."""
  nll = token_nll(logits, targets) if nll is None else nll
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  return (nll * weights).sum(), (correct * weights).sum(), weights.sum()


Aux = tuple[Array, dict[str, Array]]


def apply_model(model: nnx.Module, *args, **kwargs) -> tuple[Any, Aux]:
  """Calls the model and collects what it sowed: (output, (auxiliary loss, auxiliary metrics)).

  Models add auxiliary losses with `self.sow(nnx.Intermediate, "aux_loss", scalar)` (e.g. VQ
  commitment) and metrics with `self.sow(nnx.Intermediate, "aux_metrics", {name: scalar})`
  (averaged per batch like any metric). Values sown by repeated calls are summed.
  """
  out, sown = nnx.capture(model, nnx.Intermediate)(*args, **kwargs)
  total = jnp.zeros((), jnp.float32)
  metrics: dict[str, Array] = {}
  for path, value in nnx.to_flat_state(sown):
    if "aux_loss" in path:
      for v in jax.tree.leaves(value):
        total = total + jnp.asarray(v, jnp.float32).sum()
    elif "aux_metrics" in path:
      for record in value.get_value():
        for name, v in record.items():
          metrics[name] = metrics.get(name, 0.0) + jnp.asarray(v, jnp.float32)
  return out, (total, metrics)


def classification_loss(
  logits: Array, batch: dict[str, Array], normalizer: Array, aux: Aux, *, nll: Array | None = None
) -> tuple[Array, Metrics]:
  """Weighted cross-entropy / normalizer plus the model's auxiliary losses, and metric sums.

  An auxiliary loss is a mean over this batch's tokens; it is weighted by the batch's share of
  the normalizer, so that micro-batch losses still sum to the full-batch objective. `nll`: the
  per-token NLL if the caller has it already.
  """
  nll, correct, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"], nll=nll)
  aux_loss, aux_metrics = aux
  loss = (nll + aux_loss * weight) / normalizer
  metrics = {"loss": (nll, weight), "accuracy": (correct, weight)}
  metrics.update({name: (value, jnp.ones((), jnp.float32)) for name, value in aux_metrics.items()})
  return loss, metrics


class Task(abc.ABC):
  """Base class; subclasses implement `loss_and_metrics` and may override the rest."""

  name = "task"
  metric_names: tuple[str, ...] = ("loss", "accuracy")

  def __init__(self, config, info: DataInfo):
    self.config, self.info = config, info
    self.document_mask = document_mask(config)

  def document_kwargs(self, batch: dict[str, Array]) -> dict[str, Array]:
    """{"segment_ids": ...} for the model when documents are masked apart (lra_core.data.document_mask)."""
    return {"segment_ids": batch["segment_ids"]} if self.document_mask and "segment_ids" in batch else {}

  def prepare(self, batch: dict[str, Array], key: Array) -> dict[str, Array]:
    del key
    return batch

  def normalizer(self, batch: dict[str, Array]) -> Array:
    return jnp.maximum(batch["weights"].astype(jnp.float32).sum(), 1.0)

  @abc.abstractmethod
  def loss_and_metrics(
    self, model: nnx.Module, batch: dict[str, Array], *, normalizer: Array, rngs: nnx.Rngs | None, carry: Any = None
  ) -> tuple[Array, Metrics, Any]:
    """-> (scalar loss to differentiate, metric (sum, weight) pairs, carried state)."""

  def finalize(self, sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    """(sum, weight) pairs -> metric values; adds derived metrics (perplexity, bits)."""
    return {k: (s / w if w else float("nan")) for k, (s, w) in sums.items()}


class TokenTask(Task):
  """Per-token prediction: adds perplexity and bits per <unit> (byte, token, dim) to the loss."""

  def finalize(self, sums):
    out = super().finalize(sums)
    if "loss" in out:
      out["perplexity"] = math.exp(min(out["loss"], 700.0))
      out[f"bits_per_{self.info.unit}"] = out["loss"] / math.log(2.0)
    if "word_loss" in out:
      out["word_perplexity"] = math.exp(min(out["word_loss"], 700.0))
    return out
