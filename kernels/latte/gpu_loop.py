"""Latte's loop driver (GPU) and its block steps: a program loops over the time blocks of its whole [T, .]
slices with the state in loop values (Triton runs grid programs concurrently, so no carry could cross
them). kernels/latte/pallas.py holds the public functions and their gradients and calls this driver on
GPU (`toolkit.driver`); the TPU's is kernels/latte/tpu_grid.py, whose math the steps here run per latent group.

The steps are laid out for Triton, which keeps a program's values in registers:

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
  - No 3-D value has a D axis: the causal step's only one is its [Cs,Ct,Lg] weights of one group.

Every input comes to a step as a loader of the block's rows: `x()` all its columns, `x(g)` latent group
g's [C,Lg]. The sizes (chunk, value_block, latent_block, warps) are `toolkit.GPU_TILES`'s, powers of two; a
tile that does not divide its size (interpret mode) covers all of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.latte import tpu_grid

Array = jax.Array
f32 = jnp.float32
NEG = tpu_grid.NEG
dot = tpu_grid.dot

# The last two axes of each operand, by name: "v" value columns (tiled over the grid), "l" latents (in
# groups, or tiled over the grid), "." neither (whole in every program).
AXES = {
  "num": "vl",
  "den": ".l",
  "max": ".l",
  "p": ".l",
  "k": ".l",
  "r": ".l",
  "e": ".l",
  "v": ".v",
  "y": ".v",
  "doc": "..",
  "cont": "..",
  # the causal backward's (kernels/latte/backward.py)
  "g": ".v",
  "dv": ".v",
  "dp": ".l",
  "dk": ".l",
  "rho": ".l",
  "m": ".l",
  "carried": ".l",
  "num_grad": "vl",
  "den_grad": ".l",
}


# -- block steps: state per latent group, loaders of the block's inputs -> state, {output: [C,.]} ------


def causal_groups(
  state, p: Callable, k: Callable, v: Callable, doc: Callable | None = None, cont: Callable | None = None
):
  """`tpu_grid.causal_block` per latent group: state ((num [Dv,Lg], den [1,Lg], max [1,Lg]) per group), p,
  k [C,Lg] per group, v [C,Dv], with packed documents doc, cont [C,1] -> state, {y [C,Dv]}."""
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
    # sum_l r_tl w_stl adds up over the groups as [Cs,Ct], which meets v in one matmul after the loop
    weights = weights + (r * within).sum(-1)
    y = y + dot(r * carried, num, (1, 1))
    out.append(tpu_grid.causal_end(num, den, mx, kg, v, doc, cont))
  return tuple(out), {"y": y + dot(weights, v, (0, 0))}


def linear_groups(state, r: Callable, e: Callable, v: Callable, doc: Callable, cont: Callable, *, strict: bool):
  """`tpu_grid.linear_block` per latent group: state ((num [Dv,Lg],) per group), r, e [C,Lg] per group, v
  [C,Dv], doc, cont [C,1] -> state, {y [C,Dv]}."""
  v, doc, cont = v().astype(f32), doc(), cont()
  c = v.shape[0]
  t_index, s_index = (jax.lax.broadcasted_iota(jnp.int32, (c, c), axis) for axis in (0, 1))
  same = ((s_index < t_index) if strict else (s_index <= t_index)) & (doc == doc.T)  # [Ct,Cs]
  last, cont_last = doc == tpu_grid.last_row(doc), tpu_grid.last_row(cont) > 0
  scores, y, out = jnp.zeros((c, c), f32), jnp.zeros(v.shape, f32), []
  for g, (num,) in enumerate(state):
    rg, eg = r(g), e(g).astype(f32)
    scores = scores + dot(rg, eg, (1, 1))  # the block's r_t . e_s, [Ct,Cs], summed over the groups
    y = y + dot(jnp.where(cont > 0, rg, 0.0), num, (1, 1))
    out.append((jnp.where(cont_last, num, 0.0) + dot(v, jnp.where(last, eg, 0.0), (0, 0)),))
  return tuple(out), {"y": y + dot(jnp.where(same, scores, 0.0), v)}


def summary_groups(state, k: Callable, v: Callable):
  """`tpu_grid.summary_block` on the loop driver: one group (the grid tiles the latents)."""
  (group,) = state
  group, _ = tpu_grid.summary_block(group, k(), v())
  return (group,), {}


# -- the driver ---------------------------------------------------------------------------------------


def _kernel(
  *refs,
  names: tuple[tuple[str, ...], ...],
  step: Callable,
  state: tuple[str, ...],
  chunk: int,
  num_chunks: int,
  groups: int,
  shared: tuple[str, ...],
  reverse: bool,
  partial: tuple[str, ...],
):
  """Grid (B, H, value tiles, latent tiles): a loop over the blocks of the whole [T, .] slices (from the last
  if `reverse`), the state in loop values, a tuple over `groups` latent groups. Refs by name (`scan`); the
  outputs that are no state are written block by block (an output given per latent group, as a tuple, to
  its group's columns; one without value columns and not `partial` by the first value tile only), the final
  state (where declared) after the loop."""
  x, out = toolkit.named_refs(refs, *names)
  width = x[state[0]].shape[-1] // groups  # the state's last axis is the latents
  group = lambda g: pl.ds(g * width, width)
  xs = {n: ref for n, ref in x.items() if n not in state}
  ys = {n: ref for n, ref in out.items() if n not in state}
  lead = pl.program_id(2) == 0  # the first value tile
  extra = {"lead": lead} if partial else {}

  def store(ref, rows, y):
    if isinstance(y, tuple):  # per latent group
      for g, part in enumerate(y):
        ref[rows, group(g)] = part.astype(ref.dtype)
    else:
      ref[rows, :] = y.astype(ref.dtype)

  def body(r, values):
    r = num_chunks - 1 - r if reverse else r
    rows = pl.ds(pl.multiple_of(r * chunk, chunk), chunk)  # block r; multiple_of lets Triton align the loads
    load = lambda ref: lambda g=None: ref[rows] if g is None else ref[rows, group(g)]
    values, outs = step(values, **{n: load(ref) for n, ref in xs.items()}, **extra)
    for n, y in outs.items():
      if "v" in AXES[n] or n in partial:
        store(ys[n], rows, y)
      else:  # every value tile computed the same
        pl.when(lead)(functools.partial(store, ys[n], rows, y))
    return values

  init = tuple(tuple(x[n][:, group(g)] for n in state) for g in range(groups))
  values = jax.lax.fori_loop(0, num_chunks, body, init)

  def write(f, per_group):
    for g, value in enumerate(per_group):
      f[:, group(g)] = value

  for n, per_group in zip(state, zip(*values)):
    if n not in out:
      continue
    if n in shared:  # no value rows: every value tile computed the same, the first writes it
      pl.when(lead)(functools.partial(write, out[n], per_group))
    else:
      write(out[n], per_group)


def _tile(size: int, block: int) -> int:
  """`block` where it divides `size`, else all of it (interpret mode takes any size)."""
  return block if size % block == 0 else size


def scan(
  step: Callable,
  init: dict[str, Array],
  xs: dict[str, Array],
  ys: dict[str, tuple[int, jnp.dtype]],
  *,
  final: bool,
  chunk: int,
  interpret: bool,
  name: str,
  cost: Callable[[int], tuple[int, int]],
  tiles: dict[str, int],
  kernel: str,
  latent_grid: bool = False,
  reverse: bool = False,
  partial: tuple[str, ...] = (),
) -> dict[str, Array]:
  """`tpu_grid.scan`'s contract on the loop driver. Value columns go in tiles of tiles["value_block"]
  over a grid axis; the latents in groups of tiles["latent_block"], over a grid axis if `latent_grid`, else
  inside the step (each group of the state, p and k one by one). `init` holds the state's value rows
  (num [B,H,D,L] or num_grad). `partial`: the outputs without value columns that each value tile computes
  a part of (a sum over D, split by the tiles; every tile writes its part, summed here after the call);
  a step with any takes `lead`, true on the first value tile (for a term to add once). Triton launch
  parameters: `toolkit.compiler_params` of `kernel`."""
  b, h, t = next(iter(xs.values())).shape[:3]
  state = tuple(n for n in tpu_grid.STATE if n in init)
  d, l = init[state[0]].shape[2:]
  dv, lg = _tile(d, tiles["value_block"]), _tile(l, tiles["latent_block"])
  lt = lg if latent_grid else l  # the latents of one program
  if partial and latent_grid:
    raise ValueError("partial outputs are per value tile over all latents: not with a latent grid.")
  sizes = {"v": dv, "l": lt}

  def spec(shape, axes: str, part: bool = False):
    """The program's block: its value tile and latent tile, all of the time axis (a `partial` output: the
    value tile's own [T,L] columns)."""
    index = lambda i, j, jv, jl: (i, j) + tuple({"v": jv, "l": jv if part else jl}.get(c, 0) for c in axes)
    return pl.BlockSpec((None, None) + tuple(sizes.get(c, size) for c, size in zip(axes, shape[2:])), index)

  inputs, outputs = toolkit.Inputs(), toolkit.Outputs()
  for n, x in (*((n, init[n]) for n in state), *xs.items()):
    inputs.add(n, x, spec(x.shape, AXES[n]))
  for n, (width, dtype) in ys.items():
    shape = (b, h, t, width * (d // dv if n in partial else 1))  # a partial output: the tiles' parts side by side
    outputs.add(n, jax.ShapeDtypeStruct(shape, dtype), spec(shape, AXES[n], part=n in partial))
  written = list(outputs.shapes)
  if final:
    for n in state:
      outputs.add(n, jax.ShapeDtypeStruct(init[n].shape, f32), spec(init[n].shape, AXES[n]))
  shared = tuple(n for n in state if "v" not in AXES[n]) if final else ()
  call = pl.pallas_call(
    functools.partial(
      _kernel,
      names=toolkit.ref_names(inputs, outputs),
      step=step,
      state=state,
      chunk=chunk,
      num_chunks=t // chunk,
      groups=lt // lg,
      shared=shared,
      reverse=reverse,
      partial=partial,
    ),
    out_shape=outputs.shapes,
    grid=(b, h, d // dv, l // lt),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    compiler_params=toolkit.compiler_params(4, sequential=False, kernel=kernel),  # no carry across programs
    interpret=interpret,
    cost_estimate=toolkit.cost_estimate(*cost(b * h * t), [*inputs.arrays, *written]),
    name=name,
  )
  out = outputs.named(call(*inputs.arrays))
  for n in partial:
    out[n] = out[n].reshape(b, h, t, d // dv, -1).sum(3)
  return out
