"""Softmax attention over a sequence split over chips (kernels/context_parallel.py): ring attention.

Each of the n chips holds T/n consecutive steps of the queries, keys and values. The key-value slices
go round the ring of chips (`context_parallel.rotate`, n - 1 steps, each overlapping the next slice's transfer
with this one's scores); each chip attends its queries to the slice it holds and merges the result
with an online softmax (a running maximum, normaliser and weighted sum per query, as a flash kernel
merges its blocks), so after n slices every query has read every key it may. Masks compare positions
(global steps, from the chip a slice comes from, or those the caller gives, which travel with the
slice: FIT-AR's latents, by group), and the document ids and padding that travel with it. A block of
queries skips a key piece it may not read at all; in the plain order a causal chip then idles while
the later chips read (the last has the most to read), which the zig-zag order (context_parallel.to_zigzag)
evens out. A sliding window reaches only the neighbouring chips and never comes here
(kernels/softmax/reference.py `local_attention`).

Per step a chip forms its slice pair's scores a block of queries at a time (`query_block` x T/n per
head, float32); steps and blocks are recomputed in the backward pass (jax.checkpoint), so what the
backward keeps is each step's slice of keys and values and the running sums: O(T) per chip, not
O(T^2 / n^2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel
from lra_core.kernels.softmax.reference import MASK_VALUE, attention_mask, cap

Array = jax.Array


def ring_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool,
  k_valid: Array | None = None,
  segments: Array | None = None,
  positions: Array | None = None,
  scale: float | None = None,
  soft_cap: float = 0.0,
  query_block: int = 512,
) -> Array:
  """softmax(q k^T scale, masked) v with the time axis split over the sequence mesh axes: q [B,T,H,D],
  k [B,T,K,D], v [B,T,K,Dv] -> [B,T,H,Dv]; masks as kernels/softmax/reference.py `attention_mask` (causal,
  k_valid: bool[B,T] False = padding, segments: int[B,T] document ids, positions: int[T] or [B,T]
  what the causal mask compares, by default the steps); soft_cap as `dot_product_attention`'s. Equal
  to `dot_product_attention` with that mask, rounding apart; without a split it is computed as one slice.
  `query_block`: a chip's queries go in blocks of (at most) this many rows, the largest power of two
  dividing its slice, so a step's scores are query_block x T/n per head, never its whole slice pair."""
  b, t, h, _ = q.shape
  kw = dict(causal=causal, scale=scale, soft_cap=soft_cap, query_block=query_block)
  run = lambda q, k, v, k_valid, segments, positions: _on_chip(q, k, v, k_valid, segments, positions, **kw)
  dims = ("bth.", "btk.", "btk.", "bt", "bt", "bt")
  positions = None if positions is None else jnp.broadcast_to(positions.astype(jnp.int32), (b, t))
  args = (q, k, v, k_valid, segments, positions)
  return context_parallel.per_chip(run, args, dims, "bth.", batch=b, heads=h, kv_heads=k.shape[2], length=t)


def _on_chip(
  q, k, v, k_valid, segments, positions, *, causal: bool, scale: float | None, soft_cap: float, query_block: int
) -> Array:
  b, t, h, d = q.shape
  kv_heads, dv = k.shape[2], v.shape[-1]
  groups = h // kv_heads
  scale = d**-0.5 if scale is None else scale
  size = math.gcd(t, query_block)  # the largest power of two dividing t, for a power-of-two query_block
  blocks = t // size
  in_blocks = lambda x: jnp.moveaxis(x.reshape(b, blocks, size, *x.shape[2:]), 1, 0)  # [B,T,..] -> [N,B,size,..]
  # query head h reads key-value head h // groups
  queries = in_blocks(q.reshape(b, t, kv_heads, groups, d))
  ids = None if segments is None else segments.astype(jnp.int32)
  n, me = context_parallel.count(), context_parallel.index()
  # A slice's positions: those the caller gives, else the steps of the chip it comes from.
  steps = lambda chip: jnp.broadcast_to(context_parallel.steps_of(chip, t), (b, t))
  pos = steps(me) if positions is None else positions
  # In the zig-zag order a key slice is two pieces far apart in time: each is read (or skipped) alone.
  pieces = 2 if context_parallel.zigzag() else 1

  def read_piece(sums, query, row, query_ids, piece):
    """One query block's running (maximum, normaliser, weighted values) after reading a key piece."""
    top, total, out = sums
    keys, values, key_ids, key_valid, cols = piece
    mask = attention_mask(row, cols, causal=causal, k_valid=key_valid, q_segments=query_ids, k_segments=key_ids)

    def read_keys(sums):
      top, total, out = sums
      logits = cap(jnp.einsum("bqkgd,bskd->bkgqs", query, keys, preferred_element_type=jnp.float32) * scale, soft_cap)
      logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
      # From MASK_VALUE (finite): a row masked so far weighs its keys equally, and the first key it
      # may read fades them out (exp(MASK_VALUE - max) = 0), as one softmax over the whole row does.
      new_top = jnp.maximum(top, logits.max(-1))
      fade, p = jnp.exp(top - new_top), jnp.exp(logits - new_top[..., None])
      weighted = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
      return new_top, total * fade + p.sum(-1), out * fade[..., None] + weighted

    # Keys no query of the block may read (a causal chip's later pieces) are skipped, not computed: this
    # is the work the zig-zag order shares out. (A row read nothing yet keeps MASK_VALUE: reading an
    # all-masked piece would only add its equal weights, which the first real key fades out.)
    return jax.lax.cond(mask.any(), read_keys, lambda sums: sums, (top, total, out))

  @jax.checkpoint  # a block's scores are recomputed in the backward pass, never kept
  def read_block(sums, query, row, query_ids, pieces_):
    for piece in pieces_:
      sums = read_piece(sums, query, row, query_ids, piece)
    return sums

  @jax.checkpoint  # the backward pass recomputes a step from its slice and the sums it started from
  def read(sums, slice_, step):
    """Every query block's sums after reading the key slice of chip me - step."""
    cols = slice_["pos"] if "pos" in slice_ else steps((me - step) % n)
    key_side = (slice_["k"], slice_["v"], slice_.get("ids"), slice_.get("valid"), cols)
    split = lambda x: [None] * pieces if x is None else jnp.split(x, pieces, axis=1)
    pieces_ = list(zip(*map(split, key_side)))  # once per step, for every block
    one = lambda _, xs: (None, read_block(*xs, pieces_))
    query_ids = None if ids is None else in_blocks(ids)
    return jax.lax.scan(one, None, (sums, queries, in_blocks(pos), query_ids))[1]

  shape = (blocks, b, kv_heads, groups, size)
  sums = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, dv), jnp.float32))
  # What goes round the ring: the keys and values, and the document ids, padding and positions the
  # caller gave (what was not given follows from the step: no transfer for it).
  slice_ = dict(k=k, v=v, ids=ids, valid=k_valid, pos=positions)
  slice_ = {name: x for name, x in slice_.items() if x is not None}
  sums = read(sums, slice_, 0)

  def step(carry, i):
    sums, slice_ = carry
    slice_ = jax.tree.map(context_parallel.rotate, slice_)  # the previous chip's slice (its transfer overlaps `read`)
    return (read(sums, slice_, i), slice_), None

  if n > 1:
    (sums, _), _ = jax.lax.scan(step, (sums, slice_), jnp.arange(1, n))
  _, total, out = sums
  # A row that read any piece has total >= 1 (its largest term is exp(0)); one whose block skipped
  # every piece (it may read no key at all) gets 0 where one softmax gives the mean of all values.
  out = out / jnp.where(total > 0, total, 1.0)[..., None]
  # [N,B,K,G,size,Dv] -> [B,N,size,K,G,Dv] -> [B,T,H,Dv]
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, dv).astype(v.dtype)
