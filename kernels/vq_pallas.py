"""VQ-Attention as one Pallas kernel: the compressive cache lives in on-chip scratch.

`kernels.vq.cached_attention` (XLA) builds the cache variables of every block at once, a
[B,R,H,S,Dv] tensor in HBM. This kernel walks the blocks of one (batch, head) in order and keeps
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
over 2L + S scores needs no online rescaling. HBM traffic is the inputs and the output once each;
the cache never leaves the chip.

Layout: head-major inside ([B,H,T,D]); query head h reads key-value head h // G. z arrives twice,
as a column [T,1] (one-hot rows) and a row [1,T] (key validity), so no in-kernel transpose.

Backward: `jax.custom_vjp` whose backward is the VJP of the XLA form (`kernels.vq.cached_attention`),
recomputed from the inputs: training memory is the XLA path's; the forward (inference, evaluation,
long-context prefill) is where the kernel saves memory. On GPU (Triton) L, S, Dk and Dv should be
powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import _pallas
from kernels import vq as vq_xla

Array = jax.Array
f32 = jnp.float32
MASK = vq_xla.MASK


def _block_step(cache, q, k_prev, k_cur, v_prev, v_cur, zr_prev, zr_cur, zc_prev, codebook, bias, *,
                n_code: int, compressive: bool):
  """One query block against [previous, present] keys and the cache, then the previous block is folded.

  cache = (sum_v [S,Dv], count_row [1,S], count_col [S,1]); q [L,Dk]; k_* [L,Dk]; v_* [L,Dv];
  zr_* int [1,L]; zc_prev int [L,1]; codebook [S,Dk]; bias [L,2L] or None -> (cache, out [L,Dv]).
  """
  sum_v, count_row, count_col = cache
  l = q.shape[0]
  q = q.astype(f32)
  i = jax.lax.broadcasted_iota(jnp.int32, (l, l), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (l, l), 1)
  s_prev = _pallas.dot(q, k_prev.astype(f32), (1, 1))        # keys at distance L + i - j
  s_cur = _pallas.dot(q, k_cur.astype(f32), (1, 1))          # keys at distance i - j
  if bias is not None:
    s_prev, s_cur = s_prev + bias[:, :l], s_cur + bias[:, l:]
  keep_prev = zr_prev != n_code
  if not compressive:
    keep_prev = keep_prev & (j >= i)                         # distance <= L
  keep_cur = (zr_cur != n_code) & (j <= i)
  s_prev = jnp.where(keep_prev, s_prev, -MASK)
  s_cur = jnp.where(keep_cur, s_cur, -MASK)
  m = jnp.maximum(s_prev.max(-1, keepdims=True), s_cur.max(-1, keepdims=True))
  if compressive:
    present = count_row > 0
    s_code = _pallas.dot(q, codebook.astype(f32), (1, 1))    # [L,S]
    log_count = jnp.where(present, jnp.log(jnp.maximum(count_row, 1.0)), -MASK)
    m = jnp.maximum(m, (s_code + log_count).max(-1, keepdims=True))
  a_prev = jnp.where(keep_prev, jnp.exp(s_prev - m), 0.0)
  a_cur = jnp.where(keep_cur, jnp.exp(s_cur - m), 0.0)
  num = _pallas.dot(a_prev, v_prev.astype(f32)) + _pallas.dot(a_cur, v_cur.astype(f32))
  den = a_prev.sum(-1, keepdims=True) + a_cur.sum(-1, keepdims=True)
  if compressive:
    # exp(q.c_s - m) <= exp(-log count_s) <= 1 for every code present; absent codes masked.
    a_code = jnp.where(present, jnp.exp(jnp.where(present, s_code - m, 0.0)), 0.0)
    num = num + _pallas.dot(a_code, sum_v)
    den = den + (a_code * count_row).sum(-1, keepdims=True)
  out = num / den

  onehot = (zc_prev == jax.lax.broadcasted_iota(jnp.int32, (l, n_code), 1)).astype(f32)   # [L,S]
  sum_v = sum_v + _pallas.dot(onehot, v_prev.astype(f32), (0, 0))
  count_row = count_row + _pallas.dot(jnp.ones((1, l), f32), onehot)
  count_col = count_col + _pallas.dot(onehot, jnp.ones((l, 1), f32), (0, 0))
  return (sum_v, count_row, count_col), out


def _grid_kernel(*refs, n_code: int, compressive: bool, has_bias: bool):
  """Grid (B, H, R), R sequential; the cache in scratch across the block axis."""
  (q_ref, k_ref, kp_ref, v_ref, vp_ref, zr_ref, zrp_ref, zcp_ref, cb_ref, *rest) = refs
  bias_ref = rest.pop(0) if has_bias else None
  (ck_ref, cv_ref, czr_ref, czc_ref, csum_ref, crow_ref, ccol_ref,
   o_ref, sum_out, row_out, col_out, sum_v, count_row, count_col) = rest
  r = pl.program_id(2)

  @pl.when(r == 0)
  def _():
    sum_v[...] = csum_ref[...]
    count_row[...] = crow_ref[...]
    count_col[...] = ccol_ref[...]

  first = r == 0
  # in float32 (the block step's type anyway): TPU v3 has no select of bfloat16 vectors
  pick = lambda carried, ref: jnp.where(first, carried[...].astype(f32), ref[...].astype(f32))
  cache, out = _block_step(
      (sum_v[...], count_row[...], count_col[...]), q_ref[...], pick(ck_ref, kp_ref), k_ref[...],
      pick(cv_ref, vp_ref), v_ref[...], pick(czr_ref, zrp_ref), zr_ref[...], pick(czc_ref, zcp_ref),
      cb_ref[...], None if bias_ref is None else bias_ref[...], n_code=n_code, compressive=compressive)
  o_ref[...] = out.astype(o_ref.dtype)
  sum_v[...], count_row[...], count_col[...] = cache

  @pl.when(r == pl.num_programs(2) - 1)
  def _():
    sum_out[...], row_out[...], col_out[...] = cache


def _loop_kernel(*refs, n_code: int, compressive: bool, has_bias: bool, block_len: int, num_blocks: int):
  """Grid (B, H); the kernel loops over the R blocks of its whole [T, D] slices, the cache in loop values."""
  (q_ref, k_ref, v_ref, zr_ref, zc_ref, cb_ref, *rest) = refs
  bias_ref = rest.pop(0) if has_bias else None
  (ck_ref, cv_ref, czr_ref, czc_ref, csum_ref, crow_ref, ccol_ref, o_ref, sum_out, row_out, col_out) = rest
  l = block_len
  rows = lambda ref, r: ref[pl.ds(r * l, l), :]

  def body(r, cache):
    first = r == 0
    prev = jnp.maximum(r - 1, 0)
    pick = lambda carried, ref: jnp.where(first, carried[...].astype(f32), rows(ref, prev).astype(f32))
    zr_prev = jnp.where(first, czr_ref[...], zr_ref[:, pl.ds(prev * l, l)])
    cache, out = _block_step(
        cache, rows(q_ref, r), pick(ck_ref, k_ref), rows(k_ref, r), pick(cv_ref, v_ref), rows(v_ref, r),
        zr_prev, zr_ref[:, pl.ds(r * l, l)], pick(czc_ref, zc_ref), cb_ref[...],
        None if bias_ref is None else rows(bias_ref, r), n_code=n_code, compressive=compressive)
    o_ref[pl.ds(r * l, l), :] = out.astype(o_ref.dtype)
    return cache

  cache = jax.lax.fori_loop(0, num_blocks, body, (csum_ref[...], crow_ref[...], ccol_ref[...]))
  sum_out[...], row_out[...], col_out[...] = cache


def _forward(q, k, v, zc, zr, codebook, bias, carry, *, block_len: int, compressive: bool, driver: str,
             interpret: bool):
  """Head-major pallas_call. q [B,H,T,Dk]; k [B,Hk,T,Dk]; v [B,Hk,T,Dv]; zc int [B,Hk,T,1]; zr int
  [B,Hk,1,T]; codebook [Hk,S,Dk]; bias [B,H,T,2L] or None; carry head-major (see _head_major_carry).
  -> out [B,H,T,Dv] and the cache after the last block per query head: sum [B,H,S,Dv], count row
  [B,H,1,S], count column [B,H,S,1]."""
  b, h, t, dk = q.shape
  hk, s, _ = codebook.shape
  dv = v.shape[-1]
  g = h // hk
  l = block_len
  r = t // l
  has_bias = bias is not None
  ck, cv, czr, czc, csum, crow, ccol = carry
  out_shape = [jax.ShapeDtypeStruct((b, h, t, dv), v.dtype), jax.ShapeDtypeStruct((b, h, s, dv), f32),
               jax.ShapeDtypeStruct((b, h, 1, s), f32), jax.ShapeDtypeStruct((b, h, s, 1), f32)]
  statics = dict(n_code=s, compressive=compressive, has_bias=has_bias)
  if driver == "grid":
    def spec(shape, index):
      return pl.BlockSpec((None, None) + shape, index)
    this = lambda bb, hh, rr: (bb, hh, rr, 0)
    kv = lambda bb, hh, rr: (bb, jax.lax.div(hh, g), rr, 0)
    kv_prev = lambda bb, hh, rr: (bb, jax.lax.div(hh, g), jnp.maximum(rr - 1, 0), 0)
    row = lambda bb, hh, rr: (bb, jax.lax.div(hh, g), 0, rr)
    row_prev = lambda bb, hh, rr: (bb, jax.lax.div(hh, g), 0, jnp.maximum(rr - 1, 0))
    fixed_kv = lambda bb, hh, rr: (bb, jax.lax.div(hh, g), 0, 0)
    fixed = lambda bb, hh, rr: (bb, hh, 0, 0)
    in_specs = [spec((l, dk), this), spec((l, dk), kv), spec((l, dk), kv_prev), spec((l, dv), kv),
                spec((l, dv), kv_prev), spec((1, l), row), spec((1, l), row_prev), spec((l, 1), kv_prev),
                pl.BlockSpec((None, s, dk), lambda bb, hh, rr: (jax.lax.div(hh, g), 0, 0))]
    args = [q, k, k, v, v, zr, zr, zc, codebook]
    if has_bias:
      in_specs.append(spec((l, 2 * l), this))
      args.append(bias)
    in_specs += [spec((l, dk), fixed_kv), spec((l, dv), fixed_kv), spec((1, l), fixed_kv), spec((l, 1), fixed_kv),
                 spec((s, dv), fixed_kv), spec((1, s), fixed_kv), spec((s, 1), fixed_kv)]
    out_specs = [spec((l, dv), this), spec((s, dv), fixed), spec((1, s), fixed), spec((s, 1), fixed)]
    call = pl.pallas_call(
        functools.partial(_grid_kernel, **statics), out_shape=out_shape, grid=(b, h, r), in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=[_pallas.scratch((s, dv), f32), _pallas.scratch((1, s), f32),
                                             _pallas.scratch((s, 1), f32)],
        compiler_params=_pallas.compiler_params(2, sequential=True), interpret=interpret, name="vq_attention")
  else:
    def spec(shape, heads_of_kv=False):
      index = (lambda bb, hh: (bb, jax.lax.div(hh, g), 0, 0)) if heads_of_kv else (lambda bb, hh: (bb, hh, 0, 0))
      return pl.BlockSpec((None, None) + shape, index)
    in_specs = [spec((t, dk)), spec((t, dk), True), spec((t, dv), True), spec((1, t), True), spec((t, 1), True),
                pl.BlockSpec((None, s, dk), lambda bb, hh: (jax.lax.div(hh, g), 0, 0))]
    args = [q, k, v, zr, zc, codebook]
    if has_bias:
      in_specs.append(spec((t, 2 * l)))
      args.append(bias)
    in_specs += [spec((l, dk), True), spec((l, dv), True), spec((1, l), True), spec((l, 1), True),
                 spec((s, dv), True), spec((1, s), True), spec((s, 1), True)]
    out_specs = [spec((t, dv)), spec((s, dv)), spec((1, s)), spec((s, 1))]
    call = pl.pallas_call(
        functools.partial(_loop_kernel, block_len=l, num_blocks=r, **statics), out_shape=out_shape, grid=(b, h),
        in_specs=in_specs, out_specs=out_specs, compiler_params=_pallas.compiler_params(2, sequential=False),
        interpret=interpret, name="vq_attention")
  return call(*args, ck, cv, czr, czc, csum, crow, ccol)


def _head_major_carry(carry: dict) -> tuple:
  """The reference's carry ([B,L,Hk,.], mean [B,Hk,S,Dv], count [B,Hk,S]) in the kernel's layout."""
  count = carry["count"].astype(f32)
  return (carry["k"].transpose(0, 2, 1, 3), carry["v"].transpose(0, 2, 1, 3),
          carry["z"].transpose(0, 2, 1)[:, :, None, :], carry["z"].transpose(0, 2, 1)[..., None],
          carry["mean"].astype(f32) * count[..., None], count[:, :, None, :], count[..., None])


def _kernel_call(q, k_hat, z, v, codebook, carry, bias, *, block_len, compressive, driver, interpret):
  """[B,T,H,.] in, the head-major kernel, [B,T,H,Dv] out plus the cache per key-value head."""
  b, t, h, _ = q.shape
  hk = codebook.shape[0]
  l = block_len
  heads = lambda x: x.transpose(0, 2, 1, 3)
  zt = z.transpose(0, 2, 1)
  bias_hm = None
  if bias is not None:  # [B,R,Hk,G,L,2L] -> [B,H,T,2L]
    bias_hm = bias.transpose(0, 2, 3, 1, 4, 5).reshape(b, h, t, 2 * l)
  out, csum, _, ccol = _forward(heads(q), heads(k_hat), heads(v), zt[..., None], zt[:, :, None, :], codebook,
                                bias_hm, _head_major_carry(carry), block_len=l, compressive=compressive,
                                driver=driver, interpret=interpret)
  first_of_group = slice(None, None, h // hk)
  count = ccol[:, first_of_group, :, 0]
  mean = csum[:, first_of_group] / jnp.maximum(count, 1.0)[..., None]
  return heads(out), mean, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  carry = dict(carry_float, z=ints["carry_z"])
  return _kernel_call(q, k_hat, ints["z"], v, codebook, carry, bias, **dict(statics))


def _attention_fwd(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  return _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics), (q, k_hat, v, codebook,
                                                                                carry_float, bias, ints)


def _attention_bwd(statics, residuals, cotangents):
  q, k_hat, v, codebook, carry_float, bias, ints = residuals
  d = dict(statics)

  def xla(q, k_hat, v, codebook, carry_float, bias):
    out, _ = vq_xla.cached_attention(q, k_hat, ints["z"], v, codebook, dict(carry_float, z=ints["carry_z"]), bias,
                                     block_len=d["block_len"], reduction="serial", compressive=d["compressive"])
    return out

  _, vjp = jax.vjp(xla, q, k_hat, v, codebook, carry_float, bias)
  return vjp(cotangents[0]) + (None,)  # the new cache carries no gradient (as in the reference)


_attention.defvjp(_attention_fwd, _attention_bwd)


def vq_attention_blocks(q: Array, k_hat: Array, z: Array, v: Array, codebook: Array, *, block_len: int,
                        carry: dict, bias: Array | None = None, compressive: bool = True,
                        driver: str | None = None, interpret: bool | None = None) -> tuple[Array, dict]:
  """`kernels.vq.vq_attention_blocks` with impl="pallas": same arguments, with the position term as
  `kernels.vq.xl_bias_blocks`' output; returns the output [B,T,H,Dv] and the carry after the last
  position (equal to the XLA form's)."""
  statics = (("block_len", block_len), ("compressive", compressive), ("driver", _pallas.driver(driver)),
             ("interpret", _pallas.interpret_default() if interpret is None else interpret))

  def per_device(q, k_hat, z, v, codebook, carry, bias):
    carry_float = {"k": carry["k"], "v": carry["v"], "mean": carry["mean"], "count": carry["count"]}
    return _attention(q, k_hat, v, codebook, carry_float, bias, {"z": z, "carry_z": carry["z"]}, statics)

  carry_dims = {"k": "b.k.", "v": "b.k.", "z": "b.k", "mean": "bk..", "count": "bk."}
  out, mean, count = _pallas.run_per_device(
      per_device, (q, k_hat, z, v, codebook, carry, bias),
      ("b.h.", "b.k.", "b.k", "b.k.", "k..", carry_dims, None if bias is None else "b.kg.."),
      ("b.h.", "bk..", "bk."), batch=q.shape[0], heads=q.shape[2], kv_heads=codebook.shape[0])
  l = block_len
  tail = lambda x: x[:, -l:]
  new_carry = {"k": tail(k_hat), "v": tail(v), "z": tail(z), "mean": mean, "count": count}
  return out, jax.tree.map(jax.lax.stop_gradient, new_carry)
