"""Softmax dot-product attention as pure functions (the quadratic reference for every model).

Shapes: B batch, Tq / Tk query / key time, H query heads, K key-value heads (H % K == 0;
K == 1 is multi-query attention), D head width. Masks are built from explicit positions, so a
full forward pass and cached decoding (keys in a ring buffer, empty slots at position -1) use
the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel, toolkit
from lra_core.kernels.packed_documents import same_segment

Array = jax.Array
MASK_VALUE = -1e30  # large finite value: fully masked rows stay NaN-free


def attention_mask(
  q_pos: Array,
  k_pos: Array,
  *,
  causal: bool,
  window: int = 0,
  k_valid: Array | None = None,
  q_segments: Array | None = None,
  k_segments: Array | None = None,
) -> Array:
  """bool, broadcastable to [B,Tq,Tk]: which keys each query may read.

  q_pos: int[Tq] or [B,Tq]; k_pos: int[Tk] or [B,Tk], negative = empty cache slot.
  causal: keys at positions <= the query's. window > 0: only the `window` most recent keys
  (causal) or keys within distance < window on either side (bidirectional).
  k_valid: bool[B,Tk], False for padding.
  q_segments, k_segments: int[B,Tq], int[B,Tk] document ids (kernels/packed_documents.py): keys of
  another document are masked; both or neither.
  """
  q_pos = q_pos[None] if q_pos.ndim == 1 else q_pos
  k_pos = k_pos[None] if k_pos.ndim == 1 else k_pos
  q, k = q_pos[:, :, None], k_pos[:, None, :]
  mask = k >= 0  # an empty cache slot holds position -1
  if causal:
    mask &= k <= q
  if window:
    mask &= (q - k < window) if causal else (jnp.abs(q - k) < window)
  if k_valid is not None:
    mask &= k_valid[:, None, :]
  if (q_segments is None) != (k_segments is None):
    raise ValueError("attention_mask needs both q_segments and k_segments, or neither.")
  if q_segments is not None:
    mask &= same_segment(q_segments, k_segments)
  return mask


def dot_product_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: Array | None = None,
  bias: Array | None = None,
  scale: float | None = None,
  soft_cap: float = 0.0,
  probs_fn: Callable[[Array], Array] | None = None,
) -> Array:
  """softmax(cap(q k^T * scale) + bias, masked) v.

  q: [B,Tq,H,D]  k: [B,Tk,K,D]  v: [B,Tk,K,Dv]  mask: bool[B|1,Tq,Tk]  bias: [H|1,Tq,Tk]
  -> [B,Tq,H,Dv]. `soft_cap` > 0 bounds the scores smoothly, cap(s) = soft_cap tanh(s / soft_cap)
  (Gemma 2's); 0 leaves them. `probs_fn` transforms the attention weights (e.g. dropout).
  """
  b, tq, h, d = q.shape
  kv_heads = k.shape[2]
  if h % kv_heads:
    raise ValueError(f"query heads {h} are not a multiple of key-value heads {kv_heads}.")
  if k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or k.shape[-1] != d:
    raise ValueError(f"incompatible attention shapes q {q.shape}, k {k.shape}, v {v.shape}.")
  scale = d**-0.5 if scale is None else scale
  groups = h // kv_heads
  if toolkit.platform() == "cpu":
    return _attention_rows(q, k, v, groups, mask=mask, bias=bias, scale=scale, soft_cap=soft_cap, probs_fn=probs_fn)
  qg = q.reshape(b, tq, kv_heads, groups, d)  # query head h reads key-value head h // groups
  logits = cap(jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale, soft_cap)
  if bias is not None:
    # a per-head bias [H,..] splits as the query heads do; a shared one [1,..] broadcasts over both axes
    logits = logits + bias.reshape(
      -1, kv_heads if bias.shape[0] == h else 1, groups if bias.shape[0] == h else 1, *bias.shape[1:]
    )
  if mask is not None:
    logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  if probs_fn is not None:
    probs = probs_fn(probs)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)  # weights in v's dtype: a bf16 matmul
  return out.reshape(b, tq, h, v.shape[-1])


def cap(logits: Array, soft_cap: float) -> Array:
  """soft_cap tanh(logits / soft_cap): scores bounded by +-soft_cap, unchanged near 0; 0 = no cap."""
  return soft_cap * jnp.tanh(logits / soft_cap) if soft_cap else logits


def _attention_rows(q: Array, k: Array, v: Array, groups: int, *, mask, bias, scale, soft_cap, probs_fn) -> Array:
  """`dot_product_attention` as 4-D batched matmuls over (batch, key-value head), for CPU: a key-value
  head's `groups` query heads go in as extra query rows (group-major). XLA CPU compiles the 5-D grouped
  einsums and softmax to code that made a train step up to 1.4x slower; TPU keeps them (its compiler
  estimates them no slower)."""
  b, tq, h, d = q.shape
  kv_heads = k.shape[2]
  if groups > 1:
    q = q.reshape(b, tq, kv_heads, groups, d).transpose(0, 3, 1, 2, 4).reshape(b, groups * tq, kv_heads, d)
  logits = cap(jnp.einsum("bqkd,bskd->bkqs", q, k, preferred_element_type=jnp.float32) * scale, soft_cap)
  if bias is not None:
    logits = logits + _query_rows(bias, groups, tq, per_head=bias.shape[0] == h)
  if mask is not None:
    logits = jnp.where(_query_rows(mask, groups, tq)[:, None], logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  if probs_fn is not None:
    probs = probs_fn(probs)
  out = jnp.einsum("bkqs,bskd->bqkd", probs.astype(v.dtype), v)  # [B, groups*Tq, K, Dv]
  if groups > 1:
    out = out.reshape(b, groups, tq, kv_heads, -1).transpose(0, 2, 3, 1, 4)
  return out.reshape(b, tq, h, v.shape[-1])


def _query_rows(x: Array, groups: int, tq: int, *, per_head: bool = False) -> Array:
  """A mask or bias [N,Tq|1,Tk] laid out like the grouped logits' rows [.., groups*Tq, Tk]: with
  `per_head`, N = H = K*groups heads give [K, groups*Tq, Tk]; otherwise every group reads the same."""
  if groups == 1:
    return x
  if per_head:
    x = jnp.broadcast_to(x, (x.shape[0], tq, x.shape[2]))  # a [H,1,Tk] bias must fill its Tq rows to reshape
    return x.reshape(x.shape[0] // groups, groups * tq, x.shape[2])
  return x if x.shape[1] == 1 else jnp.tile(x, (1, groups, 1))


def local_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  window: int,
  causal: bool,
  k_valid: Array | None = None,
  segments: Array | None = None,
  scale: float | None = None,
  soft_cap: float = 0.0,
  probs_fn: Callable[[Array], Array] | None = None,
) -> Array:
  """Sliding-window attention in O(T window): equals `dot_product_attention` with
  `attention_mask(arange(T), arange(T), causal=causal, window=window, k_valid=k_valid,
  q_segments=segments, k_segments=segments)`.

  Queries go in blocks of `window`; each block reads its own and the previous key block (and the
  next one when bidirectional), which covers every key within the window. Shapes as
  `dot_product_attention` with Tq = Tk = T; k_valid: bool[B,T], False = padding; segments:
  int[B,T] document ids (None: one document).
  """
  b, t, h, _ = q.shape
  w = window
  if context_parallel.split(t):  # a sequence over chips: each chip its own blocks, its neighbours' edge blocks
    chip = functools.partial(
      local_attention, window=w, causal=causal, scale=scale, soft_cap=soft_cap, probs_fn=probs_fn
    )
    dims = ("bth.", "btk.", "btk.", "bt", "bt")
    run = lambda q, k, v, k_valid, segments: chip(q, k, v, k_valid=k_valid, segments=segments)
    args = (q, k, v, k_valid, segments)
    return context_parallel.per_chip(run, args, dims, "bth.", batch=b, heads=h, kv_heads=k.shape[2], length=t)
  if context_parallel.axes() and t % w:
    raise ValueError(f"window {w} does not divide the {t} steps of a chip's slice of the sequence.")
  n = -(-t // w)  # blocks of one window; the last padded
  pad = n * w - t
  valid = jnp.ones((b, t), bool) if k_valid is None else k_valid

  def blocks(x, fill=0):  # [B,T,...] -> [B,N,W,...], padded at the end
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
    return x.reshape(b, n, w, *x.shape[2:])

  def neighbours(x, fill):  # [B,N,W,...] -> [B,N,S*W,...]: previous (, own, next) blocks
    # the blocks beside the slice: the neighbouring chips' edge blocks, or `fill` (kernels/context_parallel.py)
    parts = [jnp.concatenate([context_parallel.before(x, 1, fill), x[:, :-1]], 1), x]
    if not causal:
      parts.append(jnp.concatenate([x[:, 1:], context_parallel.after(x, 1, fill)], 1))
    return jnp.concatenate(parts, 2)

  positions = jnp.arange(t) + context_parallel.offset(t)  # global: a neighbouring chip's block sits before 0
  q_pos = blocks(jnp.broadcast_to(positions, (b, t)), -1)  # padding at position -1: an empty slot
  k_pos = neighbours(q_pos, -1)
  seg = {}
  if segments is not None:
    q_seg = blocks(segments, -1)
    # -2 beside the blocks' -1 padding: a padded query (id -1) never matches the missing neighbour block
    seg = dict(q_segments=q_seg.reshape(b * n, w), k_segments=neighbours(q_seg, -2).reshape(b * n, -1))
  mask = attention_mask(
    q_pos.reshape(b * n, w),
    k_pos.reshape(b * n, -1),
    causal=causal,
    window=w,
    k_valid=neighbours(blocks(valid), False).reshape(b * n, -1),
    **seg,
  )
  flat = lambda x: x.reshape(b * n, -1, *x.shape[3:])
  out = dot_product_attention(
    flat(blocks(q)),
    flat(neighbours(blocks(k), 0)),
    flat(neighbours(blocks(v), 0)),
    mask=mask,
    scale=scale,
    soft_cap=soft_cap,
    probs_fn=probs_fn,
  )
  return out.reshape(b, n * w, h, -1)[:, :t]
