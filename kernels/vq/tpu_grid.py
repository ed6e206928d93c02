"""VQ-Attention's grid driver (TPU; interpret mode): the blocks of one (batch, head) in order, the compressive
cache on chip. kernels/vq/pallas.py holds the kernel's public function and its gradient, and calls this
driver off GPU (`toolkit.driver`); the GPU's is kernels/vq/gpu_parallel.py.

`kernels.vq.reference.cached_attention` (XLA) builds the cache variables of every block at once, a [B,R,H,S,Dv]
tensor in HBM, and the scores of every block, [B,R,H,L,2L+S]. Here the kernel keeps only the running
cache of one head, in scratch (VMEM) across the sequential block axis:

  sum_v [S,Dv]   sum of the values of every key folded so far, per code (float32)
  count [1,S]    their number per code (also kept as a column [S,1] for the final means)

Block r of L queries reads the present block (causal) and the previous block exactly, plus the codebook:
code s scores q.c_s + log(count_s) and contributes the mean sum_v_s / count_s, so

  out = (a_prev v_prev + a_cur v_cur + exp(q C^T - m) sum_v) / (sum a_prev + sum a_cur + exp(q C^T - m) . count)

with one shared max m per query (`block_weights`). After the block the previous block is folded into the cache
(`fold`), so block r + 1 sees the carried cache, the carried block and blocks <= r - 1, as the reference
does. Everything in a block step is a matmul, an exp or a row reduction. HBM traffic is the inputs and the
output once each (q, k and the bias once per value tile); the cache never leaves the chip.

Layout: head-major inside ([B,H,T,D]); query head h reads key-value head h // G.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.vq import grid_layout, reference

Array = jax.Array
f32 = jnp.float32
MASK = reference.MASK


# -- block sizes ---------------------------------------------------------------------------------

LANES, SUBLANES = 128, 8  # a TPU VMEM tile: a block's last two dimensions are padded to multiples of these
MOSAIC_SCRATCH = 2**20  # VMEM the compiler keeps for itself (its internal scratch), as measured: see docs/kernels.md


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
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
  """Estimated VMEM of one grid step, every block padded to whole tiles. `itemsize` is that of q, k and v.
  The counts of each term are fitted to what Mosaic reports for TPU v3 at L = S = 512, Dk = 128
  (docs/kernels.md), rounded up."""
  l, lq, s, dk, dt, a = block_len, query_block, n_code, d_k, value_block, itemsize
  x = tile_bytes
  # Blocks that change every step, double-buffered: q, k and k_prev, v and v_prev, the output, the code
  # rows and column, the bias; documents add two query columns and three key rows.
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
  # Blocks read once per value tile (pl.Buffered(1)): the codebook and the carried block and cache.
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
  written = x(s, dt, 4) + x(s, 1, 4)  # the cache after the last block
  scratch = x(s, dt, 4) + x(1, s, 4) + x(s, 1, 4)
  # float32 temporaries of attending Lq queries: [Lq,L] scores of two key blocks, [Lq,S] code scores, values
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
  Elsewhere (interpret mode) whole. (The GPU's parallel driver: `gpu_parallel.tiles`.)"""
  if platform != "tpu":
    return d_v, block_len
  widths = [w for w in range(d_v, 0, -LANES) if d_v % w == 0] if d_v % LANES == 0 else [d_v]
  lengths = [n for n in range(block_len, 0, -LANES) if block_len % n == 0] if block_len % LANES == 0 else [block_len]
  sizes = dict(block_len=block_len, n_code=n_code, d_k=d_k, itemsize=itemsize, has_bias=has_bias)
  # Widths first: a value tile recomputes the query-code and local scores (Dk / Dt more matmul work per
  # tile), while a query sub-block costs only grid steps.
  for dt in widths:
    for lq in lengths:
      if budget is None or vmem_bytes(value_block=dt, query_block=lq, has_segments=has_segments, **sizes) <= budget:
        return dt, lq
  return widths[-1], lengths[-1]


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
  """What the kernel computes and moves, for XLA's and lra_core.cost.hlo_cost's rooflines (a custom call is
  opaque to them)."""
  b, h, t, l, s, dk, dv = batch, heads, seq_len, block_len, n_code, d_k, d_v
  tiles, blocks = dv // value_block, t // l
  scores = 2 * l * (2 * l + s) * dk  # the [L,2L+S] scores, recomputed by every value tile
  values = 2 * l * (2 * l + s) * dv + 2 * l * s * dv + 4 * l * s  # their products with v, and the fold, over all of Dv
  flops = b * h * blocks * (tiles * scores + values)
  exps = b * h * blocks * tiles * l * (2 * l + s)
  # Read once per tile: q, k and k_prev, the bias, the code rows and column, the codebook, the documents.
  per_tile = (
    t * dk * itemsize * 3
    + (t * 2 * l * 4 if has_bias else 0)
    + t * 8
    + s * dk * itemsize
    + (t * 20 if has_segments else 0)
  )
  moved = b * h * (tiles * per_tile + 3 * t * dv * itemsize + 2 * s * dv * 4)  # v twice, the output, the cache
  return pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=int(moved))


# -- the block step ----------------------------------------------------------------------------------


def local_scores(q, k_prev, k_cur, zr_prev, zr_cur, bias, row0, docs=None, *, n_code: int, compressive: bool):
  """Queries row0 .. row0 + Lq - 1 of a block (q [Lq,Dk], float32) scored against the [previous, present]
  keys k_* [L,Dk]: zr_* int [1,L] their codes (S: no key); bias = the [Lq,L] position terms of the
  (previous, present) keys, or None (the halves come in split: Triton cannot slice a loaded array); docs =
  (query ids int [Lq,1], reads the cache [Lq,1] 0/1, previous and present key ids int [1,L]) or None.
  -> (s_prev, s_cur [Lq,L], -MASK where masked; keep_prev, keep_cur [Lq,L] bool)."""
  lq, l = q.shape[0], k_cur.shape[0]
  i = row0 + jax.lax.broadcasted_iota(jnp.int32, (lq, l), 0)  # the queries' places in the block
  j = jax.lax.broadcasted_iota(jnp.int32, (lq, l), 1)
  s_prev = toolkit.dot(q, k_prev.astype(f32), (1, 1))  # keys at distance L + i - j
  s_cur = toolkit.dot(q, k_cur.astype(f32), (1, 1))  # keys at distance i - j
  if bias is not None:
    s_prev, s_cur = s_prev + bias[0], s_cur + bias[1]
  keep_prev = zr_prev != n_code  # code S marks no key (padding, or a key outside the window)
  if not compressive:
    keep_prev = keep_prev & (j >= i)  # distance <= L
  keep_cur = (zr_cur != n_code) & (j <= i)
  if docs is not None:
    q_seg, _, k_seg_prev, k_seg_cur = docs
    keep_prev = keep_prev & (q_seg == k_seg_prev)
    keep_cur = keep_cur & (q_seg == k_seg_cur)
  return jnp.where(keep_prev, s_prev, -MASK), jnp.where(keep_cur, s_cur, -MASK), keep_prev, keep_cur


def block_weights(
  cache,
  q,
  k_prev,
  k_cur,
  zr_prev,
  zr_cur,
  codebook,
  bias,
  row0,
  docs=None,
  *,
  n_code: int,
  compressive: bool,
) -> dict:
  """The unnormalised weights of `local_scores`' queries over its keys and the cache's codes, each against
  one shared max per query (the block is whole on chip: no online rescaling). cache = (sum_v [S,Dt],
  count_row [1,S], count_col [S,1]); codebook [S,Dk]. -> {a_prev, a_cur [Lq,L]; a_code [Lq,S] (exp(q.c_s -
  m): a code's count is in its sum of values) or None; den [Lq,1], the normaliser; m [Lq,1], the max}."""
  _, count_row, _ = cache
  q = q.astype(f32)
  s_prev, s_cur, keep_prev, keep_cur = local_scores(
    q, k_prev, k_cur, zr_prev, zr_cur, bias, row0, docs, n_code=n_code, compressive=compressive
  )
  m = jnp.maximum(s_prev.max(-1, keepdims=True), s_cur.max(-1, keepdims=True))
  if compressive:
    present = count_row > 0  # [1,S]
    if docs is not None:
      present = present & (docs[1] > 0)  # [Lq,S]: only queries of the cache's document
    s_code = toolkit.dot(q, codebook.astype(f32), (1, 1))  # [Lq,S]
    # A code stands for count_s keys of mean value: its weight is count_s exp(q.c_s), i.e. score + log count.
    log_count = jnp.where(present, jnp.log(jnp.maximum(count_row, 1.0)), -MASK)
    m = jnp.maximum(m, (s_code + log_count).max(-1, keepdims=True))
  a_prev = jnp.where(keep_prev, jnp.exp(s_prev - m), 0.0)
  a_cur = jnp.where(keep_cur, jnp.exp(s_cur - m), 0.0)
  den = a_prev.sum(-1, keepdims=True) + a_cur.sum(-1, keepdims=True)
  a_code = None
  if compressive:
    # exp(q.c_s - m) <= exp(-log count_s) <= 1 for every code present; absent codes masked.
    a_code = jnp.where(present, jnp.exp(jnp.where(present, s_code - m, 0.0)), 0.0)
    den = den + (a_code * count_row).sum(-1, keepdims=True)
  return {"a_prev": a_prev, "a_cur": a_cur, "a_code": a_code, "den": den, "m": m}


def _attend(cache, q, k_prev, k_cur, v_prev, v_cur, zr_prev, zr_cur, codebook, bias, row0, docs=None, **kw):
  """`block_weights`' queries attended: v_* [L,Dt] -> out [Lq,Dt]."""
  w = block_weights(cache, q, k_prev, k_cur, zr_prev, zr_cur, codebook, bias, row0, docs, **kw)
  num = toolkit.dot(w["a_prev"], v_prev.astype(f32)) + toolkit.dot(w["a_cur"], v_cur.astype(f32))
  if w["a_code"] is not None:
    num = num + toolkit.dot(w["a_code"], cache[0])  # sum_v = count_s * mean_s: the counts are already in
  return num / w["den"]


def fold(cache, v_prev, zc_prev, keep=None, *, n_code: int):
  """The previous block folded into the cache with one-hot matmuls: v_prev [L,Dt], zc_prev int [L,1];
  keep [1,L] 0/1 (constant; documents only): whether the old cache stays (else the fold restarts it)."""
  sum_v, count_row, count_col = cache
  l = v_prev.shape[0]
  if keep is not None:
    keep = keep.max(-1, keepdims=True)  # [1,1]
    sum_v, count_row, count_col = sum_v * keep, count_row * keep, count_col * keep
  # Code S (a key that does not enter) matches no column: its row of the one-hot is all zero.
  onehot = (zc_prev == jax.lax.broadcasted_iota(jnp.int32, (l, n_code), 1)).astype(f32)  # [L,S]
  sum_v = sum_v + toolkit.dot(onehot, v_prev.astype(f32), (0, 0))
  # The counts as a row and as a column, each a matmul: no transpose in the kernel.
  count_row = count_row + toolkit.dot(jnp.ones((1, l), f32), onehot)
  count_col = count_col + toolkit.dot(onehot, jnp.ones((l, 1), f32), (0, 0))
  return sum_v, count_row, count_col


def _kernel(*refs, names: tuple[tuple[str, ...], ...], n_code: int, compressive: bool):
  """Grid (B, H, J, R, Q): J value tiles, then R blocks and their Q query sub-blocks, both in order; the
  cache of one value tile in scratch across them, the previous block folded after the last sub-block.
  Refs by name (`forward` declares them)."""
  x, out, cache = toolkit.named_refs(refs, *names)
  r, qi = pl.program_id(3), pl.program_id(4)
  last_r, last_q = pl.num_programs(3) - 1, pl.num_programs(4) - 1

  @pl.when((r == 0) & (qi == 0))
  def _():  # the cache the window starts from
    cache["sum_v"][...] = x["carry_sum"][...]
    cache["count_row"][...] = x["carry_count_row"][...]
    cache["count_col"][...] = x["carry_count_col"][...]

  ops = grid_layout.step_operands(x, r == 0)
  state = (cache["sum_v"][...], cache["count_row"][...], cache["count_col"][...])
  attended = _attend(
    state,
    *(ops[n] for n in ("q", "k_prev", "k_cur", "v_prev", "v_cur", "zr_prev", "zr_cur", "codebook", "bias")),
    qi * x["q"].shape[0],  # the sub-block's first row in the block
    ops["docs"],
    n_code=n_code,
    compressive=compressive,
  )
  out["out"][...] = attended.astype(out["out"].dtype)

  @pl.when(qi == last_q)
  def _():  # the previous block enters the cache once all of this block's queries have read it
    folded = fold(state, ops["v_prev"], ops["z_fold"], ops["keep"], n_code=n_code)
    cache["sum_v"][...], cache["count_row"][...], cache["count_col"][...] = folded

    @pl.when(r == last_r)
    def _():
      out["sum"][...], out["count_col"][...] = folded[0], folded[2]


# -- the driver ---------------------------------------------------------------------------------------


def forward(
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
) -> dict[str, Array]:
  """The head-major pallas_call. q [B,H,T,Dk]; k [B,Hk,T,Dk]; v [B,Hk,T,Dv]; zc int [B,Hk,T,1]; zr int
  [B,Hk,1,T]; codebook [Hk,S,Dk]; bias [B,H,T,2L] or None; carry head-major (`grid_layout.head_major_carry`);
  docs (`grid_layout.document_inputs`) or None. Values are read in J = Dv / value_block tiles, each its own
  program (the scores recomputed per tile); the queries of a block are attended query_block rows at a time.
  -> {out [B,H,T,Dv], and the cache after the last block per query head: sum [B,H,S,Dv] and count_col
  [B,H,J,S,1] (the same for every tile)}."""
  b, h, t, dk = q.shape
  hk, s, _ = codebook.shape
  dv = v.shape[-1]
  l, dt, lq = block_len, value_block, query_block
  r, nj, nq = t // l, dv // value_block, block_len // query_block
  spec = lambda shape, index: pl.BlockSpec((None, None) + shape, index)  # a block of a [B,heads,.,.] output
  inputs = grid_layout.declare_inputs(
    dict(q=q, k=k, v=v, zc=zc, zr=zr, codebook=codebook, bias=bias, carry=carry, docs=docs),
    block_len=l,
    value_block=dt,
    query_block=lq,
    point=lambda *ids: ids,
    once=not interpret,
  )
  outputs = toolkit.Outputs()
  outputs.add(
    "out",
    jax.ShapeDtypeStruct((b, h, t, dv), v.dtype),
    spec((lq, dt), lambda bb, hh, jj, rr, qq: (bb, hh, rr * nq + qq, jj)),
  )
  # The cache after the last block: the same block index at every step, so written back once at the end.
  outputs.add(
    "sum", jax.ShapeDtypeStruct((b, h, s, dv), f32), spec((s, dt), lambda bb, hh, jj, rr, qq: (bb, hh, 0, jj))
  )
  outputs.add(
    "count_col",
    jax.ShapeDtypeStruct((b, h, nj, s, 1), f32),
    spec((None, s, 1), lambda bb, hh, jj, rr, qq: (bb, hh, jj, 0, 0)),  # one per tile: no two programs write a block
  )
  scratch = toolkit.Scratch()
  scratch.add("sum_v", (s, dt), f32)
  scratch.add("count_row", (1, s), f32)
  scratch.add("count_col", (s, 1), f32)
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
    has_bias=bias is not None,
    has_segments=docs is not None,
  )
  call = pl.pallas_call(
    functools.partial(_kernel, names=toolkit.ref_names(inputs, outputs, scratch), n_code=s, compressive=compressive),
    out_shape=outputs.shapes,
    grid=(b, h, nj, r, nq),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    # the value tiles parallel; the blocks and their query sub-blocks in order (the carried cache)
    compiler_params=toolkit.compiler_params(3, sequential=True, num_sequential=2),
    interpret=interpret,
    cost_estimate=estimate,
    name="vq_attention",
  )
  return outputs.named(call(*inputs.arrays))


def attention(
  q,
  k_hat,
  z,
  v,
  codebook,
  carry,
  bias,
  segments,
  *,
  block_len: int,
  value_block: int,
  query_block: int,
  compressive: bool,
  interpret: bool,
):
  """The grid driver: [B,T,H,.] in, the head-major kernel, out [B,T,H,Dv] and the cache after the last block
  per key-value head (mean [B,Hk,S,Dv], count [B,Hk,S])."""
  h, hk = q.shape[2], codebook.shape[0]
  x = grid_layout.head_major(q, k_hat, z, v, codebook, carry, bias, segments, block_len=block_len)
  out = forward(
    **x,
    block_len=block_len,
    value_block=value_block,
    query_block=query_block,
    compressive=compressive,
    interpret=interpret,
  )
  # Every query head of a group holds its key-value head's cache: take the group's first, and any tile's count.
  first_of_group = slice(None, None, h // hk)
  count = out["count_col"][:, first_of_group, 0, :, 0]
  mean = out["sum"][:, first_of_group] / jnp.maximum(count, 1.0)[..., None]
  return out["out"].transpose(0, 2, 1, 3), mean, count
