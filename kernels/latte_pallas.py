"""Latte as Pallas kernels: one scan over time blocks per (batch, head), its state on chip.

Both kernels walk the time blocks of one (batch, head) in order with a small carried state per
latent l, the stable pair of eq. 12 scaled by the running max m of the key logits (Appendix B.2):

  num [D,L] = sum_s exp(k_sl - m_l) v_s     (kept transposed: every per-latent vector is a row [1,L])
  den [1,L] = sum_s exp(k_sl - m_l)          max [1,L] = m_l

Causal (`causal_latte`): block r of C tokens reads p = softmax_l(q) (taken in the wrapper), k and v.
Inside the block the running max m_t is per token and the weights exp(k_s - m_t), s <= t, are exact
([C,C,L], key token leading: k and v come in once more as [C,1,.] rows, see `_causal_block`); the
past enters through the state rescaled by exp(m_past - m_t) <= 1, so every exponent is <= 0
whatever the logit range, as in `kernels.latte_xla.latte_chunk`. Block output and state update:

  y = (sum_l r_tl w_tsl) v + (r * carried) num^T,   r = p / den_t           (two matmuls)
  num <- exp(m - m') num + v^T exp(k - m'),  m' = the max after the block  (one matmul)

Bidirectional (`bidirectional_latte`): the same online update reduces the whole sequence to the
summary sum_s softmax_s(k_sl) v_s = num / den per latent; masked keys are set to NEG before the
kernel, as in the reference. The final softmax_l(q) @ summary is an XLA einsum.

Packed documents (`segments`): each token carries its document's index in the row (float32, as
[C,1] and [C,1,1] rows) and a flag saying whether it continues the document of the carried state
(the wrapper derives both from the ids and the block size, `kernels.latte_xla.chunk_documents`).
Causal: the block weights and running max keep to each token's document, the carried state reaches
only the tokens that continue it, and the state after the block sums the document open at its end.
Bidirectional: the per-document max and normaliser of the keys are O(T L) XLA reductions
(`kernels.latte_xla.bidirectional_parts`), and a third kernel (`_linear_block`) runs the linear sums
y_t = sum_{s in doc(t)} (r_t . e_s) v_s over the blocks, once forward (s <= t) and once over the
reversed sequence (s > t), with the open document's sum num [D,L] as its state.

Each kernel is one block step under the two drivers of kernels/_pallas.py ("grid": the state in
scratch across the sequential block axis; "loop": a fori_loop over the blocks with the state in
loop values). Time is padded to whole blocks with keys PAD (below NEG), which weigh exactly 0, so
a fully masked row still averages its real positions as the reference does.

Backward: `jax.custom_vjp` whose backward is the VJP of the XLA chunked forms
(`kernels.latte_xla.causal_latte` / `bidirectional_latte`), recomputed from the inputs:
gradients (to q, k, v and a carried state) are the XLA path's, and so is training memory; the
kernels run the forward pass only.

Inputs of any float dtype; the kernels compute in float32 (matmuls at HIGHEST precision: no TF32
on GPU) and return v's dtype. Block sizes: the causal kernel's time block is `chunk` (its working
set is C*C*L floats per (batch, head): keep C*C*L small on GPU, where it lives in registers); the
bidirectional one is min(BLOCK, the power of two >= T). On GPU (Triton) the chunk and L should
be powers of two (D is padded to one); on TPU the chunk a multiple of 8 (16 for bf16 values).
Both kernels compile with Mosaic (scripts/check_lowering.py, docs/kernels.md); their numbers are
tested in interpret mode.

This file holds the kernels and imports the reference, kernels/latte_xla.py; kernels/latte.py checks
the arguments and dispatches between the two on `impl`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import _pallas
from lra_core.kernels import latte_xla

Array = jax.Array
f32 = jnp.float32
NEG = latte_xla.NEG
PAD = 2 * NEG  # time padding: below every key, masked ones (NEG) included
BLOCK = 128    # time block of the bidirectional reduction


def default_chunk() -> int:
  """The causal kernel's time block for the target: its C x C x L working set lives in GPU registers
  (C = 16) or TPU VMEM (C = 32, a multiple of the 8-row tiles); interpret mode (CPU) 8, as the XLA form
  on CPU."""
  return {"gpu": 16, "tpu": 32}.get(_pallas.platform(), 8)


# float32 matmuls at full precision (no TF32 on GPU): the state sums exponentials of logits
_dot = functools.partial(_pallas.dot, precision=jax.lax.Precision.HIGHEST)


# -- block steps ------------------------------------------------------------------------------------

def _causal_block(state, p: Array, k: Array, k_rows: Array, v: Array, v_rows: Array, doc: Array | None = None,
                  doc_rows: Array | None = None, cont: Array | None = None):
  """C tokens after `state` = (num [D,L], den [1,L], max [1,L]): p, k [C,L], v [C,D], and k, v once more
  one token per leading index, k_rows [C,1,L], v_rows [C,1,D] -> state, (y [C,D],). With packed
  documents: doc [C,1] and doc_rows [C,1,1] the tokens' document indices, cont [C,1] 1 where a token
  continues the state's document (else 0).

  The exact weights w[s,t,l] = exp(k_sl - m_tl), s <= t, are [Cs,Ct,L] with the key token s leading:
  each k_s and v_s enters as the broadcast of its own row, every sum over s adds whole tiles, and
  results come out [Ct,.] in the layout of p. Mosaic then moves no row of a tile to another axis (a
  sublane gather, which TPU v3 lacks; an i1 or f32 [C,L] -> [C,1,L] reshape is not supported at all).
  """
  num, den, mx = state
  k, v = k.astype(f32), v.astype(f32)
  c = k.shape[0]
  causal = (jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0)
            <= jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 1))               # [Cs,Ct,1]: s <= t
  past = mx                                                                       # [1,L] or [Ct,L]
  if doc is not None:
    causal = causal & (doc_rows == doc[None])                                     # and s in t's document
    past = jnp.where(cont > 0, mx, NEG)
  prefix = jnp.where(causal, k_rows.astype(f32), NEG)                             # [Cs,Ct,L]: k_s for s <= t
  m = jnp.maximum(past, prefix.max(0))                                            # running max [Ct,L]
  within = jnp.where(causal, jnp.exp(prefix - m), 0.0)                            # [Cs,Ct,L], <= 1
  carried = jnp.exp(past - m)                                                     # [Ct,L], <= 1
  if doc is not None:
    carried = jnp.where(cont > 0, carried, 0.0)
  r = p / (within.sum(0) + carried * den)                  # den_t >= 1: it holds the max term
  weights = (r * within).sum(-1, keepdims=True)                                   # [Cs,Ct,1]: sum_l r_tl w_stl
  y = (weights * v_rows.astype(f32)).sum(0) + _dot(r * carried, num, (1, 1))
  if doc is None:
    end = jnp.maximum(mx, k.max(0, keepdims=True))                                # m after the block [1,L]
    to_end, decay = jnp.exp(k - end), jnp.exp(mx - end)
  else:
    last, cont_last = doc == _last_row(doc), _last_row(cont) > 0                  # [C,1], [1,1]
    end = jnp.maximum(jnp.where(cont_last, mx, NEG), jnp.where(last, k, NEG).max(0, keepdims=True))  # [1,L]
    to_end = jnp.where(last, jnp.exp(jnp.where(last, k - end, 0.0)), 0.0)       # the document open at the end
    decay = jnp.where(cont_last, jnp.exp(mx - end), 0.0)
  return (decay * num + _dot(v, to_end, (0, 0)), decay * den + to_end.sum(0, keepdims=True), end), (y,)


def _linear_block(state, r: Array, e: Array, e_rows: Array, v: Array, v_rows: Array, doc: Array, doc_rows: Array,
                  cont: Array, *, strict: bool):
  """The linear sums of segmented bidirectional Latte over C tokens after state = (num [D,L],), the sum of
  e_s v_s over the open document: r, e [C,L], e_rows [C,1,L], v [C,D], v_rows [C,1,D], doc [C,1], doc_rows
  [C,1,1], cont [C,1] -> state, (y [C,D],) with y_t = sum (r_t . e_s) v_s over the earlier tokens s of t's
  document (and s = t unless `strict`)."""
  (num,) = state
  e, v = e.astype(f32), v.astype(f32)
  c = e.shape[0]
  s_index, t_index = (jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), axis) for axis in (0, 1))
  same = ((s_index < t_index) if strict else (s_index <= t_index)) & (doc_rows == doc[None])   # [Cs,Ct,1]
  weights = jnp.where(same, (r[None] * e_rows.astype(f32)).sum(-1, keepdims=True), 0.0)        # r_t . e_s
  y = (weights * v_rows.astype(f32)).sum(0) + _dot(jnp.where(cont > 0, r, 0.0), num, (1, 1))
  last = doc == _last_row(doc)
  num = jnp.where(_last_row(cont) > 0, num, 0.0) + _dot(v, jnp.where(last, e, 0.0), (0, 0))
  return (num,), (y,)


def _last_row(x: Array) -> Array:
  """The last row [1,1] of a non-negative column x [C,1], as a masked sum (Triton has no slices)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(rows == x.shape[0] - 1, x, 0.0).sum(0, keepdims=True)


def _summary_block(state, k: Array, v: Array):
  """The online softmax-over-time sums: state (num [D,L], den [1,L], max [1,L]), k [C,L], v [C,D]."""
  num, den, mx = state
  k = k.astype(f32)
  m = jnp.maximum(mx, k.max(0, keepdims=True))
  e, decay = jnp.exp(k - m), jnp.exp(mx - m)
  return (decay * num + _dot(v.astype(f32), e, (0, 0)), decay * den + e.sum(0, keepdims=True), m), ()


# -- the two drivers --------------------------------------------------------------------------------

def _grid_kernel(*refs, step: Callable, n_state: int, n_x: int, n_y: int, final: bool):
  """Grid (B, H, R), R sequential: the state in scratch across the block axis."""
  init, xs, ys = refs[:n_state], refs[n_state:n_state + n_x], refs[n_state + n_x:n_state + n_x + n_y]
  finals = refs[n_state + n_x + n_y:len(refs) - n_state] if final else ()
  scratch = refs[len(refs) - n_state:]
  r = pl.program_id(2)

  @pl.when(r == 0)
  def _():
    for s, i in zip(scratch, init):
      s[...] = i[...]

  state, outs = step(tuple(s[...] for s in scratch), *(x[...] for x in xs))
  for y_ref, y in zip(ys, outs):
    y_ref[...] = y.astype(y_ref.dtype)
  for s, value in zip(scratch, state):
    s[...] = value
  if final:
    @pl.when(r == pl.num_programs(2) - 1)
    def _():
      for f, value in zip(finals, state):
        f[...] = value


def _loop_kernel(*refs, step: Callable, n_state: int, n_x: int, n_y: int, final: bool, chunk: int,
                 num_chunks: int):
  """Grid (B, H): a loop over the blocks of the whole [T, .] slices, the state in loop values."""
  init, xs, ys = refs[:n_state], refs[n_state:n_state + n_x], refs[n_state + n_x:n_state + n_x + n_y]
  finals = refs[n_state + n_x + n_y:]

  def body(r, state):
    rows = pl.ds(pl.multiple_of(r * chunk, chunk), chunk)
    state, outs = step(state, *(x[rows] for x in xs))
    for y_ref, y in zip(ys, outs):
      y_ref[rows, :] = y.astype(y_ref.dtype)
    return state

  state = jax.lax.fori_loop(0, num_chunks, body, tuple(i[...] for i in init))
  for f, value in zip(finals, state):
    f[...] = value


def _scan(step: Callable, init: Sequence[Array], xs: Sequence[Array], ys: Sequence[tuple[int, jnp.dtype]], *,
          final: bool, chunk: int, driver: str, interpret: bool, name: str,
          cost: Callable[[int], tuple[int, int]]) -> tuple[Array, ...]:
  """`step` over the time blocks of every (batch, head), head-major: init (the state) [B,H,.,.] float32,
  xs [B,H,T,.] with T a multiple of `chunk` -> per (width Y, dtype) in `ys` an output [B,H,T,Y] written
  block by block, then the last state if `final`. `cost(tokens)` = (flops, exps) of `step` over that many
  tokens of one (batch, head), declared to the rooflines (a custom call is opaque to them)."""
  b, h, t = xs[0].shape[:3]
  flops, exps = cost(b * h * t)
  moved = sum(x.size * x.dtype.itemsize for x in (*init, *xs)) + sum(b * h * t * w * jnp.dtype(d).itemsize
                                                                      for w, d in ys)
  estimate = pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=int(moved))
  n = t // chunk
  statics = dict(step=step, n_state=len(init), n_x=len(xs), n_y=len(ys), final=final)
  out_shape = ([jax.ShapeDtypeStruct((b, h, t, width), dtype) for width, dtype in ys]
               + ([jax.ShapeDtypeStruct(s.shape, f32) for s in init] if final else []))
  if driver == "grid":
    timed = lambda x: pl.BlockSpec((None, None, chunk) + x.shape[3:], lambda i, j, r: (i, j, r) + (0,) * (x.ndim - 3))
    fixed = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, j, r: (i, j, 0, 0))
    call = pl.pallas_call(
        functools.partial(_grid_kernel, **statics), out_shape=out_shape, grid=(b, h, n),
        in_specs=[fixed(s) for s in init] + [timed(x) for x in xs],
        out_specs=[timed(y) for y in out_shape[:len(ys)]] + [fixed(s) for s in init if final],
        scratch_shapes=[_pallas.scratch(s.shape[2:], f32) for s in init],
        compiler_params=_pallas.compiler_params(2, sequential=True), interpret=interpret, cost_estimate=estimate,
        name=name)
  else:
    whole = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, j: (i, j) + (0,) * (x.ndim - 2))
    call = pl.pallas_call(
        functools.partial(_loop_kernel, chunk=chunk, num_chunks=n, **statics), out_shape=out_shape,
        grid=(b, h), in_specs=[whole(x) for x in (*init, *xs)], out_specs=[whole(y) for y in out_shape],
        compiler_params=_pallas.compiler_params(2, sequential=False), interpret=interpret, cost_estimate=estimate,
        name=name)
  return tuple(call(*init, *xs))


def _head_major(x: Array, t: int, value: float = 0.0) -> Array:
  """[B,T,H,X] -> [B,H,T',X], time padded to t with `value`."""
  x = x.swapaxes(1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, t - x.shape[2]), (0, 0)), constant_values=value)


def _options(driver: str | None, interpret: bool | None) -> tuple[str, bool]:
  return _pallas.driver(driver), _pallas.interpret_default() if interpret is None else interpret


# -- causal -----------------------------------------------------------------------------------------

def _triton_width(v: Array) -> Array:
  """v [B,T,H,D] with D padded by zeros to a power of two on GPU (Triton takes no other sizes; the padded
  columns' outputs are zeros, cut afterwards), unchanged elsewhere."""
  d = v.shape[-1]
  if _pallas.platform() != "gpu" or d == pl.next_power_of_2(d):
    return v
  return jnp.pad(v, [(0, 0)] * 3 + [(0, pl.next_power_of_2(d) - d)])


def _document_rows(segments: Array, heads: int, chunk: int, t: int) -> tuple[Array, Array, Array]:
  """segments int[B,T] -> (doc [B,H,T',1], doc_rows [B,H,T',1,1], cont [B,H,T',1]) in float32 for blocks
  of `chunk` tokens, T' = t (a multiple of chunk; the padding continues the last document)."""
  doc, cont = latte_xla.chunk_documents(latte_xla.documents(segments), chunk)
  b = doc.shape[0]
  column = lambda x: jnp.broadcast_to(x.reshape(b, 1, -1, 1).astype(f32), (b, heads, t, 1))
  doc = column(doc)
  return doc, doc[..., None], column(cont)


def _causal_forward(q, k, v, state, segments, latent_scale, *, chunk: int, driver: str, interpret: bool) -> Array:
  b, t, h, _ = q.shape
  d = v.shape[-1]
  tp = -(-t // chunk) * chunk
  v = _triton_width(v)
  num = jnp.pad(state["num"].astype(f32), [(0, 0)] * 3 + [(0, v.shape[-1] - d)])
  init = (num.swapaxes(-1, -2), state["den"].astype(f32)[:, :, None],
          state["max"].astype(f32)[:, :, None])                                    # [B,H,D,L], 2 x [B,H,1,L]
  k, v = _head_major(k.astype(f32), tp, PAD), _head_major(v, tp)
  rows = lambda x: x[:, :, :, None, :]                                            # [B,H,T,1,X], same bytes
  xs = (_head_major(latte_xla.latent_probs(q, latent_scale), tp), k, rows(k), v, rows(v))
  dims = ("bh..", "bh..", "bh...", "bh..", "bh...")
  if segments is not None:
    xs, dims = xs + _document_rows(segments, h, chunk, tp), dims + ("bh..", "bh...", "bh..")
  l, dp = q.shape[-1], v.shape[-1]
  # per token: the [C,L] block weights and their products with v (C D), the carried part and the state update
  cost = lambda n: (n * (3 * chunk * l + 2 * chunk * dp + 4 * l * dp), n * (chunk * l + 3 * l))
  run = functools.partial(_scan, _causal_block, ys=((dp, v.dtype),), final=False, chunk=chunk, driver=driver,
                          interpret=interpret, name="causal_latte", cost=cost)
  (out,) = _pallas.run_per_device(run, (init, xs), (("bh..",) * 3, dims), ("bh..",), batch=b, heads=h)
  return out[:, :, :t, :d].swapaxes(1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _causal(q, k, v, state, segments, latent_scale, options):
  return _causal_forward(q, k, v, state, segments, latent_scale, **dict(options))


def _causal_fwd(q, k, v, state, segments, latent_scale, options):
  return _causal(q, k, v, state, segments, latent_scale, options), (q, k, v, state, segments, latent_scale)


def _causal_bwd(options, residuals, cotangent):
  chunk = dict(options)["chunk"]
  *floats, segments, latent_scale = residuals
  xla = lambda q, k, v, state, latent_scale: latte_xla.causal_latte(q, k, v, chunk=chunk, state=state,
                                                                    segments=segments, latent_scale=latent_scale)
  *grads, scale_grad = jax.vjp(xla, *floats, latent_scale)[1](cotangent)
  return (*grads, None, scale_grad)


_causal.defvjp(_causal_fwd, _causal_bwd)


def causal_latte(q: Array, k: Array, v: Array, *, chunk: int | None = None, state: dict[str, Array] | None = None,
                 segments: Array | None = None, latent_scale: Array | None = None, driver: str | None = None,
                 interpret: bool | None = None) -> Array:
  """`kernels.latte.causal_latte` with impl="pallas" (arguments checked there): q, k [B,T,H,L],
  v [B,T,H,D] -> [B,T,H,D] in v's dtype. `chunk` is the kernel's time block (default per backend);
  `segments` int[B,T] packed documents, `latent_scale` [B,T,H,L] times p(l|t); `driver` "grid" | "loop"
  (default per backend), `interpret` (default off GPU and TPU)."""
  b, _, h, l = q.shape
  chunk = default_chunk() if chunk is None else chunk
  state = latte_xla.init_latte_state(b, h, l, v.shape[-1]) if state is None else state
  driver, interpret = _options(driver, interpret)
  return _causal(q, k, v, state, segments, latent_scale,
                 (("chunk", chunk), ("driver", driver), ("interpret", interpret)))


# -- bidirectional ----------------------------------------------------------------------------------

def _bidirectional_forward(q, k, v, segments, latent_scale, *, block: int, chunk: int, driver: str,
                           interpret: bool) -> Array:
  b, t, h, l = q.shape
  d = v.shape[-1]
  p = latte_xla.latent_probs(q, latent_scale)
  if segments is not None:
    return _segmented_forward(p, k, v, segments, chunk=chunk, driver=driver, interpret=interpret)
  v = _triton_width(v)
  c = min(block, pl.next_power_of_2(t))
  tp = -(-t // c) * c
  dp = v.shape[-1]
  init = (jnp.zeros((b, h, dp, l), f32), jnp.zeros((b, h, 1, l), f32), jnp.full((b, h, 1, l), NEG, f32))
  cost = lambda n: (n * 2 * l * dp, n * l)  # per token: v^T exp(k - m), one exp per latent
  run = functools.partial(_scan, _summary_block, ys=(), final=True, chunk=c, driver=driver, interpret=interpret,
                          name="bidirectional_latte", cost=cost)
  num, den, _ = _pallas.run_per_device(run, (init, (_head_major(k, tp, PAD), _head_major(v, tp))),
                                       (("bh..",) * 3, ("bh..",) * 2), ("bh..",) * 3, batch=b, heads=h)
  summary = num[:, :, :d] / den                                             # [B,H,D,L]; den >= 1
  return jnp.einsum("bthl,bhdl->bthd", p, summary).astype(v.dtype)


def _segmented_forward(p, k, v, segments, *, chunk: int, driver: str, interpret: bool) -> Array:
  """Bidirectional Latte over packed documents: `latte_xla.bidirectional_parts`, then `_linear_block`
  forward (s <= t) and over the reversed sequence (s > t)."""
  b, t, h, l = p.shape
  d = v.shape[-1]
  r, e, _ = latte_xla.bidirectional_parts(p, k, segments)
  vp = _triton_width(v)
  dp = vp.shape[-1]
  tp = -(-t // chunk) * chunk
  rows = lambda x: x[:, :, :, None, :]
  init = (jnp.zeros((b, h, dp, l), f32),)
  # per token: r_t . e_s over the block (C L), their products with v (C D), the carried part, the state update
  cost = lambda n: (n * (2 * chunk * l + 2 * chunk * dp + 4 * l * dp), 0)
  dims = (("bh..",), ("bh..", "bh..", "bh...", "bh..", "bh...", "bh..", "bh...", "bh.."))
  outs = []
  for strict in (False, True):
    order = (lambda x: jnp.flip(x, axis=1)) if strict else (lambda x: x)
    re, ee, ve = _head_major(order(r), tp), _head_major(order(e), tp), _head_major(order(vp), tp)
    xs = (re, ee, rows(ee), ve, rows(ve)) + _document_rows(order(segments), h, chunk, tp)
    run = functools.partial(_scan, functools.partial(_linear_block, strict=strict), ys=((dp, f32),), final=False,
                            chunk=chunk, driver=driver, interpret=interpret, name="bidirectional_latte_documents",
                            cost=cost)
    (y,) = _pallas.run_per_device(run, (init, xs), dims, ("bh..",), batch=b, heads=h)
    outs.append(order(y[:, :, :t, :d].swapaxes(1, 2)))
  return (outs[0] + outs[1]).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _bidirectional(q, k, v, segments, latent_scale, options):
  return _bidirectional_forward(q, k, v, segments, latent_scale, **dict(options))


def _bidirectional_fwd(q, k, v, segments, latent_scale, options):
  return _bidirectional(q, k, v, segments, latent_scale, options), (q, k, v, segments, latent_scale)


def _bidirectional_bwd(options, residuals, cotangent):
  q, k, v, segments, latent_scale = residuals
  xla = lambda q, k, v, latent_scale: latte_xla.bidirectional_latte(
      q, k, v, segments=segments, latent_scale=latent_scale, chunk=dict(options)["chunk"])
  dq, dk, dv, dscale = jax.vjp(xla, q, k, v, latent_scale)[1](cotangent)
  return dq, dk, dv, None, dscale


_bidirectional.defvjp(_bidirectional_fwd, _bidirectional_bwd)


def bidirectional_latte(q: Array, k: Array, v: Array, *, mask: Array | None = None, segments: Array | None = None,
                        latent_scale: Array | None = None, block: int = BLOCK, chunk: int | None = None,
                        driver: str | None = None, interpret: bool | None = None) -> Array:
  """`kernels.latte.bidirectional_latte` with impl="pallas" (arguments checked there): q, k [B,T,H,L],
  v [B,T,H,D], mask bool [B,T] -> [B,T,H,D] in v's dtype. `block`: the time block of the reduction
  (at most the next power of two >= T). With `segments` int[B,T] (packed documents) the linear sums
  run in blocks of `chunk` tokens (default as the causal kernel's). `latent_scale` [B,T,H,L] times p(l|t)."""
  chunk = default_chunk() if chunk is None else chunk
  options = (("block", block), ("chunk", chunk)) + tuple(zip(("driver", "interpret"), _options(driver, interpret)))
  return _bidirectional(q, latte_xla.masked_keys(k, mask), v, segments, latent_scale, options)
