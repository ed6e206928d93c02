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
[C,1] columns, and [C,1,1] rows for the "grid" steps) and a flag saying whether it continues the
document of the carried state (the wrapper derives both from the ids and the block size,
`kernels.latte_xla.chunk_documents`).
Causal: the block weights and running max keep to each token's document, the carried state reaches
only the tokens that continue it, and the state after the block sums the document open at its end.
Bidirectional: the per-document max and normaliser of the keys are O(T L) XLA reductions
(`kernels.latte_xla.bidirectional_parts`), and a third kernel (`_linear_block`) runs the linear sums
y_t = sum_{s in doc(t)} (r_t . e_s) v_s over the blocks, once forward (s <= t) and once over the
reversed sequence (s > t), with the open document's sum num [D,L] as its state.

Each kernel is a block step under one of the two drivers of kernels/toolkit.py. "grid" (TPU, and
interpret mode): the grid is (B, H, blocks), the state in scratch across the sequential block axis,
and the steps above. "loop" (GPU): a program loops over the blocks of its whole [T, .] slices with the
state in loop values, and its steps (`_causal_groups`, `_linear_groups`, `_summary_groups`) are laid
out for Triton, which keeps a program's values in registers:

  - The grid is (B, H, value tiles, latent tiles). The state num [D,L] is independent across value
    columns, so a program owns `value_block` of them (den, max and the block weights are recomputed by
    each: O(C L) per token against the O(L D) of the matmuls). The bidirectional reduction is
    independent per latent as well and tiles the latents on the grid; the causal and linear sums add
    all latents into each output, so a program walks its latents in groups of `latent_block` inside
    the step, with the state a tuple over the groups.
  - A float32 matmul at HIGHEST precision (IEEE, not TF32: the state sums exponentials of logits) is
    done by Triton with FMAs on CUDA cores, both operands' whole contraction in registers: (rows +
    columns per thread) x K floats. So every contraction is a time block or a latent group, never all
    of L or a long block (a contraction of 128 needed over a thousand registers a thread: the spills).
  - The causal block's exact weights are [Cs,Ct,Lg], one latent group at a time, and sum_l r_tl w_stl
    adds up over the groups as [Cs,Ct], which meets v in one matmul; the segmented linear sums' scores
    r_t . e_s are [Ct,Cs] matmuls over the groups. No 3-D value has a D axis.

The GPU sizes (chunk, block, value_block, latent_block, warps) are `toolkit.GPU_TILES`'s, powers of two
(D is padded to one); a tile that does not divide its size (interpret mode) covers all of it. Time is
padded to whole blocks with keys PAD (below NEG), which weigh exactly 0, so a fully masked row still
averages its real positions as the reference does.

Backward: `jax.custom_vjp` whose backward is the VJP of the XLA chunked forms
(`kernels.latte_xla.causal_latte` / `bidirectional_latte`), recomputed from the inputs:
gradients (to q, k, v and a carried state) are the XLA path's, and so is training memory; the
kernels run the forward pass only.

Inputs of any float dtype; the kernels compute in float32 (matmuls at HIGHEST precision: no TF32
on GPU) and return v's dtype. Time blocks: the causal kernel's is `chunk` (`default_chunk`: 16 on
GPU, 32 on TPU, where the [C,C,L] weights are in VMEM); the bidirectional reduction's min(block, the
power of two >= T) and the linear sums' `chunk` (`default_block`). On GPU (Triton) the blocks and L
should be powers of two; on TPU the chunk a multiple of 8 (16 for bf16 values). The kernels compile
with Mosaic (scripts/check_lowering.py, docs/kernels.md) and with XLA:GPU + Triton + ptxas for the
H100 and A100 without spills at the papers' sizes (lra_core/bench/gpu_compile.py); their numbers are
tested in interpret mode under both drivers.

This file holds the kernels and imports the reference, kernels/latte_xla.py; kernels/latte.py checks
the arguments and dispatches between the two on `impl`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import latte_xla, toolkit

Array = jax.Array
f32 = jnp.float32
NEG = latte_xla.NEG
PAD = 2 * NEG  # time padding: below every key, masked ones (NEG) included
BLOCK = 128  # time block of the bidirectional reduction (off GPU)
DRIVERS = ("grid", "loop")  # of kernels/toolkit.py: no "parallel", the state crosses the blocks in order


def default_chunk() -> int:
  """The causal kernel's time block for the target: on GPU `toolkit.GPU_TILES` (its C x C weights per
  latent group are in registers), on TPU 32 (a multiple of the 8-row tiles; the C x C x L weights are in
  VMEM); interpret mode (CPU) 8, as the XLA form on CPU."""
  if toolkit.platform() == "gpu":
    return toolkit.gpu_tiles("causal_latte")["chunk"]
  return {"tpu": 32}.get(toolkit.platform(), 8)


def default_block(segmented: bool = False) -> int:
  """The bidirectional kernel's time block for the target: the reduction's, or with packed documents the
  linear sums' (`segmented`). On GPU `toolkit.GPU_TILES`: a block is a matmul's contraction, which Triton
  keeps in registers; elsewhere BLOCK, and the causal kernel's chunk for the linear sums."""
  if toolkit.platform() == "gpu":
    return toolkit.gpu_tiles("bidirectional_latte")["chunk" if segmented else "block"]
  return default_chunk() if segmented else BLOCK


def _loop_tiles(kernel: str, value_block: int | None, latent_block: int | None) -> tuple[tuple[str, int], ...]:
  """The "loop" driver's value and latent tiles: the given ones, else `toolkit.GPU_TILES[kernel]`'s."""
  tiles = toolkit.gpu_tiles(kernel)
  return (("value_block", value_block or tiles["value_block"]), ("latent_block", latent_block or tiles["latent_block"]))


# float32 matmuls at full precision (no TF32 on GPU): the state sums exponentials of logits
_dot = functools.partial(toolkit.dot, precision=jax.lax.Precision.HIGHEST)


# -- block steps ------------------------------------------------------------------------------------


def _causal_block(
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
  causal = jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0) <= jax.lax.broadcasted_iota(
    jnp.int32, (c, c, 1), 1
  )  # [Cs,Ct,1]: s <= t
  past = mx  # [1,L] or [Ct,L]
  if doc is not None:
    causal = causal & (doc_rows == doc[None])  # and s in t's document
    past = jnp.where(cont > 0, mx, NEG)
  prefix = jnp.where(causal, k_rows.astype(f32), NEG)  # [Cs,Ct,L]: k_s for s <= t
  m = jnp.maximum(past, prefix.max(0))  # running max [Ct,L]
  within = jnp.where(causal, jnp.exp(prefix - m), 0.0)  # [Cs,Ct,L], <= 1
  carried = jnp.exp(past - m)  # [Ct,L], <= 1
  if doc is not None:
    carried = jnp.where(cont > 0, carried, 0.0)
  r = p / (within.sum(0) + carried * den)  # den_t >= 1: it holds the max term
  weights = (r * within).sum(-1, keepdims=True)  # [Cs,Ct,1]: sum_l r_tl w_stl
  y = (weights * v_rows.astype(f32)).sum(0) + _dot(r * carried, num, (1, 1))
  return _causal_end(num, den, mx, k, v, doc, cont), (y,)


def _linear_block(
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
  [C,1,1], cont [C,1] -> state, (y [C,D],) with y_t = sum (r_t . e_s) v_s over the earlier tokens s of t's
  document (and s = t unless `strict`)."""
  (num,) = state
  e, v = e.astype(f32), v.astype(f32)
  c = e.shape[0]
  s_index, t_index = (jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), axis) for axis in (0, 1))
  same = ((s_index < t_index) if strict else (s_index <= t_index)) & (doc_rows == doc[None])  # [Cs,Ct,1]
  weights = jnp.where(same, (r[None] * e_rows.astype(f32)).sum(-1, keepdims=True), 0.0)  # r_t . e_s
  y = (weights * v_rows.astype(f32)).sum(0) + _dot(jnp.where(cont > 0, r, 0.0), num, (1, 1))
  last = doc == _last_row(doc)
  num = jnp.where(_last_row(cont) > 0, num, 0.0) + _dot(v, jnp.where(last, e, 0.0), (0, 0))
  return (num,), (y,)


def _last_row(x: Array) -> Array:
  """The last row [1,1] of a non-negative column x [C,1], as a masked sum (Triton has no slices)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(rows == x.shape[0] - 1, x, 0.0).sum(0, keepdims=True)


# GPU ("loop" driver) block steps: every input comes as a loader of the block's rows, `x()` all its
# columns, `x(g)` latent group g's [C,Lg], and the state as a tuple over the latent groups. Triton does a
# float32 matmul at HIGHEST precision on CUDA cores with both operands' whole contraction in registers
# ((rows + columns per thread) x K floats), so every contraction here is a time block (C) or a latent
# group (Lg), and the only 3-D value is the causal step's [C,C,Lg] weights of one group.


def _causal_groups(
  state, p: Callable, k: Callable, v: Callable, doc: Callable | None = None, cont: Callable | None = None
):
  """`_causal_block` per latent group: state ((num [Dv,Lg], den [1,Lg], max [1,Lg]) per group), p, k
  [C,Lg] per group, v [C,Dv], with packed documents doc, cont [C,1] -> state, (y [C,Dv],). The weights
  sum_l r_tl w_stl add up over the groups as [Cs,Ct] and meet v in one matmul."""
  v = v().astype(f32)
  c = v.shape[0]
  causal = jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0) <= jax.lax.broadcasted_iota(
    jnp.int32, (c, c, 1), 1
  )  # [Cs,Ct,1]: s <= t
  if doc is not None:
    doc, cont = doc(), cont()
    causal = causal & (doc[:, None] == doc[None])  # and s in t's document
  weights, y, out = jnp.zeros((c, c), f32), jnp.zeros(v.shape, f32), []
  for g, (num, den, mx) in enumerate(state):
    kg = k(g).astype(f32)
    past = mx if doc is None else jnp.where(cont > 0, mx, NEG)  # [1,Lg] or [Ct,Lg]
    prefix = jnp.where(causal, kg[:, None], NEG)  # [Cs,Ct,Lg]: k_s for s <= t
    m = jnp.maximum(past, prefix.max(0))  # running max [Ct,Lg]
    within = jnp.where(causal, jnp.exp(prefix - m), 0.0)  # [Cs,Ct,Lg], <= 1
    carried = jnp.exp(past - m)  # [Ct,Lg], <= 1
    if doc is not None:
      carried = jnp.where(cont > 0, carried, 0.0)
    r = p(g) / (within.sum(0) + carried * den)  # den_t >= 1: holds the max term
    weights = weights + (r * within).sum(-1)  # [Cs,Ct]: sum_l r_tl w_stl
    y = y + _dot(r * carried, num, (1, 1))
    out.append(_causal_end(num, den, mx, kg, v, doc, cont))
  return tuple(out), (y + _dot(weights, v, (0, 0)),)


def _causal_end(num, den, mx, k, v, doc, cont):
  """The causal state after a block (as `_causal_block`'s): the sums scaled to the max at its end, over the
  document open there."""
  if doc is None:
    end = jnp.maximum(mx, k.max(0, keepdims=True))  # m after the block [1,L]
    to_end, decay = jnp.exp(k - end), jnp.exp(mx - end)
  else:
    last, cont_last = doc == _last_row(doc), _last_row(cont) > 0  # [C,1], [1,1]
    end = jnp.maximum(jnp.where(cont_last, mx, NEG), jnp.where(last, k, NEG).max(0, keepdims=True))  # [1,L]
    to_end = jnp.where(last, jnp.exp(jnp.where(last, k - end, 0.0)), 0.0)  # the document open at the end
    decay = jnp.where(cont_last, jnp.exp(mx - end), 0.0)
  return decay * num + _dot(v, to_end, (0, 0)), decay * den + to_end.sum(0, keepdims=True), end


def _linear_groups(state, r: Callable, e: Callable, v: Callable, doc: Callable, cont: Callable, *, strict: bool):
  """`_linear_block` per latent group: state ((num [Dv,Lg],) per group), r, e [C,Lg] per group, v [C,Dv],
  doc, cont [C,1] -> state, (y [C,Dv],); the block's scores r_t . e_s are matmuls [Ct,Cs] over the groups."""
  v, doc, cont = v().astype(f32), doc(), cont()
  c = v.shape[0]
  t_index, s_index = (jax.lax.broadcasted_iota(jnp.int32, (c, c), axis) for axis in (0, 1))
  same = ((s_index < t_index) if strict else (s_index <= t_index)) & (doc == doc.T)  # [Ct,Cs]
  last, cont_last = doc == _last_row(doc), _last_row(cont) > 0
  scores, y, out = jnp.zeros((c, c), f32), jnp.zeros(v.shape, f32), []
  for g, (num,) in enumerate(state):
    rg, eg = r(g), e(g).astype(f32)
    scores = scores + _dot(rg, eg, (1, 1))
    y = y + _dot(jnp.where(cont > 0, rg, 0.0), num, (1, 1))
    out.append((jnp.where(cont_last, num, 0.0) + _dot(v, jnp.where(last, eg, 0.0), (0, 0)),))
  return tuple(out), (y + _dot(jnp.where(same, scores, 0.0), v),)


def _summary_groups(state, k: Callable, v: Callable):
  """`_summary_block` on the loop driver: one group (the grid tiles the latents)."""
  (group,) = state
  group, _ = _summary_block(group, k(), v())
  return (group,), ()


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
  init, xs, ys = refs[:n_state], refs[n_state : n_state + n_x], refs[n_state + n_x : n_state + n_x + n_y]
  finals = refs[n_state + n_x + n_y : len(refs) - n_state] if final else ()
  scratch = refs[len(refs) - n_state :]
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


def _loop_kernel(
  *refs,
  step: Callable,
  n_state: int,
  n_x: int,
  n_y: int,
  final: bool,
  chunk: int,
  num_chunks: int,
  groups: int,
  shared: tuple[bool, ...],
):
  """Grid (B, H, value tiles, latent tiles): a loop over the blocks of the whole [T, .] slices, the state in
  loop values, a tuple over `groups` latent groups (see the GPU block steps). A final state `shared` by the
  value tiles (no value rows: each computes the same) is written by the first alone."""
  init, xs, ys = refs[:n_state], refs[n_state : n_state + n_x], refs[n_state + n_x : n_state + n_x + n_y]
  finals = refs[n_state + n_x + n_y :]
  width = init[0].shape[-1] // groups
  group = lambda g: pl.ds(g * width, width)

  def body(r, state):
    rows = pl.ds(pl.multiple_of(r * chunk, chunk), chunk)
    load = lambda x: lambda g=None: x[rows] if g is None else x[rows, group(g)]
    state, outs = step(state, *map(load, xs))
    for y_ref, y in zip(ys, outs):
      y_ref[rows, :] = y.astype(y_ref.dtype)
    return state

  state = jax.lax.fori_loop(0, num_chunks, body, tuple(tuple(i[:, group(g)] for i in init) for g in range(groups)))

  def write(f, values):
    for g, value in enumerate(values):
      f[:, group(g)] = value

  for f, values, once in zip(finals, zip(*state), shared):
    if once:
      pl.when(pl.program_id(2) == 0)(functools.partial(write, f, values))
    else:
      write(f, values)


def _tile(size: int, block: int) -> int:
  """`block` where it divides `size`, else all of it (interpret mode takes any size)."""
  return block if size % block == 0 else size


def _scan(
  step: Callable,
  init: Sequence[Array],
  xs: Sequence[Array],
  ys: Sequence[tuple[int, jnp.dtype]],
  *,
  final: bool,
  chunk: int,
  driver: str,
  interpret: bool,
  name: str,
  cost: Callable[[int], tuple[int, int]],
  kinds: Sequence[str] = (),
  tiles: dict[str, int] | None = None,
  kernel: str = "",
  latent_grid: bool = False,
) -> tuple[Array, ...]:
  """`step` over the time blocks of every (batch, head), head-major: init (the state) [B,H,.,L] float32,
  xs [B,H,T,.] with T a multiple of `chunk` -> per (width Y, dtype) in `ys` an output [B,H,T,Y] written
  block by block, then the last state if `final`. `cost(tokens)` = (flops, exps) of `step` over that many
  tokens of one (batch, head), declared to the rooflines (a custom call is opaque to them).

  "loop" driver (GPU): `kinds` names the last two axes of each array of init and xs, "v" value columns
  (tiles of tiles["value_block"] over a grid axis), "l" latents, "." neither. The latents go in groups of
  tiles["latent_block"], over a grid axis if `latent_grid`, else inside the step (each group of the state,
  p and k one by one); the init's first array holds the value rows (num [D,L]). Triton launch parameters:
  `toolkit.compiler_params` of `kernel`."""
  b, h, t = xs[0].shape[:3]
  flops, exps = cost(b * h * t)
  moved = sum(x.size * x.dtype.itemsize for x in (*init, *xs)) + sum(
    b * h * t * w * jnp.dtype(d).itemsize for w, d in ys
  )
  estimate = pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=int(moved))
  n = t // chunk
  statics = dict(step=step, n_state=len(init), n_x=len(xs), n_y=len(ys), final=final)
  out_shape = [jax.ShapeDtypeStruct((b, h, t, width), dtype) for width, dtype in ys] + (
    [jax.ShapeDtypeStruct(s.shape, f32) for s in init] if final else []
  )
  if driver == "grid":
    timed = lambda x: pl.BlockSpec((None, None, chunk) + x.shape[3:], lambda i, j, r: (i, j, r) + (0,) * (x.ndim - 3))
    fixed = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, j, r: (i, j, 0, 0))
    call = pl.pallas_call(
      functools.partial(_grid_kernel, **statics),
      out_shape=out_shape,
      grid=(b, h, n),
      in_specs=[fixed(s) for s in init] + [timed(x) for x in xs],
      out_specs=[timed(y) for y in out_shape[: len(ys)]] + [fixed(s) for s in init if final],
      scratch_shapes=[toolkit.scratch(s.shape[2:], f32) for s in init],
      compiler_params=toolkit.compiler_params(2, sequential=True),
      interpret=interpret,
      cost_estimate=estimate,
      name=name,
    )
    return tuple(call(*init, *xs))
  d, l = init[0].shape[2:]
  dv, lg = _tile(d, tiles["value_block"]), _tile(l, tiles["latent_block"])
  lt = lg if latent_grid else l
  sizes = {"v": dv, "l": lt}

  def spec(x, kind: str):
    index = lambda i, j, jv, jl: (i, j) + tuple({"v": jv, "l": jl}.get(c, 0) for c in kind)
    return pl.BlockSpec((None, None) + tuple(sizes.get(c, size) for c, size in zip(kind, x.shape[2:])), index)

  state_specs = [spec(s, kind) for s, kind in zip(init, kinds)]
  shared = tuple("v" not in kind for kind in kinds[: len(init)]) if final else ()
  call = pl.pallas_call(
    functools.partial(_loop_kernel, chunk=chunk, num_chunks=n, groups=lt // lg, shared=shared, **statics),
    out_shape=out_shape,
    grid=(b, h, d // dv, l // lt),
    in_specs=state_specs + [spec(x, kind) for x, kind in zip(xs, kinds[len(init) :])],
    out_specs=[spec(y, ".v") for y in out_shape[: len(ys)]] + (state_specs if final else []),
    compiler_params=toolkit.compiler_params(4, sequential=False, kernel=kernel),
    interpret=interpret,
    cost_estimate=estimate,
    name=name,
  )
  return tuple(call(*init, *xs))


def _head_major(x: Array, t: int, value: float = 0.0) -> Array:
  """[B,T,H,X] -> [B,H,T',X], time padded to t with `value`."""
  x = x.swapaxes(1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, t - x.shape[2]), (0, 0)), constant_values=value)


def _options(driver: str | None, interpret: bool | None) -> tuple[str, bool]:
  return toolkit.driver(driver, drivers=DRIVERS), toolkit.interpret_default() if interpret is None else interpret


# -- causal -----------------------------------------------------------------------------------------


def _triton_width(v: Array) -> Array:
  """v [B,T,H,D] with D padded by zeros to a power of two on GPU (Triton takes no other sizes; the padded
  columns' outputs are zeros, cut afterwards), unchanged elsewhere."""
  d = v.shape[-1]
  if toolkit.platform() != "gpu" or d == pl.next_power_of_2(d):
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


def _causal_forward(
  q,
  k,
  v,
  state,
  segments,
  latent_scale,
  *,
  chunk: int,
  driver: str,
  interpret: bool,
  tiles: tuple[tuple[str, int], ...],
) -> Array:
  b, t, h, _ = q.shape
  d = v.shape[-1]
  tp = -(-t // chunk) * chunk
  v = _triton_width(v)
  num = jnp.pad(state["num"].astype(f32), [(0, 0)] * 3 + [(0, v.shape[-1] - d)])
  init = (
    num.swapaxes(-1, -2),
    state["den"].astype(f32)[:, :, None],
    state["max"].astype(f32)[:, :, None],
  )  # [B,H,D,L], 2 x [B,H,1,L]
  p = _head_major(latte_xla.latent_probs(q, latent_scale), tp)
  k, v = _head_major(k.astype(f32), tp, PAD), _head_major(v, tp)
  docs = () if segments is None else _document_rows(segments, h, chunk, tp)
  if driver == "grid":
    rows = lambda x: x[:, :, :, None, :]  # [B,H,T,1,X], same bytes
    step, xs = _causal_block, (p, k, rows(k), v, rows(v)) + docs
  else:
    step, xs = _causal_groups, (p, k, v) + docs[::2]  # doc and cont [B,H,T,1]
  l, dp = q.shape[-1], v.shape[-1]
  # per token: the [C,L] block weights and their products with v (C D), the carried part and the state update
  cost = lambda n: (n * (3 * chunk * l + 2 * chunk * dp + 4 * l * dp), n * (chunk * l + 3 * l))
  run = functools.partial(
    _scan,
    step,
    ys=((dp, v.dtype),),
    final=False,
    chunk=chunk,
    driver=driver,
    interpret=interpret,
    name="causal_latte",
    cost=cost,
    kernel="causal_latte",
    kinds=("vl", ".l", ".l", ".l", ".l", ".v", "..", ".."),
    tiles=dict(tiles),
  )
  dims = tuple("bh" + "." * (x.ndim - 2) for x in xs)
  (out,) = toolkit.run_per_device(run, (init, xs), (("bh..",) * 3, dims), ("bh..",), batch=b, heads=h)
  return out[:, :, :t, :d].swapaxes(1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _causal(q, k, v, state, segments, latent_scale, options):
  return _causal_forward(q, k, v, state, segments, latent_scale, **dict(options))


def _causal_fwd(q, k, v, state, segments, latent_scale, options):
  return _causal(q, k, v, state, segments, latent_scale, options), (q, k, v, state, segments, latent_scale)


def _causal_bwd(options, residuals, cotangent):
  chunk = dict(options)["chunk"]
  *floats, segments, latent_scale = residuals
  xla = lambda q, k, v, state, latent_scale: latte_xla.causal_latte(
    q, k, v, chunk=chunk, state=state, segments=segments, latent_scale=latent_scale
  )
  *grads, scale_grad = jax.vjp(xla, *floats, latent_scale)[1](cotangent)
  return (*grads, None, scale_grad)


_causal.defvjp(_causal_fwd, _causal_bwd)


def causal_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  chunk: int | None = None,
  state: dict[str, Array] | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
  driver: str | None = None,
  interpret: bool | None = None,
  value_block: int | None = None,
  latent_block: int | None = None,
) -> Array:
  """`kernels.latte.causal_latte` with impl="pallas" (arguments checked there): q, k [B,T,H,L],
  v [B,T,H,D] -> [B,T,H,D] in v's dtype. `chunk` is the kernel's time block (default per backend);
  `segments` int[B,T] packed documents, `latent_scale` [B,T,H,L] times p(l|t); `driver` "grid" | "loop"
  (default per backend), `interpret` (default off GPU and TPU). "loop" driver: value columns per program
  and latents per group (default `toolkit.GPU_TILES`; all of D or L where the tile does not divide it)."""
  b, _, h, l = q.shape
  chunk = default_chunk() if chunk is None else chunk
  state = latte_xla.init_latte_state(b, h, l, v.shape[-1]) if state is None else state
  driver, interpret = _options(driver, interpret)
  return _causal(
    q,
    k,
    v,
    state,
    segments,
    latent_scale,
    (
      ("chunk", chunk),
      ("driver", driver),
      ("interpret", interpret),
      ("tiles", _loop_tiles("causal_latte", value_block, latent_block)),
    ),
  )


# -- bidirectional ----------------------------------------------------------------------------------


def _bidirectional_forward(
  q,
  k,
  v,
  segments,
  latent_scale,
  *,
  block: int,
  chunk: int,
  driver: str,
  interpret: bool,
  tiles: tuple[tuple[str, int], ...],
) -> Array:
  b, t, h, l = q.shape
  d = v.shape[-1]
  p = latte_xla.latent_probs(q, latent_scale)
  if segments is not None:
    return _segmented_forward(p, k, v, segments, chunk=chunk, driver=driver, interpret=interpret, tiles=tiles)
  v = _triton_width(v)
  c = min(block, pl.next_power_of_2(t))
  tp = -(-t // c) * c
  dp = v.shape[-1]
  init = (jnp.zeros((b, h, dp, l), f32), jnp.zeros((b, h, 1, l), f32), jnp.full((b, h, 1, l), NEG, f32))
  cost = lambda n: (n * 2 * l * dp, n * l)  # per token: v^T exp(k - m), one exp per latent
  step = _summary_block if driver == "grid" else _summary_groups
  run = functools.partial(
    _scan,
    step,
    ys=(),
    final=True,
    chunk=c,
    driver=driver,
    interpret=interpret,
    name="bidirectional_latte",
    cost=cost,
    kernel="bidirectional_latte",
    kinds=("vl", ".l", ".l", ".l", ".v"),
    tiles=dict(tiles),
    latent_grid=True,
  )
  num, den, _ = toolkit.run_per_device(
    run,
    (init, (_head_major(k, tp, PAD), _head_major(v, tp))),
    (("bh..",) * 3, ("bh..",) * 2),
    ("bh..",) * 3,
    batch=b,
    heads=h,
  )
  summary = num[:, :, :d] / den  # [B,H,D,L]; den >= 1
  return jnp.einsum("bthl,bhdl->bthd", p, summary).astype(v.dtype)


def _segmented_forward(
  p, k, v, segments, *, chunk: int, driver: str, interpret: bool, tiles: tuple[tuple[str, int], ...]
) -> Array:
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
  outs = []
  for strict in (False, True):
    order = (lambda x: jnp.flip(x, axis=1)) if strict else (lambda x: x)
    re, ee, ve = _head_major(order(r), tp), _head_major(order(e), tp), _head_major(order(vp), tp)
    doc, doc_rows, cont = _document_rows(order(segments), h, chunk, tp)
    if driver == "grid":
      step, xs = _linear_block, (re, ee, rows(ee), ve, rows(ve), doc, doc_rows, cont)
    else:
      step, xs = _linear_groups, (re, ee, ve, doc, cont)
    run = functools.partial(
      _scan,
      functools.partial(step, strict=strict),
      ys=((dp, f32),),
      final=False,
      chunk=chunk,
      driver=driver,
      interpret=interpret,
      name="bidirectional_latte_documents",
      cost=cost,
      kernel="bidirectional_latte",
      kinds=("vl", ".l", ".l", ".v", "..", ".."),
      tiles=dict(tiles),
    )
    dims = tuple("bh" + "." * (x.ndim - 2) for x in xs)
    (y,) = toolkit.run_per_device(run, (init, xs), (("bh..",), dims), ("bh..",), batch=b, heads=h)
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
    q, k, v, segments=segments, latent_scale=latent_scale, chunk=dict(options)["chunk"]
  )
  dq, dk, dv, dscale = jax.vjp(xla, q, k, v, latent_scale)[1](cotangent)
  return dq, dk, dv, None, dscale


_bidirectional.defvjp(_bidirectional_fwd, _bidirectional_bwd)


def bidirectional_latte(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: Array | None = None,
  segments: Array | None = None,
  latent_scale: Array | None = None,
  block: int | None = None,
  chunk: int | None = None,
  driver: str | None = None,
  interpret: bool | None = None,
  value_block: int | None = None,
  latent_block: int | None = None,
) -> Array:
  """`kernels.latte.bidirectional_latte` with impl="pallas" (arguments checked there): q, k [B,T,H,L],
  v [B,T,H,D], mask bool [B,T] -> [B,T,H,D] in v's dtype. `block`: the time block of the reduction
  (at most the next power of two >= T; default `default_block()`). With `segments` int[B,T] (packed
  documents) the linear sums run in blocks of `chunk` tokens (default `default_block(segmented=True)`).
  `latent_scale` [B,T,H,L] times p(l|t). "loop" driver: value columns and latents per program (the
  reduction) or per group (the linear sums), default `toolkit.GPU_TILES`."""
  block = default_block() if block is None else block
  chunk = default_block(segmented=True) if chunk is None else chunk
  options = (("block", block), ("chunk", chunk)) + tuple(zip(("driver", "interpret"), _options(driver, interpret)))
  options += (("tiles", _loop_tiles("bidirectional_latte", value_block, latent_block)),)
  return _bidirectional(q, latte_xla.masked_keys(k, mask), v, segments, latent_scale, options)
