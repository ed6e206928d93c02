"""VQ-Attention's gradient on the grid driver (TPU; interpret mode): two kernels over the blocks of one
(batch, head), from the forward's inputs only (no [B,R,H,S,Dv] cache per block, no scores leave the chip).
kernels/vq/pallas.py wires them into `jax.custom_vjp`; the XLA form's VJP is the tests' oracle.

Query i of block r weighs the previous block's keys, the present block's (causal) and the cache's codes
(kernels/vq/tpu_grid.py `block_weights`): with den_i its normaliser,

  p_ij = a_ij / den_i (a key),   w_is = exp(q_i.c_s - m_i) / den_i (a code, whose value is the cache's
  sum of values sum_s = count_s mean_s),   out_i = sum_j p_ij v_j + sum_s w_is sum_s.

With g_i = dout_i the usual softmax adjoint, its row term D_i = g_i . out_i taken as sum_j p_ij (g_i . v_j) +
sum_s w_is (g_i . sum_s) (no forward output is kept), gives

  dS_ij = p_ij (g_i . v_j - D_i),   dS_is = w_is (g_i . sum_s - count_s D_i)
  dq_i = sum_j dS_ij k_j + sum_s dS_is c_s,   dk_j = sum_i dS_ij q_i,   dc_s = sum_i dS_is q_i,
  dbias_ij = dS_ij,   dv_j = sum_i p_ij g_i,   dsum_s(block r) = sum_i w_is g_i.

The first sums need the cache each block reads, the last one runs backwards: the fold after block r adds
block r - 1 (its entering keys, `fold`) to keep_r times the cache, so the adjoint of the cache block r reads is
T_r = dsum(r) + keep_r T_{r+1} (T_R = 0: the next window's carry has no gradient), and a key of block r - 1
receives T_{r+1} at its code. Hence two kernels:

  `_scores_kernel`  the blocks in order, the cache rebuilt in scratch as the forward builds it: dq, dk, the
                    codebook's and the position term's gradients, and each query's log-normaliser lse_i.
  `_values_kernel`  the blocks from last to first, a value tile per program, T in scratch: dv (both
                    windows' keys and the cache's share) and the carried cache's adjoint T_0. w_is is
                    rebuilt as exp(q_i.c_s - lse_i): no count, and no sum of values, is needed backwards.

A code absent from the cache block r reads has w_is = 0 in the forward; here its exp is only bounded
(exp(min(q.c_s - lse, 0)) <= 1): T then holds a finite value at a code no key of the cache has, which no
key reads (a key entering at code s makes count_s >= 1 for every block that reads it).

`grad_through_cache=False` (the authors' `grad_thru_cache=0`) holds the previous block and the cache
constant: no dk and dv from the previous block's reads, no dsum; dq and the codebook's gradient are whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.vq import grid_layout, tpu_grid

Array = jax.Array
f32 = jnp.float32
NO_VALUES = ("v", "v_prev", "carry_v", "carry_sum", "carry_count_row", "carry_count_col")  # what `_values_kernel` skips


# -- block sizes ---------------------------------------------------------------------------------


def vmem_bytes(
  *,
  block_len: int,
  n_code: int,
  d_k: int,
  d_v: int,
  value_block: int,
  query_block: int,
  itemsize: int,
  has_bias: bool,
  has_segments: bool = False,
) -> int:
  """Estimated VMEM of a step of `_scores_kernel`, the larger of the two (it keeps the whole cache, [S,Dv]
  float32, where the forward keeps a tile), every block padded to whole tiles; `tpu_grid.vmem_bytes`' terms.
  Compiled for TPU v3 at Transformer-VQ's head (L = S = 512, Dk 128, Dv 1536, Dt 128, bfloat16, XL biases)
  Mosaic reports 22.25 MiB at Lq 256 and 17.12 at Lq 128, against 23.98 and 18.11 here."""
  l, lq, s, dk, dt, a = block_len, query_block, n_code, d_k, value_block, itemsize
  x = tpu_grid.tile_bytes
  # Blocks that change every step, double-buffered: q, k and k_prev, the value tiles, the codes, the
  # output's cotangent, the bias and its gradient, dq, lse, the keys' gradients; documents' ids.
  pipelined = (
    x(lq, dk, a)
    + 2 * x(l, dk, a)
    + 2 * x(l, dt, a)
    + 2 * x(1, l, 4)
    + x(l, 1, 4)
    + x(lq, dt, a)
    + (2 * x(lq, 2 * l, 4) if has_bias else 0)
    + x(lq, dk, 4)
    + x(lq, 1, 4)
    + 2 * x(l, dk, 4)
    + ((2 * x(lq, 1, 4) + 3 * x(1, l, 4)) if has_segments else 0)
  )
  # Read or written once per (batch, head): the codebook, the carried block and cache, the codebook's gradient.
  once = x(s, dk, a) + x(l, dk, a) + x(l, dt, a) + x(1, l, 4) + x(l, 1, 4) + x(s, dt, 4) + x(1, s, 4) + x(s, 1, 4)
  once += x(s, dk, 4)
  scratch = (d_v // dt) * x(s, dt, 4) + x(1, s, 4) + x(s, 1, 4) + 2 * x(lq, l, 4) + x(lq, s, 4)
  # float32 temporaries: scores, weights and their gradients [Lq,L] and [Lq,S]; the fold's one-hot
  temporaries = 8 * x(lq, l, 4) + 3 * x(lq, s, 4) + 3 * x(l, s, 4) + 2 * x(l, dt, 4) + 2 * x(l, dk, 4)
  return 2 * pipelined + once + scratch + temporaries + tpu_grid.MOSAIC_SCRATCH


def query_block(forward_block: int, *, budget: int | None, **sizes) -> int:
  """The backward's query sub-block: the forward's where `vmem_bytes` fits `budget` (None: no limit, off
  TPU), else the longest shorter divisor of block_len in whole sublanes that does (the shortest if none).
  Every candidate divides block_len: the forward's does, and so must a shorter one."""
  if budget is None:
    return forward_block
  l = sizes["block_len"]
  shorter = [n for n in range(forward_block - 1, 0, -1) if l % n == 0 and n % tpu_grid.SUBLANES == 0]
  rows = [forward_block, *shorter]
  for lq in rows:
    if vmem_bytes(query_block=lq, **sizes) <= budget:
      return lq
  return rows[-1]


def work(*, batch: int, heads: int, seq_len: int, block_len: int, n_code: int, d_k: int, d_v: int, tiles: int = 1):
  """(FLOPs, exps) of the two kernels together, for the rooflines (a custom call is opaque to them): per
  block the scores against 2L keys and S codes (again in each of the values kernel's `tiles` value tiles),
  g . v and g . sum over Dv, dq, dk and the codebook's gradient over Dk, dv, the cache's adjoint and the
  fold over Dv."""
  b, h, l, s, dk, dv = batch, heads, block_len, n_code, d_k, d_v
  columns = 2 * l + s
  per_block = 2 * l * columns * (dk * (3 + tiles) + dv) + 2 * l * 2 * l * dv + 3 * 2 * l * s * dv
  return b * h * (seq_len // l) * per_block, b * h * seq_len * columns * (1 + tiles)


# -- the kernels ---------------------------------------------------------------------------------------


def _scores_kernel(*refs, names, n_code: int, compressive: bool, through_cache: bool):
  """Grid (B, H, R, Q, J): the blocks and their query sub-blocks in order, and the value tiles in order
  within each: dS sums over every value column, so the tiles' products g . v and g . sum collect in scratch
  and the last tile takes the step. The cache lives in scratch as `tpu_grid._kernel` keeps it, one [S,Dt]
  slab per tile. dk of block r collects over its sub-blocks in an output block that stays put; the previous
  block's share goes to `dk_prev`, one block later in its array (block 0 there: the carried block)."""
  x, out, scratch = toolkit.named_refs(refs, *names)
  r, qi, j = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  last_q, last_j = pl.num_programs(3) - 1, pl.num_programs(4) - 1

  @pl.when((r == 0) & (qi == 0))
  def _():
    scratch["sum_v"][j] = x["carry_sum"][...]

    @pl.when(j == 0)
    def _():
      scratch["count_row"][...] = x["carry_count_row"][...]
      scratch["count_col"][...] = x["carry_count_col"][...]
      out["dcodebook"][...] = jnp.zeros_like(out["dcodebook"])

  @pl.when((qi == 0) & (j == 0))
  def _():  # the keys' outputs collect over the block's query sub-blocks
    out["dk"][...] = jnp.zeros_like(out["dk"])
    out["dk_prev"][...] = jnp.zeros_like(out["dk_prev"])

  @pl.when(j == 0)
  def _():
    for name in ("gv_prev", "gv_cur", "g_sum"):
      scratch[name][...] = jnp.zeros_like(scratch[name])

  ops = grid_layout.step_operands(x, r == 0)
  state = (scratch["sum_v"][j], scratch["count_row"][...], scratch["count_col"][...])
  g = x["dout"][...].astype(f32)
  scratch["gv_prev"][...] += toolkit.dot(g, ops["v_prev"], (1, 1))  # [Lq,L]: g_i . v_j, this tile's part
  scratch["gv_cur"][...] += toolkit.dot(g, ops["v_cur"].astype(f32), (1, 1))
  if compressive:
    scratch["g_sum"][...] += toolkit.dot(g, state[0], (1, 1))  # [Lq,S]: g_i . sum_s

  @pl.when(j == last_j)
  def _():
    q = ops["q"].astype(f32)
    w = tpu_grid.block_weights(
      state,
      *(ops[n] for n in ("q", "k_prev", "k_cur", "zr_prev", "zr_cur", "codebook", "bias")),
      qi * q.shape[0],
      ops["docs"],
      n_code=n_code,
      compressive=compressive,
    )
    inv = 1.0 / w["den"]
    p_prev, p_cur = w["a_prev"] * inv, w["a_cur"] * inv
    gv_prev, gv_cur = scratch["gv_prev"][...], scratch["gv_cur"][...]
    d = (p_prev * gv_prev).sum(-1, keepdims=True) + (p_cur * gv_cur).sum(-1, keepdims=True)
    if compressive:
      w_code, g_sum = w["a_code"] * inv, scratch["g_sum"][...]
      d = d + (w_code * g_sum).sum(-1, keepdims=True)
    ds_prev, ds_cur = p_prev * (gv_prev - d), p_cur * (gv_cur - d)
    dq = toolkit.dot(ds_prev, ops["k_prev"]) + toolkit.dot(ds_cur, ops["k_cur"].astype(f32))
    if compressive:
      ds_code = w_code * (g_sum - state[1] * d)
      dq = dq + toolkit.dot(ds_code, ops["codebook"].astype(f32))
      out["dcodebook"][...] += toolkit.dot(ds_code, q, (0, 0))
    out["dq"][...] = dq
    out["lse"][...] = w["m"] + jnp.log(w["den"])
    if "dbias" in out:
      out["dbias"][...] = jnp.concatenate([ds_prev, ds_cur], axis=1)
    out["dk"][...] += toolkit.dot(ds_cur, q, (0, 0))
    if through_cache:
      out["dk_prev"][...] += toolkit.dot(ds_prev, q, (0, 0))

  @pl.when(qi == last_q)
  def _():  # the previous block enters the cache once every query of this block has read it
    folded = tpu_grid.fold(state, ops["v_prev"], ops["z_fold"], ops["keep"], n_code=n_code)
    scratch["sum_v"][j] = folded[0]

    @pl.when(j == last_j)
    def _():  # the counts once, after the last tile's step has used them
      scratch["count_row"][...], scratch["count_col"][...] = folded[1], folded[2]


def _values_kernel(*refs, names, n_code: int, compressive: bool, through_cache: bool):
  """Grid (B, H, J, R, Q): a value tile per program, the blocks from last to first (`point` reverses the
  block axis) and their query sub-blocks in order. Scratch: T (the cache's adjoint) and `later`, what block
  r - 1's keys have collected so far (the reads of block r as its previous block, and the cache's share);
  dv of block r starts from `later` as it was when block r + 1 ended."""
  x, out, scratch = toolkit.named_refs(refs, *names)
  step, qi = pl.program_id(3), pl.program_id(4)
  r = pl.num_programs(3) - 1 - step
  last_step, last_q = pl.num_programs(3) - 1, pl.num_programs(4) - 1

  @pl.when((step == 0) & (qi == 0))
  def _():
    scratch["adjoint"][...] = jnp.zeros_like(scratch["adjoint"])
    scratch["later"][...] = jnp.zeros_like(scratch["later"])

  ops = grid_layout.step_operands(x, r == 0)
  s = x["codebook"].shape[0]

  @pl.when(qi == 0)
  def _():  # block r's dv starts from what its keys collected at block r + 1; block r - 1's collection begins
    out["dv"][...] = scratch["later"][...]
    if compressive and through_cache:
      # block r - 1's keys enter the cache block r + 1 reads: T_{r+1} at their codes (code S: none)
      l = ops["z_fold"].shape[0]
      onehot = (ops["z_fold"] == jax.lax.broadcasted_iota(jnp.int32, (l, s), 1)).astype(f32)
      scratch["later"][...] = toolkit.dot(onehot, scratch["adjoint"][...])
      if ops["keep"] is not None:  # a fold that drops the cache ends the earlier blocks' share of T
        scratch["adjoint"][...] *= ops["keep"].max(-1, keepdims=True)
    else:
      scratch["later"][...] = jnp.zeros_like(scratch["later"])

  q = ops["q"].astype(f32)
  # The forward's normalised weights from its log-normaliser: the same scores and masks, no sum to take again.
  lse = x["lse"][...]
  s_prev, s_cur, keep_prev, keep_cur = tpu_grid.local_scores(
    q,
    *(ops[n] for n in ("k_prev", "k_cur", "zr_prev", "zr_cur", "bias")),
    qi * q.shape[0],
    ops["docs"],
    n_code=n_code,
    compressive=compressive,
  )
  p_prev = jnp.where(keep_prev, jnp.exp(s_prev - lse), 0.0)
  p_cur = jnp.where(keep_cur, jnp.exp(s_cur - lse), 0.0)
  g = x["dout"][...].astype(f32)
  out["dv"][...] += toolkit.dot(p_cur, g, (0, 0))
  if through_cache:
    scratch["later"][...] += toolkit.dot(p_prev, g, (0, 0))
    if compressive:
      w_code = jnp.exp(jnp.minimum(toolkit.dot(q, ops["codebook"].astype(f32), (1, 1)) - lse, 0.0))
      if ops["docs"] is not None:
        w_code = w_code * ops["docs"][1]  # only queries of the cache's document read it
      scratch["adjoint"][...] += toolkit.dot(w_code, g, (0, 0))

  @pl.when((step == last_step) & (qi == last_q))
  def _():
    out["dcarry_v"][...] = scratch["later"][...]
    out["dcarry_sum"][...] = scratch["adjoint"][...]


def gradients(
  x: dict,
  dout: Array,
  *,
  block_len: int,
  value_block: int,
  query_block: int,
  compressive: bool,
  grad_through_cache: bool,
  interpret: bool,
) -> dict[str, Array]:
  """Both kernels on `grid_layout.head_major`'s inputs `x` and the output's cotangent dout [B,H,T,Dv], per
  query head (a group's heads are summed by the caller): {dq [B,H,T,Dk]; dk [B,H,T,Dk] and dk_prev [B,H,T,Dk]
  (the previous block's share, one block later: the carried block's first); dcodebook [B,H,S,Dk]; dbias
  [B,H,T,2L] where there is a bias; dv [B,H,T,Dv]; dcarry_v [B,H,L,Dv]; dcarry_sum [B,H,S,Dv], the carried
  sums' adjoint}, all float32."""
  q, v, codebook = x["q"], x["v"], x["codebook"]
  b, h, t, dk = q.shape
  s, dv = codebook.shape[1], v.shape[-1]
  l, dt, lq = block_len, value_block, query_block
  nr, nj, nq = t // l, dv // dt, l // lq
  spec = lambda shape, index: pl.BlockSpec((None, None) + shape, index)
  kw = dict(n_code=s, compressive=compressive, through_cache=grad_through_cache)
  once = not interpret

  # The scores kernel, grid (B, H, R, Q, J).
  scores_point = lambda bb, hh, rr, qq, jj: (bb, hh, jj, rr, qq)
  inputs = grid_layout.declare_inputs(x, block_len=l, value_block=dt, query_block=lq, point=scores_point, once=once)
  queries = lambda bb, hh, rr, qq, jj: (bb, hh, rr * nq + qq, 0)
  inputs.add("dout", dout, spec((lq, dt), lambda bb, hh, rr, qq, jj: (bb, hh, rr * nq + qq, jj)))
  outputs = toolkit.Outputs()
  outputs.add("dq", jax.ShapeDtypeStruct((b, h, t, dk), f32), spec((lq, dk), queries))
  outputs.add("lse", jax.ShapeDtypeStruct((b, h, t, 1), f32), spec((lq, 1), queries))
  block = lambda bb, hh, rr, qq, jj: (bb, hh, rr, 0)
  outputs.add("dk", jax.ShapeDtypeStruct((b, h, t, dk), f32), spec((l, dk), block))
  outputs.add("dk_prev", jax.ShapeDtypeStruct((b, h, t, dk), f32), spec((l, dk), block))
  outputs.add(
    "dcodebook", jax.ShapeDtypeStruct((b, h, s, dk), f32), spec((s, dk), lambda bb, hh, rr, qq, jj: (bb, hh, 0, 0))
  )
  if x["bias"] is not None:
    outputs.add("dbias", jax.ShapeDtypeStruct((b, h, t, 2 * l), f32), spec((lq, 2 * l), queries))
  scratch = toolkit.Scratch()
  scratch.add("sum_v", (nj, s, dt), f32)
  scratch.add("count_row", (1, s), f32)
  scratch.add("count_col", (s, 1), f32)
  scratch.add("gv_prev", (lq, l), f32)
  scratch.add("gv_cur", (lq, l), f32)
  scratch.add("g_sum", (lq, s), f32)
  flops, exps = work(batch=b, heads=h, seq_len=t, block_len=l, n_code=s, d_k=dk, d_v=dv, tiles=nj)
  scores_share = (dk * 4 + dv) / (dk * (3 + nj) + dv)  # the first kernel's part of `work`, roughly
  first = pl.pallas_call(
    functools.partial(_scores_kernel, names=toolkit.ref_names(inputs, outputs, scratch), **kw),
    out_shape=outputs.shapes,
    grid=(b, h, nr, nq, nj),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    compiler_params=toolkit.compiler_params(2, sequential=True, num_sequential=3),
    interpret=interpret,
    name="vq_attention_dq",
    cost_estimate=toolkit.cost_estimate(flops * scores_share, exps / (1 + nj), [*inputs.arrays, *outputs.shapes]),
  )
  grads = outputs.named(first(*inputs.arrays))

  # The values kernel: a value tile per program, the blocks backwards, grid (B, H, J, R, Q).
  values_point = lambda bb, hh, jj, step, qq: (bb, hh, jj, nr - 1 - step, qq)
  inputs = grid_layout.declare_inputs(
    x, block_len=l, value_block=dt, query_block=lq, point=values_point, once=once, skip=NO_VALUES
  )
  queries = lambda bb, hh, jj, step, qq: (bb, hh, (nr - 1 - step) * nq + qq, 0)
  queries_tile = lambda bb, hh, jj, step, qq: (bb, hh, (nr - 1 - step) * nq + qq, jj)
  inputs.add("dout", dout, spec((lq, dt), queries_tile))
  inputs.add("lse", grads["lse"], spec((lq, 1), queries))
  outputs = toolkit.Outputs()
  outputs.add(
    "dv",
    jax.ShapeDtypeStruct((b, h, t, dv), f32),
    spec((l, dt), lambda bb, hh, jj, step, qq: (bb, hh, nr - 1 - step, jj)),
  )
  at_end = lambda bb, hh, jj, step, qq: (bb, hh, 0, jj)  # written once, after the first block
  outputs.add("dcarry_v", jax.ShapeDtypeStruct((b, h, l, dv), f32), spec((l, dt), at_end))
  outputs.add("dcarry_sum", jax.ShapeDtypeStruct((b, h, s, dv), f32), spec((s, dt), at_end))
  scratch = toolkit.Scratch()
  scratch.add("adjoint", (s, dt), f32)
  scratch.add("later", (l, dt), f32)
  second = pl.pallas_call(
    functools.partial(_values_kernel, names=toolkit.ref_names(inputs, outputs, scratch), **kw),
    out_shape=outputs.shapes,
    grid=(b, h, nj, nr, nq),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    compiler_params=toolkit.compiler_params(3, sequential=True, num_sequential=2),
    interpret=interpret,
    name="vq_attention_dv",
    cost_estimate=toolkit.cost_estimate(
      flops * (1 - scores_share), exps * nj / (1 + nj), [*inputs.arrays, *outputs.shapes]
    ),
  )
  grads.update(outputs.named(second(*inputs.arrays)))
  return grads
