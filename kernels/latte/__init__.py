"""Latte (Dolga et al., "Latent Attention for Linear Time Transformers") behind one `impl` switch:
the names models and tests use.

kernels/latte/reference.py is the reference (impl="xla", the default: the chunked jnp scan, the decoding
step and the quadratic oracles), kernels/latte/pallas.py the kernels (impl="pallas", forward and backward).
This file checks the arguments, picks the XLA form's default chunk for the target and dispatches; it
imports both, and neither imports it. Causal Latte with a `span` (by default the kernels on GPU) runs
its spans side by side (kernels/latte/spans.py).

Both cores take `segments` int[B,T] (packed documents, kernels/packed_documents.py: a token reads only its
own document's tokens) and `latent_scale` float[B,T,H,L] (multiplies p(l|t): latent dropout).

With the time axis split over chips (kernels/context_parallel.py) each chip runs the same core on its slice.
Causal: the state it starts from is the fold of the earlier chips' `document_state`s (restarting at
a document that starts on a chip), one [B,H,L,D+2] state per chip all-gathered. Bidirectional: the
softmax over time needs the global max and sums of exp(k - max) and exp(k - max) v per latent, one
pmax and one psum of [B,H,L,D+1]; the per-chip work is then one einsum, the same for both impls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel, toolkit
from lra_core.kernels.latte import pallas, reference, spans
from lra_core.kernels.latte.reference import (
  bidirectional_latte_reference,
  causal_latte_reference,
  init_latte_state,
  latte_step,
)
from lra_core.kernels.packed_documents import segment_starts

__all__ = [
  "IMPLS",
  "bidirectional_latte",
  "bidirectional_latte_reference",
  "causal_latte",
  "causal_latte_reference",
  "default_chunk",
  "init_latte_state",
  "latte_step",
]

Array = jax.Array
IMPLS = ("xla", "pallas")


def _check(
  q: Array,
  k: Array,
  v: Array,
  mask: Array | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
) -> None:
  if q.ndim != 4 or q.shape != k.shape:
    raise ValueError(f"latte expects q and k of one shape [B,T,H,L], got q {q.shape}, k {k.shape}.")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"latte expects v [B,T,H,D] matching q {q.shape} in B, T, H; got v {v.shape}.")
  if mask is not None and mask.shape != q.shape[:2]:
    raise ValueError(f"latte mask must be bool [B,T] = {q.shape[:2]}, got {mask.shape}.")
  if segments is not None and (segments.shape != q.shape[:2] or not jnp.issubdtype(segments.dtype, jnp.integer)):
    raise ValueError(f"latte segments must be int [B,T] = {q.shape[:2]}, got {segments.dtype} {segments.shape}.")
  if latent_scale is not None and latent_scale.shape != q.shape:
    raise ValueError(f"latte latent_scale must be [B,T,H,L] = {q.shape}, got {latent_scale.shape}.")


def _check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl {impl!r} is not one of {IMPLS}.")


def default_chunk() -> int:
  """Chunk length of the XLA form for the target devices (kernels/toolkit.py `current`, e.g. a TPU
  mesh traced on a CPU host): on CPUs the C x C x L exact weights cost more than they save."""
  return 8 if toolkit.platform() == "cpu" else 64


def bidirectional_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: Array | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
  impl: str = "xla",
  chunk: int | None = None,
) -> Array:
  """Latte(Q, K, V) = softmax_L(Q) softmax_T(K)^T V in O(T L D).

  Args:
    q, k: [B,T,H,L] latent scores of each token (softmax over L for q, over T for k).
    v: [B,T,H,D] values.
    mask: bool[B,T], False = padding (a padded token's key takes no weight).
    segments: int[B,T] packed documents: every document has its own softmax over time, in
      O(T L (C + D)) with chunks of `chunk` tokens.
    latent_scale: float[B,T,H,L] multiplying p(l|t) (latent dropout).
    impl: "xla" (kernels/latte/reference.py) or "pallas" (kernels/latte/pallas.py).
    chunk: the tokens per block of the packed-documents sums (None: the default per backend and impl).

  Returns:
    [B,T,H,D].
  """
  _check(q, k, v, mask, segments, latent_scale)
  _check_impl(impl)
  _check_chunk(chunk)
  if context_parallel.split(q.shape[1]):
    if segments is not None:
      raise ValueError("bidirectional latte over packed documents cannot split the sequence over chips yet.")
    return _bidirectional_per_chip(q, k, v, mask, latent_scale)
  kw = dict(mask=mask, segments=segments, latent_scale=latent_scale)
  if impl == "pallas":
    return pallas.bidirectional_latte(q, k, v, chunk=chunk, **kw)
  return reference.bidirectional_latte(q, k, v, chunk=default_chunk() if chunk is None else chunk, **kw)


def _check_chunk(chunk: int | None) -> None:
  if chunk is not None and chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}.")


def causal_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  impl: str = "xla",
  chunk: int | None = None,
  state: dict[str, Array] | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
  span: int | None = None,
) -> Array:
  """Causal Latte: a scan over chunks of `chunk` tokens, exact inside each.

  O(T L (C + D)) time and O(B C^2 H L) working memory.

  Args:
    q, k: [B,T,H,L] latent scores of each token (softmax over L for q; for k, over the tokens so far).
    v: [B,T,H,D] values.
    impl: "xla" (kernels/latte/reference.py) or "pallas" (kernels/latte/pallas.py).
    chunk: C, the tokens per step of the scan; 1 is the paper's token-by-token scan. None: the default
      per backend (`default_chunk`; with impl="pallas" the kernel's block, `pallas.default_chunk`).
    state: continues a sequence (see `init_latte_state`).
    segments: int[B,T] packed documents: the state restarts at each document's first token (a given
      `state` continues the row's first document).
    latent_scale: float[B,T,H,L] multiplying p(l|t) (latent dropout).
    span: the tokens per span of the chunk-parallel passes (kernels/latte/spans.py): the spans' scans run
      side by side, each from the state the spans before it leave. None: the kernels' default on GPU
      (`pallas.default_span`), no split elsewhere; a span >= T: no split.

  Returns:
    [B,T,H,D].
  """
  _check(q, k, v, segments=segments, latent_scale=latent_scale)
  _check_impl(impl)
  _check_chunk(chunk)
  if span is not None and span < 1:
    raise ValueError(f"span must be >= 1, got {span}.")
  if context_parallel.split(q.shape[1]):
    return _causal_per_chip(
      q, k, v, impl=impl, chunk=chunk, state=state, segments=segments, latent_scale=latent_scale, span=span
    )
  span = pallas.default_span() if span is None and impl == "pallas" else span
  if span is not None and span < q.shape[1]:
    b, _, h, l = q.shape
    state = init_latte_state(b, h, l, v.shape[-1]) if state is None else state
    core = functools.partial(_causal_core, impl=impl, chunk=chunk)
    return spans.causal(core, q, k, v, span=span, state=state, segments=segments, latent_scale=latent_scale)
  return _causal_core(q, k, v, impl=impl, chunk=chunk, state=state, segments=segments, latent_scale=latent_scale)


def _causal_core(q, k, v, *, impl, chunk, state, segments, latent_scale) -> Array:
  """One scan per row by `impl` (arguments checked)."""
  kw = dict(state=state, segments=segments, latent_scale=latent_scale)
  if impl == "pallas":  # chunk None: the kernel's own block for the target (tile-sized, not the XLA form's)
    return pallas.causal_latte(q, k, v, chunk=chunk, **kw)
  return reference.causal_latte(q, k, v, chunk=default_chunk() if chunk is None else chunk, **kw)


# -- one sequence over several chips (kernels/context_parallel.py) --------------------------------------------


def _causal_per_chip(q, k, v, *, impl, chunk, state, segments, latent_scale, span) -> Array:
  b, t, h, l = q.shape
  state = init_latte_state(b, h, l, v.shape[-1]) if state is None else state

  def chip(q, k, v, state, segments, latent_scale):
    b = q.shape[0]  # this chip's rows
    boundary = jnp.zeros((b,), bool)  # this slice's first token starts a document
    summary = reference.document_state(k, v, segments)
    fresh = boundary  # the document open at the slice's end starts inside it: the fold restarts
    if segments is not None:
      starts = segment_starts(segments)
      boundary = starts[:, 0] & (context_parallel.index() > 0)  # chip 0 continues the given state
      fresh = boundary | starts[:, 1:].any(axis=1)
    carried = context_parallel.fold_before(summary, reference.merge_states, state, fresh)
    empty = init_latte_state(*q.shape[:1], *q.shape[2:], v.shape[-1])
    incoming = {n: jnp.where(boundary.reshape((-1,) + (1,) * (x.ndim - 1)), empty[n], x) for n, x in carried.items()}
    return causal_latte(
      q, k, v, impl=impl, chunk=chunk, state=incoming, segments=segments, latent_scale=latent_scale, span=span
    )

  state_dims = {n: "bh" + "." * (x.ndim - 2) for n, x in state.items()}
  args = (q, k, v, state, segments, latent_scale)
  dims = ("bth.", "bth.", "bth.", state_dims, "bt", "bth.")
  return context_parallel.per_chip(chip, args, dims, "bth.", batch=b, heads=h, length=t)


def _bidirectional_per_chip(q, k, v, mask, latent_scale) -> Array:
  b, t, h, _ = q.shape

  def chip(q, k, v, mask, latent_scale):
    k = reference.masked_keys(k, mask)
    m = jax.lax.stop_gradient(context_parallel.maximum(jax.lax.stop_gradient(k.max(1))))  # [B,H,L]
    e = jnp.exp(k - m[:, None])
    num = context_parallel.total(jnp.einsum("bthl,bthd->bhld", e, v.astype(jnp.float32)))
    den = context_parallel.total(e.sum(1))  # >= 1 somewhere: it holds the max term
    p = reference.latent_probs(q, latent_scale)
    return jnp.einsum("bthl,bhld->bthd", p, num / den[..., None]).astype(v.dtype)

  dims = ("bth.", "bth.", "bth.", "bt", "bth.")
  return context_parallel.per_chip(chip, (q, k, v, mask, latent_scale), dims, "bth.", batch=b, heads=h, length=t)
