"""VQ-Attention (Lingle 2024, Transformer-VQ) behind one `impl` switch: the names models and tests use.

kernels/vq/reference.py is the reference (impl="xla", the default: quantization, the blockwise XLA form
`cached_attention`, decoding and the quadratic oracles), kernels/vq/pallas.py the kernel
(impl="pallas": the compressive cache on chip; its gradient kernels too, kernels/vq/grid_backward.py on TPU and
kernels/vq/gpu_backward.py on GPU). This
file checks the arguments, builds the carry and the position term both take, and dispatches; it
imports both, and neither imports it.

With the time axis split over chips (kernels/context_parallel.py) each chip runs either core on its own
blocks from the carry the unsplit scan would reach there: the previous chip's last block as a halo
of L positions, and a compressive cache folded over the chips before (one [B,H,S,Dv+1] per chip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel
from lra_core.kernels.vq import pallas, reference
from lra_core.kernels.vq.reference import (
  MASK,
  REDUCTIONS,
  band_to_matrix,
  cached_attention,
  code_statistics,
  codewords,
  decode_step,
  dense_attention,
  document_plan,
  group_heads,
  group_table,
  init_carry,
  init_decode_state,
  quantize,
  relative_bias,
  vq_attention_reference,
  xl_bias_blocks,
)

__all__ = [
  "IMPLS",
  "MASK",
  "REDUCTIONS",
  "band_to_matrix",
  "cached_attention",
  "check_shapes",
  "code_statistics",
  "codewords",
  "decode_step",
  "dense_attention",
  "document_plan",
  "group_heads",
  "group_table",
  "init_carry",
  "init_decode_state",
  "quantize",
  "relative_bias",
  "vq_attention",
  "vq_attention_blocks",
  "vq_attention_reference",
  "xl_bias_blocks",
]

Array = jax.Array
IMPLS = ("xla", "pallas")

sg = jax.lax.stop_gradient


def vq_attention_blocks(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  *,
  block_len: int,
  reduction: str = "serial",
  carry: dict | None = None,
  rel: tuple[Array, Array] | None = None,
  compressive: bool = True,
  impl: str = "xla",
  segments: Array | None = None,
  grad_through_cache: bool = True,
  chunk_blocks: int = 0,
  carry_gradient: bool = False,
) -> tuple[Array, dict]:
  """The linear-time core, continuing from `carry` (the state before the first position).

  Args:
    q: [B,T,H,Dk] queries.
    k_hat: [B,T,Hk,Dk] quantized keys (straight-through gradients are the caller's choice).
    z: int32 [B,T,Hk], each key's code.
    v: [B,T,Hk,Dv] values.
    codebook: [Hk,S,Dk], which scores the compressed keys.
    block_len: L, the positions per block (the paper's block length): the cache advances a block at a time.
    reduction: how the cache's running means are summed over blocks (Appendix E), one of REDUCTIONS:
      "serial" (lax.scan), "matmul" (lower-triangular weights), "assoc" (lax.associative_scan).
    carry: the state before the first position (`init_carry`; None: an empty one).
    rel: (rel_q [B,T,H,Dk], rel_table [H,L+1,Dk]) adds Transformer-XL position biases at distances
      0..L; older keys get content scores only.
    compressive: False drops the codebook cache: a sliding window over the last L+1 positions (the
      paper's ablation).
    impl: "xla" runs `reference.cached_attention`, "pallas" the fused kernel of kernels/vq/pallas.py (its
      scan is serial: `reduction` must be "serial").
    segments: int [B,T] packed documents (0 = padding): every query reads keys of its own segment only,
      in the exact part and in the cache (which restarts per document: `reference.document_plan`); the
      carry's `seg` continues them across windows.
    grad_through_cache: False holds the state passed from block to block constant in the backward pass
      (the authors' `grad_thru_cache=0`): the compressive cache and the previous block's keys and values.
      The output is the same; a query's gradient reaches only its own block's keys and values (and the
      codebook, through the cache's scores).
    chunk_blocks: > 0 (impl="xla"): a lax.scan over the blocks, that many at a time
      (`reference.chunked_attention`: the same function, its working set one chunk's); 0: all blocks at once.
    carry_gradient: differentiate through the returned carry (impl="xla": for a caller that runs a
      sequence block by block and passes the carry on, which then differentiates what one call over all
      blocks does); False holds it constant in the backward pass.

  Returns:
    The output [B,T,H,Dv] (dtype of v) and the carry after the last position.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl {impl!r} is not one of {IMPLS}.")
  if impl == "pallas" and reduction != "serial":
    raise ValueError(
      f"impl 'pallas' scans the blocks serially in on-chip memory; reduction must be 'serial', got {reduction!r}."
    )
  b, t, _, dk = q.shape
  hk, s = codebook.shape[0], codebook.shape[1]
  if segments is not None and tuple(segments.shape) != (b, t):
    raise ValueError(f"segments must be [B,T] = [{b},{t}], got {tuple(segments.shape)}.")
  if carry is None:
    carry = init_carry(b, block_len, hk, s, dk, v.shape[-1], k_hat.dtype)
  if context_parallel.split(t):
    kw = dict(block_len=block_len, reduction=reduction, compressive=compressive, impl=impl)
    kw.update(grad_through_cache=grad_through_cache, chunk_blocks=chunk_blocks, carry_gradient=carry_gradient)
    return _per_chip(q, k_hat, z, v, codebook, carry, rel, segments, **kw)
  if impl == "pallas":  # the kernel reads the position term as XLA's [L,2L] blocks, the size of its local scores
    if carry_gradient:
      raise ValueError("carry_gradient needs impl 'xla': the Pallas kernel holds its carry constant.")
    bias = None if rel is None else xl_bias_blocks(rel, hk, block_len)
    return pallas.vq_attention_blocks(
      q,
      k_hat,
      z,
      v,
      codebook,
      block_len=block_len,
      carry=carry,
      bias=bias,
      compressive=compressive,
      segments=segments,
      grad_through_cache=grad_through_cache,
    )
  return reference.chunked_attention(
    q,
    k_hat,
    z,
    v,
    codebook,
    carry,
    rel,
    block_len=block_len,
    chunk_blocks=chunk_blocks,
    reduction=reduction,
    compressive=compressive,
    segments=segments,
    grad_through_cache=grad_through_cache,
    carry_gradient=carry_gradient,
  )


def _per_chip(q, k_hat, z, v, codebook, carry, rel, segments, **kw) -> tuple[Array, dict]:
  """`vq_attention_blocks` on one sequence split over chips (kernels/context_parallel.py), blocks whole on
  each. A chip starts from the carry the unsplit scan would hold at its first block: the previous
  chip's last block (k_hat, v, z, ids: a halo of L positions) and the compressive cache of every
  block before that one: each chip's cache of its own folds (from an empty one, `cache_variables`),
  merged over the chips before it (restarting at a chip where a document restarts the cache). The
  carry after the last position is the last chip's, on every chip."""
  b, t, h = q.shape[:3]
  hk, s, l = codebook.shape[0], codebook.shape[1], kw["block_len"]

  def chip(q, k_hat, z, v, codebook, carry, rel_q, rel_table, segments):
    if q.shape[1] % l:
      raise ValueError(f"block_len {l} does not divide the {q.shape[1]} steps of a chip's slice of the sequence.")
    first = context_parallel.index() == 0
    halo = {"k": k_hat, "v": v, "z": z, "seg": jnp.full(z.shape[:2], -1, jnp.int32) if segments is None else segments}
    fills = {"k": 0, "v": 0, "z": s, "seg": -1}  # no key, no document: chip 0 reads the given carry instead
    prev = {
      n: jnp.where(first, carry[n], context_parallel.before(x.astype(carry[n].dtype), l, fills[n]))
      for n, x in halo.items()
    }
    plan = None if segments is None else reference.document_plan(segments, prev["seg"], l)
    empty = dict(carry, mean=jnp.zeros_like(carry["mean"]), count=jnp.zeros_like(carry["count"]))
    z_prev, v_prev = reference.previous_blocks(z, prev["z"], l), reference.previous_blocks(v, prev["v"], l)
    mean, count = reference.cache_variables(z_prev, v_prev, empty, plan, n_code=s, reduction=kw["reduction"])
    restarts = jnp.zeros((q.shape[0],), bool) if plan is None else (~plan["keep"]).any(axis=1)

    # the cache after a chip: its own folds, after the earlier chips' unless it restarted
    cache = context_parallel.fold_before(
      (mean[:, -1], count[:, -1]), reference.merge, (carry["mean"], carry["count"]), restarts
    )
    incoming = dict(prev, mean=cache[0], count=cache[1])
    local_rel = None if rel_q is None else (rel_q, rel_table)
    out, new = vq_attention_blocks(q, k_hat, z, v, codebook, carry=incoming, rel=local_rel, segments=segments, **kw)
    last = context_parallel.index() == context_parallel.count() - 1
    new = {n: context_parallel.total(jnp.where(last, x, jnp.zeros_like(x))) for n, x in new.items()}  # the last chip's
    return out, new

  carry_dims = {"k": "b.k.", "v": "b.k.", "z": "b.k", "mean": "bk..", "count": "bk.", "seg": "b."}
  rel_q, rel_table = (None, None) if rel is None else rel
  args = (q, k_hat, z, v, codebook, carry, rel_q, rel_table, segments)
  dims = ("bth.", "btk.", "btk", "btk.", "k..", carry_dims, "bth.", "h..", "bt")
  return context_parallel.per_chip(chip, args, dims, ("bth.", carry_dims), batch=b, heads=h, kv_heads=hk, length=t)


def check_shapes(q: Array, k: Array, v: Array, codebook: Array, block_len: int) -> None:
  """One-sentence errors for inconsistent shapes, before any tracing of the attention."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B,T,H,D]; got shapes {q.shape}, {k.shape}, {v.shape}.")
  b, t, h, dk = q.shape
  if k.shape[:2] != (b, t) or v.shape[:2] != (b, t) or k.shape[2] != v.shape[2]:
    raise ValueError(
      f"k {k.shape} and v {v.shape} must share batch, time and heads with each other and batch/time with q {q.shape}."
    )
  if k.shape[-1] != dk or h % k.shape[2]:
    raise ValueError(f"k {k.shape} must have q's key width {dk} and a head count dividing q's {h}.")
  if codebook.ndim != 3 or codebook.shape[0] != k.shape[2] or codebook.shape[2] != dk:
    raise ValueError(f"codebook must be [H,S,Dk] = [{k.shape[2]},S,{dk}], got {codebook.shape}.")
  if block_len <= 0 or t % block_len:
    raise ValueError(f"sequence length {t} is not a multiple of block_len {block_len}.")


def vq_attention(
  q: Array,
  k: Array,
  v: Array,
  codebook: Array,
  *,
  block_len: int,
  reduction: str = "serial",
  impl: str = "xla",
  segments: Array | None = None,
) -> Array:
  """Causal softmax attention of q over the vector-quantized keys, in linear time.

  Equal (values and gradients w.r.t. q, v and the codebook) to `vq_attention_reference`; k reaches the
  output only through the argmin, so its gradient is zero in both (models add a straight-through estimator).

  Args:
    q, k: [B,T,H,Dk] queries and (unquantized) keys.
    v: [B,T,H,Dv] values.
    codebook: [H,S,Dk], S codewords per head.
    block_len, reduction, impl: as in `vq_attention_blocks`.
    segments: int [B,T]: each query attends within its own document only.

  Returns:
    [B,T,H,Dv].
  """
  check_shapes(q, k, v, codebook, block_len)
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction {reduction!r} is not one of {REDUCTIONS}.")
  if impl not in IMPLS:
    raise ValueError(f"impl {impl!r} is not one of {IMPLS}.")
  # The argmin has no gradient: stopping it here keeps the quantizer's distances out of the backward pass.
  z, _ = quantize(sg(k), sg(codebook))
  out, _ = vq_attention_blocks(
    q, codewords(z, codebook), z, v, codebook, block_len=block_len, reduction=reduction, impl=impl, segments=segments
  )
  return out
