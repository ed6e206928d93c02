"""Attention cores of FLASH (Hua et al. 2022) in jnp: relu^2 attention and mixed chunk attention.

Shapes: B batch, T time, H heads (1 in a GAU), S query/key width, E value width, C chunk.

Mixed chunk attention (Section 3.2) splits time into chunks of C and adds two parts:
  local  inside each chunk, quadratic: kernel(scale * q_i . k_j + bias[i, j]) v_j, with j <= i
         when causal; kernel is relu^2 (FLASH), softmax (MC-TFM++) or the identity (linear
         attention's exact intra-chunk term);
  global across chunks, linear: lin_q_i . sum_h lin_scale * lin_k_h^T v_h, summed over all chunks
         (non-causal) or over the chunks before i's (causal: an exclusive cumulative sum).
With one chunk and the global part dropped this is quadratic attention; `relu2_attention` is that
quadratic form written as one T x T matrix, the oracle of the tests.

Decoding keeps, per layer, the global sum over finished chunks, the current chunk's partial sum
and the current chunk's keys and values: memory O(C (S + E) + S E) per head, whatever the length.
Padding (mask False) contributes nothing to either part; padded rows return garbage.

This file is the reference (impl="xla") and imports no Pallas code; kernels/flash_pallas.py is the
kernel, which differentiates through this file; kernels/flash.py checks arguments and dispatches on
`impl` between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
LOCAL_KERNELS = ("relu2", "softmax", "linear")


def _local_weights(scores: Array, allowed: Array, kernel: str) -> Array:
  """Attention weights from float32 scores [..., I, J]; positions not allowed get weight 0."""
  if kernel == "relu2":
    return jnp.where(allowed, jnp.square(jax.nn.relu(scores)), 0.0)
  if kernel == "softmax":
    scores = jnp.where(allowed, scores, -1e30)
    return jnp.where(allowed, jax.nn.softmax(scores, axis=-1), 0.0)
  if kernel == "linear":
    return jnp.where(allowed, scores, 0.0)
  raise ValueError(f"local kernel {kernel!r} is not one of {LOCAL_KERNELS}.")


def relu2_attention(q: Array, k: Array, v: Array, *, scale: float, bias: Array | None = None,
                    causal: bool = False, mask: Array | None = None, kernel: str = "relu2") -> Array:
  """Quadratic GAU attention: y_i = sum_j relu(scale q_i . k_j + bias[i, j])^2 v_j.

  q, k [B,T,H,S], v [B,T,H,E], bias [T,T] (added to every head), mask bool[B,T] (False = padding
  key) -> [B,T,H,E]. `kernel` as in mixed_chunk_attention.
  """
  t = q.shape[1]
  scores = jnp.einsum("bihs,bjhs->bhij", q, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  allowed = jnp.ones((t, t), bool)
  if causal:
    allowed = jnp.tril(allowed)
  if mask is not None:
    allowed = allowed & mask[:, None, None, :]
  weights = _local_weights(scores, allowed, kernel)
  return jnp.einsum("bhij,bjhe->bihe", weights.astype(v.dtype), v)


def mixed_chunk_attention(quad_q: Array, quad_k: Array, lin_q: Array | None, lin_k: Array | None,
                          v: Array, *, chunk: int, causal: bool, quad_scale: float, lin_scale: float,
                          bias: Array | None = None, mask: Array | None = None,
                          kernel: str = "relu2") -> Array:
  """Local quadratic attention per chunk + global linear attention across chunks (eqs. 7, 8).

  quad_q, quad_k, lin_q, lin_k [B,T,H,S]; v [B,T,H,E]; bias [C,C] relative bias inside a chunk
  (sliced when T < C); mask bool[B,T], False = padding. lin_q = lin_k = None drops the global part
  (FLASH local-only); quad_q = None drops the local part (global-only). T need not be a multiple
  of C: the tail is padded and cut off. -> [B,T,H,E]
  """
  b, t = v.shape[:2]
  c = min(chunk, t)
  g = -(-t // c)
  valid = jnp.ones((b, t), bool) if mask is None else mask
  if g * c != t:
    widths = lambda x: [(0, 0), (0, g * c - t)] + [(0, 0)] * (x.ndim - 2)
    quad_q, quad_k, lin_q, lin_k, v, valid = (None if x is None else jnp.pad(x, widths(x))
                                              for x in (quad_q, quad_k, lin_q, lin_k, v, valid))
  chunked = lambda x: None if x is None else x.reshape(b, g, c, *x.shape[2:])
  quad_q, quad_k, lin_q, lin_k, v, valid = map(chunked, (quad_q, quad_k, lin_q, lin_k, v, valid))
  out = jnp.zeros(v.shape, jnp.float32)
  if quad_q is not None:
    scores = jnp.einsum("bgihs,bgjhs->bghij", quad_q, quad_k, preferred_element_type=jnp.float32) * quad_scale
    if bias is not None:
      scores = scores + bias[:c, :c].astype(jnp.float32)
    allowed = valid[:, :, None, None, :]
    if causal:
      allowed = allowed & jnp.tril(jnp.ones((c, c), bool))
    weights = _local_weights(scores, allowed, kernel)
    out = out + jnp.einsum("bghij,bgjhe->bgihe", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
  if lin_q is not None:
    keys = jnp.where(valid[..., None, None], lin_k, 0)
    kv = jnp.einsum("bgchs,bgche->bghse", keys, v, preferred_element_type=jnp.float32) * lin_scale
    if causal:  # chunk g reads chunks 0..g-1: an exclusive cumulative sum over G steps, not T
      kv = jnp.concatenate([jnp.zeros_like(kv[:, :1]), jnp.cumsum(kv[:, :-1], axis=1)], axis=1)
    else:
      kv = kv.sum(axis=1, keepdims=True)
    out = out + jnp.einsum("bgchs,bghse->bgche", lin_q.astype(jnp.float32), kv)
  return out.reshape(b, g * c, *v.shape[3:])[:, :t].astype(v.dtype)


def linear_attention_reference(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                               eps: float = 1e-6) -> Array:
  """linear_attention as one T x T matrix (the oracle)."""
  fq, fk = jax.nn.relu(q), jax.nn.relu(k)
  ones = jnp.ones((*v.shape[:-1], 1), v.dtype)
  both = relu2_attention(fq, fk, jnp.concatenate([v, ones], -1), scale=1.0, causal=causal, mask=mask,
                         kernel="linear")
  return (both[..., :-1] / (both[..., -1:] + eps)).astype(v.dtype)


# -- decoding ------------------------------------------------------------------------------------------

def init_chunk_state(batch: int, heads: int, chunk: int, qk_dim: int, v_dim: int, *, local: bool = True,
                     linear: bool = True, dtype=jnp.float32) -> dict[str, Array]:
  """State of causal mixed chunk attention before position 0."""
  state = {}
  if local:  # the current chunk's keys and values
    state["keys"] = jnp.zeros((batch, chunk, heads, qk_dim), dtype)
    state["values"] = jnp.zeros((batch, chunk, heads, v_dim), dtype)
  if linear:
    state["kv"] = jnp.zeros((batch, heads, qk_dim, v_dim), jnp.float32)       # finished chunks
    state["partial"] = jnp.zeros((batch, heads, qk_dim, v_dim), jnp.float32)  # the current chunk
  return state


def chunk_step(quad_q: Array | None, quad_k: Array | None, lin_q: Array | None, lin_k: Array | None, v: Array,
               state: dict[str, Array], position: Array, *, chunk: int, quad_scale: float, lin_scale: float,
               bias_row: Array | None = None, kernel: str = "relu2") -> tuple[Array, dict[str, Array]]:
  """One causal step at `position`: inputs [B,H,S] / [B,H,E], bias_row [C] (bias[i, :] for
  i = position mod C) -> y [B,H,E], next state. Equals mixed_chunk_attention at that position
  (None drops a part, as there)."""
  i = position % chunk
  state = dict(state)
  out = jnp.zeros(v.shape, jnp.float32)
  if quad_q is not None:
    keys = jax.lax.dynamic_update_index_in_dim(state["keys"], quad_k.astype(state["keys"].dtype), i, 1)
    values = jax.lax.dynamic_update_index_in_dim(state["values"], v.astype(state["values"].dtype), i, 1)
    state["keys"], state["values"] = keys, values
    scores = jnp.einsum("bhs,bjhs->bhj", quad_q, keys, preferred_element_type=jnp.float32) * quad_scale
    if bias_row is not None:
      scores = scores + bias_row.astype(jnp.float32)
    weights = _local_weights(scores, jnp.arange(chunk) <= i, kernel)
    out = out + jnp.einsum("bhj,bjhe->bhe", weights, values.astype(jnp.float32))
  if lin_q is not None:
    out = out + jnp.einsum("bhs,bhse->bhe", lin_q.astype(jnp.float32), state["kv"])
    partial = state["partial"] + jnp.einsum("bhs,bhe->bhse", lin_k, v, preferred_element_type=jnp.float32) * lin_scale
    done = i == chunk - 1  # the chunk is finished: it joins the global sum of the chunks after it
    state["kv"] = jnp.where(done, state["kv"] + partial, state["kv"])
    state["partial"] = jnp.where(done, jnp.zeros_like(partial), partial)
  return out.astype(v.dtype), state


def linear_step(q: Array, k: Array, v: Array, state: dict[str, Array], position: Array, *, chunk: int,
                eps: float = 1e-6) -> tuple[Array, dict[str, Array]]:
  """One causal step of linear_attention: q, k [B,H,S], v [B,H,E] -> y [B,H,E], next state
  (init_chunk_state with v_dim E + 1)."""
  fq, fk = jax.nn.relu(q), jax.nn.relu(k)
  both, state = chunk_step(fq, fk, fq, fk, jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1), state, position,
                           chunk=chunk, quad_scale=1.0, lin_scale=1.0, kernel="linear")
  both = both.astype(jnp.float32)
  return (both[..., :-1] / (both[..., -1:] + eps)).astype(v.dtype), state
