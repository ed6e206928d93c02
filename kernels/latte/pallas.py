"""Latte as Pallas kernels: one scan over time blocks per (batch, head), its state on chip. This file holds
the public functions, their gradients and the layout both drivers read; the block steps and drivers are
kernels/latte/tpu_grid.py (TPU, interpret mode) and kernels/latte/gpu_loop.py (GPU).

Both kernels walk the time blocks of one (batch, head) in order with a small carried state per latent l,
the stable pair of eq. 12 scaled by the running max of the key logits (Appendix B.2, `tpu_grid`):
num [D,L], den [1,L], max [1,L].

Causal (`causal_latte`): block r of C tokens reads p = softmax_l(q) (taken here), k and v. Inside the
block the running max is per token and the weights exp(k_s - m_t), s <= t, are exact; the past enters
through the state rescaled by exp(m_past - m_t) <= 1, so every exponent is <= 0 whatever the logit range,
as in `kernels.latte.reference.latte_chunk`.

Bidirectional (`bidirectional_latte`): the same online update reduces the whole sequence to the summary
sum_s softmax_s(k_sl) v_s = num / den per latent; masked keys are set to NEG before the kernel, as in the
reference. The final softmax_l(q) @ summary is an XLA einsum.

Packed documents (`segments`): each token carries its document's index and whether it continues the
document of the carried state (`_document_columns`, from `kernels.latte.reference.chunk_documents`). Causal:
the block weights and running max keep to each token's document, the carried state reaches only the
tokens that continue it, and the state after the block sums the document open at its end.
Bidirectional: the per-document max and normaliser of the keys are O(T L) XLA reductions
(`kernels.latte.reference.bidirectional_parts`), and a third kernel (the linear step) runs the linear sums
y_t = sum_{s in doc(t)} (r_t . e_s) v_s over the blocks, once forward (s <= t) and once over the
reversed sequence (s > t), with the open document's sum num [D,L] as its state.

Drivers (kernels/toolkit.py): "grid" (TPU, and interpret mode), grid (B, H, blocks), the state in scratch
across the sequential block axis; "loop" (GPU), a program loops over the blocks of its whole [T, .]
slices with the state in loop values, its steps laid out for Triton's registers (kernels/latte/gpu_loop.py).

Backward: bidirectional Latte without documents differentiates only its summary with a kernel
(kernels/latte/backward.py: parallel over the time blocks, from the forward's max, normaliser and summary);
softmax_l(q) and the product with the summary are XLA's, with XLA's VJP. With packed documents the linear
sums are their own gradient's kernels: y = A v with A_ts = r_t . e_s over each document, so dr, de and dv
are the same sums of other operands (`_linear_sums_bwd`), on either driver. Causal Latte, with or without
packed documents, differentiates with two kernels of kernels/latte/backward.py on either driver: the
forward scan once more, writing dp, rho, the running max and the carried scale per token, then a reverse
scan carrying the adjoints of num and den; p(l|t) is XLA's here too. On the loop driver each program owns a
tile of value columns, so the two sums over D (dp, and dk's g . v) come out per tile and XLA adds them.

Inputs of any float dtype; the kernels compute in float32 (matmuls at HIGHEST precision: no TF32 on GPU)
and return v's dtype. Time blocks: the causal kernel's is `chunk` (`default_chunk`), the bidirectional
reduction's min(block, the power of two >= T) and the linear sums' `chunk` (`default_block`). On GPU
(Triton) the blocks and L should be powers of two; on TPU the chunk a multiple of 8 (16 for bf16 values).
The kernels compile with Mosaic (scripts/check_lowering.py, docs/kernels.md) and with XLA:GPU + Triton +
ptxas for the H100 and A100 without spills at the papers' sizes (lra_core/bench/gpu_compile.py); their
numbers are tested in interpret mode under both drivers.

This file imports the reference, kernels/latte/reference.py; kernels/latte/__init__.py checks the arguments and
dispatches between the two on `impl`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import per_device, toolkit
from lra_core.kernels.latte import backward, gpu_loop, reference, spans, tpu_grid

Array = jax.Array
f32 = jnp.float32
NEG = reference.NEG
# Time padding: below every key, masked ones (NEG) included, so a padded key weighs exactly 0 and a fully
# masked row still averages its real positions, as the reference does.
PAD = 2 * NEG
BLOCK = 128  # time block of the bidirectional reduction (off GPU)
DRIVERS = ("grid", "loop")  # of kernels/toolkit.py: no "parallel", the state crosses the blocks in order


def default_chunk() -> int:
  """The causal kernel's time block for the target: on GPU `toolkit.GPU_TILES` (its C x C weights per
  latent group are in registers), on TPU 32 (a multiple of the 8-row tiles; the C x C x L weights are in
  VMEM); interpret mode (CPU) 8, as the XLA form on CPU."""
  if toolkit.platform() == "gpu":
    return toolkit.gpu_tiles("causal_latte")["chunk"]
  return {"tpu": 32}.get(toolkit.platform(), 8)


def default_span(kernel: str = "causal_latte") -> int | None:
  """The span of `kernel`'s chunk-parallel passes on the target (kernels/latte/spans.py; "causal_latte" or
  "bidirectional_latte"): on GPU `toolkit.GPU_TILES`'s, so that a training shape launches enough programs to
  fill the SMs (a serial chain per batch row, head and value tile would not); None elsewhere (the TPU's grid
  driver runs one sequential block axis per core, and its batch and heads are parallel already)."""
  return toolkit.gpu_tiles(kernel)["span"] if toolkit.platform() == "gpu" else None


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


def _scan(
  driver: str,
  steps: tuple[Callable, Callable],
  init: dict[str, Array],
  xs: dict[str, Array],
  ys: dict[str, tuple[int, jnp.dtype]],
  *,
  rows: tuple[str, ...] = (),
  tiles: tuple[tuple[str, int], ...],
  kernel: str,
  latent_grid: bool = False,
  partial: tuple[str, ...] = (),
  **common,
) -> dict[str, Array]:
  """`tpu_grid.scan` or `gpu_loop.scan` by `driver`, with `steps` = (the grid step, the loop step) of one
  block step. `rows` is the grid driver's, `tiles`, `kernel`, `latent_grid` and `partial` the loop driver's;
  common: final, chunk, interpret, name, cost, reverse."""
  if driver == "grid":
    return tpu_grid.scan(steps[0], init, xs, ys, rows=rows, **common)
  return gpu_loop.scan(
    steps[1], init, xs, ys, tiles=dict(tiles), kernel=kernel, latent_grid=latent_grid, partial=partial, **common
  )


def _head_major(x: Array, t: int, value: float = 0.0) -> Array:
  """[B,T,H,X] -> [B,H,T',X], time padded to t with `value`."""
  x = x.swapaxes(1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, t - x.shape[2]), (0, 0)), constant_values=value)


def _options(driver: str | None, interpret: bool | None) -> tuple[str, bool]:
  return toolkit.driver(driver, drivers=DRIVERS), toolkit.interpret_default() if interpret is None else interpret


# -- causal -----------------------------------------------------------------------------------------


def _triton_width(v: Array, axis: int = -1) -> Array:
  """v [B,T,H,D] (or any array with D at `axis`) with D padded by zeros to a power of two on GPU (Triton takes
  no other sizes; the padded columns' outputs are zeros, cut afterwards), unchanged elsewhere."""
  d = v.shape[axis]
  if toolkit.platform() != "gpu" or d == pl.next_power_of_2(d):
    return v
  pad = [(0, 0)] * v.ndim
  pad[axis] = (0, pl.next_power_of_2(d) - d)
  return jnp.pad(v, pad)


def _document_columns(segments: Array, heads: int, chunk: int, t: int) -> dict[str, Array]:
  """segments int[B,T] -> {doc, cont} [B,H,T',1] in float32 for blocks of `chunk` tokens, T' = t (a multiple
  of chunk; the padding continues the last document): each token's document index, and 1 where it
  continues the document of the state carried into its block."""
  segments = jnp.pad(segments, ((0, 0), (0, t - segments.shape[1])), mode="edge")
  doc, cont = reference.chunk_documents(reference.documents(segments), chunk)
  b = doc.shape[0]
  # one row of ids per batch row, broadcast to every head (the drivers' blocks are per head)
  column = lambda x: jnp.broadcast_to(x.reshape(b, 1, -1, 1).astype(f32), (b, heads, t, 1))
  return {"doc": column(doc), "cont": column(cont)}


def _dims(tree: dict[str, Array]) -> dict[str, str]:
  """run_per_device's axes of head-major operands: batch and heads split, nothing else."""
  return {n: "bh" + "." * (x.ndim - 2) for n, x in tree.items()}


def _causal_inputs(p, k, v, state, chunk: int) -> tuple[dict[str, Array], dict[str, Array]]:
  """The causal scan's initial state [B,H,.,L] and head-major inputs, time padded to whole blocks of `chunk`
  and v to Triton's width (`_triton_width`)."""
  t = p.shape[1]
  tp = -(-t // chunk) * chunk
  v = _triton_width(v)
  num = jnp.pad(state["num"].astype(f32), [(0, 0)] * 3 + [(0, v.shape[-1] - state["num"].shape[-1])])
  init = {
    "num": num.swapaxes(-1, -2),  # [B,H,D,L]: every per-latent vector a row [1,L] (tpu_grid)
    "den": state["den"].astype(f32)[:, :, None],  # [B,H,1,L]
    "max": state["max"].astype(f32)[:, :, None],
  }
  xs = {"p": _head_major(p, tp), "k": _head_major(k.astype(f32), tp, PAD), "v": _head_major(v, tp)}
  return init, xs


def _causal_forward(
  p,
  k,
  v,
  state,
  segments,
  *,
  chunk: int,
  driver: str,
  interpret: bool,
  tiles: tuple[tuple[str, int], ...],
) -> Array:
  b, t, h, l = p.shape
  d = v.shape[-1]
  init, xs = _causal_inputs(p, k, v, state, chunk)
  if segments is not None:
    xs.update(_document_columns(segments, h, chunk, xs["k"].shape[2]))
  dp = xs["v"].shape[-1]
  # per token: the [C,L] block weights and their products with v (C D), the carried part and the state update
  cost = lambda n: (n * (3 * chunk * l + 2 * chunk * dp + 4 * l * dp), n * (chunk * l + 3 * l))
  run = functools.partial(
    _scan,
    driver,
    (tpu_grid.causal_block, gpu_loop.causal_groups),
    ys={"y": (dp, v.dtype)},
    rows=("k", "v", "doc"),
    final=False,
    chunk=chunk,
    interpret=interpret,
    name="causal_latte",
    cost=cost,
    kernel="causal_latte",
    tiles=tiles,
  )
  out = per_device.run_per_device(run, (init, xs), (_dims(init), _dims(xs)), {"y": "bh.."}, batch=b, heads=h)
  return out["y"][:, :, :t, :d].swapaxes(1, 2)  # the time padding and Triton's value padding cut


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _causal(p, k, v, state, segments, options):
  return _causal_forward(p, k, v, state, segments, **dict(options))


def _causal_fwd(p, k, v, state, segments, options):
  return _causal(p, k, v, state, segments, options), (p, k, v, state, segments)


def _causal_bwd(options, residuals, dy):
  """Two kernels (kernels/latte/backward.py `causal_grad`) on either driver: the forward scan once more and a
  reverse one."""
  p, k, v, state, segments = residuals
  opts = dict(options)
  b, t, h, _ = p.shape
  init, xs = _causal_inputs(p, k, v, state, opts["chunk"])
  tp = xs["k"].shape[2]
  xs["g"] = _head_major(_triton_width(dy.astype(f32)), tp)
  if segments is not None:
    xs.update(_document_columns(segments, h, opts["chunk"], tp))

  scan = functools.partial(
    _scan,
    opts["driver"],
    interpret=opts["interpret"],
    tiles=opts["tiles"],
    kernel="causal_latte",
  )

  def run(init, xs):
    dp, dk, dv, dstate = backward.causal_grad(init, xs, chunk=opts["chunk"], scan=scan)
    return {"dp": dp, "dk": dk, "dv": dv}, dstate

  grads, dstate = per_device.run_per_device(
    run,
    (init, xs),
    (_dims(init), _dims(xs)),
    ({"dp": "bh..", "dk": "bh..", "dv": "bh.."}, _dims(init)),
    batch=b,
    heads=h,
  )
  cut = lambda x, like: x[:, :, :t, : like.shape[-1]].swapaxes(1, 2).astype(like.dtype)
  dstate = {
    "num": dstate["num"].swapaxes(-1, -2)[..., : state["num"].shape[-1]].astype(state["num"].dtype),
    "den": dstate["den"][:, :, 0].astype(state["den"].dtype),
    "max": dstate["max"][:, :, 0].astype(state["max"].dtype),
  }
  return cut(grads["dp"], p), cut(grads["dk"], k), cut(grads["dv"], v), dstate, None


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
  state = reference.init_latte_state(b, h, l, v.shape[-1]) if state is None else state
  driver, interpret = _options(driver, interpret)
  # p(l|t) is XLA's, with its VJP (latent_scale's gradient too); the scan is the kernel
  return _causal(
    reference.latent_probs(q, latent_scale),
    k,
    v,
    state,
    segments,
    (
      ("chunk", chunk),
      ("driver", driver),
      ("interpret", interpret),
      ("tiles", _loop_tiles("causal_latte", value_block, latent_block)),
    ),
  )


# -- bidirectional ----------------------------------------------------------------------------------


def _reduction_block(block: int, t: int) -> int:
  """The bidirectional reduction's time block: a short sequence is one block (a power of two, for Triton)."""
  return min(block, pl.next_power_of_2(t))


def _summary_state(
  k, v, *, block: int, span: int | None, driver: str, interpret: bool, tiles: tuple[tuple[str, int], ...]
):
  """The reduction kernel on float32 keys k [B,T,H,L] (masked at NEG) and v [B,T,H,D] -> (S [B,H,D,L],
  den [B,H,1,L], max [B,H,1,L]): S_l = sum_s softmax_s(k_sl) v_s, and the normaliser and max it came from.
  With `span` < T each span of it is a row of its own and the rows' states merge after the kernel
  (kernels/latte/spans.py)."""
  b, t, h, l = k.shape
  d = v.shape[-1]
  v = _triton_width(v)
  c = _reduction_block(block, t)
  g, per_span = spans.count(t, span, c)
  dp = v.shape[-1]
  init = {
    "num": jnp.zeros((b, h, dp, l), f32),
    "den": jnp.zeros((b, h, 1, l), f32),
    "max": jnp.full((b, h, 1, l), NEG, f32),  # no key yet: the first block's max replaces it
  }
  xs = {"k": _head_major(k, g * per_span, PAD), "v": _head_major(v, g * per_span)}
  cost = lambda n: (n * 2 * l * dp, n * l)  # per token: v^T exp(k - m), one exp per latent
  scan = functools.partial(
    _scan,
    driver,
    (tpu_grid.summary_block, gpu_loop.summary_groups),
    ys={},
    final=True,
    chunk=c,
    interpret=interpret,
    name="bidirectional_latte",
    cost=cost,
    kernel="bidirectional_latte",
    tiles=tiles,
    latent_grid=True,  # the reduction is independent per latent: a latent tile per program
  )

  def run(init, xs):  # this device's rows
    if g == 1:
      return scan(init, xs)
    init = {n: jnp.repeat(x, g, axis=1) for n, x in init.items()}  # every span starts empty
    return spans.merge_rows(scan(init, {n: spans.rows(x, g) for n, x in xs.items()}), g)

  state = per_device.run_per_device(run, (init, xs), (_dims(init), _dims(xs)), _dims(init), batch=b, heads=h)
  return state["num"][:, :, :d] / state["den"], state["den"], state["max"]  # den >= 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _summary(k, v, options, grad_heads):
  return _summary_state(k, v, **dict(options))[0]


def _summary_fwd(k, v, options, grad_heads):
  s, den, mx = _summary_state(k, v, **dict(options))
  return s, (k, v, s, den, mx)  # O(B H L D) kept: no [T,L] weights


def _summary_bwd(options, grad_heads, residuals, ds):
  """The summary's gradient as a kernel (kernels/latte/backward.py), parallel over the time blocks, on k
  and v in their own layout."""
  k, v, s, den, mx = residuals
  b, t, h, l = k.shape
  d = v.shape[-1]
  opts = dict(options)

  def run(k, v, mx, den, s, ds):
    g = grad_heads or backward.heads_per_program(k.shape[2], l, v.shape[-1])  # this device's heads
    return backward.summary_grad(
      k, v, mx, den, s, ds, block=opts["block"], interpret=opts["interpret"], heads_per_program=g
    )

  # Triton's value padding (GPU only): zero columns of v, s and ds, whose dv columns are cut below
  args = (k, _triton_width(v), mx, den, _triton_width(s, axis=2), _triton_width(ds.astype(f32), axis=2))
  dims = ("bth.", "bth.", "bh..", "bh..", "bh..", "bh..")
  dk, dv = per_device.run_per_device(run, args, dims, ("bth.", "bth."), batch=b, heads=h)
  return dk.astype(k.dtype), dv[..., :d]


_summary.defvjp(_summary_fwd, _summary_bwd)


def _linear_sums_forward(
  r,
  e,
  v,
  segments,
  *,
  chunk: int,
  span: int | None,
  driver: str,
  interpret: bool,
  tiles: tuple[tuple[str, int], ...],
) -> Array:
  """y_t = sum_{s in doc(t)} (r_t . e_s) v_s for r, e [B,T,H,X] and v [B,T,H,Y] -> float32 [B,T,H,Y]: the
  linear step forward (s <= t) and over the reversed sequence (s > t). X and Y are the latents and the
  value width in the forward; the gradient swaps them (`_linear_sums_bwd`). With `span` < T each span is a
  row of its own, started from the sums the spans before it leave (kernels/latte/spans.py)."""
  b, t, h, _ = r.shape
  y_width = v.shape[-1]
  r, e, v = _triton_width(r.astype(f32)), _triton_width(e.astype(f32)), _triton_width(v)  # zeros add nothing
  x, yp = r.shape[-1], v.shape[-1]
  g, per_span = spans.count(t, span, chunk)
  tp = g * per_span
  init = {"num": jnp.zeros((b, h, yp, x), f32)}
  # per token: r_t . e_s over the block (C X), their products with v (C Y), the carried part, the state update
  cost = lambda n: (n * (2 * chunk * x + 2 * chunk * yp + 4 * x * yp), 0)
  outs = []
  for strict in (False, True):
    # The later tokens of a document are the earlier ones of the reversed sequence, strictly (s = t counted once).
    order = (lambda z: jnp.flip(z, axis=1)) if strict else (lambda z: z)
    xs = {"r": _head_major(order(r), tp), "e": _head_major(order(e), tp), "v": _head_major(order(v), tp)}
    xs.update(_document_columns(order(segments), h, chunk, tp))
    scan = functools.partial(
      _scan,
      driver,
      tuple(functools.partial(step, strict=strict) for step in (tpu_grid.linear_block, gpu_loop.linear_groups)),
      ys={"y": (yp, f32)},
      rows=("e", "v", "doc"),
      final=False,
      chunk=chunk,
      interpret=interpret,
      name="bidirectional_latte_documents",
      cost=cost,
      kernel="bidirectional_latte",
      tiles=tiles,
    )

    def run(init, xs, scan=scan):  # this device's rows
      if g == 1:
        return scan(init, xs)
      init = {"num": spans.linear_starts(xs["e"], xs["v"], xs["doc"], g)}
      y = scan(init, {n: spans.rows(x, g) for n, x in xs.items()})["y"]
      return {"y": y.reshape(y.shape[0], -1, tp, y.shape[-1])}  # [B,H G,S,Y] -> [B,H,T,Y]

    y = per_device.run_per_device(run, (init, xs), (_dims(init), _dims(xs)), {"y": "bh.."}, batch=b, heads=h)["y"]
    outs.append(order(y[:, :, :t, :y_width].swapaxes(1, 2)))
  return outs[0] + outs[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear_sums(r, e, v, segments, options):
  return _linear_sums_forward(r, e, v, segments, **dict(options))


def _linear_sums_fwd(r, e, v, segments, options):
  return _linear_sums(r, e, v, segments, options), (r, e, v, segments)


def _linear_sums_bwd(options, residuals, dy):
  """y = A v with A_ts = r_t . e_s over each document, so each gradient is the same sums of other operands
  (the kernels of the forward, X and Y swapped where they differ):

    dr_t = sum_s (dy_t . v_s) e_s,   de_s = sum_t (v_s . dy_t) r_t,   dv_s = sum_t (e_s . r_t) dy_t
  """
  r, e, v, segments = residuals
  sums = lambda a, b, c: _linear_sums_forward(a, b, c, segments, **dict(options))
  dy = dy.astype(f32)
  return sums(dy, v, e).astype(r.dtype), sums(v, dy, r).astype(e.dtype), sums(e, r, dy).astype(v.dtype), None


_linear_sums.defvjp(_linear_sums_fwd, _linear_sums_bwd)


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
  grad_heads: int | None = None,
  span: int | None = None,
) -> Array:
  """`kernels.latte.bidirectional_latte` with impl="pallas" (arguments checked there): q, k [B,T,H,L],
  v [B,T,H,D], mask bool [B,T] -> [B,T,H,D] in v's dtype. `block`: the time block of the reduction
  (at most the next power of two >= T; default `default_block()`). With `segments` int[B,T] (packed
  documents) the linear sums run in blocks of `chunk` tokens (default `default_block(segmented=True)`).
  `latent_scale` [B,T,H,L] times p(l|t). "loop" driver: value columns and latents per program (the
  reduction) or per group (the linear sums), default `toolkit.GPU_TILES`. `grad_heads`: heads per program of
  the summary's backward kernel (default per target, `backward.heads_per_program`; it must divide the heads
  each device holds). `span`: the tokens per chunk-parallel pass of the reduction and the linear sums
  (kernels/latte/spans.py; default `default_span`, on GPU only)."""
  # What both forms share; each adds its time block (hashable tuples: custom_vjp's static arguments).
  common = tuple(zip(("driver", "interpret"), _options(driver, interpret)))
  common += (("tiles", _loop_tiles("bidirectional_latte", value_block, latent_block)),)
  common += (("span", default_span("bidirectional_latte") if span is None else span),)
  k = reference.masked_keys(k, mask)
  if segments is not None:
    # The O(T L) per-document max and normaliser are XLA's (with their VJP); the linear sums, forward and
    # gradient, are the kernels.
    chunk = default_block(segmented=True) if chunk is None else chunk
    r, e, _ = reference.bidirectional_parts(reference.latent_probs(q, latent_scale), k.astype(f32), segments)
    return _linear_sums(r, e, v, segments, (("chunk", chunk), *common)).astype(v.dtype)
  block = default_block() if block is None else block
  # The summary is the kernel (its gradient too); p(l|t) and the product with it are XLA's, with their VJP.
  summary = _summary(k, v, (("block", block), *common), grad_heads)  # [B,H,D,L]
  return jnp.einsum("bthl,bhdl->bthd", reference.latent_probs(q, latent_scale), summary).astype(v.dtype)
