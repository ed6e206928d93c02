"""Latte's backward kernels: the gradient of bidirectional Latte's summary, from the forward's residuals.

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
"""

from __future__ import annotations

import functools

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
