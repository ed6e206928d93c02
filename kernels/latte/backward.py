"""Latte's backward kernels: the gradient of bidirectional Latte's summary, from the forward's residuals, and
causal Latte's gradient as two scans.

Bidirectional Latte (no packed documents) reduces the sequence to one summary per latent l,

  S_l = sum_s a_sl v_s,   a_sl = exp(k_sl - m_l) / den_l   (a softmax over time; m_l, den_l the forward's
                                                          running max and normaliser),

and the output y_t = sum_l p(l|t) S_l is an XLA product outside the kernel, whose own gradient gives
dS_l = sum_t p(l|t) dy_t. The summary's gradient needs no scan:

  dv_s  = sum_l a_sl dS_l                        [C,L] x [L,D]: one matmul per block
  dk_sl = a_sl (v_s . dS_l - S_l . dS_l)          [C,D] x [D,L]: one matmul per block

so every time block is an independent program: grid (B, H / g, T / C), all axes parallel (on GPU that many
programs; on TPU either core takes any). The forward keeps only m, den [1,L] and S [D,L] per (batch, head),
O(B H L D), never a [T,L] weight matrix; a is recomputed from k in the block.

Layout: the kernel reads k [B,T,H,L] and v [B,T,H,D] as they are (viewed as [B,T,H*L] and [B,T,H*D], no
copy) and writes dk, dv the same way. A program takes g heads side by side: its blocks are [C, g*L] and
[C, g*D], and dS enters as the block-diagonal [g*D, g*L] of those heads' dS (zeros off the diagonal), so
one matmul serves them all and no head reads another's summary. g = 1 on GPU (Triton tiles a head's L and
D, powers of two); on TPU the fewest heads whose lanes fill whole 128-wide tiles (a Mosaic block's last
dimension is a multiple of 128 or the whole axis), e.g. 2 heads of 64 latents: the block-diagonal product
then does g times a head's matmul work, on the MXU.

The last time block may run past T: its rows beyond T read whatever lies there and are never written back,
and every row's gradient depends on its own k and v only. kernels/latte/pallas.py wires this kernel into
`jax.custom_vjp`; the XLA form's VJP is the tests' oracle.

Causal Latte (no packed documents; `causal_dp_block`, `causal_grad_block`). Token t's output is
y_t = sum_l p_tl N_tl / Z_tl with the sums over s <= t and the carried state (num0, den0 at max m0):

  N_tl = a_tl num0_l + sum_s w_tsl v_s,   Z_tl = a_tl den0_l + sum_s w_tsl,
  w_tsl = exp(k_sl - M_tl),  a_tl = exp(m0_l - M_tl),  M_tl the running max (a constant of the gradient:
  it cancels in N / Z, and the XLA form stops its gradient too).

With g_t = dy_t, rho_tl = p_tl / Z_tl and dp_tl = g_t . N_tl / Z_tl (the gradient to p):

  dv_s  = sum_{t >= s} sum_l w_tsl rho_tl g_t
  dk_sl = sum_{t >= s} w_tsl rho_tl (g_t . v_s - dp_tl)
  dnum0_l = sum_t a_tl rho_tl g_t,  dden0_l = -sum_t a_tl rho_tl dp_tl,  dm0_l = num0_l . dnum0_l + den0_l dden0_l

dp needs N_t, which only a forward scan has, and the sums over t >= s a reverse one, so the gradient is two
kernels (on the grid driver `causal_dp_block`, `causal_grad_block`; on the loop driver, GPU,
`causal_dp_groups`, `causal_grad_groups`, per latent group): the forward scan once more, its state on chip, writing
dp, rho, M and the carried scale exp(m_past - M_t) per token ([T,L] each: no [T,L,D] and no C x C x L
weights leave the chip); then the blocks from last to first, carrying the adjoints of num and den from the
later blocks scaled to the block's end max E (every exponent <= 0: w_tsl = exp(k_sl - E) exp(E - M_tl)):

  gnum [D,L] = sum_{t later} exp(E - M_tl) rho_tl g_t,   gden [1,L] = sum_{t later} exp(E - M_tl) rho_tl dp_tl
  dv_s += sum_l exp(k_sl - E) gnum_l,   dk_sl += exp(k_sl - E) (v_s . gnum_l - gden_l)
  and on to the block before: gnum <- exp(E' - E) gnum + sum_t carried_tl rho_tl g_t (E' its end max)

After the first block gnum, gden are dnum0 and -dden0.

On the loop driver a program owns a tile of Dv value columns (kernels/latte/gpu_loop.py: Triton keeps a
matmul's whole contraction in registers, so none runs over all of D). Everything per value column (num,
gnum, dv) stays in its tile; the two sums over D, dp_tl's g_t . N_tl and dk's g_t . v_s, come out as each
tile's part ([T,L] per tile) and XLA adds the parts after the call; dk's dp and gden terms are added by the
first tile only.
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
LANES = 128  # a TPU tile's minor dimension


def heads_per_program(heads: int, latents: int, width: int) -> int:
  """g for the target (see the module docstring): 1 on GPU; on TPU (and in interpret mode, which checks the
  same blocks) the fewest heads dividing `heads` whose latents and values fill whole 128-lane tiles, else
  all of them (a block of the whole axis)."""
  if toolkit.platform() == "gpu":
    return 1
  for g in range(1, heads + 1):
    if heads % g == 0 and (g * latents) % LANES == 0 and (g * width) % LANES == 0:
      return g
  return heads


def block_diagonal(ds: Array, g: int) -> Array:
  """ds [B,H,D,L] -> [B,H/g,g*D,g*L]: each group of g heads' dS on the diagonal, zeros elsewhere."""
  b, h, d, l = ds.shape
  grouped = ds.reshape(b, h // g, g, d, 1, l)
  diagonal = jnp.eye(g, dtype=ds.dtype)[:, None, :, None]  # [g,1,g,1]: head a's rows meet head c's columns if a = c
  return (grouped * diagonal).reshape(b, h // g, g * d, g * l)  # a product by 0 or 1, no matmul


def summary_grad_block(k: Array, v: Array, mx: Array, den: Array, sds: Array, ds: Array) -> tuple[Array, Array]:
  """One block of C tokens of g heads: k [C,gL] (float32), v [C,gD], mx, den, sds [1,gL] (sds_l = S_l . dS_l),
  ds [gD,gL] (block-diagonal) -> dk [C,gL], dv [C,gD], both float32."""
  a = jnp.exp(k - mx) / den  # [C,gL], <= 1: the forward's softmax over time, block by block
  dk = a * (tpu_grid.dot(v.astype(f32), ds, (1, 0)) - sds)
  dv = tpu_grid.dot(a, ds, (1, 1))  # a dS^T without a transpose
  return dk, dv


def causal_dp_block(
  state,
  p: Array,
  k: Array,
  k_rows: Array,
  v: Array,
  v_rows: Array,
  g: Array,
  doc: Array | None = None,
  doc_rows: Array | None = None,
  cont: Array | None = None,
):
  """The forward scan once more (`tpu_grid.causal_block`'s state and weights, its packed documents too),
  writing what the reverse scan reads: g [C,D] the output's cotangent -> state, {dp, rho, m, carried} [C,L]
  (see the module docstring)."""
  num, den, mx = state
  k, v, g = k.astype(f32), v.astype(f32), g.astype(f32)
  within, carried, m, total = tpu_grid.causal_weights(mx, den, k_rows, doc, doc_rows, cont)
  gv = (v_rows.astype(f32) * g[None]).sum(-1, keepdims=True)  # [Cs,Ct,1]: g_t . v_s
  dp = ((within * gv).sum(0) + carried * tpu_grid.dot(g, num, (1, 0))) / total
  end = tpu_grid.causal_end(num, den, mx, k, v, doc, cont)
  return end, {"dp": dp, "rho": p / total, "m": m, "carried": carried}


def causal_grad_block(
  state,
  k: Array,
  v: Array,
  g: Array,
  g_rows: Array,
  rho_rows: Array,
  dp: Array,
  dp_rows: Array,
  m_rows: Array,
  rho: Array,
  m: Array,
  carried: Array,
  doc: Array | None = None,
  doc_rows: Array | None = None,
):
  """One block of the reverse scan: state (gnum [D,L], gden [1,L]) from the later blocks; k [C,L], v, g [C,D];
  the first kernel's rho, dp, m, carried [C,L]; the "_rows" [C,1,.] one token per leading index; with packed
  documents doc [C,1] (and its rows) -> state before the block, {dk [C,L], dv [C,D]}. The weights are
  [Ct,Cs,L], the query token t leading, so that every sum over t adds whole tiles (as
  `tpu_grid.causal_block`'s sums over s). The carried scale is 0 where a token starts a document, so the
  adjoints reach only the tokens of the document that continues across the block's start."""
  gnum, gden = state
  k, v, g = k.astype(f32), v.astype(f32), g.astype(f32)
  c = k.shape[0]
  causal = jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0) >= jax.lax.broadcasted_iota(
    jnp.int32, (c, c, 1), 1
  )  # [Ct,Cs,1]: s <= t
  if doc is not None:
    causal = causal & (doc_rows == doc[None])  # and s in t's document
  within = tpu_grid.masked_exp(k[None] - m_rows, causal)  # [Ct,Cs,L]; k_s - M_t for s > t can overflow
  gv = (g_rows.astype(f32) * v[None]).sum(-1, keepdims=True)  # [Ct,Cs,1]: g_t . v_s
  dk = (within * rho_rows * (gv - dp_rows)).sum(0)
  dv = ((within * rho_rows).sum(-1, keepdims=True) * g_rows.astype(f32)).sum(0)
  # the later blocks, through the block's end max E: exp(k_s - E) <= 1 for the keys the state after the block
  # sums (with packed documents those of the document open at its end; masked before exp, the others' can
  # overflow)
  end = tpu_grid.last_row(m)
  x = jnp.exp(k - end) if doc is None else tpu_grid.masked_exp(k - end, doc == tpu_grid.last_row(doc))
  dk = dk + x * (tpu_grid.dot(v, gnum, (1, 0)) - gden)
  dv = dv + tpu_grid.dot(x, gnum, (1, 1))
  decay = tpu_grid.last_row(carried)  # exp(E' - E): the scale of the block before
  w = carried * rho
  return (decay * gnum + tpu_grid.dot(g, w, (0, 0)), decay * gden + (w * dp).sum(0, keepdims=True)), {
    "dk": dk,
    "dv": dv,
  }


def causal_dp_groups(state, p: Callable, k: Callable, v: Callable, g: Callable, doc=None, cont=None, *, lead):
  """`causal_dp_block` on the loop driver (GPU), per latent group, for one program's value tile: state ((num
  [Dv,Lg], den, max [1,Lg]) per group), the loaders of `gpu_loop` -> state, {dp: this tile's part (the sums
  over D split by the tiles, added after the call), rho, m, carried: per group [C,Lg]}. `lead` unused: every
  part of dp is a sum over this tile's columns."""
  del lead
  v, g = v().astype(f32), g().astype(f32)
  gv = tpu_grid.dot(v, g, (1, 1))[:, :, None]  # [Cs,Ct,1]: g_t . v_s over the tile, contracting Dv only
  doc_rows = None
  if doc is not None:
    doc, cont = doc(), cont()
    doc_rows = doc[:, None]
  new, outs = [], {n: [] for n in ("dp", "rho", "m", "carried")}
  for i, (num, den, mx) in enumerate(state):
    kg = k(i).astype(f32)
    within, carried, m, total = tpu_grid.causal_weights(mx, den, kg[:, None], doc, doc_rows, cont)
    outs["dp"].append(((within * gv).sum(0) + carried * tpu_grid.dot(g, num, (1, 0))) / total)
    outs["rho"].append(p(i) / total)
    outs["m"].append(m)
    outs["carried"].append(carried)
    new.append(tpu_grid.causal_end(num, den, mx, kg, v, doc, cont))
  return tuple(new), {n: tuple(x) for n, x in outs.items()}


def causal_grad_groups(
  state,
  k: Callable,
  v: Callable,
  g: Callable,
  rho: Callable,
  dp: Callable,
  m: Callable,
  carried: Callable,
  doc: Callable | None = None,
  *,
  lead,
):
  """`causal_grad_block` on the loop driver, per latent group, for one program's value tile: state ((gnum
  [Dv,Lg], gden [1,Lg]) per group) -> state, {dk: this tile's part, per group [C,Lg]; dv [C,Dv]}. The weights
  are [Cs,Ct,Lg] as in `gpu_loop.causal_groups`. dk_sl sums w rho (g_t . v_s - dp_tl) over t: g . v splits
  over the value tiles, the dp term (and gden's) is added by the `lead` tile only."""
  v, g = v().astype(f32), g().astype(f32)
  c = v.shape[0]
  causal = jax.lax.broadcasted_iota(jnp.int32, (c, c, 1), 0) <= jax.lax.broadcasted_iota(
    jnp.int32, (c, c, 1), 1
  )  # [Cs,Ct,1]: s <= t
  last = None
  if doc is not None:
    doc = doc()
    causal = causal & (doc[:, None] == doc[None])  # and s in t's document
    last = doc == tpu_grid.last_row(doc)  # the document open at the block's end
  gv = tpu_grid.dot(v, g, (1, 1))[:, :, None]  # [Cs,Ct,1]: g_t . v_s over the tile
  weights, dv, new, dks = jnp.zeros((c, c), f32), jnp.zeros(v.shape, f32), [], []
  for i, (gnum, gden) in enumerate(state):
    kg, rho_i, dp_i, m_i, carried_i = k(i).astype(f32), rho(i), dp(i), m(i), carried(i)
    wr = tpu_grid.masked_exp(kg[:, None] - m_i[None], causal) * rho_i[None]  # k_s - M_t for s > t can overflow
    once = jnp.where(lead, dp_i, 0.0)  # [Ct,Lg]: the dp term, on one tile
    dk = (wr * (gv - once[None])).sum(1)
    weights = weights + wr.sum(-1)  # sum_l w rho over the groups, [Cs,Ct]: one matmul with g after the loop
    end = tpu_grid.last_row(m_i)  # the block's end max E [1,Lg]
    x = jnp.exp(kg - end) if last is None else tpu_grid.masked_exp(kg - end, last)
    dk = dk + x * (tpu_grid.dot(v, gnum, (1, 0)) - jnp.where(lead, gden, 0.0))
    dv = dv + tpu_grid.dot(x, gnum, (1, 1))
    decay, w = tpu_grid.last_row(carried_i), carried_i * rho_i
    new.append((decay * gnum + tpu_grid.dot(g, w, (0, 0)), decay * gden + (w * dp_i).sum(0, keepdims=True)))
    dks.append(dk)
  return tuple(new), {"dk": tuple(dks), "dv": dv + tpu_grid.dot(weights, g, (1, 0))}


def causal_grad(
  init: dict[str, Array], xs: dict[str, Array], *, chunk: int, scan: Callable
) -> tuple[Array, Array, Array, dict[str, Array]]:
  """The carried state `init` (num [B,H,D,L], den, max [B,H,1,L]) and head-major inputs `xs`, time padded to
  whole blocks: p, k [B,H,T,L] (k padded below every key), v and the cotangent g [B,H,T,D] float32, with
  packed documents doc, cont [B,H,T,1] (`tpu_grid.causal_block`'s) -> dp, dk [B,H,T,L], dv [B,H,T,D], and
  the gradient to the state {num, den, max} in its layout. `scan(steps, init, xs, ys, rows=, partial=,
  final=, reverse=, chunk=, name=, cost=)` runs a (grid, loop) pair of block steps on the chosen driver
  (kernels/latte/pallas.py)."""
  l, d = xs["p"].shape[-1], xs["v"].shape[-1]
  # per token: the forward's weights and sums (3 C L + 2 C D + 4 L D), g . v (2 C D), g num (2 L D)
  cost = lambda n: (n * (3 * chunk * l + 4 * chunk * d + 6 * l * d), n * (chunk * l + 3 * l))
  ys = {name: (l, f32) for name in ("dp", "rho", "m", "carried")}
  first = scan(
    (causal_dp_block, causal_dp_groups),
    init,
    xs,
    ys,
    rows=("k", "v", "doc"),
    partial=("dp",),
    final=False,
    chunk=chunk,
    name="causal_latte_backward_dp",
    cost=cost,
  )
  adjoint = {"num_grad": jnp.zeros_like(init["num"]), "den_grad": jnp.zeros_like(init["den"])}
  xs = {n: xs[n] for n in ("k", "v", "g", "doc") if n in xs} | first  # the reverse scan needs no cont
  # per token: the weights (C L), g . v (2 C D), dk's and dv's sums (4 C L + 2 C D), the later blocks (4 L D),
  # the adjoints' update (2 L D)
  cost = lambda n: (n * (5 * chunk * l + 4 * chunk * d + 6 * l * d), n * (chunk * l + l))
  out = scan(
    (causal_grad_block, causal_grad_groups),
    adjoint,
    xs,
    {"dk": (l, f32), "dv": (d, f32)},
    rows=("g", "rho", "dp", "m", "doc"),
    partial=("dk",),
    final=True,
    reverse=True,
    chunk=chunk,
    name="causal_latte_backward",
    cost=cost,
  )
  dnum, dden = out["num_grad"], -out["den_grad"]
  dmax = (init["num"] * dnum).sum(2, keepdims=True) + init["den"] * dden
  return first["dp"], out["dk"], out["dv"], {"num": dnum, "den": dden, "max": dmax}


def _kernel(*refs, names):
  x, out = toolkit.named_refs(refs, *names)
  dk, dv = summary_grad_block(*(x[n][...] for n in ("k", "v", "max", "den", "sds", "ds")))
  out["dk"][...] = dk
  out["dv"][...] = dv.astype(out["dv"].dtype)


def summary_grad(
  k: Array,
  v: Array,
  mx: Array,
  den: Array,
  s: Array,
  ds: Array,
  *,
  block: int,
  interpret: bool,
  heads_per_program: int,
) -> tuple[Array, Array]:
  """k [B,T,H,L] float32, v [B,T,H,D]; the forward's mx, den [B,H,1,L] and summary s [B,H,D,L]; its cotangent
  ds [B,H,D,L] -> dk [B,T,H,L] float32, dv [B,T,H,D] in v's dtype (`summary_grad_block` on every block)."""
  b, t, h, l = k.shape
  d = v.shape[-1]
  g = heads_per_program
  # A short sequence is one block: on TPU of the whole axis, on GPU of the next power of two (Triton takes no
  # other sizes; the rows past the end are masked).
  c = min(block, pl.next_power_of_2(t) if toolkit.platform() == "gpu" else t)
  ds = ds.astype(f32)
  rows = lambda x: x.reshape(b, 1, h * l)  # [B,H,1,L] -> [B,1,H*L]: the same bytes
  timed = lambda width: pl.BlockSpec((None, c, g * width), lambda i, j, r: (i, r, j))
  per_group = lambda shape: pl.BlockSpec((None, None) + shape, lambda i, j, r: (i, j, 0, 0))
  inputs, outputs = toolkit.Inputs(), toolkit.Outputs()
  inputs.add("k", k.reshape(b, t, h * l), timed(l))
  inputs.add("v", v.reshape(b, t, h * d), timed(d))
  for name, x in (("max", mx), ("den", den), ("sds", (s * ds).sum(2, keepdims=True))):
    inputs.add(name, rows(x), pl.BlockSpec((None, 1, g * l), lambda i, j, r: (i, 0, j)))
  inputs.add("ds", block_diagonal(ds, g), per_group((g * d, g * l)))
  outputs.add("dk", jax.ShapeDtypeStruct((b, t, h * l), f32), timed(l))
  outputs.add("dv", jax.ShapeDtypeStruct((b, t, h * d), v.dtype), timed(d))
  # per token and head: a (one exp per latent), v dS and a dS^T (2 g D L each: the block-diagonal's zeros too)
  flops = b * t * h * (4 * g * l * d + 4 * l)
  call = pl.pallas_call(
    functools.partial(_kernel, names=toolkit.ref_names(inputs, outputs)),
    out_shape=outputs.shapes,
    grid=(b, h // g, pl.cdiv(t, c)),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    compiler_params=toolkit.compiler_params(3, sequential=False, kernel="bidirectional_latte"),
    interpret=interpret,
    cost_estimate=toolkit.cost_estimate(flops, b * t * h * l, [*inputs.arrays, *outputs.shapes]),
    name="bidirectional_latte_backward",
  )
  dk, dv = call(*inputs.arrays)
  return dk.reshape(b, t, h, l), dv.reshape(b, t, h, d)
