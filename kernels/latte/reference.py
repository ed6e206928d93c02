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

Packed documents (`segments` int[B,T], kernels/packed_documents.py): a token reads only the tokens of its
own document, the contiguous run of equal ids it lies in. Causal: the state restarts at each
document's first token (inside a chunk the weights are masked to the token's document, and the
carried state only reaches tokens of the document it was summing). Bidirectional: each document
has its own softmax over time, taken in two O(T L) passes (the per-document max and normaliser of
the key logits, `_per_document`) and one linear sum per direction over the chunks (`linear_scan`):
y_t = sum_{s in doc(t)} (r_t . e_s) v_s with r = p(l|t) / normaliser and e = exp(k - max) <= 1,
split at t into the part up to t and the part after it. No chunk alignment enters the numbers:
a document gives the outputs it gets alone, up to float rounding, wherever it starts.

`latent_scale` float[B,T,H,L] multiplies p(l|t) after the softmax over l (latent dropout: the keep
mask over the keep rate); None leaves p(l|t) as it is.

This file is the reference (impl="xla") and imports no Pallas code; kernels/latte/pallas.py holds
the kernels, whose backward is this file's XLA form; kernels/latte/__init__.py checks arguments, picks the
default chunk and dispatches on `impl` between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
sg = jax.lax.stop_gradient
NEG = -1e30  # finite stand-in for log(0): exp underflows to 0 without inf - inf
OTHER = 2 * NEG  # keys of another document in the quadratic references: below masked padding (NEG)

f32 = jnp.float32


def masked_keys(k: Array, mask: Array | None) -> Array:
  """k in float32 with the padding (mask False) at NEG: no weight in a softmax over time."""
  k = k.astype(f32)
  return k if mask is None else jnp.where(mask[:, :, None, None], k, NEG)


def documents(segments: Array) -> Array:
  """int32[B,T]: the index of each token's document in its row, 0 for the first and one more at
  every change of segment id (documents are the contiguous runs of equal ids)."""
  change = (segments[:, 1:] != segments[:, :-1]).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


def chunk_documents(doc: Array, chunk: int) -> tuple[Array, Array]:
  """doc int[B,T] -> (doc, cont) [B,N,C] in chunks of `chunk` (the tail padded with the last
  document): cont True where a token belongs to the document of the token before its chunk (the
  first chunk: document 0, which a carried state continues)."""
  b, t = doc.shape
  n = -(-t // chunk)
  doc = jnp.pad(doc, ((0, 0), (0, n * chunk - t)), mode="edge").reshape(b, n, chunk)  # the tail continues the last
  before = jnp.concatenate([jnp.zeros_like(doc[:, :1, 0]), doc[:, :-1, -1]], axis=1)
  return doc, doc == before[:, :, None]


def latent_probs(q: Array, latent_scale: Array | None) -> Array:
  """p(l|t) = softmax_l(q) in float32, times `latent_scale` where one is given."""
  p = jax.nn.softmax(q.astype(f32), -1)
  return p if latent_scale is None else p * latent_scale.astype(f32)


def _per_document(x: Array, doc: Array, op) -> Array:
  """op (jax.ops.segment_max / segment_sum) of x [B,T,H,L] over each token's document, per token."""
  t = x.shape[1]
  # at most T documents; their indices rise along the row (`documents`), so sorted
  per_doc = jax.vmap(lambda xb, db: op(xb, db, num_segments=t, indices_are_sorted=True))(x, doc)
  return jnp.take_along_axis(per_doc, doc[:, :, None, None], axis=1)


# -- bidirectional (Def. 1) ---------------------------------------------------------------------


def bidirectional_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: Array | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
  chunk: int = 8,
) -> Array:
  """Latte(Q, K, V) = softmax_L(Q) softmax_T(K)^T V in O(T L D); mask bool[B,T], False = padding.
  With `segments` int[B,T] each document has its own softmax over time (`bidirectional_parts` and
  two `linear_scan`s over chunks of `chunk` tokens)."""
  p = latent_probs(q, latent_scale)
  if segments is None:
    summary = jnp.einsum("bthl,bthd->bhld", jax.nn.softmax(masked_keys(k, mask), axis=1), v.astype(f32))
    return jnp.einsum("bthl,bhld->bthd", p, summary).astype(v.dtype)
  r, e, doc = bidirectional_parts(p, masked_keys(k, mask), segments)
  v32 = v.astype(f32)
  ahead = linear_scan(r, e, v32, doc, chunk=chunk, strict=False)
  flip = lambda x: jnp.flip(x, axis=1)
  behind = flip(linear_scan(flip(r), flip(e), flip(v32), flip(doc), chunk=chunk, strict=True))
  return (ahead + behind).astype(v.dtype)


def bidirectional_parts(p: Array, k: Array, segments: Array) -> tuple[Array, Array, Array]:
  """The O(T L) part of segmented bidirectional Latte: p(l|t) [B,T,H,L], float32 keys k (padding at
  NEG) and segments int[B,T] -> (r, e, doc): e = exp(k - m) with m the max of k over the token's
  document (so e <= 1 and the document's sum of e is >= 1), r = p / that sum, doc = `documents`.
  Then y_t = sum_{s in doc(t)} (r_t . e_s) v_s. m is a constant of the gradient: y does not depend on it."""
  doc = documents(segments)
  e = jnp.exp(k - sg(_per_document(k, doc, jax.ops.segment_max)))
  return p / _per_document(e, doc, jax.ops.segment_sum), e, doc


def linear_chunk(
  num: Array, r: Array, e: Array, v: Array, doc: Array, cont: Array, *, strict: bool
) -> tuple[Array, Array]:
  """C tokens after `num` [B,H,L,D] (the sum of e_s v_s over the open document before the chunk):
  r, e [B,C,H,L], v [B,C,H,D], doc int[B,C], cont bool[B,C] (see `chunk_documents`) -> next num,
  y [B,C,H,D] with y_t = sum (r_t . e_s) v_s over the earlier tokens s of t's document (and s = t
  unless `strict`)."""
  c = r.shape[1]
  t_index, s_index = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
  order = t_index > s_index if strict else t_index >= s_index
  same = order[None] & (doc[:, :, None] == doc[:, None, :])  # [B,Ct,Cs]
  scores = jnp.where(same[..., None], jnp.einsum("bthl,bshl->btsh", r, e), 0.0)
  y = jnp.einsum("btsh,bshd->bthd", scores, v)
  y = y + jnp.einsum("bthl,bhld->bthd", jnp.where(cont[:, :, None, None], r, 0.0), num)
  last = doc == doc[:, -1:]  # the document open at the end
  num = jnp.where(cont[:, -1, None, None, None], num, 0.0) + jnp.einsum(
    "bshl,bshd->bhld", jnp.where(last[:, :, None, None], e, 0.0), v
  )
  return num, y


def linear_scan(r: Array, e: Array, v: Array, doc: Array, *, chunk: int, strict: bool) -> Array:
  """y_t = sum over s <= t (s < t if `strict`) of t's document of (r_t . e_s) v_s: float32 r, e
  [B,T,H,L], v [B,T,H,D], doc int[B,T] -> [B,T,H,D], a scan over chunks (`linear_chunk`)."""
  b, t, h, l = r.shape
  c = min(chunk, t)
  n = -(-t // c)
  docs, cont = (x.swapaxes(0, 1) for x in chunk_documents(doc, c))

  def chunks(x):
    x = jnp.pad(x, ((0, 0), (0, n * c - t), (0, 0), (0, 0)))  # e = 0 after the end: no weight
    return x.reshape(b, n, c, h, x.shape[-1]).swapaxes(0, 1)

  step = lambda num, xs: linear_chunk(num, *xs, strict=strict)
  _, y = jax.lax.scan(step, jnp.zeros((b, h, l, v.shape[-1]), f32), (chunks(r), chunks(e), chunks(v), docs, cont))
  return y.swapaxes(0, 1).reshape(b, n * c, h, -1)[:, :t]


def _document_keys(k: Array, allowed: Array) -> Array:
  """k^T [B,H,L,T,S] of float32 keys [B,S,H,L] with the pairs not `allowed` [B,T,S] at OTHER."""
  return jnp.where(allowed[:, None, None], jnp.einsum("bshl->bhls", k)[:, :, :, None, :], OTHER)


def bidirectional_latte_reference(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: Array | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
) -> Array:
  """Quadratic: A[t,s] = sum_l p(l|t) p(s|l) as a T x T matrix, then A V; with `segments`, p(s|l)
  a softmax over the token's own document (an explicit [T,S] mask per latent)."""
  p = latent_probs(q, latent_scale)
  k = masked_keys(k, mask)
  if segments is None:
    a = jnp.einsum("bthl,bshl->bhts", p, jax.nn.softmax(k, axis=1))
  else:
    p_s = jax.nn.softmax(_document_keys(k, segments[:, :, None] == segments[:, None, :]), axis=-1)
    a = jnp.einsum("bthl,bhlts->bhts", p, p_s)
  return jnp.einsum("bhts,bshd->bthd", a, v.astype(f32)).astype(v.dtype)


# -- causal (Def. 2) ------------------------------------------------------------------------------


def init_latte_state(batch: int, heads: int, latents: int, width: int) -> dict[str, Array]:
  """The recurrent state of eq. 12 in the stable form of eq. 21: the sums over the past scaled by
  exp(-running max). Constant size: [B,H,L,D] + 2 x [B,H,L]."""
  return {
    "num": jnp.zeros((batch, heads, latents, width), f32),
    "den": jnp.zeros((batch, heads, latents), f32),
    "max": jnp.full((batch, heads, latents), NEG, f32),
  }


def document_state(k: Array, v: Array, segments: Array | None) -> dict[str, Array]:
  """The state an empty one becomes after k [B,T,H,L], v [B,T,H,D]: the sums of the document open
  at the end (all of it without `segments`), without the scan: what a chip's slice of a split
  sequence passes on (kernels/context_parallel.py), O(T L D)."""
  k = k.astype(f32)
  if segments is not None:
    doc = documents(segments)
    k = jnp.where((doc == doc[:, -1:])[:, :, None, None], k, NEG)
  m = sg(k.max(1))  # [B,H,L]
  e = jnp.exp(k - m[:, None])  # 0 off the last document: k - m <= NEG there
  # float32 sums of exponentials: HIGHEST, or a GPU's default would round the operands to TF32
  num = jnp.einsum("bshl,bshd->bhld", e, v.astype(f32), precision=jax.lax.Precision.HIGHEST)
  return {"num": num, "den": e.sum(1), "max": m}


def merge_states(first: dict[str, Array], then: dict[str, Array]) -> dict[str, Array]:
  """The state after `first`'s tokens and then `then`'s, one document: both sums rescaled to the
  larger running max (an empty state's max is NEG, its sums 0: it changes nothing)."""
  m = jnp.maximum(first["max"], then["max"])
  a, b = jnp.exp(first["max"] - m), jnp.exp(then["max"] - m)
  return {
    "num": a[..., None] * first["num"] + b[..., None] * then["num"],
    "den": a * first["den"] + b * then["den"],
    "max": m,
  }


def latte_chunk(
  state: dict[str, Array], p: Array, k: Array, v: Array, docs: tuple[Array, Array] | None = None
) -> tuple[dict[str, Array], Array]:
  """C tokens after `state`: p = p(l|t), k [B,C,H,L], v [B,C,H,D] -> next state, y [B,C,H,D].

  Inside the chunk the weights exp(k_s - m_t), s <= t, are exact (m_t the running max, masked before
  exp, so nothing overflows in the gradient either); the past enters through the state, rescaled by
  exp(m_past - m_t) <= 1. With C = 1 this is eq. 21 token by token.

  docs = (doc int[B,C], cont bool[B,C]) (`chunk_documents`): the weights and the running max keep
  to each token's document, the state reaches only the tokens that continue its document, and the
  next state sums the document open at the chunk's end.
  """
  c = k.shape[1]
  causal = (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :])[None, :, :, None, None]
  if docs is None:
    past_max = state["max"][:, None]  # [B,1,H,L]
    m = sg(jnp.maximum(past_max, jax.lax.cummax(k, axis=1)))  # outputs do not depend on it
  else:
    doc, cont = docs
    causal = causal & (doc[:, :, None] == doc[:, None, :])[..., None, None]  # [B,Ct,Cs,1,1]
    past_max = jnp.where(cont[:, :, None, None], state["max"][:, None], NEG)  # [B,Ct,H,L]
    m = sg(jnp.maximum(past_max, jnp.where(causal, k[:, None], NEG).max(2)))
  carried = jnp.exp(past_max - m)  # [B,Ct,H,L]
  if docs is not None:
    carried = jnp.where(cont[:, :, None, None], carried, 0.0)
  # masked before exp too: a later key's k - m can overflow, and inf * 0 in the gradient is NaN
  within = jnp.where(causal, jnp.exp(jnp.where(causal, k[:, None] - m[:, :, None], 0.0)), 0.0)
  den = within.sum(2) + carried * state["den"][:, None]  # >= 1: holds the max term
  r = p / den
  y = jnp.einsum("btsh,bshd->bthd", (r[:, :, None] * within).sum(-1), v)
  y = y + jnp.einsum("bthl,bhld->bthd", r * carried, state["num"])
  end = m[:, -1]  # the last token's running max: the next state's scale
  if docs is None:
    to_end, decay = jnp.exp(k - end[:, None]), jnp.exp(state["max"] - end)
  else:
    last = (doc == doc[:, -1:])[:, :, None, None]  # the document open at the end
    to_end = jnp.where(last, jnp.exp(jnp.where(last, k - end[:, None], 0.0)), 0.0)
    # masked before exp too: a state of another document can sit far above this one's keys
    cont_last = cont[:, -1, None, None]
    decay = jnp.where(cont_last, jnp.exp(jnp.where(cont_last, state["max"] - end, 0.0)), 0.0)
  new = {
    "num": decay[..., None] * state["num"] + jnp.einsum("bshl,bshd->bhld", to_end, v),
    "den": decay * state["den"] + to_end.sum(1),
    "max": end,
  }
  return new, y


def causal_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  chunk: int,
  state: dict[str, Array] | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
) -> Array:
  """Causal Latte: a scan over chunks of `chunk` >= 1 tokens, exact inside each.

  O(T L (C + D)) time and O(B C^2 H L) working memory; chunk = 1 is the paper's token-by-token scan.
  `state` continues a sequence (see `init_latte_state`; with `segments`, it continues the row's
  first document); `segments` int[B,T] restarts the sums at each document's first token.
  """
  return causal_scan(latent_probs(q, latent_scale), k, v, chunk=chunk, state=state, segments=segments)


def causal_scan(
  p: Array, k: Array, v: Array, *, chunk: int, state: dict[str, Array] | None = None, segments: Array | None = None
) -> Array:
  """`causal_latte` from p = p(l|t) [B,T,H,L] (`latent_probs`) rather than q: the scan over chunks alone."""
  b, t, h, l = p.shape
  c = min(chunk, t)
  n = -(-t // c)
  pad = n * c - t  # steps after the end with k = NEG (weight 0); no output reads them

  def chunks(x, value=0.0):
    x = jnp.pad(x.astype(f32), ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=value)
    return x.reshape(b, n, c, h, x.shape[-1]).swapaxes(0, 1)

  state = init_latte_state(b, h, l, v.shape[-1]) if state is None else state
  xs = (chunks(p), chunks(k, NEG), chunks(v))
  if segments is None:
    _, y = jax.lax.scan(lambda s, x: latte_chunk(s, *x), state, xs)
  else:
    docs = tuple(x.swapaxes(0, 1) for x in chunk_documents(documents(segments), c))
    _, y = jax.lax.scan(lambda s, x: latte_chunk(s, *x[:3], x[3:]), state, xs + docs)
  return y.swapaxes(0, 1).reshape(b, n * c, h, -1)[:, :t].astype(v.dtype)


def latte_step(q: Array, k: Array, v: Array, state: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  """One decoding step in constant memory: q, k [B,H,L], v [B,H,D] -> y [B,H,D], next state."""
  p = jax.nn.softmax(q.astype(f32), -1)
  state, y = latte_chunk(state, p[:, None], k.astype(f32)[:, None], v.astype(f32)[:, None])
  return y[:, 0].astype(v.dtype), state


def causal_latte_reference(
  q: Array, k: Array, v: Array, *, segments: Array | None = None, latent_scale: Array | None = None
) -> Array:
  """Quadratic: p(s|l,t) as an explicit masked softmax over s for every (t, l), then the sums of eq. 8;
  with `segments` the mask also keeps s to t's document."""
  b, t = q.shape[:2]
  allowed = jnp.broadcast_to(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], (b, t, t))
  if segments is not None:
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])
  p_s = jax.nn.softmax(_document_keys(k.astype(f32), allowed), axis=-1)  # [B,H,L,T,S]
  a = jnp.einsum("bthl,bhlts->bhts", latent_probs(q, latent_scale), p_s)
  return jnp.einsum("bhts,bshd->bthd", a, v.astype(f32)).astype(v.dtype)
