"""Latte: latent attention in linear time (Dolga et al., "Latte: Latent Attention for Linear Time
Transformers"), as pure jnp functions.

Shapes: B batch, T time, H heads, L latent states per head, D value width per head.
  q, k: [B,T,H,L] logits over the latent states   v: [B,T,H,D]   ->   [B,T,H,D]

Bidirectional (Def. 1):  y_t = sum_l p(l|t) sum_s p(s|l) v_s,
  p(l|t) = softmax_l(q_t), p(s|l) = softmax over time of k[:, l].
Causal (Def. 2):         y_t = sum_l p(l|t) sum_{s<=t} p(s|l,t) v_s,
  p(s|l,t) = exp(k_sl) / sum_{r<=t} exp(k_rl), a softmax over the prefix.

The causal form runs as a scan over chunks of C tokens (`latte_chunk`). The state is eq. 12's pair of
prefix sums per latent, num = sum_s exp(k_s - m) v_s and den = sum_s exp(k_s - m), scaled by the
running max m of the logits (Appendix B.2), so every exponent is <= 0 whatever the logit range.
Inside a chunk the weights exp(k_s - m_t), s <= t, are formed exactly (C x C per latent) and
contracted with matmuls; C = 1 is the paper's token-by-token recurrence (eq. 21, Appendix D), which
`latte_step` uses for decoding in constant memory. Work is O(T L (C + D)). The `*_reference`
functions are the quadratic formulas the tests compare against.

This file is the reference (impl="xla") and imports no Pallas code; kernels/latte_pallas.py holds
the kernels, whose backward is this file's XLA form; kernels/latte.py checks arguments, picks the
default chunk and dispatches on `impl` between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
sg = jax.lax.stop_gradient
NEG = -1e30  # finite stand-in for log(0): exp underflows to 0 without inf - inf

f32 = jnp.float32


def masked_keys(k: Array, mask: Array | None) -> Array:
  """k in float32 with the padding (mask False) at NEG: no weight in a softmax over time."""
  k = k.astype(f32)
  return k if mask is None else jnp.where(mask[:, :, None, None], k, NEG)


# -- bidirectional (Def. 1) ---------------------------------------------------------------------

def bidirectional_latte(q: Array, k: Array, v: Array, *, mask: Array | None = None) -> Array:
  """Latte(Q, K, V) = softmax_L(Q) softmax_T(K)^T V in O(T L D); mask bool[B,T], False = padding."""
  summary = jnp.einsum("bthl,bthd->bhld", jax.nn.softmax(masked_keys(k, mask), axis=1), v.astype(f32))
  return jnp.einsum("bthl,bhld->bthd", jax.nn.softmax(q.astype(f32), -1), summary).astype(v.dtype)


def bidirectional_latte_reference(q: Array, k: Array, v: Array, *, mask: Array | None = None) -> Array:
  """Quadratic: A[t,s] = sum_l p(l|t) p(s|l) as a T x T matrix, then A V."""
  p_s = jax.nn.softmax(masked_keys(k, mask), axis=1)
  a = jnp.einsum("bthl,bshl->bhts", jax.nn.softmax(q.astype(f32), -1), p_s)
  return jnp.einsum("bhts,bshd->bthd", a, v.astype(f32)).astype(v.dtype)


# -- causal (Def. 2) ------------------------------------------------------------------------------

def init_latte_state(batch: int, heads: int, latents: int, width: int) -> dict[str, Array]:
  """The recurrent state of eq. 12 in the stable form of eq. 21: the sums over the past scaled by
  exp(-running max). Constant size: [B,H,L,D] + 2 x [B,H,L]."""
  return {"num": jnp.zeros((batch, heads, latents, width), f32),
          "den": jnp.zeros((batch, heads, latents), f32),
          "max": jnp.full((batch, heads, latents), NEG, f32)}


def latte_chunk(state: dict[str, Array], p: Array, k: Array, v: Array) -> tuple[dict[str, Array], Array]:
  """C tokens after `state`: p = softmax_l(q), k [B,C,H,L], v [B,C,H,D] -> next state, y [B,C,H,D].

  Inside the chunk the weights exp(k_s - m_t), s <= t, are exact (m_t the running max, masked before
  exp, so nothing overflows in the gradient either); the past enters through the state, rescaled by
  exp(m_past - m_t) <= 1. With C = 1 this is eq. 21 token by token.
  """
  c = k.shape[1]
  causal = (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :])[None, :, :, None, None]
  m = sg(jnp.maximum(state["max"][:, None], jax.lax.cummax(k, axis=1)))  # outputs do not depend on it
  carried = jnp.exp(state["max"][:, None] - m)                                 # [B,Ct,H,L]
  within = jnp.where(causal, jnp.exp(jnp.where(causal, k[:, None] - m[:, :, None], 0.0)), 0.0)
  den = within.sum(2) + carried * state["den"][:, None]                       # >= 1: holds the max term
  r = p / den
  y = jnp.einsum("btsh,bshd->bthd", (r[:, :, None] * within).sum(-1), v)
  y = y + jnp.einsum("bthl,bhld->bthd", r * carried, state["num"])
  end = m[:, -1]
  to_end, decay = jnp.exp(k - end[:, None]), jnp.exp(state["max"] - end)
  new = {"num": decay[..., None] * state["num"] + jnp.einsum("bshl,bshd->bhld", to_end, v),
         "den": decay * state["den"] + to_end.sum(1), "max": end}
  return new, y


def causal_latte(q: Array, k: Array, v: Array, *, chunk: int, state: dict[str, Array] | None = None) -> Array:
  """Causal Latte: a scan over chunks of `chunk` >= 1 tokens, exact inside each.

  O(T L (C + D)) time and O(B C^2 H L) working memory; chunk = 1 is the paper's token-by-token scan.
  `state` continues a sequence (see `init_latte_state`).
  """
  b, t, h, l = q.shape
  c = min(chunk, t)
  n = -(-t // c)
  pad = n * c - t  # steps after the end with k = NEG (weight 0); no output reads them

  def chunks(x, value=0.0):
    x = jnp.pad(x.astype(f32), ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=value)
    return x.reshape(b, n, c, h, x.shape[-1]).swapaxes(0, 1)

  state = init_latte_state(b, h, l, v.shape[-1]) if state is None else state
  xs = (chunks(jax.nn.softmax(q.astype(f32), -1)), chunks(k, NEG), chunks(v))
  _, y = jax.lax.scan(lambda s, x: latte_chunk(s, *x), state, xs)
  return y.swapaxes(0, 1).reshape(b, n * c, h, -1)[:, :t].astype(v.dtype)


def latte_step(q: Array, k: Array, v: Array, state: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  """One decoding step in constant memory: q, k [B,H,L], v [B,H,D] -> y [B,H,D], next state."""
  p = jax.nn.softmax(q.astype(f32), -1)
  state, y = latte_chunk(state, p[:, None], k.astype(f32)[:, None], v.astype(f32)[:, None])
  return y[:, 0].astype(v.dtype), state


def causal_latte_reference(q: Array, k: Array, v: Array) -> Array:
  """Quadratic: p(s|l,t) as an explicit masked softmax over s for every (t, l), then the sums of eq. 8."""
  t = q.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  logits = jnp.where(causal[None, None, None], jnp.einsum("bshl->bhls", k.astype(f32))[:, :, :, None, :], NEG)
  p_s = jax.nn.softmax(logits, axis=-1)                                    # [B,H,L,T,S]
  a = jnp.einsum("bthl,bhlts->bhts", jax.nn.softmax(q.astype(f32), -1), p_s)
  return jnp.einsum("bhts,bshd->bthd", a, v.astype(f32)).astype(v.dtype)
