"""Output heads shared by every model family: pooling, classifier and two-tower matching.

A sequence model produces features [B,T,D]; for classification tasks it pools them and calls a
head. Two-tower retrieval (LRA) encodes both documents with the SAME encoder (towers folded into
the batch), pools each and compares the two vectors only in the head, so no token of one
document can attend to the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core import task_kinds
from lra_core.models.layers.core import ACTIVATIONS, Dense, param

Array = jax.Array
POOLING = ("cls", "mean", "max")


def pool(x: Array, mask: Array | None, kind: str) -> Array:
  """[B,T,D] -> [B,D]. 'cls' takes position 0 (the model prepends a CLS vector there)."""
  if kind == "cls":
    return x[:, 0]
  if mask is None:
    mask = jnp.ones(x.shape[:2], bool)
  m = mask[..., None]
  if kind == "mean":
    return (x * m).sum(1) / jnp.maximum(m.sum(1), 1).astype(x.dtype)
  if kind == "max":
    return jnp.where(m, x, jnp.finfo(x.dtype).min).max(1)
  raise ValueError(f"pooling {kind!r} is not one of {POOLING}.")


class ClassifierHead(nnx.Module):
  """features [B,F] -> logits [B,C] through one hidden layer (as the LRA classifiers)."""

  def __init__(
    self, features: int, hidden: int, num_classes: int, *, activation: str = "relu", dtype=jnp.float32, rngs: nnx.Rngs
  ):
    self.hidden = Dense(features, hidden, axes=("embed", "mlp"), use_bias=True, dtype=dtype, rngs=rngs)
    self.out = Dense(hidden, num_classes, axes=("mlp", None), use_bias=True, dtype=dtype, rngs=rngs)
    self.activation = activation

  def __call__(self, x: Array) -> Array:
    return self.out(ACTIVATIONS[self.activation](self.hidden(x))).astype(jnp.float32)


class TwoTowerHead(nnx.Module):
  """pooled [B,2,D] -> logits [B,C] from [e1, e2, e1*e2, e1-e2] (LRA retrieval)."""

  def __init__(
    self, features: int, hidden: int, num_classes: int, *, activation: str = "relu", dtype=jnp.float32, rngs: nnx.Rngs
  ):
    self.classifier = ClassifierHead(4 * features, hidden, num_classes, activation=activation, dtype=dtype, rngs=rngs)

  def __call__(self, pooled: Array) -> Array:
    e1, e2 = pooled[:, 0], pooled[:, 1]
    return self.classifier(jnp.concatenate([e1, e2, e1 * e2, e1 - e2], axis=-1))


class TaskHead(nnx.Module):
  """The output layer a task needs, on final features x [B',T,D].

  lm / mlm / image_ar: per-token logits [B,T,V] (tied to `embed` if given: x E^T / D, or x E^T without
  `tied_scale`), plus a learned bias over the vocabulary with `output_bias`;
  classify: pooled -> [B,C]; retrieval: the batch holds both towers ([2B,T,D]) -> [B,C].
  """

  def __init__(
    self,
    task: str,
    features: int,
    *,
    vocab_size: int = 0,
    num_classes: int = 0,
    pooling: str = "mean",
    hidden: int = 0,
    embed=None,
    tied_scale: bool = True,
    output_bias: bool = False,
    dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    kind = task_kinds.kind(task)
    self.pooling, self.embed, self.tied_scale = pooling, embed, tied_scale
    self.pools, self.towers = kind.classifies, kind.towers
    hidden = hidden or features
    self.bias = (
      param(rngs, jax.nn.initializers.zeros, (vocab_size,), ("vocab",)) if kind.per_token and output_bias else None
    )
    if kind.per_token:
      out = None if embed is not None else Dense(features, vocab_size, axes=("embed", "vocab"), dtype=dtype, rngs=rngs)
    elif kind.classifies and kind.towers == 2:
      out = TwoTowerHead(features, hidden, num_classes, dtype=dtype, rngs=rngs)
    elif kind.classifies and kind.towers == 1:
      out = ClassifierHead(features, hidden, num_classes, dtype=dtype, rngs=rngs)
    else:
      raise ValueError(f"no output head for task {task!r}.")
    self.out = out

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    if not self.pools:
      if self.out is not None:
        logits = self.out(x).astype(jnp.float32)
      else:
        # Tied: x E^T / D. Lookups (E's rows) have norm ~sqrt(D) and so has x (normalised): without the
        # 1/D (T5's D^-1/2 on a table that stores E / sqrt(D)) a fresh model would score each input token
        # D above the others. (Gemma scales its lookups instead: Embed's multiplier, and no 1/D here.)
        logits = self.embed.attend(x).astype(jnp.float32)
        logits = logits * x.shape[-1] ** -1.0 if self.tied_scale else logits
      return logits if self.bias is None else logits + self.bias[...]
    pooled = pool(x, mask, self.pooling)
    if self.towers > 1:  # the towers of one example sit in consecutive rows (fold_towers)
      pooled = pooled.reshape(-1, self.towers, pooled.shape[-1])
    return self.out(pooled)


def fold_towers(inputs: Array, mask: Array | None) -> tuple[Array, Array | None]:
  """Retrieval inputs [B,2,T] -> [2B,T] so one encoder call encodes both documents."""
  inputs = inputs.reshape(-1, inputs.shape[-1])
  return inputs, (None if mask is None else mask.reshape(-1, mask.shape[-1]))
