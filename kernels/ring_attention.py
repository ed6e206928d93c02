"""Softmax attention over a sequence split over chips (kernels/context.py): ring attention.

Each of the n chips holds T/n consecutive steps of the queries, keys and values. The key-value slices
go round the ring of chips (`context.rotate`, n - 1 steps, each overlapping the next slice's transfer
with this one's scores); each chip attends its queries to the slice it holds and merges the result
with an online softmax (a running maximum, normaliser and weighted sum per query, as a flash kernel
merges its blocks), so after n slices every query has read every key it may. Masks compare global
positions (the slice's chip gives its offset) and the document ids and padding that travel with each
slice; a causal chip reads the slices after its own fully masked, and does the same work for them:
the plain order's imbalance (the last chip has the most to read). A sliding window reaches only the
neighbouring chips and never comes here (kernels/attention.py `local_attention`).

Per step a chip forms one slice pair's scores, T/n x T/n per head, in float32; the step is recomputed
in the backward pass (jax.checkpoint), so what the backward keeps per step is the slice of keys and
values and the running sums: O(T) per chip, not O(T^2 / n).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context
from lra_core.kernels.attention import MASK_VALUE, attention_mask

Array = jax.Array


def ring_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool,
  k_valid: Array | None = None,
  segments: Array | None = None,
  scale: float | None = None,
) -> Array:
  """softmax(q k^T scale, masked) v with the time axis split over the sequence mesh axes: q [B,T,H,D],
  k [B,T,K,D], v [B,T,K,Dv] -> [B,T,H,Dv]; masks as kernels/attention.py `attention_mask` (causal,
  k_valid: bool[B,T] False = padding, segments: int[B,T] document ids). Equal to
  `dot_product_attention` with that mask, rounding apart; without a split it is computed as one slice."""
  b, t, h, _ = q.shape
  run = lambda q, k, v, k_valid, segments: _on_chip(q, k, v, k_valid, segments, causal=causal, scale=scale)
  dims = ("bth.", "btk.", "btk.", "bt", "bt")
  args = (q, k, v, k_valid, segments)
  return context.per_chip(run, args, dims, "bth.", batch=b, heads=h, kv_heads=k.shape[2], length=t)


def _on_chip(q, k, v, k_valid, segments, *, causal: bool, scale: float | None) -> Array:
  b, t, h, d = q.shape
  kv_heads, dv = k.shape[2], v.shape[-1]
  scale = d**-0.5 if scale is None else scale
  queries = q.reshape(b, t, kv_heads, h // kv_heads, d)  # query head h reads key-value head h // groups
  ids = jnp.zeros((b, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
  valid = jnp.ones((b, t), bool) if k_valid is None else k_valid
  rows = context.offset(t) + jnp.arange(t)
  n, me = context.count(), context.index()

  @jax.checkpoint  # the scores of a slice pair are recomputed in the backward pass, never kept
  def read(sums, slice_, step):
    """The running (maximum, normaliser, weighted values) after reading the key slice of chip me - step."""
    top, total, out = sums
    keys, values, key_ids, key_valid = slice_
    cols = (me - step) % n * t + jnp.arange(t)
    mask = attention_mask(rows, cols, causal=causal, k_valid=key_valid, q_segments=ids, k_segments=key_ids)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", queries, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
    # From MASK_VALUE (finite): a row masked so far weighs its keys equally, and the first key it may
    # read fades them out (exp(MASK_VALUE - max) = 0), as one softmax over the whole row does.
    new_top = jnp.maximum(top, logits.max(-1))
    fade, p = jnp.exp(top - new_top), jnp.exp(logits - new_top[..., None])
    weighted = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return new_top, total * fade + p.sum(-1), out * fade[..., None] + weighted

  shape = (b, kv_heads, h // kv_heads, t)
  sums = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, dv), jnp.float32))
  slice_ = (k, v, ids, valid)
  sums = read(sums, slice_, 0)

  def step(carry, i):
    sums, slice_ = carry
    slice_ = jax.tree.map(context.rotate, slice_)  # the previous chip's slice (its transfer overlaps `read`)
    return (read(sums, slice_, i), slice_), None

  if n > 1:
    (sums, _), _ = jax.lax.scan(step, (sums, slice_), jnp.arange(1, n))
  _, total, out = sums
  out = out / total[..., None]  # >= 1: each row's largest term is exp(0)
  return jnp.moveaxis(out, 3, 1).reshape(b, t, h, dv).astype(v.dtype)
