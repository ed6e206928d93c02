"""FLASH's mixed chunk attention as one Pallas kernel: the [C, C] local scores never reach HBM.

`kernels.flash_xla.mixed_chunk_attention` (the reference) computes, for chunk g of C positions,

  local   kernel(quad_scale q k^T + bias) v      [C,C] scores of the chunk against itself, with
                                                 the causal and padding masks (relu2 / softmax / linear)
  global  lin_q KV_g                             KV_g [S,E] float32, a sum of lin_scale lin_k^T v

with KV_g the sum over chunks 0..g-1 (causal: an exclusive prefix) or over all chunks (non-causal),
and holds the [B,G,H,C,C] scores and the [B,G,H,S,E] prefix sums in HBM. Either part may be absent.

Packed documents (`segments`) or global_norm "mean": the wrapper computes, in O(T), each key's
weight in the carried sum, each chunk's carry factor (0 where a document starts inside it: the
sum restarts) and each query's factor on the carried sum (0 when its document started in its own
chunk; 1 / chunks summed for "mean"), from `flash_xla.global_layout`; the local scores compare
document indices. Non-causal adds two carried sums, from the left (the earlier chunks) and from
the right (the later chunks), and the query's document's keys in its own chunk through the linear
kernel. Scores and sums accumulate in float32; the output has v's dtype.

Two drivers (kernels/toolkit.py), both reading E in J tiles of Et columns (KV and the output are
independent across value columns; the local scores are recomputed per tile):

  "grid" (TPU)  grid (B, H, J, G), the chunks sequential: causal, KV [S,Et] is carried in VMEM scratch
                and updated after its use, so no per-chunk state reaches HBM (non-causal reads the
                total, one XLA einsum; with documents non-causal is two walks, forward and backward,
                added). `_chunk_step` is one chunk, whole: Et is as wide as the target's VMEM allows
                (`value_block`).
  "parallel"    (GPU) no carry: the state every chunk reads is XLA's prefix over the chunks, and every
                chunk, query tile and value tile is its own program: kernels/flash_parallel.py.

Layout: head-major inside ([B,H,T,S]); T is padded to a multiple of C and cut afterwards. The
padding mask (`mask` and the padded tail) arrives as float32, a row [1,T] for the local keys and a
column [T,1] for the keys summed into KV (grid driver), so the kernel transposes nothing.

Backward: `jax.custom_vjp` whose backward is the VJP of the XLA reference
(`kernels.flash_xla.mixed_chunk_attention`), recomputed from the inputs: training memory is the XLA
path's; the forward is where the kernel saves HBM traffic. On GPU (Triton) C, S and the tiles should
be powers of two.

This file is the kernel and imports the reference, kernels/flash_xla.py; kernels/flash.py dispatches
between the two on `impl`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import flash_parallel, flash_xla, toolkit

Array = jax.Array
f32 = jnp.float32
MASK = 1e30
DRIVERS = ("grid", "parallel")  # TPU, GPU (kernels/toolkit.py)
# Kernel operands in a fixed order; a call passes the ones its parts need.
OPERANDS = ("qq", "qk", "lq", "lk", "v", "kv", "row", "col", "bias", "qdoc", "kdoc", "keep", "read", "oscale")
STEP = tuple(n for n in OPERANDS if n != "kv")  # _chunk_step's arguments after kv
ROWS = ("row", "kdoc")  # [B,1,T] operands: one value per key, along lanes
COLUMNS = ("col", "qdoc", "keep", "read", "read2", "oscale")  # [B,T,1] operands (both drivers)


def _weights(scores: Array, allowed: Array | None, kernel: str) -> Array:
  """Local attention weights from float32 scores [C,C]; positions not allowed get weight 0."""
  if kernel == "relu2":
    w = jnp.square(jnp.maximum(scores, 0.0))
  elif kernel == "softmax":
    if allowed is not None:
      scores = jnp.where(allowed, scores, -MASK)
    w = jnp.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
  else:
    w = scores
  return w if allowed is None else jnp.where(allowed, w, 0.0)


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
  same = None if qdoc is None else qdoc == kdoc  # [C,C]
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
    out = toolkit.dot(_weights(scores, allowed, kernel).astype(v.dtype), v)
  if lq is not None:
    part = toolkit.dot(lq.astype(f32), kv)
    if read is not None:
      part = part * read
    if own:
      scores = toolkit.dot(lq.astype(f32), lk.astype(f32), (1, 1)) * lin_scale
      allowed = same if row is None else same & (row > 0)
      part = part + toolkit.dot(jnp.where(allowed, scores, 0.0) * oscale, v.astype(f32))
    out = part if out is None else out + part
    if carried:  # after its use: the chunks before this one in the walk
      keys = lk if col is None else jnp.where(col > 0, lk, jnp.zeros_like(lk))
      if keep is not None:
        kv = kv * keep[:1, :]
      kv = kv + toolkit.dot(keys, v, (0, 0)) * lin_scale
  return out, kv


def _grid_kernel(*refs, names: tuple[str, ...], **statics):
  """Grid (B, H, J, G): J value tiles, G sequential; a causal KV of one tile lives in scratch across
  the chunk axis."""
  ins, (o_ref, *scratch) = toolkit.named_refs(refs, names)
  load = lambda name: ins[name][...] if name in ins else None
  carried = statics["carried"]
  if carried:
    (kv_ref,) = scratch

    @pl.when(pl.program_id(3) == 0)
    def _():
      kv_ref[...] = jnp.zeros(kv_ref.shape, f32)

    kv = kv_ref[...]
  else:
    kv = load("kv")
  out, kv = _chunk_step(kv, *(load(n) for n in STEP), **statics)
  o_ref[...] = out.astype(o_ref.dtype)
  if carried:
    kv_ref[...] = kv


LANES, SUBLANES = 128, 8  # a TPU VMEM tile


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
  return -(-rows // SUBLANES) * SUBLANES * -(-cols // LANES) * LANES * itemsize


def vmem_bytes(*, chunk: int, s: int, value_block: int, itemsize: int) -> int:
  """Estimated VMEM of one grid step of the TPU kernel (grid driver), blocks padded to whole tiles: the
  pipelined [C,S] query/key blocks, [C,Et] value and output blocks, masks and bias twice (double-
  buffered); KV [S,Et] as input or scratch; the float32 temporaries ([C,C] scores and weights, the
  [C,Et] output and upcast values, the KV update, upcast [C,S] operands); the compiler's own scratch.
  An upper bound: Mosaic reports 26.5 MiB where this gives 31.6 (C 512, S 128, Et 2048, bfloat16, v3)."""
  c, et, a = chunk, value_block, itemsize
  x = _tile_bytes
  pipelined = 4 * x(c, s, a) + 2 * x(c, et, a) + x(1, c, 4) + x(c, 1, 4) + x(c, c, 4) + x(s, et, 4)
  temporaries = 3 * x(c, c, 4) + 3 * x(c, et, 4) + 2 * x(s, et, 4) + 4 * x(c, s, 4)
  return 2 * pipelined + x(s, et, 4) + temporaries + 2**20


def value_block(e: int, *, chunk: int, s: int, itemsize: int, budget: int | None, platform: str = "tpu") -> int:
  """The width of the value tiles, a divisor of e. TPU: the widest multiple of 128 lanes whose
  `vmem_bytes` fits `budget` (128 when none does: the compiler then names the excess); e itself when
  it is no multiple of 128. GPU: `GPU_TILES`' value_block where it divides e (a power of two, as
  Triton needs). Elsewhere (interpret mode) e."""
  if platform == "gpu":
    tile = toolkit.gpu_tiles("mixed_chunk_attention")["value_block"]
    return tile if e % tile == 0 else e
  if platform != "tpu" or e % LANES:
    return e
  widths = [w for w in range(e, 0, -LANES) if e % w == 0]
  fits = [
    w for w in widths if budget is None or vmem_bytes(chunk=chunk, s=s, value_block=w, itemsize=itemsize) <= budget
  ]
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
  """What the grid driver computes and moves, for XLA's and lra_core.hlo_cost's rooflines (a custom call is
  opaque to them): per chunk the local [C,C] scores once per value tile and their product with the
  values, the global part's lin_q KV and (causal) KV update over all of E; the [C,S] blocks read once
  per tile, v and the output once. (The parallel driver's: `flash_parallel.cost`.)"""
  b, h, t, c = batch, heads, seq_len, chunk
  tiles, chunks = e // value_tile, t // chunk
  flops = chunks * ((tiles * 2 * c * c * s + 2 * c * c * e) * local + 2 * c * s * e * (1 + carried))
  moved = tiles * t * s * itemsize * (2 * local + 1 + carried) + 2 * t * e * itemsize
  return pl.CostEstimate(flops=int(b * h * flops), transcendentals=0, bytes_accessed=int(b * h * moved))


def _grid_forward(
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
  """The grid driver on head-major operands: qq, qk, lq, lk [B,H,T,S]; v [B,H,T,E]; kv [B,H,S,E];
  ROWS [B,1,T]; COLUMNS [B,T,1]; bias [C,C] (each only where needed; T a multiple of C) -> [B,H,T,E].
  E is read in J = E / value_tile tiles, each its own program (the local scores recomputed per tile).
  `reverse` walks the chunks last to first (the carried sum then holds the later chunks)."""
  b, h, t, e = args["v"].shape
  c, g, et = chunk, t // chunk, value_tile
  nj = e // et
  names = tuple(n for n in OPERANDS if n in args)
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
  at = (lambda rr: g - 1 - rr) if reverse else (lambda rr: rr)
  time = lambda bb, hh, jj, rr: (bb, hh, at(rr), 0)
  tiled = lambda bb, hh, jj, rr: (bb, hh, at(rr), jj)
  index = {"v": tiled, "kv": lambda bb, hh, jj, rr: (bb, hh, 0, jj), "bias": lambda bb, hh, jj, rr: (0, 0)}
  block = {"v": (None, None, c, et), "kv": (None, None, s, et), "bias": (c, c)}
  for n in ROWS:
    index[n], block[n] = (lambda bb, hh, jj, rr: (bb, 0, at(rr))), (None, 1, c)
  for n in COLUMNS:
    index[n], block[n] = (lambda bb, hh, jj, rr: (bb, at(rr), 0)), (None, c, 1)
  in_specs = [pl.BlockSpec(block.get(n, (None, None, c, args[n].shape[-1])), index.get(n, time)) for n in names]
  call = pl.pallas_call(
    functools.partial(_grid_kernel, names=names, **statics),
    out_shape=jax.ShapeDtypeStruct((b, h, t, e), args["v"].dtype),
    grid=(b, h, nj, g),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, None, c, et), tiled),
    scratch_shapes=[toolkit.scratch((s, et), f32)] if carried else [],
    compiler_params=toolkit.compiler_params(3, sequential=True),
    interpret=interpret,
    cost_estimate=estimate,
    name="mixed_chunk_attention",
  )
  return call(*(args[n] for n in names))


def _kernel_call(
  quad_q,
  quad_k,
  lin_q,
  lin_k,
  v,
  bias,
  mask,
  segments,
  *,
  chunk,
  value_tile,
  query_tile,
  key_tile,
  causal,
  quad_scale,
  lin_scale,
  global_norm,
  kernel,
  upcast,
  driver,
  interpret,
) -> Array:
  """[B,T,H,.] in, the head-major kernel per device, [B,T,H,E] out.

  Grid driver: without documents and with "sum", causal carries KV forward, non-causal reads the
  total (one einsum here). Otherwise (`flash_xla.global_layout`): causal carries KV forward with
  restarts; non-causal is two walks, forward (local part, the query's own chunk, the earlier chunks)
  and backward (the later chunks), added. Parallel driver: the states every chunk reads, computed
  here (`flash_parallel.chunk_states`), and one call."""
  b, t, h, _ = v.shape
  c = min(chunk, t)
  g = -(-t // c)
  pad = g * c - t
  head_major = lambda x: jnp.pad(x.transpose(0, 2, 1, 3), [(0, 0), (0, 0), (0, pad), (0, 0)])
  plain = segments is None and global_norm == "sum"
  keep = None
  if mask is not None or pad or not plain:
    keep = jnp.ones((b, t), f32) if mask is None else mask.astype(f32)
    keep = jnp.pad(keep, [(0, 0), (0, pad)])
  args = {"v": head_major(v)}
  if quad_q is not None:
    args.update(qq=head_major(quad_q), qk=head_major(quad_k))
    if keep is not None:
      args["row"] = keep[:, None, :]
    if bias is not None:
      args["bias"] = bias[:c, :c]
  lay = {}
  if not plain:
    doc = flash_xla.documents(segments, keep[:, :t] > 0, g * c)
    lay = flash_xla.global_layout(
      doc.reshape(b, g, c), (keep > 0).reshape(b, g, c), causal=causal, global_norm=global_norm
    )
    documents = dict(qdoc=doc.astype(f32)[:, :, None], kdoc=doc.astype(f32)[:, None, :])
    if segments is not None and quad_q is not None:
      args.update(documents)
  statics = dict(
    chunk=c,
    value_tile=value_tile,
    causal=causal,
    kernel=kernel,
    quad_scale=quad_scale,
    lin_scale=lin_scale,
    upcast=upcast,
    interpret=interpret,
  )
  dims = lambda call_args: {n: "b.." if n in ROWS + COLUMNS else ".." if n == "bias" else "bh.." for n in call_args}
  if driver == "parallel":
    if lin_q is not None:
      lq, lk = head_major(lin_q), head_major(lin_k)
      states = functools.partial(
        flash_parallel.chunk_states, lk, args["v"], chunk=c, causal=causal, lin_scale=lin_scale
      )
      args["lq"] = lq
      if plain:
        args["kv"] = states(keep, None)
      else:
        tokens = lambda x: x.reshape(b, g * c)[:, :, None]  # [B,G,C] -> [B,T,1]
        args.update(
          kv=states(lay["fwd_w"].reshape(b, g * c), lay["fwd_keep"]), read=tokens(lay["fwd_read"] * lay["scale"])
        )
        if not causal:  # the later chunks of the document, and its keys in the query's own chunk
          args.update(
            kv2=states(lay["bwd_w"].reshape(b, g * c), lay["bwd_keep"], reverse=True),
            read2=tokens(lay["bwd_read"] * lay["scale"]),
            lk=lk,
            row=keep[:, None, :],
            oscale=tokens(lay["scale"]),
            **documents,
          )
    run = functools.partial(
      flash_parallel.forward, query_tile=query_tile, key_tile=key_tile, local_documents=segments is not None, **statics
    )
    out = toolkit.run_per_device(run, (args,), (dims(args),), "bh..", batch=b, heads=h)
    return out[:, :, :t].transpose(0, 2, 1, 3)
  # Per-chunk flags onto their tokens, [B,T,1].
  layout = {k: (jnp.repeat(x, c, axis=1) if x.ndim == 2 else x.reshape(b, g * c))[:, :, None] for k, x in lay.items()}
  calls = []  # (args, carried, own, reverse)
  if lin_q is None:
    calls.append((args, False, False, False))
  elif plain:
    args["lq"] = head_major(lin_q)
    if causal:
      args["lk"] = head_major(lin_k)
      if keep is not None:
        args["col"] = keep[:, :, None]
    else:  # every chunk reads the total: one einsum here, nothing to carry in the kernel
      keys = lin_k if mask is None else jnp.where(mask[:, :, None, None], lin_k, jnp.zeros_like(lin_k))
      args["kv"] = jnp.einsum("bths,bthe->bhse", keys, v, preferred_element_type=f32) * lin_scale
    calls.append((args, causal, False, False))
  else:
    lq, lk = head_major(lin_q), head_major(lin_k)
    args.update(lq=lq, lk=lk, col=layout["fwd_w"], keep=layout["fwd_keep"], read=layout["fwd_read"] * layout["scale"])
    if not causal:
      args.update(row=keep[:, None, :], oscale=layout["scale"], **documents)
    calls.append((args, True, not causal, False))
    if not causal:
      later = dict(
        v=args["v"],
        lq=lq,
        lk=lk,
        col=layout["bwd_w"],
        keep=layout["bwd_keep"],
        read=layout["bwd_read"] * layout["scale"],
      )
      calls.append((later, True, False, True))
  out = 0
  for call_args, carried, own, reverse in calls:
    run = functools.partial(_grid_forward, carried=carried, own=own, reverse=reverse, **statics)
    out = out + toolkit.run_per_device(run, (call_args,), (dims(call_args),), "bh..", batch=b, heads=h)
  return out[:, :, :t].transpose(0, 2, 1, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics):
  return _kernel_call(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, **dict(statics))


def _attention_fwd(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics):
  out = _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics)
  return out, (quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments)


def _attention_bwd(statics, residuals, cotangent):
  *floats, mask, segments = residuals
  d = {k: x for k, x in statics if k not in ("value_tile", "query_tile", "key_tile", "upcast", "driver", "interpret")}

  def xla(quad_q, quad_k, lin_q, lin_k, v, bias):
    return flash_xla.mixed_chunk_attention(
      quad_q, quad_k, lin_q, lin_k, v, bias=bias, mask=mask, segments=segments, **d
    )

  _, vjp = jax.vjp(xla, *floats)
  return vjp(cotangent) + (None, None)  # the mask and the segments get no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def mixed_chunk_attention(
  quad_q: Array | None,
  quad_k: Array | None,
  lin_q: Array | None,
  lin_k: Array | None,
  v: Array,
  *,
  chunk: int,
  causal: bool,
  quad_scale: float,
  lin_scale: float,
  bias: Array | None = None,
  mask: Array | None = None,
  segments: Array | None = None,
  global_norm: str = "sum",
  kernel: str = "relu2",
  driver: str | None = None,
  interpret: bool | None = None,
  value_tile: int | None = None,
  query_tile: int | None = None,
  key_tile: int | None = None,
) -> Array:
  """`kernels.flash.mixed_chunk_attention` with impl="pallas": same arguments and result
  (quad_q, quad_k, lin_q, lin_k [B,T,H,S]; v [B,T,H,E]; bias [C,C]; mask bool[B,T]; segments
  int[B,T]; global_norm "sum" | "mean" -> [B,T,H,E]);
  `driver` ("grid" or "parallel") and `interpret` default to the target's (`toolkit.driver`,
  `toolkit.interpret_default`), `value_tile` (the width of the value tiles, a divisor of E) to
  `value_block` for the target; the parallel driver's `query_tile` and `key_tile` (rows of a chunk,
  divisors of C = min(chunk, T)) to `GPU_TILES`' query_block and key_block where they divide C, else C."""
  if kernel not in flash_xla.LOCAL_KERNELS:
    raise ValueError(f"local kernel {kernel!r} is not one of {flash_xla.LOCAL_KERNELS}.")
  b, t, h, _ = v.shape
  c = min(chunk, t)
  for name, x in (("quad_q", quad_q), ("quad_k", quad_k), ("lin_q", lin_q), ("lin_k", lin_k)):
    if x is not None and (x.ndim != 4 or x.shape[:3] != (b, t, h)):
      raise ValueError(f"{name} has shape {x.shape}; expected [B,T,H,S] with B, T, H = {(b, t, h)} as in v.")
  if quad_q is not None and bias is not None and (bias.ndim != 2 or min(bias.shape) < c):
    raise ValueError(f"bias has shape {bias.shape}; expected [C,C] with C >= {c}.")
  if mask is not None and mask.shape != (b, t):
    raise ValueError(f"mask has shape {mask.shape}; expected [B,T] = {(b, t)}.")
  if segments is not None and segments.shape != (b, t):
    raise ValueError(f"segments has shape {segments.shape}; expected [B,T] = {(b, t)}.")
  if global_norm not in flash_xla.GLOBAL_NORMS:
    raise ValueError(f"global_norm {global_norm!r} is not one of {flash_xla.GLOBAL_NORMS}.")
  if quad_q is None and lin_q is None:
    return jnp.zeros_like(v)
  e = v.shape[-1]
  if value_tile is None:
    s = max(x.shape[-1] for x in (quad_q, lin_q) if x is not None)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (quad_q, lin_q, v) if x is not None)
    value_tile = value_block(
      e, chunk=c, s=s, itemsize=itemsize, budget=toolkit.vmem_budget(), platform=toolkit.platform()
    )
  if value_tile <= 0 or e % value_tile:
    raise ValueError(f"value tile {value_tile} does not divide E {e}.")
  tiles = toolkit.gpu_tiles("mixed_chunk_attention")
  query_tile = flash_parallel.tile(c, tiles["query_block"]) if query_tile is None else query_tile
  key_tile = flash_parallel.tile(c, tiles["key_block"]) if key_tile is None else key_tile
  for name, tile in (("query", query_tile), ("key", key_tile)):
    if tile <= 0 or c % tile:
      raise ValueError(f"{name} tile {tile} does not divide the chunk {c}.")
  statics = (
    ("chunk", chunk),
    ("value_tile", value_tile),
    ("query_tile", query_tile),
    ("key_tile", key_tile),
    ("causal", causal),
    ("quad_scale", quad_scale),
    ("lin_scale", lin_scale),
    ("global_norm", global_norm),
    ("kernel", kernel),
    ("upcast", not toolkit.bf16_matmuls()),
    ("driver", toolkit.driver(driver, gpu="parallel", drivers=DRIVERS)),
    ("interpret", toolkit.interpret_default() if interpret is None else interpret),
  )
  return _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics)
