"""VQ-Attention's gradient on the parallel driver (GPU): every block at once, as its forward
(kernels/vq/gpu_parallel.py) attends them, from the cache XLA's prefix gives each block. kernels/vq/pallas.py
wires it into `jax.custom_vjp`; the XLA form's VJP is the tests' oracle.

A code is one more key of block r's queries, scoring q.c_s + log count_s with value mean_s (block r's
cache), so with the forward's log-normaliser lse_i and D_i = dout_i . out_i (both kept by the forward)
this is softmax attention's backward over [previous block, present block, codes]:

  p_ij = exp(s_ij - lse_i),   dS_ij = p_ij (dout_i . v_j - D_i)
  dq_i = sum_j dS_ij k_j,   dk_j = sum_i dS_ij q_i,   dv_j = sum_i p_ij dout_i,   dbias_ij = dS_ij

(for a code, k_j is c_s and v_j mean_s: the codebook's gradient and each block's cache's, dmean_r). Triton
keeps a program's working set in registers, so no product runs over all of Dv: dout_i . v_j sums the value
tiles in a loop, and dv takes a program per value tile. Three calls, every grid axis parallel:

  "vq_attention_dq"  `_dq_kernel`, (B, H, R, L/Lq): a query tile against its window's key tiles and the
                     codes: dq, dbias.
  "vq_attention_dk"  `_column_kernel`, (B, H, R+1 + R, N): a key tile of the window ([carried block,
                     sequence], each read as the present block by the block it is and as the previous one by
                     the block after) or, in the last R rows, a code tile of block r's cache (N: the more of
                     L/Lk and S/Sc; a program past its kind's count does nothing): dk, or the codebook's
                     gradient per block.
  "vq_attention_dv"  `_column_kernel` again, times Dv/Dt value tiles: dv, or dmean per block.

The cache's own gradient is XLA's (`_cache_adjoint`): with the counts constant, each block's cache mean is
its folded sums over max(count, 1), linear in the values, so dmean per block goes back to the values and
the carried means by a reverse scan. With `grad_through_cache=False` the previous block and the cache are
constants: no dk, dv from the previous-block role, no dmean.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.vq import gpu_parallel, reference

Array = jax.Array
f32 = jnp.float32
MASK = reference.MASK


def _keep(x: dict, rows, cols, window_at, role: str, *, n_code: int, compressive: bool, q_seg=None):
  """Which queries (places in their block, [Lq,1]) read which keys (places in theirs, [1,Lk]; window rows
  `window_at`, a pl.ds) as the present ("cur") or the previous ("prev") block: [Lq,Lk] bool. q_seg: the
  queries' document ids [Lq,1] where there are documents."""
  keep = x["z_row"][:, window_at] != n_code  # code S: no key
  if role == "cur":
    keep = keep & (cols <= rows)
  elif not compressive:
    keep = keep & (cols >= rows)  # distance <= L
  if q_seg is not None:
    keep = keep & (q_seg == x["k_seg"][:, window_at])
  return keep


def _value_products(g_ref, rows_at, v_ref, cols_at, *, value_block: int, lq: int, lk: int):
  """g_i . v_j for the queries at rows `rows_at` of g_ref and the keys at rows `cols_at` of v_ref, summed over
  every value column a tile of Dt at a time: [Lq,Lk]."""
  dt = value_block
  tiles = g_ref.shape[-1] // dt

  def tile(jt, acc):
    cols = pl.ds(jt * dt, dt)
    return acc + toolkit.dot(g_ref[rows_at, cols].astype(f32), v_ref[cols_at, cols].astype(f32), (1, 1))

  return jax.lax.fori_loop(0, tiles, tile, jnp.zeros((lq, lk), f32))


class _Block:
  """What a program reads of a query tile (block r, tile qi): its rows, queries, lse, D and document ids, and
  its weights over a key tile or a code tile, for the kernels' shared steps."""

  def __init__(self, x: dict, r, qi, *, lq: int, lk: int, block_len: int, n_code: int, compressive: bool):
    self.x, self.l, self.lq, self.lk = x, block_len, lq, lk
    self.n_code, self.compressive = n_code, compressive
    self.at = pl.ds(r * block_len + qi * lq, lq)  # the queries' rows in [T]
    self.r, self.qi = r, qi
    self.q = x["q"][self.at, :].astype(f32)
    self.lse, self.d = x["lse"][self.at, :], x["d"][self.at, :]
    self.q_seg = x["q_seg"][self.at, :] if "q_seg" in x else None

  def key_weights(self, half: int, kt):
    """(p [Lq,Lk], the tile's rows in the window arrays) of the queries against key tile kt of half 0 (the
    previous block) or 1 (the present one) of the window they read; p = exp(s - lse) where a query reads."""
    x, l, lq, lk = self.x, self.l, self.lq, self.lk
    window_at = pl.ds(self.r * l + half * l + kt * lk, lk)  # in the [T + L] window arrays
    scores = toolkit.dot(self.q, x["k"][window_at, :].astype(f32), (1, 1))
    if "bias" in x:
      scores = scores + x["bias"][self.at, pl.ds(half * l + kt * lk, lk)]
    rows = self.qi * lq + jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 0)
    cols = kt * lk + jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
    role = "cur" if half == 1 else "prev"
    keep = _keep(x, rows, cols, window_at, role, n_code=self.n_code, compressive=self.compressive, q_seg=self.q_seg)
    return jnp.where(keep, jnp.exp(jnp.where(keep, scores, 0.0) - self.lse), 0.0), window_at

  def code_weights(self, ct, sc: int):
    """(p [Lq,Sc], the tile's rows in the cache) of the queries against code tile ct of the cache their
    block reads."""
    x = self.x
    codes = pl.ds(ct * sc, sc)
    log_count = x["log_count"][:, codes]  # -MASK where a code is empty
    scores = toolkit.dot(self.q, x["codebook"][codes, :].astype(f32), (1, 1)) + log_count
    keep = log_count > -MASK / 2
    if "reads" in x:
      keep = keep & (x["reads"][self.at, :] > 0)  # only queries of the cache's document
    return jnp.where(keep, jnp.exp(jnp.where(keep, scores, 0.0) - self.lse), 0.0), codes


def _dq_kernel(*refs, names, n_code: int, compressive: bool, block_len: int, tiles: dict):
  """Grid (B, H, R, L/Lq): the query tile's key tiles (the previous block's, the present one's up to the
  diagonal) and code tiles, each one step of dq and its columns of dbias."""
  x, out = toolkit.named_refs(refs, *names)
  l, lq, lk, sc, dt = block_len, tiles["query_block"], tiles["key_block"], tiles["code_block"], tiles["value_block"]
  r, qi = pl.program_id(2), pl.program_id(3)
  blk = _Block(x, r, qi, lq=lq, lk=lk, block_len=l, n_code=n_code, compressive=compressive)
  if "dbias" in out:
    out["dbias"][...] = jnp.zeros((lq, 2 * l), f32)  # the tiles no query reads stay 0

  def keys(half: int):
    def step(kt, dq):
      p, window_at = blk.key_weights(half, kt)
      gv = _value_products(x["g"], blk.at, x["v"], window_at, value_block=dt, lq=lq, lk=lk)
      ds = p * (gv - blk.d)
      if "dbias" in out:
        out["dbias"][:, pl.ds(half * l + kt * lk, lk)] = ds
      return dq + toolkit.dot(ds, x["k"][window_at, :].astype(f32))

    return step

  def codes(ct, dq):
    p, at = blk.code_weights(ct, sc)
    gm = _value_products(x["g"], blk.at, x["mean"], at, value_block=dt, lq=lq, lk=sc)
    return dq + toolkit.dot(p * (gm - blk.d), x["codebook"][at, :].astype(f32))

  dq = jnp.zeros((lq, x["q"].shape[-1]), f32)
  first = 0 if compressive else jax.lax.div(qi * lq, lk)  # tiles wholly farther than L: none
  dq = jax.lax.fori_loop(first, l // lk, keys(0), dq)
  dq = jax.lax.fori_loop(0, jax.lax.div(qi * lq + lq + lk - 1, lk), keys(1), dq)  # up to the diagonal
  if compressive:
    dq = jax.lax.fori_loop(0, n_code // sc, codes, dq)
  out["dq"][...] = dq.astype(out["dq"].dtype)


def _column_kernel(*refs, names, n_code: int, compressive: bool, block_len: int, tiles: dict, through_cache: bool):
  """Grid (B, H, W, N[, J]): W = R + 1 key blocks of the window, then R caches; N tiles of keys (Lk) or codes
  (Sc), whichever are more (a program past its kind's count does nothing); with J, one value tile per
  program: dv or dmean, else dk or the codebook's gradient. A key tile of window block w is the present
  block of query block w - 1 and the previous block of query block w; a code tile of cache r is read by
  query block r."""
  x, out = toolkit.named_refs(refs, *names)
  l, lq, lk, sc, dt = block_len, tiles["query_block"], tiles["key_block"], tiles["code_block"], tiles["value_block"]
  nr = x["q"].shape[0] // l
  w, n = pl.program_id(2), pl.program_id(3)
  values = "dv" in out  # this call's kind: values (a tile of them per program) or keys
  jt = pl.program_id(4) if values else None
  block = lambda r, qi: _Block(x, r, qi, lq=lq, lk=lk, block_len=l, n_code=n_code, compressive=compressive)

  def contribution(p, blk, cols_at, v_ref):
    """One query tile's share: p^T g over the value tile, or dS^T q (dS from the values at rows `cols_at`
    of v_ref)."""
    if values:
      return toolkit.dot(p, x["g"][blk.at, pl.ds(jt * dt, dt)].astype(f32), (0, 0))
    gv = _value_products(x["g"], blk.at, v_ref, cols_at, value_block=dt, lq=lq, lk=p.shape[1])
    return toolkit.dot(p * (gv - blk.d), blk.q, (0, 0))

  width = dt if values else x["q"].shape[-1]

  @pl.when((w <= nr) & (n < l // lk))
  def _():  # a key tile of window block w
    def read_as(half: int, r):
      def step(qi, acc):
        blk = block(r, qi)
        p, window_at = blk.key_weights(half, n)
        return acc + contribution(p, blk, window_at, x["v"])

      return step

    acc = jnp.zeros((lk, width), f32)
    # as the present block of query block w - 1: its query tiles from the key tile's diagonal on
    cur = jax.lax.fori_loop(jax.lax.div(n * lk, lq), l // lq, read_as(1, jnp.maximum(w - 1, 0)), acc)
    acc = jnp.where(w >= 1, cur, acc)
    if through_cache:  # as the previous block of query block w (none after the last block)
      last = l // lq if compressive else jax.lax.div(n * lk + lk + lq - 1, lq)  # the window: rows <= cols
      prev = jax.lax.fori_loop(0, last, read_as(0, jnp.minimum(w, nr - 1)), acc)
      acc = jnp.where(w < nr, prev, acc)
    out["dv" if values else "dk"][...] = acc.astype(out["dv" if values else "dk"].dtype)

  if compressive and (through_cache or not values):

    @pl.when((w > nr) & (n < n_code // sc))
    def _():  # a code tile of the cache query block w - R - 1 reads
      r = w - nr - 1

      def step(qi, acc):
        blk = block(r, qi)
        p, at = blk.code_weights(n, sc)
        return acc + contribution(p, blk, at, x["mean"])

      acc = jax.lax.fori_loop(0, l // lq, step, jnp.zeros((sc, width), f32))
      out["dmean" if values else "dcodebook"][...] = acc


def gradients(
  q,
  k_hat,
  z,
  v,
  codebook,
  carry,
  bias,
  segments,
  out,
  lse,
  dout,
  *,
  block_len: int,
  value_block: int,
  query_block: int,
  key_block: int,
  code_block: int,
  compressive: bool,
  grad_through_cache: bool,
  interpret: bool,
) -> dict[str, Array]:
  """The gradient of `gpu_parallel.attention`'s output: [B,T,H,.] in, the forward's output `out` and its
  log-normaliser lse [B,H,T,1], the output's cotangent dout [B,T,H,Dv] -> {q, k_hat, v, codebook, bias (the
  position term, or None), carry_k, carry_v, carry_mean}, per key-value head."""
  b, t, h, dk = q.shape
  hk, s, _ = codebook.shape
  dv = v.shape[-1]
  l, lq, lk, sc = block_len, query_block, key_block, code_block
  nr, g = t // l, h // hk
  tiles = dict(value_block=value_block, query_block=lq, key_block=lk, code_block=sc)
  statics = dict(n_code=s, compressive=compressive, block_len=l, tiles=tiles)
  plan, z_prev, mean, count, log_count = gpu_parallel.block_caches(z, v, carry, segments, block_len=l, n_code=s)
  heads = lambda x: x.transpose(0, 2, 1, 3)
  window = lambda x, carried: jnp.concatenate([carried.astype(x.dtype), x], axis=1)
  g_hm = heads(dout)
  d = (dout.astype(f32) * out.astype(f32)).sum(-1)[..., None].transpose(0, 2, 1, 3)  # [B,H,T,1]: dout . out
  kv_head = lambda hh: jax.lax.div(hh, g)
  whole = lambda shape, kv=False: pl.BlockSpec(
    (None, None) + shape, lambda bb, hh, *_: (bb, kv_head(hh) if kv else hh, 0, 0)
  )
  per_row = lambda shape: pl.BlockSpec((None, None) + shape, lambda bb, hh, *_: (bb, 0, 0, 0))

  def declare(cache_block):
    """The inputs, whole per (batch, head), the cache of the block `cache_block(program ids)` names."""
    inputs = toolkit.Inputs()
    inputs.add("q", heads(q), whole((t, dk)))
    inputs.add("g", g_hm, whole((t, dv)))
    inputs.add("lse", lse, whole((t, 1)))
    inputs.add("d", d, whole((t, 1)))
    inputs.add("k", heads(window(k_hat, carry["k"])), whole((t + l, dk), kv=True))
    inputs.add("v", heads(window(v, carry["v"])), whole((t + l, dv), kv=True))
    inputs.add("z_row", window(z, carry["z"]).transpose(0, 2, 1)[:, :, None, :], whole((1, t + l), kv=True))
    inputs.add("codebook", codebook, pl.BlockSpec((None, s, dk), lambda bb, hh, *_: (kv_head(hh), 0, 0)))
    at_cache = lambda bb, hh, *ids: (bb, cache_block(*ids), kv_head(hh), 0, 0)
    inputs.add("mean", mean[:, :nr], pl.BlockSpec((None, None, None, s, dv), at_cache))
    inputs.add("log_count", log_count, pl.BlockSpec((None, None, None, 1, s), at_cache))
    if bias is not None:  # [B,R,Hk,G,L,2L] -> [B,H,T,2L]
      inputs.add("bias", bias.transpose(0, 2, 3, 1, 4, 5).reshape(b, h, t, 2 * l), whole((t, 2 * l)))
    if plan is not None:  # one row of ids per batch row, whatever the head
      inputs.add("q_seg", plan["seg"].reshape(b, 1, t, 1), per_row((t, 1)))
      inputs.add("reads", plan["reads"].astype(f32).reshape(b, 1, t, 1), per_row((t, 1)))
      inputs.add("k_seg", window(segments.astype(jnp.int32), carry["seg"]).reshape(b, 1, 1, t + l), per_row((1, t + l)))
    return inputs

  def call(kernel, inputs, outputs, grid, name, pairs, per_pair, exps, **kw):
    """The kernel's call, declaring `pairs` (query, key or code) scores at `per_pair` FLOPs and `exps` exps,
    and what it reads and writes (each input once: its tiles are read about once per program row)."""
    flops = 2 * pairs * per_pair
    return outputs.named(
      pl.pallas_call(
        functools.partial(kernel, names=toolkit.ref_names(inputs, outputs), **statics, **kw),
        out_shape=outputs.shapes,
        grid=grid,
        in_specs=inputs.specs,
        out_specs=outputs.specs,
        compiler_params=toolkit.compiler_params(len(grid), sequential=False, kernel="vq_attention_backward"),
        interpret=interpret,
        name=name,
        cost_estimate=toolkit.cost_estimate(flops, exps, [*inputs.arrays, *outputs.shapes]),
      )(*inputs.arrays)
    )

  tile = lambda shape, index: pl.BlockSpec((None, None) + shape, index)
  # dq and dbias: a program per query tile
  inputs = declare(lambda rr, qq: rr)
  outputs = toolkit.Outputs()
  queries = lambda bb, hh, rr, qq: (bb, hh, rr * (l // lq) + qq, 0)
  outputs.add("dq", jax.ShapeDtypeStruct((b, h, t, dk), q.dtype), tile((lq, dk), queries))  # each row written once
  if bias is not None:
    outputs.add("dbias", jax.ShapeDtypeStruct((b, h, t, 2 * l), f32), tile((lq, 2 * l), queries))
  # each query scores about 1.5 L keys and S codes (Dk), then g . v (Dv) and dq (Dk)
  keys, codes_read = b * h * t * (l + l // 2), b * h * t * (s if compressive else 0)
  pairs = keys + codes_read
  grads = call(_dq_kernel, inputs, outputs, (b, h, nr, l // lq), "vq_attention_dq", pairs, 2 * dk + dv, pairs)

  # dk and the codebook's gradient, then dv and dmean: a program per key tile or code tile (and value tile)
  n_key, n_code_tiles = l // lk, s // sc
  for values in (False, True):
    codes = compressive and (grad_through_cache or not values)
    grid = (b, h, nr + 1 + (nr if codes else 0), max(n_key, n_code_tiles if codes else 0))
    grid += (dv // value_block,) if values else ()
    width, tiled = (value_block, lambda jj: jj) if values else (dk, lambda: 0)
    inputs = declare(lambda w, n, *_: jnp.maximum(w - nr - 1, 0))
    outputs = toolkit.Outputs()
    key_at = lambda bb, hh, w, n, *jj: (bb, hh, jnp.minimum(w, nr) * n_key + jnp.minimum(n, n_key - 1), tiled(*jj))
    outputs.add(
      "dv" if values else "dk",
      # one program writes a key tile whole: in the keys' type unless a group's query heads are summed after
      jax.ShapeDtypeStruct((b, h, t + l, dv if values else dk), (v if values else k_hat).dtype if g == 1 else f32),
      tile((lk, width), key_at),
    )
    if codes:
      code_at = lambda bb, hh, w, n, *jj: (
        bb,
        hh,
        jnp.maximum(w - nr - 1, 0),
        jnp.minimum(n, n_code_tiles - 1),
        tiled(*jj),
      )
      outputs.add(
        "dmean" if values else "dcodebook",
        jax.ShapeDtypeStruct((b, h, nr, s, dv if values else dk), f32),
        pl.BlockSpec((None, None, None, sc, width), code_at),
      )
    name = "vq_attention_dv" if values else "vq_attention_dk"
    # the same pairs (the previous block's only through the cache), scored again in each value tile for dv,
    # then p^T g; or g . v and dS^T q
    pairs = (keys if grad_through_cache else b * h * t * l // 2) + (codes_read if codes else 0)
    tiles_v = dv // value_block if values else 1
    per_pair = dk * tiles_v + dv if values else 2 * dk + dv
    grads.update(
      call(
        _column_kernel, inputs, outputs, grid, name, pairs, per_pair, pairs * tiles_v, through_cache=grad_through_cache
      )
    )

  per_kv_head = lambda x: x.reshape((x.shape[0], hk, g) + x.shape[2:]).sum(2)  # [B,H,..] -> [B,Hk,..]
  dk_win, dv_win = (heads(per_kv_head(grads[n])) for n in ("dk", "dv"))  # [B,T+L,Hk,.]
  result = {
    "q": heads(grads["dq"]),
    "k_hat": dk_win[:, l:],
    "v": dv_win[:, l:],
    "carry_k": dk_win[:, :l],
    "carry_v": dv_win[:, :l],
    "carry_mean": jnp.zeros_like(carry["mean"], f32),
    "codebook": jnp.zeros((hk, s, dk), f32),
    "bias": None,
  }
  if compressive:
    result["codebook"] = per_kv_head(grads["dcodebook"].sum((0, 2))[None])[0]
  if compressive and grad_through_cache:  # the cache's share: XLA's prefix differentiated
    dmean = per_kv_head(grads["dmean"]).transpose(0, 2, 1, 3, 4)  # [B,R,Hk,S,Dv]
    z_fold, reset = reference.fold_codes(z_prev, plan, n_code=s)
    dv_prev, result["carry_mean"] = _cache_adjoint(dmean, count, z_fold, reset, carry["count"])
    result["carry_v"] = result["carry_v"] + dv_prev[:, 0]
    later = dv_prev[:, 1:].reshape(b, t - l, hk, dv)  # blocks 0 .. R - 2 as previous blocks
    result["v"] = result["v"] + jnp.concatenate([later, jnp.zeros_like(result["v"][:, :l])], axis=1)
  if bias is not None:  # [B,H,T,2L] -> [B,R,Hk,G,L,2L]
    result["bias"] = grads["dbias"].reshape(b, hk, g, nr, l, 2 * l).transpose(0, 3, 1, 2, 4, 5)
  return result


def _cache_adjoint(dmean, count, z_fold, reset, carry_count) -> tuple[Array, Array]:
  """The gradient of `reference.cache_variables`' means, dmean [B,R,Hk,S,Dv] (the cache after the last block
  has none), to its previous blocks' values [B,R,L,Hk,Dv] and the carried means [B,Hk,S,Dv]. With the counts
  constant, block r's cache is mean_r = (the sums folded since the last restart) / max(count_r, 1), linear in
  the values: the adjoint of fold n's sums is T_n = dmean_n / max(count_n, 1) + T_{n+1} (0 across a restart),
  a scan from the last block to the first, and a key of fold n receives T_n at its code (code S: nothing);
  the carried means, count0 T_0. Per step only a block's [L,Hk,Dv] leaves the scan, never a cache per block."""
  nr = dmean.shape[1]
  scaled = dmean / jnp.maximum(count[:, :nr], 1.0)[..., None]  # [B,R,Hk,S,Dv]
  # restart flags: T_n adds T_{n+1} unless fold n + 1 restarts the prefix
  goes_on = ~reset[:, 1:]  # [B,R]: fold n + 1 keeps what came before it

  def step(later, x):
    d_n, goes_on_n, z_n = x  # [B,Hk,S,Dv], [B], [B,L,Hk] (fold n's codes; n >= 1)
    t_n = d_n + jnp.where(goes_on_n[:, None, None, None], later, 0.0)
    padded = jnp.concatenate([t_n, jnp.zeros_like(t_n[:, :, :1])], axis=2)  # code S reads a zero row
    dv = jnp.take_along_axis(padded, z_n.transpose(0, 2, 1)[..., None], axis=2)  # [B,Hk,L,Dv]
    return t_n, dv.transpose(0, 2, 1, 3)

  # fold n >= 1 (read by blocks n .. R - 1 until a restart) holds block n - 1's previous block, z_fold[:, n - 1]
  xs = (jnp.moveaxis(scaled, 1, 0), jnp.moveaxis(goes_on, 1, 0), jnp.moveaxis(jnp.roll(z_fold, 1, axis=1), 1, 0))
  t0, dv = jax.lax.scan(step, jnp.zeros_like(scaled[:, 0]), xs, reverse=True)
  dv = jnp.moveaxis(dv, 0, 1)  # [B,R,L,Hk,Dv] by fold; fold 0 is the carried cache (no keys), fold R none read
  return jnp.concatenate([dv[:, 1:], jnp.zeros_like(dv[:, :1])], axis=1), carry_count[..., None] * t0
