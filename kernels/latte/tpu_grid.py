"""Latte's grid driver (TPU; interpret mode) and its block steps: the time blocks of one (batch, head) in
order, the state in scratch across the sequential block axis. kernels/latte/pallas.py holds the public
functions and their gradients and calls this driver off GPU (`toolkit.driver`); the GPU's is
kernels/latte/gpu_loop.py, whose steps run these steps' math per latent group.

The state per latent l is the stable pair of eq. 12 scaled by the running max m of the key logits
(Appendix B.2):

  num [D,L] = sum_s exp(k_sl - m_l) v_s     (kept transposed: every per-latent vector is a row [1,L])
  den [1,L] = sum_s exp(k_sl - m_l)          max [1,L] = m_l

Causal (`causal_block`): block r of C tokens reads p = softmax_l(q) (taken in the wrapper), k and v, and
returns

  y = (sum_l r_tl w_tsl) v + (r * carried) num^T,   r = p / den_t           (two matmuls)
  num <- exp(m - m') num + v^T exp(k - m'),  m' = the max after the block  (one matmul)

Bidirectional: `summary_block` reduces the whole sequence to num / den per latent; with packed documents
`linear_block` runs the linear sums y_t = sum_{s in doc(t)} (r_t . e_s) v_s over the blocks.

Packed documents: each token carries its document's index in the row (float32, as [C,1] columns and
[C,1,1] rows) and a flag saying whether it continues the document of the carried state
(`kernels.latte.reference.chunk_documents`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.latte import reference

Array = jax.Array
f32 = jnp.float32
NEG = reference.NEG

# The state's parts in the order the steps take them (a dict of them loses its order in a pytree: shard_map
# hands `scan` its keys sorted).
STATE = ("num", "den", "max", "num_grad", "den_grad")  # the last two: the backward's adjoints
# float32 matmuls at full precision (no TF32 on GPU): the state sums exponentials of logits
dot = functools.partial(toolkit.dot, precision=jax.lax.Precision.HIGHEST)


# -- block steps: state, the block's inputs by name -> state, {output name: [C,.]} ------------------------


def causal_block(
  state,
  p: Array,
  k: Array,
  k_rows: Array,
  v: Array,
  v_rows: Array,
  doc: Array | None = None,
  doc_rows: Array | None = None,
  cont: Array | None = None,
):
  """C tokens after `state` = (num [D,L], den [1,L], max [1,L]): p, k [C,L], v [C,D], and k, v once more
  one token per leading index, k_rows [C,1,L], v_rows [C,1,D] -> state, {y [C,D]}. With packed
  documents: doc [C,1] and doc_rows [C,1,1] the tokens' document indices, cont [C,1] 1 where a token
  continues the state's document (else 0).

  The exact weights w[s,t,l] = exp(k_sl - m_tl), s <= t, are [Cs,Ct,L] with the key token s leading:
  each k_s and v_s enters as the broadcast of its own row, every sum over s adds whole tiles, and
  results come out [Ct,.] in the layout of p. Mosaic then moves no row of a tile to another axis (a
  sublane gather, which TPU v3 lacks; an i1 or f32 [C,L] -> [C,1,L] reshape is not supported at all).
  """
  num, den, mx = state
  k, v = k.astype(f32), v.astype(f32)
  within, carried, _, total = causal_weights(mx, den, k_rows, doc, doc_rows, cont)
  r = p / total
  weights = (r * within).sum(-1, keepdims=True)  # [Cs,Ct,1]: sum_l r_tl w_stl
  y = (weights * v_rows.astype(f32)).sum(0) + dot(r * carried, num, (1, 1))
  return causal_end(num, den, mx, k, v, doc, cont), {"y": y}


def causal_weights(mx, den, k_rows, doc=None, doc_rows=None, cont=None):
  """A causal block's weights after a state of max `mx` and normaliser `den` [1,L] (`causal_block`'s
  arguments): (within [Cs,Ct,L] = exp(k_sl - m_tl) for s <= t in t's document, else 0; carried [Ct,L] =
  exp(m_past - m_tl), the state's scale at token t (0 where t starts a document); m [Ct,L], the running
  max; total [Ct,L] = den_t, the normaliser at t, >= 1: it holds the max term)."""
  c = k_rows.shape[0]
  causal = jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0) <= jax.lax.broadcasted_iota(
    jnp.int32, (c, c, 1), 1
  )  # [Cs,Ct,1]: s <= t
  past = mx  # [1,L] or [Ct,L]
  if doc is not None:
    causal = causal & (doc_rows == doc[None])  # and s in t's document
    past = jnp.where(cont > 0, mx, NEG)  # a token of a new document sees no carried state
  prefix = jnp.where(causal, k_rows.astype(f32), NEG)  # [Cs,Ct,L]: k_s for s <= t
  # The max is per token (running), so every exponent below is <= 0 whatever the logit range, as in
  # `kernels.latte.reference.latte_chunk`.
  m = jnp.maximum(past, prefix.max(0))  # running max [Ct,L]
  within = jnp.where(causal, jnp.exp(prefix - m), 0.0)  # [Cs,Ct,L], <= 1
  carried = jnp.exp(past - m)  # [Ct,L], <= 1: the state rescaled from its max to the token's
  if doc is not None:
    carried = jnp.where(cont > 0, carried, 0.0)
  return within, carried, m, within.sum(0) + carried * den


def causal_end(num, den, mx, k, v, doc, cont):
  """The causal state after a block (as `causal_block`'s): the sums scaled to the max at its end, over the
  document open there."""
  if doc is None:
    end = jnp.maximum(mx, k.max(0, keepdims=True))  # m after the block [1,L]
    to_end, decay = jnp.exp(k - end), jnp.exp(mx - end)
  else:
    last, cont_last = doc == last_row(doc), last_row(cont) > 0  # [C,1], [1,1]
    # Only the document open at the block's end carries on; the carried state too if the block continues it.
    end = jnp.maximum(jnp.where(cont_last, mx, NEG), jnp.where(last, k, NEG).max(0, keepdims=True))  # [1,L]
    to_end = masked_exp(k - end, last)
    decay = jnp.where(cont_last, jnp.exp(mx - end), 0.0)
  return decay * num + dot(v, to_end, (0, 0)), decay * den + to_end.sum(0, keepdims=True), end


def masked_exp(x: Array, keep: Array) -> Array:
  """exp(x) where `keep`, else 0. The inner where keeps exp of the masked entries (other documents' keys, later
  tokens' logits, which can sit far above the max) from overflowing before the mask."""
  return jnp.where(keep, jnp.exp(jnp.where(keep, x, 0.0)), 0.0)


def linear_block(
  state,
  r: Array,
  e: Array,
  e_rows: Array,
  v: Array,
  v_rows: Array,
  doc: Array,
  doc_rows: Array,
  cont: Array,
  *,
  strict: bool,
):
  """The linear sums of segmented bidirectional Latte over C tokens after state = (num [D,L],), the sum of
  e_s v_s over the open document: r, e [C,L], e_rows [C,1,L], v [C,D], v_rows [C,1,D], doc [C,1], doc_rows
  [C,1,1], cont [C,1] -> state, {y [C,D]} with y_t = sum (r_t . e_s) v_s over the earlier tokens s of t's
  document (and s = t unless `strict`)."""
  (num,) = state
  e, v = e.astype(f32), v.astype(f32)
  c = e.shape[0]
  s_index, t_index = (jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), axis) for axis in (0, 1))
  same = ((s_index < t_index) if strict else (s_index <= t_index)) & (doc_rows == doc[None])  # [Cs,Ct,1]
  weights = jnp.where(same, (r[None] * e_rows.astype(f32)).sum(-1, keepdims=True), 0.0)  # r_t . e_s
  y = (weights * v_rows.astype(f32)).sum(0) + dot(jnp.where(cont > 0, r, 0.0), num, (1, 1))
  last = doc == last_row(doc)  # the tokens of the document open at the block's end
  num = jnp.where(last_row(cont) > 0, num, 0.0) + dot(v, jnp.where(last, e, 0.0), (0, 0))
  return (num,), {"y": y}


def summary_block(state, k: Array, v: Array):
  """The online softmax-over-time sums: state (num [D,L], den [1,L], max [1,L]), k [C,L], v [C,D]."""
  num, den, mx = state
  k = k.astype(f32)
  m = jnp.maximum(mx, k.max(0, keepdims=True))
  e, decay = jnp.exp(k - m), jnp.exp(mx - m)  # both <= 1: the sums so far rescaled to the new max
  return (decay * num + dot(v.astype(f32), e, (0, 0)), decay * den + e.sum(0, keepdims=True), m), {}


def last_row(x: Array) -> Array:
  """The last row [1,1] of a non-negative column x [C,1], as a masked sum (Triton has no slices)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(rows == x.shape[0] - 1, x, 0.0).sum(0, keepdims=True)


# -- the driver ---------------------------------------------------------------------------------------


def _kernel(*refs, names: tuple[tuple[str, ...], ...], step: Callable, state: tuple[str, ...], final: bool):
  """Grid (B, H, R), R sequential: the state in scratch across the block axis. Refs by name (`scan`)."""
  x, out, carry = toolkit.named_refs(refs, *names)
  r = pl.program_id(2)

  @pl.when(r == 0)
  def _():  # the state the sequence starts from
    for n in state:
      carry[n][...] = x[n][...]

  new, ys = step(tuple(carry[n][...] for n in state), **{n: ref[...] for n, ref in x.items() if n not in state})
  for n, y in ys.items():
    out[n][...] = y.astype(out[n].dtype)
  for n, value in zip(state, new):
    carry[n][...] = value
  if final:

    @pl.when(r == pl.num_programs(2) - 1)
    def _():
      for n, value in zip(state, new):
        out[n][...] = value


def scan(
  step: Callable,
  init: dict[str, Array],
  xs: dict[str, Array],
  ys: dict[str, tuple[int, jnp.dtype]],
  *,
  rows: tuple[str, ...] = (),
  final: bool,
  chunk: int,
  interpret: bool,
  name: str,
  cost: Callable[[int], tuple[int, int]],
  reverse: bool = False,
) -> dict[str, Array]:
  """`step` over the time blocks of every (batch, head), head-major: init (the state by name, of STATE)
  [B,H,.,L] float32, xs [B,H,T,.] with T a multiple of `chunk` -> per (width Y, dtype) in `ys` an output [B,H,T,Y]
  written block by block, then the last state by name if `final`. `rows`: the xs the step also takes one
  token per leading index, as "<name>_rows" (`causal_block`). `cost(tokens)` = (flops, exps) of `step`
  over that many tokens of one (batch, head). `reverse`: the blocks from the last to the first (a backward
  pass; the outputs still land at their own blocks)."""
  # [B,H,T,1,X]: the same bytes, a block of it [C,1,X] (see `causal_block`)
  xs = dict(xs, **{f"{n}_rows": xs[n][:, :, :, None, :] for n in rows if n in xs})
  b, h, t = next(iter(xs.values())).shape[:3]
  state = tuple(n for n in STATE if n in init)
  order = (lambda r: t // chunk - 1 - r) if reverse else (lambda r: r)
  timed = lambda shape: pl.BlockSpec(
    (None, None, chunk) + shape[3:], lambda i, j, r: (i, j, order(r)) + (0,) * (len(shape) - 3)
  )  # block r of the time axis (from the end if `reverse`)
  fixed = lambda shape: pl.BlockSpec((None, None) + shape[2:], lambda i, j, r: (i, j, 0, 0))  # whole, every step
  inputs = toolkit.Inputs()
  for n in state:
    inputs.add(n, init[n], fixed(init[n].shape))
  for n, x in xs.items():
    inputs.add(n, x, timed(x.shape))
  outputs, scratch = toolkit.Outputs(), toolkit.Scratch()
  for n, (width, dtype) in ys.items():
    outputs.add(n, jax.ShapeDtypeStruct((b, h, t, width), dtype), timed((b, h, t, width)))
  written = list(outputs.shapes)
  for n in state:
    scratch.add(n, init[n].shape[2:], f32)
    if final:
      outputs.add(n, jax.ShapeDtypeStruct(init[n].shape, f32), fixed(init[n].shape))
  call = pl.pallas_call(
    functools.partial(_kernel, names=toolkit.ref_names(inputs, outputs, scratch), step=step, state=state, final=final),
    out_shape=outputs.shapes,
    grid=(b, h, t // chunk),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    compiler_params=toolkit.compiler_params(2, sequential=True),  # the blocks in order: the carried state
    interpret=interpret,
    cost_estimate=toolkit.cost_estimate(*cost(b * h * t), [*inputs.arrays, *written]),
    name=name,
  )
  return outputs.named(call(*inputs.arrays))
