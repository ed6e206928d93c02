"""FLASH's mixed chunk attention, the grid driver (TPU; interpret mode): the chunks of one (batch, head) in
order, the causal running key-value sum on chip. kernels/mixed_chunk/pallas.py holds the kernel's public
function and its gradient, prepares the operands both drivers read and calls this driver off GPU
(`toolkit.driver`); the GPU's is kernels/mixed_chunk/gpu_parallel.py.

The grid is (B, H, J, G): J value tiles of Et columns (KV and the output are independent across value
columns; the local scores are recomputed per tile), then the G chunks in order. Causal, KV [S,Et] is
carried in scratch and updated after its use, so no per-chunk state reaches HBM; non-causal without
documents reads the total, one XLA einsum (`total`); with documents non-causal is two walks, forward and
backward, added (`attention`). `_chunk_step` is one chunk, whole: Et is as wide as the target's VMEM
allows (`value_block`).

Operands arrive head-major ([B,H,T,S]) with T a multiple of C. Masks arrive as float32, a row [1,T] for the
local keys and a column [T,1] for the keys summed into KV, so the kernel transposes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import per_device, toolkit

Array = jax.Array
f32 = jnp.float32
MASK = 1e30
# Kernel operands in a fixed order; a call passes the ones its parts need.
OPERANDS = ("qq", "qk", "lq", "lk", "v", "kv", "row", "col", "bias", "qdoc", "kdoc", "keep", "read", "oscale")
STEP = tuple(n for n in OPERANDS if n != "kv")  # _chunk_step's arguments after kv
ROWS = ("row", "kdoc")  # [B,1,T] operands: one value per key, along lanes
COLUMNS = ("col", "qdoc", "keep", "read", "oscale")  # [B,T,1] operands: one value per token, along sublanes


# -- the chunk step ------------------------------------------------------------------------------------


def weights(scores: Array, allowed: Array | None, kernel: str) -> Array:
  """Local attention weights from float32 scores [C,C]; positions not allowed get weight 0."""
  if kernel == "relu2":
    w = jnp.square(jnp.maximum(scores, 0.0))
  elif kernel == "softmax":
    if allowed is not None:
      scores = jnp.where(allowed, scores, -MASK)
    w = jnp.exp(scores - scores.max(-1, keepdims=True))  # the whole chunk is on chip: no online softmax
    w = w / w.sum(-1, keepdims=True)
  else:
    w = scores
  return w if allowed is None else jnp.where(allowed, w, 0.0)  # also zeroes a fully masked softmax row


def _chunk_step(
  kv,
  qq,
  qk,
  lq,
  lk,
  v,
  row,
  col,
  bias,
  qdoc,
  kdoc,
  keep,
  read,
  oscale,
  *,
  causal: bool,
  carried: bool,
  own: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  upcast: bool,
) -> tuple[Array, Array | None]:
  """One chunk. qq, qk, lq, lk [C,S] (None where the part is absent); v [C,E]; row [1,C] float, > 0
  for a real key (None: all real); bias [C,C] or None; kv [S,E] float32 (the carried sum of the
  chunks before this one in the walk when `carried`, the total otherwise) -> (out [C,E] float32,
  kv after this chunk). With documents: qdoc [C,1] and kdoc [1,C] the tokens' document indices
  (local scores and the own-chunk term only within a document); col [C,1] each key's weight in
  the carried sum; keep [C,1] the chunk's carry factor (the same in every row); read [C,1] each
  query's factor on the carried sum; `own`: add the chunk's own keys of the query's document
  through the linear kernel, times oscale [C,1] (non-causal with documents).
  `upcast`: the matmul operands in float32 (targets without bfloat16 matmuls, `toolkit.bf16_matmuls`)."""
  if upcast:
    qq, qk, lq, lk, v = (None if x is None else x.astype(f32) for x in (qq, qk, lq, lk, v))
  out = None
  same = None if qdoc is None else qdoc == kdoc  # [C,1] == [1,C] -> [C,C]: both ids of one document
  if qq is not None:
    c = qq.shape[0]
    scores = toolkit.dot(qq, qk, (1, 1)) * quad_scale
    if bias is not None:
      scores = scores + bias.astype(f32)
    allowed = None if row is None else jnp.broadcast_to(row > 0, (c, c))
    if causal:
      tril = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1) <= jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
      allowed = tril if allowed is None else allowed & tril
    if same is not None:
      allowed = same if allowed is None else allowed & same
    out = toolkit.dot(weights(scores, allowed, kernel).astype(v.dtype), v)
  if lq is not None:
    part = toolkit.dot(lq.astype(f32), kv)  # the state is float32: so is the query that reads it
    if read is not None:
      part = part * read  # 0 where the query's document started in this chunk; 1 / chunks for "mean"
    if own:
      scores = toolkit.dot(lq.astype(f32), lk.astype(f32), (1, 1)) * lin_scale
      allowed = same if row is None else same & (row > 0)
      part = part + toolkit.dot(jnp.where(allowed, scores, 0.0) * oscale, v.astype(f32))
    out = part if out is None else out + part
    if carried:  # after its use: the chunks before this one in the walk
      keys = lk if col is None else jnp.where(col > 0, lk, jnp.zeros_like(lk))
      if keep is not None:
        kv = kv * keep[:1, :]  # a document starting inside the chunk restarts the sum (factor 0)
      kv = kv + toolkit.dot(keys, v, (0, 0)) * lin_scale
  return out, kv


def _kernel(*refs, names: tuple[tuple[str, ...], ...], **statics):
  """Grid (B, H, J, G): J value tiles, G sequential; a causal KV of one tile lives in scratch across the
  chunk axis. Refs by name (`forward` declares them)."""
  ins, out, scratch = toolkit.named_refs(refs, *names)
  load = lambda name: ins[name][...] if name in ins else None
  carried = statics["carried"]
  if carried:

    @pl.when(pl.program_id(3) == 0)
    def _():  # the first chunk of a walk reads an empty sum
      scratch["kv"][...] = jnp.zeros(scratch["kv"].shape, f32)

    kv = scratch["kv"][...]
  else:
    kv = load("kv")
  result, kv = _chunk_step(kv, **{n: load(n) for n in STEP}, **statics)
  out["out"][...] = result.astype(out["out"].dtype)
  if carried:
    scratch["kv"][...] = kv


# -- sizes ----------------------------------------------------------------------------------------------

LANES, SUBLANES = 128, 8  # a TPU VMEM tile: a block's last two dimensions are padded to multiples of these


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
  return -(-rows // SUBLANES) * SUBLANES * -(-cols // LANES) * LANES * itemsize


def vmem_bytes(*, chunk: int, s: int, value_block: int, itemsize: int) -> int:
  """Estimated VMEM of one grid step, blocks padded to whole tiles. An upper bound: Mosaic reports 26.5 MiB
  where this gives 31.6 (C 512, S 128, Et 2048, bfloat16, v3)."""
  c, et, a = chunk, value_block, itemsize
  x = tile_bytes
  # Double-buffered: the [C,S] query and key blocks, [C,Et] value and output, masks, bias, KV input.
  pipelined = 4 * x(c, s, a) + 2 * x(c, et, a) + x(1, c, 4) + x(c, 1, 4) + x(c, c, 4) + x(s, et, 4)
  # float32: [C,C] scores and weights, the [C,Et] output and upcast values, the KV update, upcast [C,S] operands
  temporaries = 3 * x(c, c, 4) + 3 * x(c, et, 4) + 2 * x(s, et, 4) + 4 * x(c, s, 4)
  return 2 * pipelined + x(s, et, 4) + temporaries + 2**20  # KV scratch; 1 MiB the compiler's own scratch


def value_block(e: int, *, chunk: int, s: int, itemsize: int, budget: int | None, platform: str = "tpu") -> int:
  """The width of the grid driver's value tiles, a divisor of e (`widest_fitting` with `vmem_bytes`). (The
  GPU's: `gpu_parallel.tile`.)"""
  size = lambda w: vmem_bytes(chunk=chunk, s=s, value_block=w, itemsize=itemsize)
  return widest_fitting(e, size, budget=budget, platform=platform)


def widest_fitting(e: int, size: Callable[[int], int], *, budget: int | None, platform: str) -> int:
  """A value tile, a divisor of e. TPU: the widest multiple of 128 lanes whose VMEM `size(width)` fits `budget`
  (128 when none does: the compiler then names the excess); e itself when it is no multiple of 128.
  Elsewhere (interpret mode) e."""
  if platform != "tpu" or e % LANES:
    return e
  widths = [w for w in range(e, 0, -LANES) if e % w == 0]
  fits = [w for w in widths if budget is None or size(w) <= budget]
  return fits[0] if fits else widths[-1]


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
  local: bool,
  carried: bool,
) -> pl.CostEstimate:
  """What the grid driver computes and moves, for XLA's and lra_core.cost.hlo_cost's rooflines (a custom call is
  opaque to them). (The parallel driver's: `gpu_parallel.cost`.)"""
  b, h, t, c = batch, heads, seq_len, chunk
  tiles, chunks = e // value_tile, t // chunk
  # Per chunk: the local [C,C] scores once per value tile and their product with v over all of E; lin_q KV
  # and (causal) the KV update over all of E.
  flops = chunks * ((tiles * 2 * c * c * s + 2 * c * c * e) * local + 2 * c * s * e * (1 + carried))
  moved = tiles * t * s * itemsize * (2 * local + 1 + carried) + 2 * t * e * itemsize  # [C,S] blocks per tile
  return pl.CostEstimate(flops=int(b * h * flops), transcendentals=0, bytes_accessed=int(b * h * moved))


# -- the driver ---------------------------------------------------------------------------------------------


def forward(
  args: dict[str, Array],
  *,
  chunk: int,
  value_tile: int,
  causal: bool,
  carried: bool,
  own: bool,
  reverse: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  upcast: bool,
  interpret: bool,
) -> Array:
  """One walk over the chunks, one pallas_call, on head-major operands: qq, qk, lq, lk [B,H,T,S]; v
  [B,H,T,E]; kv [B,H,S,E]; ROWS [B,1,T]; COLUMNS [B,T,1]; bias [C,C] (each only where needed) -> [B,H,T,E].
  `reverse` walks the chunks last to first (the carried sum then holds the later chunks)."""
  b, h, t, e = args["v"].shape
  c, g, et = chunk, t // chunk, value_tile
  nj = e // et
  s = args["lq"].shape[-1] if "lq" in args else 0
  statics = dict(
    causal=causal, carried=carried, own=own, kernel=kernel, quad_scale=quad_scale, lin_scale=lin_scale, upcast=upcast
  )
  estimate = cost(
    batch=b,
    heads=h,
    seq_len=t,
    chunk=c,
    s=max(s, args["qq"].shape[-1] if "qq" in args else 0),
    e=e,
    value_tile=et,
    itemsize=jnp.dtype(args["v"].dtype).itemsize,
    local="qq" in args,
    carried=carried,
  )
  at = (lambda rr: g - 1 - rr) if reverse else (lambda rr: rr)  # grid step rr -> the chunk it reads
  time = lambda bb, hh, jj, rr: (bb, hh, at(rr), 0)
  tiled = lambda bb, hh, jj, rr: (bb, hh, at(rr), jj)
  inputs = toolkit.Inputs()
  for n in (n for n in OPERANDS if n in args):
    if n == "v":
      spec = pl.BlockSpec((None, None, c, et), tiled)
    elif n == "kv":  # the non-causal total: the same block at every chunk step
      spec = pl.BlockSpec((None, None, s, et), lambda bb, hh, jj, rr: (bb, hh, 0, jj))
    elif n == "bias":  # [C,C], shared by every chunk, batch row and head
      spec = pl.BlockSpec((c, c), lambda bb, hh, jj, rr: (0, 0))
    elif n in ROWS:  # one row per batch row, whatever the head
      spec = pl.BlockSpec((None, 1, c), lambda bb, hh, jj, rr: (bb, 0, at(rr)))
    elif n in COLUMNS:
      spec = pl.BlockSpec((None, c, 1), lambda bb, hh, jj, rr: (bb, at(rr), 0))
    else:  # [C,S] query and key blocks, whole width
      spec = pl.BlockSpec((None, None, c, args[n].shape[-1]), time)
    inputs.add(n, args[n], spec)
  outputs = toolkit.Outputs()
  outputs.add("out", jax.ShapeDtypeStruct((b, h, t, e), args["v"].dtype), pl.BlockSpec((None, None, c, et), tiled))
  scratch = toolkit.Scratch()
  if carried:
    scratch.add("kv", (s, et), f32)
  call = pl.pallas_call(
    functools.partial(_kernel, names=toolkit.ref_names(inputs, outputs, scratch), **statics),
    out_shape=outputs.shapes,
    grid=(b, h, nj, g),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    compiler_params=toolkit.compiler_params(3, sequential=True),  # the chunk axis in order: the carried KV
    interpret=interpret,
    cost_estimate=estimate,
    name="mixed_chunk_attention",
  )
  return outputs.named(call(*inputs.arrays))["out"]


def total(lin_k: Array, v: Array, mask: Array | None, *, lin_scale: float) -> Array:
  """Non-causal without documents every chunk reads the sum over all keys: one XLA einsum over lin_k
  [B,T,H,S] and v [B,T,H,E] (masked keys left out) -> float32 [B,H,S,E]; the kernel carries nothing."""
  keys = lin_k if mask is None else jnp.where(mask[:, :, None, None], lin_k, jnp.zeros_like(lin_k))
  return jnp.einsum("bths,bthe->bhse", keys, v, preferred_element_type=f32) * lin_scale


def token_flags(layout: dict[str, Array], chunk: int) -> dict[str, Array]:
  """`reference.global_layout`'s flags on their tokens, [B,T,1]: a chunk's ([B,G]) repeated over its C tokens."""
  return {
    k: (jnp.repeat(x, chunk, axis=1) if x.ndim == 2 else x.reshape(x.shape[0], -1))[:, :, None]
    for k, x in layout.items()
  }


def attention(
  local: dict[str, Array],
  lin: tuple[Array, Array] | None,
  layout: dict[str, Array] | None,
  *,
  keep: Array | None,
  documents: dict[str, Array],
  total: Array | None,
  chunk: int,
  **statics,
) -> Array:
  """The grid driver, per device: one walk, or two added. local: the local part's operands and v
  (head-major, `pallas`); lin: (lin_q, lin_k) head-major or None; layout: `reference.global_layout`
  ([B,G] per chunk, [B,G,C] per token) or None without documents and "mean"; keep [B,T] float32 the real
  keys or None; documents: qdoc, kdoc; total: the non-causal sum without documents (`total`) ->
  [B,H,T,E].

  Without documents and with "sum", causal carries KV forward, non-causal reads the total. Otherwise
  causal carries KV forward with restarts; non-causal is two walks, forward (local part, the query's own
  chunk, the earlier chunks) and backward (the later chunks), added."""
  args = dict(local)
  b, h, t = args["v"].shape[:3]
  c, causal = chunk, statics["causal"]
  flags = token_flags(layout or {}, c)
  calls = []  # (args, carried, own, reverse)
  if lin is None:
    calls.append((args, False, False, False))
  elif layout is None:
    args["lq"] = lin[0]
    if causal:
      args["lk"] = lin[1]
      if keep is not None:
        args["col"] = keep[:, :, None]
    else:  # every chunk reads the total: nothing to carry in the kernel
      args["kv"] = total
    calls.append((args, causal, False, False))
  else:
    lq, lk = lin
    args.update(lq=lq, lk=lk, col=flags["fwd_w"], keep=flags["fwd_keep"], read=flags["fwd_read"] * flags["scale"])
    if not causal:
      args.update(row=keep[:, None, :], oscale=flags["scale"], **documents)
    calls.append((args, True, not causal, False))
    if not causal:  # the later chunks of the document: the same walk from the right
      later = dict(
        v=args["v"],
        lq=lq,
        lk=lk,
        col=flags["bwd_w"],
        keep=flags["bwd_keep"],
        read=flags["bwd_read"] * flags["scale"],
      )
      calls.append((later, True, False, True))
  dims = lambda call_args: {n: "b.." if n in ROWS + COLUMNS else ".." if n == "bias" else "bh.." for n in call_args}
  out = 0
  for call_args, carried, own, reverse in calls:
    run = functools.partial(forward, chunk=c, carried=carried, own=own, reverse=reverse, **statics)
    out = out + per_device.run_per_device(run, (call_args,), (dims(call_args),), "bh..", batch=b, heads=h)
  return out
