"""FLASH's mixed chunk attention, the parallel driver (the GPU's): every chunk at once from the state XLA's
prefix gives it. kernels/mixed_chunk/pallas.py holds the kernel's public function and its gradient, prepares the
operands both drivers read and calls this one on GPU (`toolkit.driver`); the TPU's is kernels/mixed_chunk/tpu_grid.py.

No carry: XLA computes the state every chunk reads as the reference does, a prefix over the chunks
with its restarts (`chunk_states`: [B,H,G,S,E] float32 in HBM, as in the reference; the non-causal
total [B,H,S,E]; non-causal with documents, the sums from the left and from the right), and the grid
(B, H, G, Q, J) gives each program one [Cq,Et] output tile of one chunk (`_kernel`): the local part
over key tiles of Ck rows, up to the diagonal when causal (relu2 / linear weights accumulate, softmax
runs online), masks and bias applied per tile; non-causal with documents, the query's document's keys
in its own chunk (a second pass over the key tiles); then lin_q KV_g in sub-tiles of the state's rows,
with the per-query factors. The kernel fuses the scores, masks, bias and weights with both products:
the [C,C] scores never reach HBM. A GPU needs the B H G Q J programs in parallel, and Triton keeps a
program's tiles in registers, where a chunk's [C,C] scores (256 KiB of float32 at C 256) or a carried
[S,Et] sum beside them do not fit. The price: each value tile recomputes its scores (E / Et = 12 at
C4's e 1536 and Et 128, the QK^T FLOPs equal to the PV FLOPs at S = Et), and the states make a round
trip through HBM.
Tiles: `toolkit.gpu_tiles("mixed_chunk_attention")`, powers of two (Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import per_device, toolkit
from lra_core.kernels.mixed_chunk import reference

Array = jax.Array
f32 = jnp.float32
MASK = 1e30
# The operands: no carry, so no col / keep; kv2 and read2 the sum from the right.
OPERANDS = ("qq", "qk", "lq", "lk", "v", "kv", "kv2", "row", "bias", "qdoc", "kdoc", "read", "read2", "oscale")
ROWS = ("row", "kdoc")  # [B,1,T] operands: one value per key, along lanes
COLUMNS = ("qdoc", "read", "read2", "oscale")  # [B,T,1] operands: one value per token


def _kernel(
  *refs,
  names: tuple[tuple[str, ...], ...],
  query_tile: int,
  key_tile: int,
  state_tile: int,
  chunk: int,
  causal: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  local_documents: bool,
  upcast: bool,
):
  """Grid (B, H, G, Q, J): query tile Q of chunk G, value tile J -> out [Cq,Et], no carry.

  Blocks: qq, lq [Cq,S], qdoc / read / read2 / oscale [Cq,1] and bias [Cq,C] of the query tile; qk, lk
  [C,S], v [C,Et], row / kdoc [1,C] of the whole chunk, read a key tile of Ck rows at a time (refs are
  sliced: Triton cannot slice a loaded array); kv, kv2 [S,Et] the states the chunk reads, in sub-tiles
  of `state_tile` rows. Three loops, one accumulator [Cq,Et]: the local part over the key tiles; the
  own-chunk term of non-causal documents (oscale given) over them again (in the local loop it would
  hold a second set of pipelined tiles in shared memory, and a softmax's rescaling would scale it);
  lin_q KV."""
  ins, out = toolkit.named_refs(refs, *names)
  o_ref = out["out"]
  cq, ck = query_tile, key_tile
  et = o_ref.shape[-1]
  qi = pl.program_id(3)
  load = lambda name: ins[name][...] if name in ins else None
  cast = (lambda x: x.astype(f32)) if upcast else (lambda x: x)
  keys = lambda name, k: cast(ins[name][pl.ds(k * ck, ck), :])  # key tile k, [Ck, .]
  lanes = lambda name, k: ins[name][:, pl.ds(k * ck, ck)]  # key tile k along lanes, [., Ck]
  qdoc = load("qdoc")

  def allowed(k, *, local: bool):
    """[Cq,Ck] mask of key tile k (None: all allowed): real keys; causal and documents in the local
    part, documents in the own-chunk term."""
    mask = None if "row" not in ins else jnp.broadcast_to(lanes("row", k) > 0, (cq, ck))
    parts = []
    if local and causal:
      rows = qi * cq + jax.lax.broadcasted_iota(jnp.int32, (cq, ck), 0)
      parts.append(k * ck + jax.lax.broadcasted_iota(jnp.int32, (cq, ck), 1) <= rows)
    if qdoc is not None and (local_documents or not local):
      parts.append(qdoc == lanes("kdoc", k))
    for part in parts:
      mask = part if mask is None else mask & part
    return mask

  def own_step(k, acc):
    """The query's document's keys in its own chunk through the linear kernel, times oscale (float32
    weights and values, as in the reference)."""
    scores = toolkit.dot(cast(ins["lq"][...]), keys("lk", k), (1, 1)) * lin_scale
    weights = jnp.where(allowed(k, local=False), scores, 0.0) * ins["oscale"][...]
    return acc + toolkit.dot(weights, keys("v", k).astype(f32))

  acc = jnp.zeros((cq, et), f32)
  # Causal: key tiles up to the diagonal; lax.div (not //) as the bound is non-negative.
  last = jax.lax.div((qi + 1) * cq + ck - 1, ck) if causal else chunk // ck
  if "qq" in ins:
    qq = cast(ins["qq"][...])
    softmax = kernel == "softmax"

    def local(k, carry):
      acc, top, total = carry
      scores = toolkit.dot(qq, keys("qk", k), (1, 1)) * quad_scale
      if "bias" in ins:
        scores = scores + lanes("bias", k).astype(f32)
      mask = allowed(k, local=True)
      v = keys("v", k)
      if softmax:  # online: the running maximum and sum per query, the accumulator rescaled
        if mask is not None:
          scores = jnp.where(mask, scores, -MASK)
        new_top = jnp.maximum(top, scores.max(-1, keepdims=True))
        weights = jnp.exp(scores - new_top)
        if mask is not None:
          weights = jnp.where(mask, weights, 0.0)
        rescale = jnp.exp(top - new_top)
        total = total * rescale + weights.sum(-1, keepdims=True)
        acc, top = acc * rescale, new_top
      else:
        weights = jnp.square(jnp.maximum(scores, 0.0)) if kernel == "relu2" else scores
        if mask is not None:
          weights = jnp.where(mask, weights, 0.0)
      return acc + toolkit.dot(weights.astype(v.dtype), v), top, total

    init = (acc, jnp.full((cq, 1), -MASK, f32), jnp.zeros((cq, 1), f32))
    acc, _, total = jax.lax.fori_loop(0, last, local, init)
    if softmax:  # a query with no allowed key reads nothing, as in the reference
      acc = acc / jnp.where(total > 0, total, 1.0)
  if "oscale" in ins:
    acc = jax.lax.fori_loop(0, chunk // ck, own_step, acc)
  if "lq" in ins:
    # lin_q KV over sub-tiles of Sb state rows: a whole float32 [S,Et] state tile would take as many
    # registers as the accumulator. The per-query factors scale lin_q's rows (exact but for "mean").
    reads = [(n, ins[r][...] if r in ins else None) for n, r in (("kv", "read"), ("kv2", "read2")) if n in ins]

    def state_rows(i, acc):
      rows = pl.ds(i * state_tile, state_tile)
      lq = ins["lq"][:, rows].astype(f32)
      for name, read in reads:
        acc = acc + toolkit.dot(lq if read is None else lq * read, ins[name][rows, :])
      return acc

    acc = jax.lax.fori_loop(0, ins["lq"].shape[-1] // state_tile, state_rows, acc)
  o_ref[...] = acc.astype(o_ref.dtype)


def forward(
  args: dict[str, Array],
  *,
  chunk: int,
  value_tile: int,
  query_tile: int,
  key_tile: int,
  causal: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  local_documents: bool,
  upcast: bool,
  interpret: bool,
) -> Array:
  """The parallel driver on head-major operands: qq, qk, lq, lk [B,H,T,S]; v [B,H,T,E]; kv, kv2
  [B,H,G,S,E] (the state each chunk reads) or kv [B,H,S,E] (one for all chunks); ROWS [B,1,T];
  COLUMNS [B,T,1]; bias [C,C] (each only where needed; T a multiple of C) -> [B,H,T,E]."""
  b, h, t, e = args["v"].shape
  c, g, et, cq = chunk, t // chunk, value_tile, query_tile
  nq, nj = c // cq, e // et
  s = max(args[n].shape[-1] for n in ("qq", "lq") if n in args)
  lin_s = args["lq"].shape[-1] if "lq" in args else 1  # the states' rows
  query = lambda bb, hh, gg, qq, jj: (bb, hh, gg * nq + qq, 0)

  def spec(name: str) -> pl.BlockSpec:
    """Query tiles of the chunk (qq, lq, COLUMNS, bias rows), the whole chunk (qk, lk, v's value tile, ROWS),
    the state's value tile (per chunk, or one for all chunks)."""
    width = args[name].shape[-1]
    if name in ("qq", "lq"):
      return pl.BlockSpec((None, None, cq, width), query)
    if name in ("qk", "lk"):
      return pl.BlockSpec((None, None, c, width), lambda bb, hh, gg, qq, jj: (bb, hh, gg, 0))
    if name == "v":
      return pl.BlockSpec((None, None, c, et), lambda bb, hh, gg, qq, jj: (bb, hh, gg, jj))
    if name in ("kv", "kv2") and args[name].ndim == 5:
      return pl.BlockSpec((None, None, None, lin_s, et), lambda bb, hh, gg, qq, jj: (bb, hh, gg, 0, jj))
    if name in ("kv", "kv2"):
      return pl.BlockSpec((None, None, lin_s, et), lambda bb, hh, gg, qq, jj: (bb, hh, 0, jj))
    if name in ROWS:
      return pl.BlockSpec((None, 1, c), lambda bb, hh, gg, qq, jj: (bb, 0, gg))
    if name in COLUMNS:
      return pl.BlockSpec((None, cq, 1), lambda bb, hh, gg, qq, jj: (bb, gg * nq + qq, 0))
    return pl.BlockSpec((cq, c), lambda bb, hh, gg, qq, jj: (qq, 0))  # bias

  estimate = cost(
    batch=b,
    heads=h,
    seq_len=t,
    chunk=c,
    s=s,
    e=e,
    value_tile=et,
    itemsize=jnp.dtype(args["v"].dtype).itemsize,
    local="qq" in args,
    tiles=(cq, key_tile),
    causal=causal,
    own="oscale" in args,
    states=("kv" in args) + ("kv2" in args),
    softmax=kernel == "softmax",
  )
  state_tile = tile(lin_s, toolkit.gpu_tiles("mixed_chunk_attention")["state_block"])
  inputs = toolkit.Inputs()
  for n in (n for n in OPERANDS if n in args):
    inputs.add(n, args[n], spec(n))
  outputs = toolkit.Outputs()
  outputs.add(
    "out",
    jax.ShapeDtypeStruct((b, h, t, e), args["v"].dtype),
    pl.BlockSpec((None, None, cq, et), lambda bb, hh, gg, qq, jj: (bb, hh, gg * nq + qq, jj)),
  )
  kernel_fn = functools.partial(
    _kernel,
    names=toolkit.ref_names(inputs, outputs),
    query_tile=cq,
    key_tile=key_tile,
    state_tile=state_tile,
    chunk=c,
    causal=causal,
    kernel=kernel,
    quad_scale=quad_scale,
    lin_scale=lin_scale,
    local_documents=local_documents,
    upcast=upcast,
  )
  call = pl.pallas_call(
    kernel_fn,
    out_shape=outputs.shapes,
    grid=(b, h, g, nq, nj),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    # no carry: every grid axis may run in parallel
    compiler_params=toolkit.compiler_params(5, sequential=False, kernel="mixed_chunk_attention"),
    interpret=interpret,
    cost_estimate=estimate,
    name="mixed_chunk_attention",
  )
  return outputs.named(call(*inputs.arrays))["out"]


def attention(
  local: dict[str, Array],
  lin: tuple[Array, Array] | None,
  layout: dict[str, Array] | None,
  *,
  keep: Array | None,
  documents: dict[str, Array],
  chunk: int,
  causal: bool,
  lin_scale: float,
  **statics,
) -> Array:
  """The parallel driver, per device: the states every chunk reads (`chunk_states`), then one call. local:
  the local part's operands and v (head-major, `pallas`); lin: (lin_q, lin_k) head-major or None;
  layout: `reference.global_layout` or None without documents and "mean"; keep [B,T] float32 the real keys
  or None; documents: qdoc, kdoc -> [B,H,T,E]."""
  args = dict(local)
  b, h, t = args["v"].shape[:3]
  if lin is not None:
    lq, lk = lin
    states = functools.partial(chunk_states, lk, args["v"], chunk=chunk, causal=causal, lin_scale=lin_scale)
    args["lq"] = lq
    if layout is None:
      args["kv"] = states(keep, None)
    else:
      tokens = lambda x: x.reshape(b, t)[:, :, None]  # [B,G,C] -> [B,T,1]
      args.update(
        kv=states(layout["fwd_w"].reshape(b, t), layout["fwd_keep"]),
        read=tokens(layout["fwd_read"] * layout["scale"]),
      )
      if not causal:  # the later chunks of the document, and its keys in the query's own chunk
        args.update(
          kv2=states(layout["bwd_w"].reshape(b, t), layout["bwd_keep"], reverse=True),
          read2=tokens(layout["bwd_read"] * layout["scale"]),
          lk=lk,
          row=keep[:, None, :],
          oscale=tokens(layout["scale"]),
          **documents,
        )
  run = functools.partial(forward, chunk=chunk, causal=causal, lin_scale=lin_scale, **statics)
  dims = {n: "b.." if n in ROWS + COLUMNS else ".." if n == "bias" else "bh.." for n in args}
  return per_device.run_per_device(run, (args,), (dims,), "bh..", batch=b, heads=h)


def chunk_states(
  lk: Array,
  v: Array,
  weight: Array | None,
  restart: Array | None,
  *,
  chunk: int,
  causal: bool,
  lin_scale: float,
  reverse: bool = False,
) -> Array:
  """The global state each chunk reads, as the reference sums it (for the parallel driver): lk [B,H,T,S],
  v [B,H,T,E] head-major, weight [B,T] each key's weight (0: not summed; None: all 1), restart [B,G] the
  chunks' carry factors (`reference.global_layout`; None: no documents) -> float32 [B,H,G,S,E], the
  chunks before each chunk (after it when `reverse`) with restarts; without documents, causal the
  exclusive prefix sum, non-causal the total [B,H,S,E]."""
  b, h, t, s = lk.shape
  e, g = v.shape[-1], t // chunk
  if weight is not None:
    lk = jnp.where(weight[:, None, :, None] > 0, lk, jnp.zeros_like(lk))
  if restart is None and not causal:
    return jnp.einsum("bhts,bhte->bhse", lk, v, preferred_element_type=f32) * lin_scale
  sums = (
    jnp.einsum(
      "bhgcs,bhgce->bhgse", lk.reshape(b, h, g, chunk, s), v.reshape(b, h, g, chunk, e), preferred_element_type=f32
    )
    * lin_scale
  )
  if restart is None:
    return jnp.concatenate([jnp.zeros_like(sums[:, :, :1]), jnp.cumsum(sums[:, :, :-1], axis=2)], axis=2)
  carried = reference.carried_sums(sums.reshape(b * h, g, s, e), jnp.repeat(restart, h, axis=0), reverse=reverse)
  return carried.reshape(b, h, g, s, e)


def cost(
  *,
  batch: int,
  heads: int,
  seq_len: int,
  chunk: int,
  s: int,
  e: int,
  value_tile: int,
  itemsize: int,
  tiles: tuple[int, int],
  causal: bool,
  local: bool = True,
  own: bool = False,
  states: int = 0,
  softmax: bool = False,
) -> pl.CostEstimate:
  """What the kernel computes and moves, for XLA's and lra_core.cost.hlo_cost's rooflines (a custom call is
  opaque to them): `tiles` = (Cq, Ck); `states` KV tensors read, `own` the non-causal documents'
  own-chunk term; `softmax` the local kernel's exp. Per program the key tiles it visits (causal: up
  to the diagonal) for its scores (recomputed per value tile) and their product with its values, and
  lin_q KV per state; moved, every block each program reads (a chunk's key and value tiles once per
  query tile: mostly from L2) and its output tile. The states are XLA's own operations."""
  b, h, t, c = batch, heads, seq_len, chunk
  tiles_e, chunks = e // value_tile, t // chunk
  (cq, ck), et, a = tiles, value_tile, itemsize
  nq = c // cq
  keys = sum(ck * -(-(i + 1) * cq // ck) if causal else c for i in range(nq))  # key rows, all query tiles
  # Per chunk and value tile: scores [Cq,S]x[S,keys] and weights x values [keys,Et] for each query tile.
  flops = (local * cq * keys + own * c * c) * 2 * (s + et) + states * 2 * c * s * et
  moved = (
    local * (c * s + keys * (s + et + cq)) * a
    + own * (c * s + nq * c * (s + et)) * a
    + (states > 0) * c * s * a
    + nq * states * s * et * 4
    + c * et * a
  )
  return pl.CostEstimate(
    flops=int(b * h * chunks * tiles_e * flops),
    transcendentals=int(b * h * chunks * tiles_e * local * softmax * cq * keys),
    bytes_accessed=int(b * h * chunks * tiles_e * moved),
  )


def tile(c: int, want: int) -> int:
  """`want` rows of a chunk of c where that divides it, else the whole chunk (a chunk cut short by T)."""
  want = min(want, c)
  return want if c % want == 0 else c
