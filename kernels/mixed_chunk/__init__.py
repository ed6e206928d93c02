"""FLASH's attention cores (Hua et al. 2022) behind one `impl` switch: the names models and tests use.

kernels/mixed_chunk/reference.py is the reference (impl="xla", the default: jnp, also the decoding steps and
the oracles), kernels/mixed_chunk/pallas.py the kernel (impl="pallas": mixed chunk attention as one
Pallas kernel, its gradient Pallas kernels too). This file checks `impl` and dispatches;
it imports both, and neither imports it.

With the time axis split over chips (kernels/context_parallel.py), chunks never straddle two: each chip runs
either core on its own chunks, and the global part gets the other chips' keys as one folded
[B,H,S,E] sum per chip (causal: from the chips before; non-causal: also from those after).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel
from lra_core.kernels.mixed_chunk import pallas, reference
from lra_core.kernels.mixed_chunk.reference import (
  GLOBAL_NORMS,
  chunk_step,
  init_chunk_state,
  linear_attention_reference,
  linear_step,
  relu2_attention,
)

__all__ = [
  "GLOBAL_NORMS",
  "IMPLS",
  "chunk_step",
  "init_chunk_state",
  "linear_attention",
  "linear_attention_reference",
  "linear_step",
  "mixed_chunk_attention",
  "relu2_attention",
]

Array = jax.Array
IMPLS = ("xla", "pallas")


def mixed_chunk_attention(
  quad_q: Array,
  quad_k: Array,
  lin_q: Array | None,
  lin_k: Array | None,
  v: Array,
  *,
  chunk: int,
  causal: bool,
  quad_scale: float,
  lin_scale: float,
  bias: Array | None = None,
  mask: Array | None = None,
  segments: Array | None = None,
  global_norm: str = "sum",
  kernel: str = "relu2",
  impl: str = "xla",
) -> Array:
  """Local quadratic attention per chunk + global linear attention across chunks (eqs. 7, 8).

  Args (`reference.mixed_chunk_attention` says what each form computes):
    quad_q, quad_k: [B,T,H,S] the local part's queries and keys; quad_q None drops the local part
      (global-only).
    lin_q, lin_k: [B,T,H,S] the global part's; both None drop it (FLASH local-only, FLASH-Quad).
    v: [B,T,H,E] values.
    chunk: C, the tokens per chunk; T need not be a multiple of C (the tail is padded and cut off).
    causal: each query reads keys at or before it.
    quad_scale, lin_scale: the local scores' and the global sums' factors.
    bias: [C,C] relative bias inside a chunk (sliced when T < C).
    mask: bool[B,T], False = padding.
    segments: int[B,T] packed documents (kernels/packed_documents.py): a query reads keys of its own document only.
    global_norm: "sum" (eqs. 7-8) or "mean" (the cross-chunk part divided by the number of chunks that
      hold keys of the query's document).
    kernel: the local scores' nonlinearity, one of `reference.LOCAL_KERNELS`: "relu2" (FLASH), "softmax"
      (MC-TFM++) or "linear".
    impl: "xla" (that reference) or "pallas" (one kernel, `pallas.mixed_chunk_attention`).

  Returns:
    [B,T,H,E].
  """
  if impl not in IMPLS:
    raise ValueError(f"impl {impl!r} is not one of {IMPLS}.")
  kw = dict(chunk=chunk, causal=causal, quad_scale=quad_scale, lin_scale=lin_scale, global_norm=global_norm)
  kw.update(kernel=kernel, impl=impl)
  b, t, h = v.shape[:3]
  if context_parallel.split(t) and lin_q is None and chunk >= t:  # FLASH-Quad: its one chunk spans the chips
    one = dict(causal=causal, quad_scale=quad_scale, kernel=kernel)
    run = lambda qq, qk, v, mask, segments: _one_chunk_per_chip(qq, qk, v, bias, mask, segments, **one)
    args, dims = (quad_q, quad_k, v, mask, segments), ("bth.",) * 3 + ("bt", "bt")
    return context_parallel.per_chip(run, args, dims, "bth.", batch=b, heads=h, length=t)
  if context_parallel.split(t):
    run = lambda qq, qk, lq, lk, v, mask, segments: _per_chip(qq, qk, lq, lk, v, bias, mask, segments, **kw)
    dims = ("bth.",) * 5 + ("bt", "bt")
    args = (quad_q, quad_k, lin_q, lin_k, v, mask, segments)
    return context_parallel.per_chip(run, args, dims, "bth.", batch=b, heads=h, length=t)
  core = pallas.mixed_chunk_attention if impl == "pallas" else reference.mixed_chunk_attention
  return core(
    quad_q,
    quad_k,
    lin_q,
    lin_k,
    v,
    chunk=chunk,
    causal=causal,
    quad_scale=quad_scale,
    lin_scale=lin_scale,
    bias=bias,
    mask=mask,
    segments=segments,
    global_norm=global_norm,
    kernel=kernel,
  )


def _per_chip(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, *, impl, **kw) -> Array:
  """One chip's slice of a split sequence (kernels/context_parallel.py): its own chunks, whole on the chip,
  then what the other chips' keys add to the global part (`reference.cross_chip_sums`). The chunks'
  documents and "mean" counts already span the chips (`reference.documents`, `global_layout`)."""
  b, t = v.shape[:2]
  c = kw["chunk"]
  if t % c:
    raise ValueError(f"chunk {c} does not divide the {t} steps of a chip's slice of the sequence.")
  out = mixed_chunk_attention(quad_q, quad_k, lin_q, lin_k, v, bias=bias, mask=mask, segments=segments, impl=impl, **kw)
  if lin_q is None:
    return out
  valid = jnp.ones((b, t), bool) if mask is None else mask
  doc = reference.documents(segments, valid, t)
  scale = jnp.ones((b, t), jnp.float32)
  if kw["global_norm"] != "sum":
    chunked = lambda x: x.reshape(b, t // c, c)
    lay = reference.global_layout(chunked(doc), chunked(valid), causal=kw["causal"], global_norm=kw["global_norm"])
    scale = lay["scale"].reshape(b, t)
  extra = reference.cross_chip_sums(lin_q, lin_k, v, doc, valid, scale, causal=kw["causal"], lin_scale=kw["lin_scale"])
  return (out.astype(jnp.float32) + extra).astype(v.dtype)


def _one_chunk_per_chip(
  quad_q, quad_k, v, bias, mask, segments, *, causal: bool, quad_scale: float, kernel: str
) -> Array:
  """One chip's queries of a chunk that spans the split sequence (FLASH-Quad's: the whole of it): they
  read every chip's keys, all-gathered (the all-gather form of ring attention: a chip holds the row's
  keys [T,S] and values [T,E] and its own queries' scores [T/n,T], as the reference's masks, bias and
  relu^2 weights give them). Gathered rather than passed round a ring: relu^2 weights need no running
  normaliser, the keys are FLASH's one shared head, and the row's values are what one chip holds of
  the layer's activations anyway; XLA overlaps the gather with the projections."""
  if context_parallel.zigzag():
    raise ValueError("a chunk over the whole split sequence is read in the plain order, not the zig-zag one.")
  b, t = v.shape[:2]
  gather = lambda x: jax.lax.all_gather(
    x, context_parallel.axes(), axis=1, tiled=True
  )  # the chips' slices in time order
  valid = jnp.ones((b, t), bool) if mask is None else mask
  keys, values, key_valid = gather(quad_k), gather(v), gather(valid)
  total, start = keys.shape[1], context_parallel.offset(t)
  scores = jnp.einsum("bihs,bjhs->bhij", quad_q, keys, preferred_element_type=jnp.float32) * quad_scale
  if bias is not None:  # this chip's rows of the chunk's [T,T] relative bias
    scores = scores + jax.lax.dynamic_slice_in_dim(bias[:total, :total], start, t, 0).astype(jnp.float32)
  allowed = key_valid[:, None, None, :]
  if causal:
    allowed = allowed & ((start + jnp.arange(t))[:, None] >= jnp.arange(total)[None, :])
  if segments is not None:  # documents numbered over the whole row, as the reference numbers them
    seg = gather(segments.astype(jnp.int32))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    doc = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    mine = jax.lax.dynamic_slice_in_dim(doc, start, t, 1)
    allowed = allowed & (mine[:, None, :, None] == doc[:, None, None, :])
  weights = reference.local_weights(scores, allowed, kernel)
  out = jnp.einsum("bhij,bjhe->bihe", weights.astype(v.dtype), values, preferred_element_type=jnp.float32)
  return out.astype(v.dtype)


def linear_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool,
  chunk: int = 64,
  mask: Array | None = None,
  segments: Array | None = None,
  eps: float = 1e-6,
  impl: str = "xla",
) -> Array:
  """Normalised linear attention with feature map relu (Performer's ReLU kernel, Choromanski et al.):

    y_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps),  j <= i when causal.

  The causal prefix sums are computed chunk by chunk (exact: an intra-chunk matrix plus the
  exclusive cumulative sum of the previous chunks), the denominator as one more value column.
  With segments int[B,T] each query sums over its own document's keys only. q, k [B,T,H,S],
  v [B,T,H,E] -> [B,T,H,E]. impl as in mixed_chunk_attention.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl {impl!r} is not one of {IMPLS}.")
  fq, fk = jax.nn.relu(q), jax.nn.relu(k)
  ones = jnp.ones((*v.shape[:-1], 1), v.dtype)  # the denominator rides along as one more value column
  # Non-causal: the global sum already covers every chunk, so there is no local part.
  local_q = fq if causal else None
  both = mixed_chunk_attention(
    local_q,
    fk,
    fq,
    fk,
    jnp.concatenate([v, ones], -1),
    chunk=chunk,
    causal=causal,
    quad_scale=1.0,
    lin_scale=1.0,
    mask=mask,
    segments=segments,
    kernel="linear",
    impl=impl,
  )
  num, den = both[..., :-1].astype(jnp.float32), both[..., -1:].astype(jnp.float32)  # divided in float32
  return (num / (den + eps)).astype(v.dtype)
