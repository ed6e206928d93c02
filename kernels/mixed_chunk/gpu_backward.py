"""FLASH's mixed chunk attention, its gradient on the parallel driver (GPU): every chunk at once, as the
forward (kernels/mixed_chunk/gpu_parallel.py) attends them, from the states XLA's prefix gives each chunk.
kernels/mixed_chunk/pallas.py wires it into `jax.custom_vjp`; the XLA form's VJP is the tests' oracle.

With g the output's cotangent, dW_ij = g_i . v_j and w(s) the local weights of s = quad_scale qq_i . qk_j +
bias_ij (kernels/mixed_chunk/grid_backward.py has the same algebra, carried instead of precomputed):

  local   dS = dW w'(s) (softmax: w (dW - delta_i), delta_i = sum_j w_ij dW_ij), dqq = quad_scale dS qk,
          dqk = quad_scale dS^T qq, dbias = sum dS, dv += w^T g;
  own     (non-causal documents) the same with the linear kernel, lin_scale and the per-query oscale;
  global  chunk g reads X_g (read_i lq_i X_g): dlq_i = read_i g_i X_g^T, and its keys receive the adjoint
          T_g of the sum they enter: dlk_j = col_j lin_scale v_j T_g^T, dv_j += col_j lin_scale lk_j T_g.

XLA computes the states as the forward does and the adjoints as the same prefix run the other way over
A_g = sum_i read_i lq_i^T g_i (`_states`: one product for every X, one for every A). Triton keeps a
program's working set in registers, so no product runs over all of E: g . v sums the value tiles in a
loop, and dv takes a program per value tile. Three calls, every grid axis parallel:

  "mixed_chunk_dq"  `_dq_kernel`, (B, H, G, C/Cq): a query tile against its chunk's key tiles: dqq, dlq, and
                    for softmax each query's log-normaliser and delta (a first pass of online statistics).
  "mixed_chunk_dk"  `_dk_kernel`, (B, H, G, C/Ck): a key tile against the query tiles: dqk, dlk, and the
                    bias's gradient per chunk.
  "mixed_chunk_dv"  `_dv_kernel`, (B, H, G, C/Ck, E/Et): dv.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import per_device, toolkit
from lra_core.kernels.mixed_chunk import gpu_parallel, reference

Array = jax.Array
f32 = jnp.float32
MASK = gpu_parallel.MASK
ROWS = ("row", "kdoc")  # [B,1,T]
COLUMNS = ("qdoc", "read", "read2", "oscale", "acol", "acol2", "lse", "delta")  # [B,T,1] ([B,H,T,1]: lse, delta)
READS = (("kv", "read"), ("kv2", "read2"))  # a state and the factor its readers take it with
ADJOINTS = (("dkv", "acol"), ("dkv2", "acol2"))  # an adjoint and the keys that enter its sum


class _Chunk:
  """What a program reads of its chunk: tiles of queries and keys, their scores and weights, g . v."""

  def __init__(self, x: dict, gg, *, statics: dict, tiles: dict):
    self.x, self.s = x, statics
    self.c, self.cq, self.ck, self.et = statics["chunk"], tiles["query_block"], tiles["key_block"], tiles["value_block"]
    self.sb = tiles["state_block"]
    self.base = gg * self.c
    self.cast = (lambda a: a.astype(f32)) if statics["upcast"] else (lambda a: a)

  def queries(self, qi):
    return pl.ds(self.base + qi * self.cq, self.cq)

  def keys(self, k):
    return pl.ds(self.base + k * self.ck, self.ck)

  def mask(self, qi, k, *, local: bool):
    """[Cq,Ck] allowed pairs (None: all): real keys; causal and (with segments) documents in the local part,
    documents in the own-chunk term."""
    x, cq, ck = self.x, self.cq, self.ck
    mask = None if "row" not in x else jnp.broadcast_to(x["row"][:, self.keys(k)] > 0, (cq, ck))
    parts = []
    if local and self.s["causal"]:
      rows = qi * cq + jax.lax.broadcasted_iota(jnp.int32, (cq, ck), 0)
      parts.append(k * ck + jax.lax.broadcasted_iota(jnp.int32, (cq, ck), 1) <= rows)
    if "qdoc" in x and (self.s["local_documents"] or not local):
      parts.append(x["qdoc"][self.queries(qi), :] == x["kdoc"][:, self.keys(k)])
    for part in parts:
      mask = part if mask is None else mask & part
    return mask

  def scores(self, qi, k):
    """The local part's scores [Cq,Ck] (float32, bias in) and its mask."""
    x = self.x
    scores = toolkit.dot(self.cast(x["qq"][self.queries(qi), :]), self.cast(x["qk"][self.keys(k), :]), (1, 1))
    scores = scores * self.s["quad_scale"]
    if "bias" in x:
      scores = scores + x["bias"][pl.ds(qi * self.cq, self.cq), pl.ds(k * self.ck, self.ck)].astype(f32)
    return scores, self.mask(qi, k, local=True)

  def local(self, qi, k, lse=None):
    """(scores, weights, mask) of the local part, [Cq,Ck]; softmax weights from lse [Cq,1] (by default the
    saved one)."""
    x, kernel = self.x, self.s["kernel"]
    scores, mask = self.scores(qi, k)
    if kernel == "relu2":
      weights = jnp.square(jnp.maximum(scores, 0.0))
    elif kernel == "softmax":
      lse = x["lse"][self.queries(qi), :] if lse is None else lse
      weights = jnp.exp(jnp.minimum(scores - lse, 0.0))  # bounded where a pair is masked
    else:
      weights = scores
    return scores, weights if mask is None else jnp.where(mask, weights, 0.0), mask

  def own(self, qi, k):
    """The own-chunk term's weights [Cq,Ck] (lin_scale lq . lk inside the query's document, real keys) and
    their mask."""
    x = self.x
    scores = toolkit.dot(x["lq"][self.queries(qi), :].astype(f32), x["lk"][self.keys(k), :].astype(f32), (1, 1))
    mask = self.mask(qi, k, local=False)
    return jnp.where(mask, scores * self.s["lin_scale"], 0.0), mask

  def gv(self, qi, k):
    """g_i . v_j over every value column, a tile of Et at a time: [Cq,Ck]."""
    rows, cols = self.queries(qi), self.keys(k)

    def tile(jt, acc):
      at = pl.ds(jt * self.et, self.et)
      return acc + toolkit.dot(self.x["g"][rows, at].astype(f32), self.x["v"][cols, at].astype(f32), (1, 1))

    return jax.lax.fori_loop(0, self.x["g"].shape[-1] // self.et, tile, jnp.zeros((self.cq, self.ck), f32))

  def local_ds(self, qi, k, lse=None, delta=None):
    """The local part's dS [Cq,Ck] (0 where not allowed); softmax reads lse and delta [Cq,1] (by default the
    saved ones)."""
    scores, weights, mask = self.local(qi, k, lse)
    dw = self.gv(qi, k)
    kernel = self.s["kernel"]
    if kernel == "relu2":
      ds = dw * 2.0 * jnp.maximum(scores, 0.0)
    elif kernel == "softmax":
      ds = weights * (dw - (self.x["delta"][self.queries(qi), :] if delta is None else delta))
    else:
      ds = dw
    return ds if mask is None else jnp.where(mask, ds, 0.0)

  def own_ds(self, qi, k):
    """The own-chunk term's dS [Cq,Ck], lin_scale and oscale in."""
    _, mask = self.own(qi, k)
    dw = self.gv(qi, k) * self.x["oscale"][self.queries(qi), :]
    return jnp.where(mask, dw * self.s["lin_scale"], 0.0)

  def diagonal_keys(self, qi):
    """The key tiles a query tile's local part reads: up to the diagonal when causal."""
    return jax.lax.div((qi + 1) * self.cq + self.ck - 1, self.ck) if self.s["causal"] else self.c // self.ck

  def diagonal_queries(self, k):
    """The first query tile that reads key tile k in the local part."""
    return jax.lax.div(k * self.ck, self.cq) if self.s["causal"] else 0

  def state_product(self, rows, n: int, name: str, other: str):
    """x[other][rows] . state^T over every value column, `state_block` columns at a time: [n, S] (state [S,E]
    of this chunk; a whole [S,Et] float32 tile would take as many registers as the rest of the program)."""
    x, width = self.x, self.sb

    def tile(jt, acc):
      at = pl.ds(jt * width, width)
      return acc + toolkit.dot(x[other][rows, at].astype(f32), x[name][:, at], (1, 1))

    zeros = jnp.zeros((n, x[name].shape[0]), f32)
    return jax.lax.fori_loop(0, x[other].shape[-1] // width, tile, zeros)


def _dq_kernel(*refs, names, statics: dict, tiles: dict):
  """Grid (B, H, G, C/Cq): one query tile."""
  x, out = toolkit.named_refs(refs, *names)
  ch = _Chunk(x, pl.program_id(2), statics=statics, tiles=tiles)
  qi = pl.program_id(3)
  rows = ch.queries(qi)
  last = ch.diagonal_keys(qi)
  if "qq" in x:
    if statics["kernel"] == "softmax":  # each query's log-normaliser and delta, online over the key tiles

      def stats(k, carry):
        top, total, delta = carry
        scores, mask = ch.scores(qi, k)
        scores = scores if mask is None else jnp.where(mask, scores, -MASK)
        new_top = jnp.maximum(top, scores.max(-1, keepdims=True))
        p = jnp.exp(scores - new_top)
        p = p if mask is None else jnp.where(mask, p, 0.0)
        rescale = jnp.exp(top - new_top)
        total = total * rescale + p.sum(-1, keepdims=True)
        delta = delta * rescale + (p * ch.gv(qi, k)).sum(-1, keepdims=True)
        return new_top, total, delta

      init = (jnp.full((ch.cq, 1), -MASK, f32), jnp.zeros((ch.cq, 1), f32), jnp.zeros((ch.cq, 1), f32))
      top, total, delta = jax.lax.fori_loop(0, last, stats, init)
      safe = jnp.where(total > 0, total, 1.0)  # a query with no allowed key: weights 0 whatever lse is
      lse, delta = top + jnp.log(safe), delta / safe
      out["lse"][...], out["delta"][...] = lse, delta
    else:
      lse = delta = None

    def local(k, dq):
      return dq + toolkit.dot(ch.local_ds(qi, k, lse, delta), x["qk"][ch.keys(k), :].astype(f32))

    dq = jax.lax.fori_loop(0, last, local, jnp.zeros((ch.cq, x["qq"].shape[-1]), f32))
    out["dqq"][...] = (dq * statics["quad_scale"]).astype(out["dqq"].dtype)
  if "dlq" in out:
    dlq = jnp.zeros((ch.cq, x["lq"].shape[-1]), f32)
    if "oscale" in x:
      own = lambda k, acc: acc + toolkit.dot(ch.own_ds(qi, k), x["lk"][ch.keys(k), :].astype(f32))
      dlq = jax.lax.fori_loop(0, ch.c // ch.ck, own, dlq)
    for state, factor in READS:
      if state in x:
        part = ch.state_product(rows, ch.cq, state, "g")
        dlq = dlq + (part if factor not in x else part * x[factor][rows, :])
    out["dlq"][...] = dlq.astype(out["dlq"].dtype)


def _dk_kernel(*refs, names, statics: dict, tiles: dict):
  """Grid (B, H, G, C/Ck): one key tile."""
  x, out = toolkit.named_refs(refs, *names)
  ch = _Chunk(x, pl.program_id(2), statics=statics, tiles=tiles)
  k = pl.program_id(3)
  cols = ch.keys(k)
  n_q = ch.c // ch.cq
  if "qq" in x:
    if "dbias" in out:
      out["dbias"][...] = jnp.zeros(out["dbias"].shape, f32)  # the query tiles before the diagonal stay 0

    def local(qi, dk):
      ds = ch.local_ds(qi, k)
      if "dbias" in out:
        out["dbias"][pl.ds(qi * ch.cq, ch.cq), :] = ds
      return dk + toolkit.dot(ds, x["qq"][ch.queries(qi), :].astype(f32), (0, 0))

    dk = jax.lax.fori_loop(ch.diagonal_queries(k), n_q, local, jnp.zeros((ch.ck, x["qk"].shape[-1]), f32))
    out["dqk"][...] = (dk * statics["quad_scale"]).astype(out["dqk"].dtype)
  if "dlk" in out:
    dlk = jnp.zeros((ch.ck, x["lk"].shape[-1]), f32)
    if "oscale" in x:
      own = lambda qi, acc: acc + toolkit.dot(ch.own_ds(qi, k), x["lq"][ch.queries(qi), :].astype(f32), (0, 0))
      dlk = jax.lax.fori_loop(0, n_q, own, dlk)
    for state, keys in ADJOINTS:
      if state in x:
        part = ch.state_product(cols, ch.ck, state, "v") * statics["lin_scale"]
        dlk = dlk + (part if keys not in x else jnp.where(x[keys][cols, :] > 0, part, 0.0))
    out["dlk"][...] = dlk.astype(out["dlk"].dtype)


def _dv_kernel(*refs, names, statics: dict, tiles: dict):
  """Grid (B, H, G, C/Ck, E/Et): one key tile's value tile."""
  x, out = toolkit.named_refs(refs, *names)
  ch = _Chunk(x, pl.program_id(2), statics=statics, tiles=tiles)
  k, jt = pl.program_id(3), pl.program_id(4)
  cols, at = ch.keys(k), pl.ds(jt * ch.et, ch.et)
  n_q = ch.c // ch.cq
  dv = jnp.zeros((ch.ck, ch.et), f32)
  if "qq" in x:

    def local(qi, acc):
      _, weights, _ = ch.local(qi, k)
      rounded = weights.astype(x["v"].dtype).astype(f32)  # as the forward rounds them for its product
      return acc + toolkit.dot(rounded, x["g"][ch.queries(qi), at].astype(f32), (0, 0))

    dv = jax.lax.fori_loop(ch.diagonal_queries(k), n_q, local, dv)
  if "oscale" in x:

    def own(qi, acc):
      weights, _ = ch.own(qi, k)
      rows = ch.queries(qi)
      return acc + toolkit.dot(weights * x["oscale"][rows, :], x["g"][rows, at].astype(f32), (0, 0))

    dv = jax.lax.fori_loop(0, n_q, own, dv)
  for state, keys in ADJOINTS:
    if state in x:
      part = toolkit.dot(x["lk"][cols, :].astype(f32), x[state][:, at]) * statics["lin_scale"]
      dv = dv + (part if keys not in x else jnp.where(x[keys][cols, :] > 0, part, 0.0))
  out["dv"][...] = dv.astype(out["dv"].dtype)


# -- the states ----------------------------------------------------------------------------------------------


def _sums(weighted: Array, other: Array, chunk: int) -> Array:
  """Per chunk, sum over its rows of weighted^T other: weighted [N,B,H,T,S] (N sums at once, one product),
  other [B,H,T,E] -> float32 [N,B,H,G,S,E]."""
  n, b, h, t, s = weighted.shape
  g, e = t // chunk, other.shape[-1]
  return jnp.einsum(
    "nbhgcs,bhgce->nbhgse",
    weighted.reshape(n, b, h, g, chunk, s),
    other.reshape(b, h, g, chunk, e),
    preferred_element_type=f32,
  )


def _running(sums: Array, restart: Array | None, *, reverse: bool) -> Array:
  """The state each chunk reads from per-chunk sums [B,H,G,S,E]: the chunks before it (after it when
  `reverse`), restarting where restart [B,G] is 0 (`reference.carried_sums`); None: no restarts."""
  b, h, g = sums.shape[:3]
  if restart is None:
    zero = jnp.zeros_like(sums[:, :, :1])
    if reverse:
      return jnp.concatenate([jnp.flip(jnp.cumsum(jnp.flip(sums[:, :, 1:], 2), 2), 2), zero], axis=2)
    return jnp.concatenate([zero, jnp.cumsum(sums[:, :, :-1], axis=2)], axis=2)
  flat = sums.reshape((b * h, g) + sums.shape[3:])
  return reference.carried_sums(flat, jnp.repeat(restart, h, axis=0), reverse=reverse).reshape(sums.shape)


def _states(lin, v, g, layout, keep, *, chunk: int, causal: bool, lin_scale: float) -> dict[str, Array]:
  """The states the chunks read (kv, kv2) and the adjoints their keys receive (dkv, dkv2), with the per-query
  and per-key factors (read, read2, acol, acol2): [B,H,G,S,E] float32 ([B,H,S,E] for the non-causal total)."""
  lq, lk = lin
  if toolkit.platform() == "cpu":  # interpret mode: XLA:CPU has no bfloat16 x bfloat16 -> float32 product for
    # every layout it picks; float32 operands give the same sums (bfloat16 products are exact in float32)
    lq, lk, v, g = (x.astype(f32) for x in (lq, lk, v, g))
  b, h, t = v.shape[:3]
  column = lambda x: x.reshape(b, t)[:, :, None]  # [B,G,C] -> [B,T,1]
  weigh = lambda x, w: jnp.where(w[:, None, :, None] > 0, x, jnp.zeros_like(x))  # keys by [B,T] weight
  if layout is None:
    keys = lk if keep is None else weigh(lk, keep)
    factors = {} if keep is None else dict(acol=keep[:, :, None])
    if not causal:  # the total and its adjoint
      total = jnp.einsum("bhts,bhte->bhse", keys, v, preferred_element_type=f32) * lin_scale
      adjoint = jnp.einsum("bhts,bhte->bhse", lq, g, preferred_element_type=f32)
      return dict(kv=total, dkv=adjoint, **factors)
    x = _sums(keys[None], v, chunk)[0] * lin_scale
    a = _sums(lq[None], g, chunk)[0]
    return dict(kv=_running(x, None, reverse=False), dkv=_running(a, None, reverse=True), **factors)
  read = layout["fwd_read"] * layout["scale"]
  sides = [("fwd_w", "fwd_keep", read)]
  if not causal:
    sides.append(("bwd_w", "bwd_keep", layout["bwd_read"] * layout["scale"]))
  x = _sums(jnp.stack([weigh(lk, layout[w].reshape(b, t)) for w, _, _ in sides]), v, chunk) * lin_scale
  a = _sums(jnp.stack([lq * r.reshape(b, 1, t, 1) for _, _, r in sides]), g, chunk)
  out = {}
  for i, (w, keep_name, r) in enumerate(sides):
    suffix = "" if i == 0 else "2"
    out["kv" + suffix] = _running(x[i], layout[keep_name], reverse=i == 1)
    out["dkv" + suffix] = _running(a[i], layout[keep_name], reverse=i == 0)
    out["read" + suffix], out["acol" + suffix] = column(r), column(layout[w])
  return out


# -- the driver ---------------------------------------------------------------------------------------------


def backward(
  args: dict[str, Array],
  *,
  chunk: int,
  causal: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  local_documents: bool,
  upcast: bool,
  interpret: bool,
  tiles: dict,
) -> dict[str, Array]:
  """The three calls on one device's head-major operands (qq, qk, lq, lk [B,H,T,S]; v, g [B,H,T,E]; the
  states of `_states`; ROWS [B,1,T]; COLUMNS [B,T,1]; bias [C,C]) -> dqq, dqk, dlq, dlk, dv head-major
  (where their inputs are) and dbias [B,H,G,C,C] float32."""
  b, h, t, e = args["v"].shape
  c, cq, ck, et = chunk, tiles["query_block"], tiles["key_block"], tiles["value_block"]
  g_count = t // c
  statics = dict(
    chunk=c,
    causal=causal,
    kernel=kernel,
    quad_scale=quad_scale,
    lin_scale=lin_scale,
    local_documents=local_documents,
    upcast=upcast,
  )
  local, own = "qq" in args, "oscale" in args
  reads = any(s in args for s, _ in READS)
  adjoints = any(s in args for s, _ in ADJOINTS)
  sq = args["qq"].shape[-1] if local else 0
  sl = args["lq"].shape[-1] if "lq" in args else 0

  def declare(values: dict) -> toolkit.Inputs:
    inputs = toolkit.Inputs()
    for n, a in values.items():
      if n == "bias":
        spec = pl.BlockSpec((c, c), lambda *_: (0, 0))
      elif n in ("lse", "delta"):
        spec = pl.BlockSpec((None, None, t, 1), lambda bb, hh, *_: (bb, hh, 0, 0))
      elif n in ROWS + COLUMNS:
        spec = pl.BlockSpec((None,) + a.shape[1:], lambda bb, hh, *_: (bb, 0, 0))
      elif a.ndim == 5:  # a state per chunk
        spec = pl.BlockSpec((None, None, None) + a.shape[3:], lambda bb, hh, gg, *_: (bb, hh, gg, 0, 0))
      else:  # whole per (batch, head): [T,.] operands, or the non-causal [S,E] total
        spec = pl.BlockSpec((None, None) + a.shape[2:], lambda bb, hh, *_: (bb, hh, 0, 0))
      inputs.add(n, a, spec)
    return inputs

  def call(kernel_fn, inputs, outputs, grid, name, flops, exps):
    return outputs.named(
      pl.pallas_call(
        functools.partial(kernel_fn, names=toolkit.ref_names(inputs, outputs), statics=statics, tiles=tiles),
        out_shape=outputs.shapes,
        grid=grid,
        in_specs=inputs.specs,
        out_specs=outputs.specs,
        compiler_params=toolkit.compiler_params(len(grid), sequential=False, kernel="mixed_chunk_backward"),
        interpret=interpret,
        name=name,
        cost_estimate=toolkit.cost_estimate(flops, exps, [*inputs.arrays, *outputs.shapes]),
      )(*inputs.arrays)
    )

  # pairs a query tile scores in its chunk (causal: about half), and the products per pair
  pairs = b * h * t * (c // 2 + ck // 2 if causal else c)
  own_pairs = b * h * t * c * own
  softmax = local and kernel == "softmax"
  per_state = 2 * b * h * t * sl * e
  tile = lambda shape, index: pl.BlockSpec((None, None) + shape, index)
  queries = lambda bb, hh, gg, qq: (bb, hh, gg * (c // cq) + qq, 0)
  keys = lambda bb, hh, gg, kk, *_: (bb, hh, gg * (c // ck) + kk, 0)
  grads: dict[str, Array] = {}

  outputs = toolkit.Outputs()
  if local:
    outputs.add("dqq", jax.ShapeDtypeStruct(args["qq"].shape, args["qq"].dtype), tile((cq, sq), queries))
  if reads or own:
    outputs.add("dlq", jax.ShapeDtypeStruct(args["lq"].shape, args["lq"].dtype), tile((cq, sl), queries))
  if softmax:
    for n in ("lse", "delta"):
      outputs.add(n, jax.ShapeDtypeStruct((b, h, t, 1), f32), tile((cq, 1), queries))
  if outputs.shapes:
    dq_flops = 2 * pairs * (sq + e) * (1 + softmax) + 2 * pairs * sq + own_pairs * 2 * (e + sl) + per_state * reads
    got = call(_dq_kernel, declare(args), outputs, (b, h, g_count, c // cq), "mixed_chunk_dq", dq_flops, pairs * 2)
    grads.update(got)
  later = dict(args, **{n: grads[n] for n in ("lse", "delta") if n in grads})

  outputs = toolkit.Outputs()
  if local:
    outputs.add("dqk", jax.ShapeDtypeStruct(args["qk"].shape, args["qk"].dtype), tile((ck, sq), keys))
    if "bias" in args:
      whole = pl.BlockSpec((None, None, None, c, ck), lambda bb, hh, gg, kk: (bb, hh, gg, 0, kk))
      outputs.add("dbias", jax.ShapeDtypeStruct((b, h, g_count, c, c), f32), whole)
  if adjoints or own:
    outputs.add("dlk", jax.ShapeDtypeStruct(args["lk"].shape, args["lk"].dtype), tile((ck, sl), keys))
  if outputs.shapes:
    dk_flops = 2 * pairs * (2 * sq + e) + own_pairs * 2 * (2 * sl + e) + per_state * adjoints
    got = call(_dk_kernel, declare(later), outputs, (b, h, g_count, c // ck), "mixed_chunk_dk", dk_flops, pairs)
    grads.update(got)

  outputs = toolkit.Outputs()
  value_tiles = lambda bb, hh, gg, kk, jj: (bb, hh, gg * (c // ck) + kk, jj)
  outputs.add("dv", jax.ShapeDtypeStruct(args["v"].shape, args["v"].dtype), tile((ck, et), value_tiles))
  tiles_e = e // et
  dv_flops = 2 * pairs * (sq * tiles_e + e) + own_pairs * 2 * (sl * tiles_e + e) + per_state * adjoints
  grid = (b, h, g_count, c // ck, tiles_e)
  grads.update(call(_dv_kernel, declare(later), outputs, grid, "mixed_chunk_dv", dv_flops, pairs * tiles_e))
  return {n: x for n, x in grads.items() if n not in ("lse", "delta")}


def gradients(
  local: dict[str, Array],
  lin: tuple[Array, Array] | None,
  layout: dict[str, Array] | None,
  g: Array,
  *,
  keep: Array | None,
  documents: dict[str, Array],
  chunk: int,
  causal: bool,
  lin_scale: float,
  **statics,
) -> dict[str, Array]:
  """The parallel driver's gradient, per device: the forward's operands (`gpu_parallel.attention`'s local, lin,
  layout, keep, documents) and g, the output's cotangent head-major [B,H,T,E] -> dqq, dqk, dlq, dlk, dv
  head-major and dbias [C,C] float32 (each where its input is)."""
  args = dict(local, g=g)
  b, h = g.shape[:2]
  if lin is not None:
    args.update(lq=lin[0], lk=lin[1])
    args.update(_states(lin, local["v"], g, layout, keep, chunk=chunk, causal=causal, lin_scale=lin_scale))
    if layout is not None and not causal:  # the own-chunk term
      args.update(row=keep[:, None, :], oscale=layout["scale"].reshape(b, -1)[:, :, None], **documents)
  run = functools.partial(backward, chunk=chunk, causal=causal, lin_scale=lin_scale, **statics)
  dims = {n: "b.." if n in ROWS + COLUMNS else ".." if n == "bias" else "bh.." for n in args}
  names = tuple(n for n in ("dqq", "dqk", "dlq", "dlk", "dv", "dbias") if n in _written(args))
  got = per_device.run_per_device(
    functools.partial(toolkit.picked, run, names), (args,), (dims,), tuple("bh.." for _ in names), batch=b, heads=h
  )
  grads = dict(zip(names, got, strict=True))
  if "dbias" in grads:
    grads["dbias"] = grads["dbias"].sum((0, 1, 2))
  return grads


def _written(args: dict) -> tuple[str, ...]:
  """What `backward` writes for these operands."""
  local, own = "qq" in args, "oscale" in args
  reads = any(s in args for s, _ in READS)
  adjoints = any(s in args for s, _ in ADJOINTS)
  wanted = dict(dqq=local, dqk=local, dlq=reads or own, dlk=adjoints or own, dv=True, dbias=local and "bias" in args)
  return tuple(n for n, want in wanted.items() if want)
