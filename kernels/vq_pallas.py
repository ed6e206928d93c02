"""VQ-Attention as one Pallas kernel, with a driver per backend: on TPU the compressive cache lives in
on-chip scratch; on GPU every block is attended in parallel from the cache XLA's prefix gives it.

`kernels.vq_xla.cached_attention` (XLA) builds the cache variables of every block at once, a
[B,R,H,S,Dv] tensor in HBM, and the scores of every block, [B,R,H,L,2L+S].

Grid driver (TPU; interpret mode). The kernel walks the blocks of one (batch, head) in order and keeps
only the running cache of that head on chip:

  sum_v [S,Dv]   sum of the values of every key folded so far, per code (float32)
  count [1,S]    their number per code (also kept as a column [S,1] for the final means)

Block r of L queries reads the present block (causal) and the previous block exactly, plus the
codebook: code s scores q.c_s + log(count_s) and contributes the mean sum_v_s / count_s, so

  out = (a_prev v_prev + a_cur v_cur + exp(q C^T - m) sum_v) / (sum a_prev + sum a_cur + exp(q C^T - m) . count)

with one shared max m per query (every exponent <= 0; codes with count 0 are masked). After the
block, the previous block is folded into the cache with one-hot matmuls, so block r + 1 sees the
carried cache, the carried block and blocks <= r - 1, as the reference does. Everything in a
block step is a matmul, an exp or a row reduction. The max is per block, so the joint softmax
over 2L + S scores needs no online rescaling. HBM traffic is the inputs and the output once each
(q, k and the bias once per value tile); the cache never leaves the chip.
Tiles (VMEM): the cache and the output are independent across value columns, so Dv is read in
tiles of Dt columns, a parallel grid axis whose programs each keep the cache of their columns and
recompute the scores; the queries of a block are attended Lq rows at a time, the fold after the
last sub-block. `block_sizes` picks (Dt, Lq) so that `vmem_bytes` fits the target's VMEM.

Parallel driver (GPU): kernels/vq_parallel.py, every block attended at once from the cache XLA's
prefix gives it (Triton keeps a program's working set in registers, where neither the cache nor a
whole block's scores fit).

Layout: head-major inside ([B,H,T,D]); query head h reads key-value head h // G. z arrives twice,
as a column [T,1] (one-hot rows of the fold) and a row [1,T] (key validity), so no in-kernel transpose.

Documents (`segments`, see `kernels.vq_xla.document_plan`): the wrapper turns the plan into inputs
the block step reads with elementwise ops only: the query ids and whether each query reads the cache
as columns [T,1], the key ids as a row [1,T] (compared for the exact part), the fold's codes with
keys that do not enter the cache set to the empty code S (the z column), and per block whether the
fold keeps the old cache (a row [1,T], constant over each block). The parallel driver's prefix takes
the plan as the reference does.

Backward: `jax.custom_vjp` whose backward is the VJP of the XLA form
(`kernels.vq_xla.cached_attention`), recomputed from the inputs: training memory is the XLA path's;
the forward (inference, evaluation, long-context prefill) is where the kernel saves memory.

This file is the kernel and imports the reference, kernels/vq_xla.py; kernels/vq.py checks the
arguments and dispatches between the two on `impl`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit, vq_parallel, vq_xla

Array = jax.Array
f32 = jnp.float32
MASK = vq_xla.MASK


# -- block sizes ---------------------------------------------------------------------------------

LANES, SUBLANES = 128, 8  # a TPU VMEM tile: a block's last two dimensions are padded to multiples of these
MOSAIC_SCRATCH = 2**20  # VMEM the compiler keeps for itself (its internal scratch), as measured: see docs/kernels.md


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
  return -(-rows // SUBLANES) * SUBLANES * -(-cols // LANES) * LANES * itemsize


def vmem_bytes(
  *,
  block_len: int,
  n_code: int,
  d_k: int,
  value_block: int,
  query_block: int,
  itemsize: int,
  has_bias: bool,
  has_segments: bool = False,
) -> int:
  """Estimated VMEM of one grid step of the TPU kernel (grid driver), every block padded to whole tiles:
  the pipelined blocks twice (double-buffered), the blocks read once per value tile (codebook, carry)
  once, the cache scratch, and the float32 temporaries of attending Lq queries ([Lq,L] scores of two
  key blocks, [Lq,S] code scores, [L,Dt] values) and of folding a block ([L,S] one-hot, [S,Dt] sums).
  `itemsize` is that of q, k and v. The counts of each term are fitted to what Mosaic reports for
  TPU v3 at L = S = 512, Dk = 128 (docs/kernels.md), rounded up. Documents add two query columns,
  three key rows and the carried block's ids."""
  l, lq, s, dk, dt, a = block_len, query_block, n_code, d_k, value_block, itemsize
  x = _tile_bytes
  pipelined = (
    x(lq, dk, a)
    + 2 * x(l, dk, a)
    + 2 * x(l, dt, a)
    + x(lq, dt, a)
    + 2 * x(1, l, 4)
    + x(l, 1, 4)
    + (x(lq, 2 * l, 4) if has_bias else 0)
    + ((2 * x(lq, 1, 4) + 3 * x(1, l, 4)) if has_segments else 0)
  )
  once = (
    x(s, dk, a)
    + x(l, dk, a)
    + x(l, dt, a)
    + x(1, l, 4)
    + x(l, 1, 4)
    + x(s, dt, 4)
    + x(1, s, 4)
    + x(s, 1, 4)
    + (x(1, l, 4) if has_segments else 0)
  )
  written = x(s, dt, 4) + x(s, 1, 4)
  scratch = x(s, dt, 4) + x(1, s, 4) + x(s, 1, 4)
  attend = 3 * x(lq, l, 4) + 2 * x(lq, s, 4) + 5 * x(l, dt, 4) + 2 * x(lq, dt, 4) + 3 * x(l, dk, 4)
  fold = 3 * x(l, s, 4) + x(s, dt, 4)  # the one-hot, and its transposes for the count matmuls
  return 2 * pipelined + once + 2 * written + scratch + attend + fold + MOSAIC_SCRATCH


def block_sizes(
  d_v: int,
  *,
  block_len: int,
  n_code: int,
  d_k: int,
  itemsize: int,
  has_bias: bool,
  budget: int | None,
  platform: str = "tpu",
  has_segments: bool = False,
) -> tuple[int, int]:
  """(value tile width Dt, query sub-block Lq): divisors of d_v and block_len.

  TPU: the widest Dt (a multiple of 128 lanes), then the longest Lq (a multiple of 128 rows), whose
  `vmem_bytes` fits `budget`; the narrowest and shortest when none does (the compiler then names the
  excess). A d_v or block_len that is no multiple of 128 is taken whole (a block must then span it).
  Value tiles recompute the query-code scores (Dk / Dt more matmul work per tile); query sub-blocks
  cost only grid steps. Elsewhere (interpret mode) whole. (The GPU's parallel driver: `vq_parallel.tiles`.)"""
  if platform != "tpu":
    return d_v, block_len
  widths = [w for w in range(d_v, 0, -LANES) if d_v % w == 0] if d_v % LANES == 0 else [d_v]
  lengths = [n for n in range(block_len, 0, -LANES) if block_len % n == 0] if block_len % LANES == 0 else [block_len]
  for dt in widths:
    for lq in lengths:
      if (
        budget is None
        or vmem_bytes(
          block_len=block_len,
          n_code=n_code,
          d_k=d_k,
          value_block=dt,
          query_block=lq,
          itemsize=itemsize,
          has_bias=has_bias,
          has_segments=has_segments,
        )
        <= budget
      ):
        return dt, lq
  return widths[-1], lengths[-1]


# -- the block step ----------------------------------------------------------------------------------


def _attend(
  cache,
  q,
  k_prev,
  k_cur,
  v_prev,
  v_cur,
  zr_prev,
  zr_cur,
  codebook,
  bias,
  row0,
  docs=None,
  *,
  n_code: int,
  compressive: bool,
):
  """Queries row0 .. row0 + Lq - 1 of a block against [previous, present] keys and the cache.

  cache = (sum_v [S,Dt], count_row [1,S], count_col [S,1]); q [Lq,Dk]; k_* [L,Dk]; v_* [L,Dt];
  zr_* int [1,L]; codebook [S,Dk]; bias = the [Lq,L] position terms of the (previous, present) keys, or
  None; docs = (query ids int [Lq,1], reads the cache [Lq,1] 0/1, previous and present key ids int
  [1,L]) or None -> out [Lq,Dt]. (The bias halves come in split: Triton cannot slice a loaded array.)
  """
  sum_v, count_row, _ = cache
  lq, l = q.shape[0], k_cur.shape[0]
  q = q.astype(f32)
  i = row0 + jax.lax.broadcasted_iota(jnp.int32, (lq, l), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (lq, l), 1)
  s_prev = toolkit.dot(q, k_prev.astype(f32), (1, 1))  # keys at distance L + i - j
  s_cur = toolkit.dot(q, k_cur.astype(f32), (1, 1))  # keys at distance i - j
  if bias is not None:
    s_prev, s_cur = s_prev + bias[0], s_cur + bias[1]
  keep_prev = zr_prev != n_code
  if not compressive:
    keep_prev = keep_prev & (j >= i)  # distance <= L
  keep_cur = (zr_cur != n_code) & (j <= i)
  if docs is not None:
    q_seg, _, k_seg_prev, k_seg_cur = docs
    keep_prev = keep_prev & (q_seg == k_seg_prev)
    keep_cur = keep_cur & (q_seg == k_seg_cur)
  s_prev = jnp.where(keep_prev, s_prev, -MASK)
  s_cur = jnp.where(keep_cur, s_cur, -MASK)
  m = jnp.maximum(s_prev.max(-1, keepdims=True), s_cur.max(-1, keepdims=True))
  if compressive:
    present = count_row > 0  # [1,S]
    if docs is not None:
      present = present & (docs[1] > 0)  # [Lq,S]: only queries of the cache's document
    s_code = toolkit.dot(q, codebook.astype(f32), (1, 1))  # [Lq,S]
    log_count = jnp.where(present, jnp.log(jnp.maximum(count_row, 1.0)), -MASK)
    m = jnp.maximum(m, (s_code + log_count).max(-1, keepdims=True))
  a_prev = jnp.where(keep_prev, jnp.exp(s_prev - m), 0.0)
  a_cur = jnp.where(keep_cur, jnp.exp(s_cur - m), 0.0)
  num = toolkit.dot(a_prev, v_prev.astype(f32)) + toolkit.dot(a_cur, v_cur.astype(f32))
  den = a_prev.sum(-1, keepdims=True) + a_cur.sum(-1, keepdims=True)
  if compressive:
    # exp(q.c_s - m) <= exp(-log count_s) <= 1 for every code present; absent codes masked.
    a_code = jnp.where(present, jnp.exp(jnp.where(present, s_code - m, 0.0)), 0.0)
    num = num + toolkit.dot(a_code, sum_v)
    den = den + (a_code * count_row).sum(-1, keepdims=True)
  return num / den


def _fold(cache, v_prev, zc_prev, keep=None, *, n_code: int):
  """The previous block folded into the cache with one-hot matmuls: v_prev [L,Dt], zc_prev int [L,1];
  keep [1,L] 0/1 (constant; documents only): whether the old cache stays (else the fold restarts it)."""
  sum_v, count_row, count_col = cache
  l = v_prev.shape[0]
  if keep is not None:
    keep = keep.max(-1, keepdims=True)  # [1,1]
    sum_v, count_row, count_col = sum_v * keep, count_row * keep, count_col * keep
  onehot = (zc_prev == jax.lax.broadcasted_iota(jnp.int32, (l, n_code), 1)).astype(f32)  # [L,S]
  sum_v = sum_v + toolkit.dot(onehot, v_prev.astype(f32), (0, 0))
  count_row = count_row + toolkit.dot(jnp.ones((1, l), f32), onehot)
  count_col = count_col + toolkit.dot(onehot, jnp.ones((l, 1), f32), (0, 0))
  return sum_v, count_row, count_col


def _grid_kernel(*refs, names: tuple[str, ...], n_code: int, compressive: bool):
  """Grid (B, H, J, R, Q): J value tiles, then R blocks and their Q query sub-blocks, both in order; the
  cache of one value tile in scratch across them, the previous block folded after the last sub-block.
  Inputs by name (`_forward` declares them); outputs, then scratch, after them."""
  x, (o_ref, sum_out, col_out, sum_v, count_row, count_col) = toolkit.named_refs(refs, names)
  r, qi = pl.program_id(3), pl.program_id(4)
  l = x["k"].shape[0]
  last_r, last_q = pl.num_programs(3) - 1, pl.num_programs(4) - 1

  @pl.when((r == 0) & (qi == 0))
  def _():  # the cache the window starts from
    sum_v[...] = x["carry_sum"][...]
    count_row[...] = x["carry_count_row"][...]
    count_col[...] = x["carry_count_col"][...]

  first = r == 0

  def previous(name: str, as_float: bool = True):
    """The previous block's `name`: block 0's is the carried block's. Floats in float32 (the block step's
    type anyway): TPU v3 has no select of bfloat16 vectors."""
    carried, prev = x[f"carry_{name}"][...], x[f"{name}_prev"][...]
    return jnp.where(first, carried.astype(f32), prev.astype(f32)) if as_float else jnp.where(first, carried, prev)

  v_prev = previous("v")
  cache = (sum_v[...], count_row[...], count_col[...])
  docs = keep = None
  if "q_seg" in x:
    docs = (x["q_seg"][...], x["reads"][...], previous("k_seg", as_float=False), x["k_seg"][...])
    keep = x["keep"][...]
  bias = (x["bias"][:, :l], x["bias"][:, l:]) if "bias" in x else None
  out = _attend(
    cache,
    x["q"][...],
    previous("k"),
    x["k"][...],
    v_prev,
    x["v"][...],
    previous("z_row"),
    x["z_row"][...],
    x["codebook"][...],
    bias,
    qi * x["q"].shape[0],
    docs,
    n_code=n_code,
    compressive=compressive,
  )
  o_ref[...] = out.astype(o_ref.dtype)

  @pl.when(qi == last_q)
  def _():  # the previous block enters the cache once all of this block's queries have read it
    folded = _fold(cache, v_prev, previous("z_col"), keep, n_code=n_code)
    sum_v[...], count_row[...], count_col[...] = folded

    @pl.when(r == last_r)
    def _():
      sum_out[...], col_out[...] = folded[0], folded[2]


def cost(
  *,
  batch: int,
  heads: int,
  seq_len: int,
  block_len: int,
  n_code: int,
  d_k: int,
  d_v: int,
  value_block: int,
  itemsize: int,
  has_bias: bool,
  has_segments: bool = False,
) -> pl.CostEstimate:
  """What the kernel computes and moves, for XLA's and lra_core.hlo_cost's rooflines (a custom call is
  opaque to them): per block, the [L,2L+S] scores once per value tile, their products with the
  values and the fold of a block over all of Dv; every q/k/bias block read once per tile, v twice."""
  b, h, t, l, s, dk, dv = batch, heads, seq_len, block_len, n_code, d_k, d_v
  tiles, blocks = dv // value_block, t // l
  scores = 2 * l * (2 * l + s) * dk
  values = 2 * l * (2 * l + s) * dv + 2 * l * s * dv + 4 * l * s
  flops = b * h * blocks * (tiles * scores + values)
  exps = b * h * blocks * tiles * l * (2 * l + s)
  per_tile = (
    t * dk * itemsize * 3
    + (t * 2 * l * 4 if has_bias else 0)
    + t * 8
    + s * dk * itemsize
    + (t * 20 if has_segments else 0)
  )
  moved = b * h * (tiles * per_tile + 3 * t * dv * itemsize + 2 * s * dv * 4)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=int(moved))


def _forward(
  q,
  k,
  v,
  zc,
  zr,
  codebook,
  bias,
  carry,
  docs=None,
  *,
  block_len: int,
  value_block: int,
  query_block: int,
  compressive: bool,
  interpret: bool,
):
  """Head-major pallas_call of the grid driver. q [B,H,T,Dk]; k [B,Hk,T,Dk]; v [B,Hk,T,Dv]; zc int
  [B,Hk,T,1]; zr int [B,Hk,1,T]; codebook [Hk,S,Dk]; bias [B,H,T,2L] or None; carry head-major (see
  _head_major_carry); docs (see `_document_inputs`) or None.
  Values are read in J = Dv / value_block tiles, each its own program (the scores recomputed per tile);
  the queries of a block are attended query_block rows at a time.
  -> out [B,H,T,Dv] and the cache after the last block per query head: sum [B,H,S,Dv] and the count
  column [B,H,J,S,1] (the same for every tile)."""
  b, h, t, dk = q.shape
  hk, s, _ = codebook.shape
  dv = v.shape[-1]
  g = h // hk
  l, dt, lq = block_len, value_block, query_block
  r, nj, nq = t // l, dv // value_block, block_len // query_block
  has_bias, has_segments = bias is not None, docs is not None
  out_shape = [
    jax.ShapeDtypeStruct((b, h, t, dv), v.dtype),
    jax.ShapeDtypeStruct((b, h, s, dv), f32),
    jax.ShapeDtypeStruct((b, h, nj, s, 1), f32),
  ]
  kv_head = lambda hh: jax.lax.div(hh, g)
  estimate = cost(
    batch=b,
    heads=h,
    seq_len=t,
    block_len=l,
    n_code=s,
    d_k=dk,
    d_v=dv,
    value_block=dt,
    itemsize=jnp.dtype(v.dtype).itemsize,
    has_bias=has_bias,
    has_segments=has_segments,
  )
  # Blocks read once per (batch, head, tile) take one buffer on TPU: there is nothing to prefetch.
  once = {"pipeline_mode": pl.Buffered(1)} if not interpret else {}

  def spec(shape, index, **kw):
    """A block of a [B,heads,.,.] operand; `index` maps the grid point (b, h, j, r, q) to its block."""
    return pl.BlockSpec((None, None) + shape, index, **kw)

  prev = lambda rr: jnp.maximum(rr - 1, 0)  # block 0 reads the carried block instead
  queries = lambda bb, hh, jj, rr, qq: (bb, hh, rr * nq + qq, 0)
  kv = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), rr, 0)
  kv_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), prev(rr), 0)
  v_tile = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), rr, jj)
  v_tile_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), prev(rr), jj)
  row = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, rr)
  row_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, prev(rr))
  carried = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, 0)
  carried_tile = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, jj)
  carry_k, carry_v, carry_z_row, carry_z_col, carry_sum, carry_count_row, carry_count_col = carry

  inputs = toolkit.Inputs()
  inputs.add("q", q, spec((lq, dk), queries))
  inputs.add("k", k, spec((l, dk), kv))
  inputs.add("k_prev", k, spec((l, dk), kv_prev))
  inputs.add("v", v, spec((l, dt), v_tile))
  inputs.add("v_prev", v, spec((l, dt), v_tile_prev))
  inputs.add("z_row", zr, spec((1, l), row))  # key validity (code S: no key)
  inputs.add("z_row_prev", zr, spec((1, l), row_prev))
  inputs.add("z_col_prev", zc, spec((l, 1), kv_prev))  # the fold's one-hot rows
  inputs.add("codebook", codebook, pl.BlockSpec((None, s, dk), lambda bb, hh, jj, rr, qq: (kv_head(hh), 0, 0), **once))
  if has_bias:
    inputs.add("bias", bias, spec((lq, 2 * l), queries))
  if has_segments:  # one row of ids per batch row, whatever the head
    doc_col = lambda bb, hh, jj, rr, qq: (bb, 0, rr * nq + qq, 0)
    doc_row = lambda bb, hh, jj, rr, qq: (bb, 0, 0, rr)
    inputs.add("q_seg", docs["q_seg"], spec((lq, 1), doc_col))
    inputs.add("reads", docs["reads"], spec((lq, 1), doc_col))
    inputs.add("k_seg", docs["k_seg"], spec((1, l), doc_row))
    inputs.add("k_seg_prev", docs["k_seg"], spec((1, l), lambda bb, hh, jj, rr, qq: (bb, 0, 0, prev(rr))))
    inputs.add("keep", docs["keep"], spec((1, l), doc_row))
    inputs.add("carry_k_seg", docs["carry_seg"], spec((1, l), lambda bb, hh, jj, rr, qq: (bb, 0, 0, 0), **once))
  inputs.add("carry_k", carry_k, spec((l, dk), carried, **once))
  inputs.add("carry_v", carry_v, spec((l, dt), carried_tile, **once))
  inputs.add("carry_z_row", carry_z_row, spec((1, l), carried, **once))
  inputs.add("carry_z_col", carry_z_col, spec((l, 1), carried, **once))
  inputs.add("carry_sum", carry_sum, spec((s, dt), carried_tile, **once))
  inputs.add("carry_count_row", carry_count_row, spec((1, s), carried, **once))
  inputs.add("carry_count_col", carry_count_col, spec((s, 1), carried, **once))
  out_specs = [
    spec((lq, dt), lambda bb, hh, jj, rr, qq: (bb, hh, rr * nq + qq, jj)),
    spec((s, dt), lambda bb, hh, jj, rr, qq: (bb, hh, 0, jj)),
    spec((None, s, 1), lambda bb, hh, jj, rr, qq: (bb, hh, jj, 0, 0)),
  ]
  call = pl.pallas_call(
    functools.partial(_grid_kernel, names=tuple(inputs.names), n_code=s, compressive=compressive),
    out_shape=out_shape,
    grid=(b, h, nj, r, nq),
    in_specs=inputs.specs,
    out_specs=out_specs,
    scratch_shapes=[toolkit.scratch((s, dt), f32), toolkit.scratch((1, s), f32), toolkit.scratch((s, 1), f32)],
    compiler_params=toolkit.compiler_params(3, sequential=True, num_sequential=2),
    interpret=interpret,
    cost_estimate=estimate,
    name="vq_attention",
  )
  return call(*inputs.arrays)


def _head_major_carry(carry: dict, fold_z: Array) -> tuple:
  """The reference's carry ([B,L,Hk,.], mean [B,Hk,S,Dv], count [B,Hk,S]) in the kernel's layout;
  fold_z [B,L,Hk] the codes the carried block folds with (its z, or S for keys that do not enter)."""
  count = carry["count"].astype(f32)
  return (
    carry["k"].transpose(0, 2, 1, 3),
    carry["v"].transpose(0, 2, 1, 3),
    carry["z"].transpose(0, 2, 1)[:, :, None, :],
    fold_z.transpose(0, 2, 1)[..., None],
    carry["mean"].astype(f32) * count[..., None],
    count[:, :, None, :],
    count[..., None],
  )


def _document_inputs(
  segments: Array, carry_segments: Array, z: Array, carry_z: Array, *, block_len: int, n_code: int
) -> tuple[dict, Array, Array]:
  """`kernels.vq_xla.document_plan` as kernel inputs: -> ({q_seg, reads: columns [B,1,T,1]; k_seg, keep:
  rows [B,1,1,T]; carry_seg: row [B,1,1,L]}, the fold codes of the window [B,T,Hk] and of the carried
  block [B,L,Hk]). A key folds with its code if it enters the cache (the next block begins with its
  document), else with the empty code S; the last block's keys fold in the next window."""
  b, t = segments.shape
  l = block_len
  plan = vq_xla.document_plan(segments, carry_segments, l)
  enters = plan["enters"]  # [B,R,L]: keys of block r - 1
  window_enters = jnp.concatenate([enters[:, 1:], jnp.ones((b, 1, l), bool)], axis=1).reshape(b, t)
  fold_z = jnp.where(window_enters[..., None], z, n_code)
  carry_fold_z = jnp.where(enters[:, 0, :, None], carry_z, n_code)
  col = lambda x: x.reshape(b, 1, t, 1)
  row = lambda x: x.reshape(b, 1, 1, -1)
  docs = {
    "q_seg": col(plan["seg"]),
    "reads": col(plan["reads"].astype(f32)),
    "k_seg": row(plan["seg"]),
    "keep": row(jnp.repeat(plan["keep"].astype(f32), l, axis=1)),
    "carry_seg": row(plan["prev"][:, 0]),
  }
  return docs, fold_z, carry_fold_z


def _kernel_call(
  q,
  k_hat,
  z,
  v,
  codebook,
  carry,
  bias,
  segments=None,
  *,
  block_len,
  value_block,
  query_block,
  compressive,
  driver,
  interpret,
  key_block=None,
  code_block=None,
  grad_through_cache=True,
):
  """[B,T,H,.] in, the head-major kernel, [B,T,H,Dv] out plus the cache per key-value head
  (`grad_through_cache` is the backward's: the forward is the same either way)."""
  if driver == "parallel":
    return vq_parallel.attention(
      q,
      k_hat,
      z,
      v,
      codebook,
      carry,
      bias,
      segments,
      block_len=block_len,
      value_block=value_block,
      query_block=query_block,
      key_block=key_block,
      code_block=code_block,
      compressive=compressive,
      interpret=interpret,
    )
  b, t, h, _ = q.shape
  hk = codebook.shape[0]
  l = block_len
  heads = lambda x: x.transpose(0, 2, 1, 3)
  docs, fold_z, carry_fold_z = None, z, carry["z"]
  if segments is not None:
    docs, fold_z, carry_fold_z = _document_inputs(
      segments, carry["seg"], z, carry["z"], block_len=l, n_code=codebook.shape[1]
    )
  zt = z.transpose(0, 2, 1)
  bias_hm = None
  if bias is not None:  # [B,R,Hk,G,L,2L] -> [B,H,T,2L]
    bias_hm = bias.transpose(0, 2, 3, 1, 4, 5).reshape(b, h, t, 2 * l)
  out, csum, ccol = _forward(
    heads(q),
    heads(k_hat),
    heads(v),
    fold_z.transpose(0, 2, 1)[..., None],
    zt[:, :, None, :],
    codebook,
    bias_hm,
    _head_major_carry(carry, carry_fold_z),
    docs,
    block_len=l,
    value_block=value_block,
    query_block=query_block,
    compressive=compressive,
    interpret=interpret,
  )
  first_of_group = slice(None, None, h // hk)
  count = ccol[:, first_of_group, 0, :, 0]
  mean = csum[:, first_of_group] / jnp.maximum(count, 1.0)[..., None]
  return heads(out), mean, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  carry = dict(carry_float, z=ints["carry_z"], seg=ints["carry_seg"])
  return _kernel_call(q, k_hat, ints["z"], v, codebook, carry, bias, ints["segments"], **dict(statics))


def _attention_fwd(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  return _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics), (
    q,
    k_hat,
    v,
    codebook,
    carry_float,
    bias,
    ints,
  )


def _attention_bwd(statics, residuals, cotangents):
  q, k_hat, v, codebook, carry_float, bias, ints = residuals
  d = dict(statics)

  def xla(q, k_hat, v, codebook, carry_float, bias):
    carry = dict(carry_float, z=ints["carry_z"], seg=ints["carry_seg"])
    out, _ = vq_xla.cached_attention(
      q,
      k_hat,
      ints["z"],
      v,
      codebook,
      carry,
      bias,
      block_len=d["block_len"],
      reduction="serial",
      compressive=d["compressive"],
      segments=ints["segments"],
      grad_through_cache=d["grad_through_cache"],
    )
    return out

  _, vjp = jax.vjp(xla, q, k_hat, v, codebook, carry_float, bias)
  return vjp(cotangents[0]) + (None,)  # the new cache carries no gradient (as in the reference)


_attention.defvjp(_attention_fwd, _attention_bwd)


def vq_attention_blocks(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  *,
  block_len: int,
  carry: dict,
  bias: Array | None = None,
  compressive: bool = True,
  driver: str | None = None,
  interpret: bool | None = None,
  tiles: tuple[int, ...] | None = None,
  segments: Array | None = None,
  grad_through_cache: bool = True,
) -> tuple[Array, dict]:
  """`kernels.vq.vq_attention_blocks` with impl="pallas": same arguments, with the position term as
  `kernels.vq_xla.xl_bias_blocks`' output; returns the output [B,T,H,Dv] and the carry after the last
  position (equal to the XLA form's). `driver`: "grid" (TPU, interpret) or "parallel" (GPU); by default the
  target's. `tiles`: the grid driver's (value tile width, query sub-block), by default `block_sizes` for the
  target; the parallel driver's (value tile, query rows, key rows, codes), by default `vq_parallel.tiles`.
  `segments` int [B,T]: packed documents, as in the XLA form."""
  dv, s = v.shape[-1], codebook.shape[1]
  driver = toolkit.driver(driver, gpu="parallel", drivers=("grid", "parallel"))
  if tiles is None and driver == "parallel":
    tiles = vq_parallel.tiles(dv, block_len=block_len, n_code=s)
  elif tiles is None:
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k_hat, v))
    tiles = block_sizes(
      dv,
      block_len=block_len,
      n_code=s,
      d_k=q.shape[-1],
      itemsize=itemsize,
      has_bias=bias is not None,
      budget=toolkit.vmem_budget(),
      platform=toolkit.platform(),
      has_segments=segments is not None,
    )
  names = ("value tile", "query sub-block", "key tile", "code tile")[: len(tiles)]
  for name, tile, size, what in zip(
    names, tiles, (dv, block_len, block_len, s), ("d_v", "block_len", "block_len", "n_code")
  ):
    if tile <= 0 or size % tile:
      raise ValueError(f"{name} {tile} does not divide {what} {size}.")
  if len(tiles) != (4 if driver == "parallel" else 2):
    raise ValueError(
      f"tiles {tiles} has {len(tiles)} sizes; the {driver} driver takes {4 if driver == 'parallel' else 2}."
    )
  statics = (
    ("block_len", block_len),
    ("value_block", tiles[0]),
    ("query_block", tiles[1]),
    ("compressive", compressive),
    ("grad_through_cache", grad_through_cache),
    ("driver", driver),
    ("interpret", toolkit.interpret_default() if interpret is None else interpret),
  )
  if driver == "parallel":
    statics += (("key_block", tiles[2]), ("code_block", tiles[3]))

  def per_device(q, k_hat, z, v, codebook, carry, bias, segments):
    carry_float = {"k": carry["k"], "v": carry["v"], "mean": carry["mean"], "count": carry["count"]}
    ints = {"z": z, "carry_z": carry["z"], "carry_seg": carry["seg"], "segments": segments}
    return _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics)

  carry_dims = {"k": "b.k.", "v": "b.k.", "z": "b.k", "mean": "bk..", "count": "bk.", "seg": "b."}
  out, mean, count = toolkit.run_per_device(
    per_device,
    (q, k_hat, z, v, codebook, carry, bias, segments),
    (
      "b.h.",
      "b.k.",
      "b.k",
      "b.k.",
      "k..",
      carry_dims,
      None if bias is None else "b.kg..",
      None if segments is None else "b.",
    ),
    ("b.h.", "bk..", "bk."),
    batch=q.shape[0],
    heads=q.shape[2],
    kv_heads=codebook.shape[0],
  )
  l = block_len
  tail = lambda x: x[:, -l:]
  new_carry = {
    "k": tail(k_hat),
    "v": tail(v),
    "z": tail(z),
    "mean": mean,
    "count": count,
    "seg": carry["seg"] if segments is None else tail(segments).astype(jnp.int32),
  }
  return out, jax.tree.map(jax.lax.stop_gradient, new_carry)
