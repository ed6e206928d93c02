"""VQ-Attention's parallel driver, the GPU's: every block attended at once from the cache XLA's prefix
gives it. kernels/vq/pallas.py holds the kernel's public function, its gradient and the TPU's grid driver,
and calls this one on GPU (`toolkit.driver`).

Triton keeps a program's working set in registers (at most 64K of them per SM) and stages matmul
operands in shared memory (227 KiB on an H100): neither the cache [S,Dt] nor a whole
block's [L,2L+S] scores fit, and a walk over the blocks would leave most SMs idle at small batch. So
the cache each block reads is XLA's prefix over blocks (`reference.cache_variables`, the reference's own
computation: [B,R,Hk,S,Dv] in HBM, like the XLA form's), and the grid is (B, H, R, L / Lq, Dv / Dt):
each program attends Lq queries of one block over one value tile by an online softmax over Lk-key
tiles of the previous block, of the present block up to the diagonal, and Sc-code tiles of the cache
(a code is one more key: score q.c_s + log count_s, value its mean). What the kernel saves over the
XLA form is the scores and weights, which never reach HBM. Tiles and warps: `tiles`
(`toolkit.GPU_TILES`), powers of two as Triton needs; docs/kernels.md gives what ptxas reports.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.vq import reference

Array = jax.Array
f32 = jnp.float32
MASK = reference.MASK


def _kernel(
  *refs,
  names: tuple[tuple[str, ...], ...],
  n_code: int,
  compressive: bool,
  block_len: int,
  key_block: int,
  code_block: int,
):
  """Grid (B, H, R, Q, J): one [Lq, Dt] output tile of block r, the Lq queries of sub-block q and the Dt value
  columns of tile j, by an online softmax over Lk-key tiles of the [previous, present] window (the present
  one up to the diagonal) and Sc-code tiles of the cache block r reads (XLA's prefix: `cache_variables`).

  A code scores q.c_s + log count_s and contributes its mean, so the cache enters as S more keys. Refs keep
  whole windows in global memory ([T + L, .], the carried block first) and are read tile by tile. Refs by
  name (`attention` declares them)."""
  x, out = toolkit.named_refs(refs, *names)
  q_ref, k_ref, v_ref, zr_ref, o_ref = x["q"], x["k"], x["v"], x["z_row"], out["out"]
  has_bias, has_segments = "bias" in x, "q_seg" in x
  l, lk, sc = block_len, key_block, code_block
  r, qi = pl.program_id(2), pl.program_id(3)
  q = q_ref[...]
  lq = q.shape[0]
  row = qi * lq + jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 0)  # the queries' places in the block
  q_seg = x["q_seg"][...] if has_segments else None

  def update(state, scores, keep, values):
    """One tile of the online softmax: masked scores [Lq,K] against values [K,Dt]."""
    acc, m, total = state
    scores = jnp.where(keep, scores, -MASK)
    m_new = jnp.maximum(m, scores.max(-1, keepdims=True))
    a = jnp.where(keep, jnp.exp(scores - m_new), 0.0)
    rescale = jnp.exp(m - m_new)  # what was summed so far was weighted against the old max
    acc = acc * rescale + toolkit.dot(a.astype(values.dtype), values)
    return acc, m_new, total * rescale + a.sum(-1, keepdims=True)

  def keys(half: int):
    """The key tiles of half 0 (previous block) or 1 (present block) of block r's window."""

    def step(kt, state):
      start = r * l + half * l + kt * lk  # in the [T + L] window arrays
      scores = toolkit.dot(q, k_ref[pl.ds(start, lk), :], (1, 1))
      if has_bias:
        scores = scores + x["bias"][:, pl.ds(half * l + kt * lk, lk)]  # [Lq,2L]: previous keys' columns first
      col = kt * lk + jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
      keep = zr_ref[:, pl.ds(start, lk)] != n_code
      if half == 1:
        keep = keep & (col <= row)  # causal within the block
      elif not compressive:
        keep = keep & (col >= row)  # distance <= L
      if has_segments:
        keep = keep & (q_seg == x["k_seg"][:, pl.ds(start, lk)])
      return update(state, scores, keep, v_ref[pl.ds(start, lk), :])

    return step

  def codes(ct, state):
    log_count = x["log_count"][:, pl.ds(ct * sc, sc)]  # -MASK where a code is empty
    scores = toolkit.dot(q, x["codebook"][pl.ds(ct * sc, sc), :], (1, 1)) + log_count
    keep = log_count > -MASK / 2  # an empty code
    if has_segments:
      keep = keep & (x["reads"][...] > 0)  # only queries of the cache's document
    return update(state, scores, keep, x["mean"][pl.ds(ct * sc, sc), :])

  dt = o_ref.shape[-1]
  state = (jnp.zeros((lq, dt), f32), jnp.full((lq, 1), -MASK, f32), jnp.zeros((lq, 1), f32))
  first = 0 if compressive else jax.lax.div(qi * lq, lk)  # tiles wholly farther than L: none
  state = jax.lax.fori_loop(first, l // lk, keys(0), state)
  state = jax.lax.fori_loop(0, jax.lax.div(qi * lq + lq + lk - 1, lk), keys(1), state)  # up to the diagonal
  if compressive:
    state = jax.lax.fori_loop(0, n_code // sc, codes, state)
  acc, m, total = state
  o_ref[...] = (acc / total).astype(o_ref.dtype)  # total > 0: a query always reads itself

  @pl.when(pl.program_id(4) == 0)
  def _():  # the log-normaliser, for the backward (kernels/vq/gpu_backward.py): one value tile writes it
    out["lse"][...] = m + jnp.log(total)


def block_caches(z, v, carry, segments, *, block_len: int, n_code: int) -> tuple:
  """What the forward and the backward (kernels/vq/gpu_backward.py) read of the cache: the documents' plan
  (or None), each block's previous block's codes z_prev [B,R,L,Hk], XLA's prefix (`reference.cache_variables`:
  mean [B,R+1,Hk,S,Dv], count [B,R+1,Hk,S]) and the log counts block r reads [B,R,Hk,1,S] (-MASK: empty)."""
  r = z.shape[1] // block_len
  plan = None if segments is None else reference.document_plan(segments, carry["seg"], block_len)
  z_prev = reference.previous_blocks(z, carry["z"], block_len)
  v_prev = reference.previous_blocks(v, carry["v"], block_len)
  mean, count = reference.cache_variables(z_prev, v_prev, carry, plan, n_code=n_code, reduction="serial")
  log_count = jnp.where(count[:, :r] > 0, jnp.log(jnp.maximum(count[:, :r], 1.0)), -MASK)[:, :, :, None]
  return plan, z_prev, mean, count, log_count


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
  key_block: int,
  code_block: int,
  compressive: bool,
  interpret: bool,
):
  """XLA's prefix gives the cache every block reads (`reference.cache_variables`, as the
  reference computes it), then one pallas_call over (B, H, R, L / Lq, Dv / Dt) attends every block at once.
  [B,T,H,.] in -> out [B,T,H,Dv], the cache after the last block (mean [B,Hk,S,Dv], count [B,Hk,S]) and
  each query's log-normaliser [B,H,T,1] (the backward's)."""
  b, t, h, dk = q.shape
  hk, s, _ = codebook.shape
  dv = v.shape[-1]
  l, dt, lq = block_len, value_block, query_block
  r, g = t // l, h // hk
  plan, z_prev, mean, count, log_count = block_caches(z, v, carry, segments, block_len=l, n_code=s)
  # every block's [previous, present] window is rows r L .. r L + 2L of the carried block + the sequence
  window = lambda x, carried: jnp.concatenate([carried.astype(x.dtype), x], axis=1)
  heads = lambda x: x.transpose(0, 2, 1, 3)
  kv_head = lambda hh: jax.lax.div(hh, g)
  tiled = lambda shape, index: pl.BlockSpec((None, None) + shape, index)
  queries = lambda bb, hh, rr, qq, jj: (bb, hh, rr * (l // lq) + qq, 0)
  whole_kv = lambda bb, hh, rr, qq, jj: (bb, kv_head(hh), 0, 0)
  inputs = toolkit.Inputs()
  inputs.add("q", heads(q), tiled((lq, dk), queries))
  inputs.add("k", heads(window(k_hat, carry["k"])), tiled((t + l, dk), whole_kv))
  inputs.add("v", heads(window(v, carry["v"])), tiled((t + l, dt), lambda bb, hh, rr, qq, jj: (bb, kv_head(hh), 0, jj)))
  inputs.add("z_row", window(z, carry["z"]).transpose(0, 2, 1)[:, :, None, :], tiled((1, t + l), whole_kv))
  inputs.add("codebook", codebook, pl.BlockSpec((None, s, dk), lambda bb, hh, rr, qq, jj: (kv_head(hh), 0, 0)))
  # the cache block r reads: its means [S,Dt] and log counts [1,S]
  inputs.add(
    "mean",
    mean[:, :r],
    pl.BlockSpec((None, None, None, s, dt), lambda bb, hh, rr, qq, jj: (bb, rr, kv_head(hh), 0, jj)),
  )
  inputs.add(
    "log_count",
    log_count,
    pl.BlockSpec((None, None, None, 1, s), lambda bb, hh, rr, qq, jj: (bb, rr, kv_head(hh), 0, 0)),
  )
  if bias is not None:  # [B,R,Hk,G,L,2L] -> [B,H,T,2L]
    inputs.add("bias", bias.transpose(0, 2, 3, 1, 4, 5).reshape(b, h, t, 2 * l), tiled((lq, 2 * l), queries))
  if plan is not None:  # one row of ids per batch row, whatever the head
    col = lambda a: a.reshape(b, 1, t, 1)
    doc_col = tiled((lq, 1), lambda bb, hh, rr, qq, jj: (bb, 0, rr * (l // lq) + qq, 0))
    inputs.add("q_seg", col(plan["seg"]), doc_col)
    inputs.add("reads", col(plan["reads"].astype(f32)), doc_col)
    inputs.add(
      "k_seg",
      window(segments.astype(jnp.int32), carry["seg"]).reshape(b, 1, 1, t + l),
      tiled((1, t + l), lambda bb, hh, rr, qq, jj: (bb, 0, 0, 0)),
    )
  outputs = toolkit.Outputs()
  outputs.add(
    "out",
    jax.ShapeDtypeStruct((b, h, t, dv), v.dtype),
    tiled((lq, dt), lambda bb, hh, rr, qq, jj: (bb, hh, rr * (l // lq) + qq, jj)),
  )
  outputs.add("lse", jax.ShapeDtypeStruct((b, h, t, 1), f32), tiled((lq, 1), queries))
  statics = dict(
    names=toolkit.ref_names(inputs, outputs),
    n_code=s,
    compressive=compressive,
    block_len=l,
    key_block=key_block,
    code_block=code_block,
  )
  estimate = cost(
    batch=b,
    heads=h,
    seq_len=t,
    block_len=l,
    n_code=s,
    d_k=dk,
    d_v=dv,
    value_block=dt,
    query_block=lq,
    itemsize=jnp.dtype(v.dtype).itemsize,
    has_bias=bias is not None,
    compressive=compressive,
  )
  call = pl.pallas_call(
    functools.partial(_kernel, **statics),
    out_shape=outputs.shapes,
    grid=(b, h, r, l // lq, dv // dt),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    # no carry: every grid axis may run in parallel
    compiler_params=toolkit.compiler_params(5, sequential=False, kernel="vq_attention"),
    interpret=interpret,
    cost_estimate=estimate,
    name="vq_attention",
  )
  out = outputs.named(call(*inputs.arrays))
  # entry r of the prefix: the cache after the last block
  return heads(out["out"]), mean[:, r], count[:, r], out["lse"]


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
  query_block: int,
  itemsize: int,
  has_bias: bool,
  compressive: bool,
) -> pl.CostEstimate:
  """The parallel driver's work for the rooflines: per query and value tile, scores against the previous
  block, the present one up to the diagonal (about half) and the codes, and their products with the values;
  per program the query tile, the keys and values of its window, its bias rows and the cache block."""
  b, h, t, l, s, dk, dv = batch, heads, seq_len, block_len, n_code, d_k, d_v
  tiles, programs = dv // value_block, b * h * (t // query_block) * (dv // value_block)
  keys = l + (l + query_block) // 2 + (s if compressive else 0)
  flops = b * h * t * tiles * keys * 2 * (dk + value_block)
  exps = b * h * t * tiles * keys
  per_program = (
    (query_block * dk + keys * (dk + value_block)) * itemsize
    + keys * 4
    + (query_block * 2 * l * 4 if has_bias else 0)
    + (s * value_block * 4 if compressive else 0)
  )
  moved = programs * per_program + b * h * t * dv * itemsize
  return pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=int(moved))


def tiles(d_v: int, *, block_len: int, n_code: int, kernel: str = "vq_attention") -> tuple[int, int, int, int]:
  """(value tile Dt, query rows Lq, key rows Lk, codes Sc) of the parallel driver's `kernel` (its forward, or
  "vq_attention_backward"): `toolkit.GPU_TILES`, each cut to its dimension (a dimension that the tile does
  not divide is taken whole)."""
  tiles = toolkit.gpu_tiles(kernel)
  fit = lambda size, want: min(want, size) if size % min(want, size) == 0 else size
  return (
    fit(d_v, tiles["value_block"]),
    fit(block_len, tiles["query_block"]),
    fit(block_len, tiles["key_block"]),
    fit(n_code, tiles["code_block"]),
  )
