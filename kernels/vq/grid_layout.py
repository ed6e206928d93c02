"""The grid kernels' inputs (kernels/vq/tpu_grid.py's forward, kernels/vq/grid_backward.py's two kernels): the
public layout turned head-major, the carried cache as sums, the documents' plan as ids each block step
compares elementwise, every input's block spec declared once, and what a block step reads from its refs.

Layout: head-major inside ([B,H,T,D]); query head h reads key-value head h // G.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import toolkit
from lra_core.kernels.vq import reference

Array = jax.Array
f32 = jnp.float32


def head_major_carry(carry: dict, fold_z: Array) -> tuple:
  """The reference's carry ([B,L,Hk,.], mean [B,Hk,S,Dv], count [B,Hk,S]) in the kernel's layout;
  fold_z [B,L,Hk] the codes the carried block folds with (its z, or S for keys that do not enter)."""
  count = carry["count"].astype(f32)
  return (
    carry["k"].transpose(0, 2, 1, 3),
    carry["v"].transpose(0, 2, 1, 3),
    carry["z"].transpose(0, 2, 1)[:, :, None, :],
    fold_z.transpose(0, 2, 1)[..., None],
    carry["mean"].astype(f32) * count[..., None],  # the kernel carries sums: the means times their counts
    count[:, :, None, :],
    count[..., None],
  )


def document_inputs(
  segments: Array, carry_segments: Array, z: Array, carry_z: Array, *, block_len: int, n_code: int
) -> tuple[dict, Array, Array]:
  """`kernels.vq.reference.document_plan` as inputs the block step reads with elementwise ops only: -> ({q_seg,
  reads: columns [B,1,T,1]; k_seg, keep: rows [B,1,1,T]; carry_seg: row [B,1,1,L]}, the fold codes of the
  window [B,T,Hk] and of the carried block [B,L,Hk])."""
  b, t = segments.shape
  l = block_len
  plan = reference.document_plan(segments, carry_segments, l)
  enters = plan["enters"]  # [B,R,L]: keys of block r - 1
  # A key folds with its code if it enters the cache (the next block begins with its document), else with
  # the empty code S; the last block's keys fold in the next window, where the plan decides again.
  window_enters = jnp.concatenate([enters[:, 1:], jnp.ones((b, 1, l), bool)], axis=1).reshape(b, t)
  fold_z = jnp.where(window_enters[..., None], z, n_code)
  carry_fold_z = jnp.where(enters[:, 0, :, None], carry_z, n_code)
  col = lambda x: x.reshape(b, 1, t, 1)  # one id per batch row, read by every head
  row = lambda x: x.reshape(b, 1, 1, -1)
  docs = {
    "q_seg": col(plan["seg"]),
    "reads": col(plan["reads"].astype(f32)),
    "k_seg": row(plan["seg"]),
    "keep": row(jnp.repeat(plan["keep"].astype(f32), l, axis=1)),  # per block, repeated over its keys
    "carry_seg": row(plan["prev"][:, 0]),
  }
  return docs, fold_z, carry_fold_z


def head_major(q, k_hat, z, v, codebook, carry, bias, segments, *, block_len: int) -> dict:
  """The grid kernels' inputs from the public layout ([B,T,H,.], the reference's carry and position term):
  `forward`'s arguments by name."""
  b, t, h, _ = q.shape
  l = block_len
  heads = lambda x: x.transpose(0, 2, 1, 3)
  docs, fold_z, carry_fold_z = None, z, carry["z"]
  if segments is not None:
    docs, fold_z, carry_fold_z = document_inputs(
      segments, carry["seg"], z, carry["z"], block_len=l, n_code=codebook.shape[1]
    )
  bias_hm = None
  if bias is not None:  # [B,R,Hk,G,L,2L] -> [B,H,T,2L]
    bias_hm = bias.transpose(0, 2, 3, 1, 4, 5).reshape(b, h, t, 2 * l)
  # z twice: as a column [T,1] (one-hot rows of the fold) and a row [1,T] (key validity): no transpose inside.
  return {
    "q": heads(q),
    "k": heads(k_hat),
    "v": heads(v),
    "zc": fold_z.transpose(0, 2, 1)[..., None],
    "zr": z.transpose(0, 2, 1)[:, :, None, :],
    "codebook": codebook,
    "bias": bias_hm,
    "carry": head_major_carry(carry, carry_fold_z),
    "docs": docs,
  }


def declare_inputs(
  x: dict, *, block_len: int, value_block: int, query_block: int, point, once: bool, skip=()
) -> toolkit.Inputs:
  """The block steps' inputs and their block specs, declared once for the forward and both backward kernels:
  x holds `forward`'s head-major arrays by argument name (bias and docs may be None); `point` maps a
  kernel's program ids to the grid point (batch, head, value tile, block, query sub-block) they stand for;
  `skip` the refs a kernel does not read. `once`: blocks read once per (batch, head, tile) take one
  buffer (TPU: there is nothing to prefetch)."""
  q, codebook = x["q"], x["codebook"]
  h, dk = q.shape[1], q.shape[-1]
  hk, s, _ = codebook.shape
  g = h // hk
  l, dt, lq = block_len, value_block, query_block
  nq = l // lq
  # lax.div, not //: integer floor division lowers through `sign`, whose Mosaic lowering needs the chip kind.
  kv_head = lambda hh: jax.lax.div(hh, g)
  single = {"pipeline_mode": pl.Buffered(1)} if once else {}
  prev = lambda rr: jnp.maximum(rr - 1, 0)  # block 0 reads the carried block instead (`step_operands`)

  def spec(shape, index, **kw):
    """A block of a [B,heads,.,.] operand; `index` maps the grid point (b, h, j, r, q) to its block."""
    return pl.BlockSpec((None, None) + shape, lambda *ids: index(*point(*ids)), **kw)

  queries = lambda bb, hh, jj, rr, qq: (bb, hh, rr * nq + qq, 0)  # sub-block qq of block rr, in units of Lq rows
  kv = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), rr, 0)
  kv_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), prev(rr), 0)
  v_tile = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), rr, jj)
  v_tile_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), prev(rr), jj)
  row = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, rr)  # rows [1,T] advance along lanes
  row_prev = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, prev(rr))
  carried = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, 0)
  carried_tile = lambda bb, hh, jj, rr, qq: (bb, kv_head(hh), 0, jj)
  carry_k, carry_v, carry_z_row, carry_z_col, carry_sum, carry_count_row, carry_count_col = x["carry"]
  declared = [
    ("q", q, spec((lq, dk), queries)),
    ("k", x["k"], spec((l, dk), kv)),
    ("k_prev", x["k"], spec((l, dk), kv_prev)),
    ("v", x["v"], spec((l, dt), v_tile)),
    ("v_prev", x["v"], spec((l, dt), v_tile_prev)),
    ("z_row", x["zr"], spec((1, l), row)),  # key validity (code S: no key)
    ("z_row_prev", x["zr"], spec((1, l), row_prev)),
    ("z_col_prev", x["zc"], spec((l, 1), kv_prev)),  # the fold's one-hot rows
    ("codebook", codebook, pl.BlockSpec((None, s, dk), lambda *ids: (kv_head(point(*ids)[1]), 0, 0), **single)),
  ]
  if x["bias"] is not None:
    declared.append(("bias", x["bias"], spec((lq, 2 * l), queries)))
  docs = x["docs"]
  if docs is not None:  # one row of ids per batch row, whatever the head
    doc_col = lambda bb, hh, jj, rr, qq: (bb, 0, rr * nq + qq, 0)
    doc_row = lambda bb, hh, jj, rr, qq: (bb, 0, 0, rr)
    declared += [
      ("q_seg", docs["q_seg"], spec((lq, 1), doc_col)),
      ("reads", docs["reads"], spec((lq, 1), doc_col)),
      ("k_seg", docs["k_seg"], spec((1, l), doc_row)),
      ("k_seg_prev", docs["k_seg"], spec((1, l), lambda bb, hh, jj, rr, qq: (bb, 0, 0, prev(rr)))),
      ("keep", docs["keep"], spec((1, l), doc_row)),
      ("carry_k_seg", docs["carry_seg"], spec((1, l), lambda bb, hh, jj, rr, qq: (bb, 0, 0, 0), **single)),
    ]
  declared += [
    ("carry_k", carry_k, spec((l, dk), carried, **single)),
    ("carry_v", carry_v, spec((l, dt), carried_tile, **single)),
    ("carry_z_row", carry_z_row, spec((1, l), carried, **single)),
    ("carry_z_col", carry_z_col, spec((l, 1), carried, **single)),
    ("carry_sum", carry_sum, spec((s, dt), carried_tile, **single)),
    ("carry_count_row", carry_count_row, spec((1, s), carried, **single)),
    ("carry_count_col", carry_count_col, spec((s, 1), carried, **single)),
  ]
  inputs = toolkit.Inputs()
  for name, array, block in declared:
    if name not in skip:
      inputs.add(name, array, block)
  return inputs


def step_operands(x: dict, first) -> dict:
  """What a block step reads from its refs `x` (by name; each kernel declares the ones it needs), block 0's
  previous block being the carried one. Floats in float32 (the block step's type anyway): TPU v3 has no
  select of bfloat16 vectors. -> q, k_prev, k_cur, zr_prev, zr_cur, codebook, bias (the two halves or None),
  docs (as `block_weights` takes them, or None), keep; v_prev, v_cur and z_fold where declared."""

  def previous(name: str, as_float: bool = True):
    carried, prev = x[f"carry_{name}"][...], x[f"{name}_prev"][...]
    return jnp.where(first, carried.astype(f32), prev.astype(f32)) if as_float else jnp.where(first, carried, prev)

  l = x["k"].shape[0]
  ops = {
    "q": x["q"][...],
    "k_prev": previous("k"),
    "k_cur": x["k"][...],
    "zr_prev": previous("z_row"),
    "zr_cur": x["z_row"][...],
    "codebook": x["codebook"][...],
    "bias": (x["bias"][:, :l], x["bias"][:, l:]) if "bias" in x else None,  # [Lq,2L]: previous keys, then present
    "docs": None,
    "keep": None,
  }
  if "q_seg" in x:
    ops["docs"] = (x["q_seg"][...], x["reads"][...], previous("k_seg", as_float=False), x["k_seg"][...])
    ops["keep"] = x["keep"][...]
  if "v" in x:
    ops["v_prev"], ops["v_cur"] = previous("v"), x["v"][...]
  if "z_col_prev" in x:
    ops["z_fold"] = previous("z_col")
  return ops
