"""FLASH's mixed chunk attention as one Pallas kernel: the public function, its gradient, the operands both
drivers read, and the choice of driver. The [C, C] local scores never reach HBM.

`kernels.mixed_chunk.reference.mixed_chunk_attention` (the reference) computes, for chunk g of C positions,

  local   kernel(quad_scale q k^T + bias) v      [C,C] scores of the chunk against itself, with
                                                 the causal and padding masks (relu2 / softmax / linear)
  global  lin_q KV_g                             KV_g [S,E] float32, a sum of lin_scale lin_k^T v

with KV_g the sum over chunks 0..g-1 (causal: an exclusive prefix) or over all chunks (non-causal),
and holds the [B,G,H,C,C] scores and the [B,G,H,S,E] prefix sums in HBM. Either part may be absent.

Packed documents (`segments`) or global_norm "mean": `_kernel_call` computes, in O(T), each key's weight
in the carried sum, each chunk's carry factor (0 where a document starts inside it: the sum restarts)
and each query's factor on the carried sum (0 when its document started in its own chunk; 1 / chunks
summed for "mean"), from `reference.global_layout`; the local scores compare document indices.
Non-causal adds two carried sums, from the left (the earlier chunks) and from the right (the later
chunks), and the query's document's keys in its own chunk through the linear kernel. Scores and sums
accumulate in float32; the output has v's dtype.

Two drivers (kernels/toolkit.py), both reading E in tiles of Et columns:

  "grid"      (TPU; interpret mode) kernels/mixed_chunk/tpu_grid.py: the chunks in order, the causal KV [S,Et] carried
              in on-chip scratch.
  "parallel"  (GPU) kernels/mixed_chunk/gpu_parallel.py: no carry, the state every chunk reads is XLA's prefix over
              the chunks, and every chunk, query tile and value tile is its own program.

Backward: `jax.custom_vjp` whose backward is kernels too, from the forward's inputs only (no per-chunk state and no
scores are kept): on the grid driver walks over the chunks with the states and their adjoints in scratch
(kernels/mixed_chunk/grid_backward.py: a forward and a reverse walk, or one walk non-causal without documents);
on the parallel driver three calls, dq, dk and dv, over XLA's per-chunk states and adjoints
(kernels/mixed_chunk/gpu_backward.py). The XLA reference's VJP is the tests' oracle. On GPU (Triton) C, S and
the tiles should be powers of two.

This file imports the reference, kernels/mixed_chunk/reference.py; the package (kernels/mixed_chunk/__init__.py)
dispatches between the two on `impl`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel, toolkit
from lra_core.kernels.mixed_chunk import gpu_backward, gpu_parallel, grid_backward, reference, tpu_grid

Array = jax.Array
f32 = jnp.float32
DRIVERS = ("grid", "parallel")  # TPU, GPU (kernels/toolkit.py)


def _operands(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, *, chunk, causal, global_norm) -> dict:
  """The operands both drivers read, forward and backward, from [B,T,H,.] inputs: head-major with T padded to
  whole chunks (`head_major`) the local part's (local: v, qq, qk, row, bias, qdoc, kdoc), the global part's
  (lin: lin_q, lin_k), the real keys (keep, float32 [B,T'], or None), the global layout of documents and
  "mean" (layout, or None: `plain`), the documents' ids (documents: qdoc, kdoc); chunk c = min(chunk, T)."""
  b, t, h, _ = v.shape
  c = min(chunk, t)
  g = -(-t // c)
  pad = g * c - t
  head_major = lambda x: jnp.pad(x.transpose(0, 2, 1, 3), [(0, 0), (0, 0), (0, pad), (0, 0)])
  plain = segments is None and global_norm == "sum"  # the global part is a plain prefix (causal) or total
  keep = None
  if mask is not None or pad or not plain:  # the real keys, float32 [B,T']: the padded tail is no key
    keep = jnp.ones((b, t), f32) if mask is None else mask.astype(f32)
    keep = jnp.pad(keep, [(0, 0), (0, pad)])
  local = {"v": head_major(v)}
  if quad_q is not None:
    local.update(qq=head_major(quad_q), qk=head_major(quad_k))
    if keep is not None:
      local["row"] = keep[:, None, :]
    if bias is not None:
      local["bias"] = bias[:c, :c]  # a chunk cut short by T reads the bias's top-left corner
  layout, documents = None, {}
  if not plain:
    doc = reference.documents(segments, keep[:, :t] > 0, g * c)
    layout = reference.global_layout(
      doc.reshape(b, g, c), (keep > 0).reshape(b, g, c), causal=causal, global_norm=global_norm
    )
    # float32 ids, a column for the queries and a row for the keys: compared with no transpose in the kernel
    documents = dict(qdoc=doc.astype(f32)[:, :, None], kdoc=doc.astype(f32)[:, None, :])
    if segments is not None and quad_q is not None:
      local.update(documents)
  lin = None if lin_q is None else (head_major(lin_q), head_major(lin_k))
  return dict(
    local=local, lin=lin, layout=layout, keep=keep, documents=documents, plain=plain, c=c, head_major=head_major
  )


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
  **_backward,  # the backward's tiles
) -> Array:
  """[B,T,H,.] in, [B,T,H,E] out: `_operands`, then the driver."""
  t = v.shape[1]
  x = _operands(
    quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, chunk=chunk, causal=causal, global_norm=global_norm
  )
  statics = dict(
    value_tile=value_tile,
    causal=causal,
    kernel=kernel,
    quad_scale=quad_scale,
    lin_scale=lin_scale,
    upcast=upcast,
    interpret=interpret,
  )
  parts = dict(keep=x["keep"], documents=x["documents"], chunk=x["c"])
  if driver == "parallel":
    out = gpu_parallel.attention(
      x["local"],
      x["lin"],
      x["layout"],
      query_tile=query_tile,
      key_tile=key_tile,
      local_documents=segments is not None,
      **parts,
      **statics,
    )
  else:
    total = None
    if lin_q is not None and x["plain"] and not causal:
      total = tpu_grid.total(lin_k, v, mask, lin_scale=lin_scale)
    out = tpu_grid.attention(x["local"], x["lin"], x["layout"], total=total, **parts, **statics)
  return out[:, :, :t].transpose(0, 2, 1, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics):
  statics = dict(statics)
  with context_parallel.within(statics.pop("sequence_axes")):
    return _kernel_call(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, **statics)


def _attention_fwd(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics):
  out = _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics)
  return out, (quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments)


def _attention_bwd(statics, residuals, cotangent):
  quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments = residuals
  d = dict(statics)
  with context_parallel.within(d["sequence_axes"]):
    grads = _gradients(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, cotangent, d)
  t = v.shape[1]

  def public(name, like):  # head-major and padded -> [B,T,H,.]; an input of a dropped part gets zeros
    if like is None or name not in grads:
      return None if like is None else jnp.zeros_like(like)
    return grads[name][:, :, :t].transpose(0, 2, 1, 3).astype(like.dtype)

  dbias = None
  if bias is not None and "dbias" not in grads:  # no local part: the bias is not read
    dbias = jnp.zeros_like(bias)
  elif bias is not None:  # the kernel read the top-left [C,C]; the rest of a larger table gets no gradient
    c = grads["dbias"].shape[0]
    dbias = jnp.zeros(bias.shape, f32).at[:c, :c].set(grads["dbias"]).astype(bias.dtype)
  return (
    public("dqq", quad_q),
    public("dqk", quad_k),
    public("dlq", lin_q),
    public("dlk", lin_k),
    public("dv", v),
    dbias,
    None,  # the mask and the segments get no gradient
    None,
  )


def _gradients(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, cotangent, d) -> dict[str, Array]:
  """The driver's gradients (kernels/mixed_chunk/grid_backward.py or gpu_backward.py) from `_operands`,
  head-major with T padded."""
  causal, lin_scale = d["causal"], d["lin_scale"]
  x = _operands(
    quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, chunk=d["chunk"], causal=causal, global_norm=d["global_norm"]
  )
  args = (x["local"], x["lin"], x["layout"], x["head_major"](cotangent))
  kw = {k: d[k] for k in ("causal", "kernel", "quad_scale", "lin_scale", "upcast", "interpret")}
  kw.update(keep=x["keep"], documents=x["documents"], chunk=x["c"])
  if d["driver"] == "parallel":
    query, key, value = d["backward_tiles"]
    tiles = dict(
      query_block=gpu_parallel.tile(x["c"], query),
      key_block=gpu_parallel.tile(x["c"], key),
      value_block=value,
      state_block=min(value, toolkit.gpu_tiles("mixed_chunk_backward")["state_block"]),
    )
    return gpu_backward.gradients(*args, local_documents=segments is not None, tiles=tiles, **kw)
  totals = None
  if lin_q is not None and x["plain"] and not causal:  # the total every chunk reads, and its adjoint
    adjoint = jnp.einsum("bths,bthe->bhse", lin_q.astype(f32), cotangent.astype(f32))
    totals = (tpu_grid.total(lin_k, v, mask, lin_scale=lin_scale), adjoint)
  return grid_backward.gradients(*args, totals=totals, value_tile=d["backward_value_tile"], **kw)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _backward_tiles(e: int, rows: tuple[int | None, int | None], value_tile: int | None) -> tuple[int, int, int]:
  """The parallel driver's backward tiles: (query rows, key rows, value columns), the forward's where the
  caller gave them, else `GPU_TILES["mixed_chunk_backward"]` (rows cut to the chunk where they are used)."""
  tiles = toolkit.gpu_tiles("mixed_chunk_backward")
  query, key = (want or tiles[name] for want, name in zip(rows, ("query_block", "key_block"), strict=True))
  return query, key, value_tile or gpu_parallel.tile(e, tiles["value_block"])


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
  """`kernels.mixed_chunk.mixed_chunk_attention` with impl="pallas": same arguments and result
  (quad_q, quad_k, lin_q, lin_k [B,T,H,S]; v [B,T,H,E]; bias [C,C]; mask bool[B,T]; segments
  int[B,T]; global_norm "sum" | "mean" -> [B,T,H,E]);
  `driver` ("grid" or "parallel") and `interpret` default to the target's (`toolkit.driver`,
  `toolkit.interpret_default`), `value_tile` (the width of the value tiles, a divisor of E) to
  `tpu_grid.value_block` for the target (on GPU `GPU_TILES`' value_block); the parallel driver's
  `query_tile` and `key_tile` (rows of a chunk, divisors of C = min(chunk, T)) to `GPU_TILES`' query_block
  and key_block where they divide C, else C."""
  if kernel not in reference.LOCAL_KERNELS:
    raise ValueError(f"local kernel {kernel!r} is not one of {reference.LOCAL_KERNELS}.")
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
  if global_norm not in reference.GLOBAL_NORMS:
    raise ValueError(f"global_norm {global_norm!r} is not one of {reference.GLOBAL_NORMS}.")
  if quad_q is None and lin_q is None:
    return jnp.zeros_like(v)
  e = v.shape[-1]
  given_tile, given_rows = value_tile, (query_tile, key_tile)  # the backward's too, where given
  tiles = toolkit.gpu_tiles("mixed_chunk_attention")
  if value_tile is None and toolkit.platform() == "gpu":
    value_tile = gpu_parallel.tile(e, tiles["value_block"])  # a power of two, as Triton needs
  elif value_tile is None:
    s = max(x.shape[-1] for x in (quad_q, lin_q) if x is not None)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (quad_q, lin_q, v) if x is not None)
    value_tile = tpu_grid.value_block(
      e, chunk=c, s=s, itemsize=itemsize, budget=toolkit.vmem_budget(), platform=toolkit.platform()
    )
  if value_tile <= 0 or e % value_tile:
    raise ValueError(f"value tile {value_tile} does not divide E {e}.")
  query_tile = gpu_parallel.tile(c, tiles["query_block"]) if query_tile is None else query_tile
  key_tile = gpu_parallel.tile(c, tiles["key_block"]) if key_tile is None else key_tile
  for name, tile in (("query", query_tile), ("key", key_tile)):
    if tile <= 0 or c % tile:
      raise ValueError(f"{name} tile {tile} does not divide the chunk {c}.")
  upcast = not toolkit.bf16_matmuls()
  driver = toolkit.driver(driver, gpu="parallel", drivers=DRIVERS)
  backward_value_tile = given_tile or e
  if driver == "grid" and given_tile is None:  # the backward keeps more per step than the forward: its own tiles
    s = max(x.shape[-1] for x in (quad_q, lin_q) if x is not None)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (quad_q, lin_q, v) if x is not None)
    sizes = dict(chunk=c, s=s, itemsize=itemsize, budget=toolkit.vmem_budget(), platform=toolkit.platform())
    backward_value_tile = grid_backward.value_block(e, **sizes)
  statics = (
    ("chunk", chunk),
    ("value_tile", value_tile),
    ("backward_value_tile", backward_value_tile),
    ("backward_tiles", _backward_tiles(e, given_rows, given_tile)),
    ("query_tile", query_tile),
    ("key_tile", key_tile),
    ("causal", causal),
    ("quad_scale", quad_scale),
    ("lin_scale", lin_scale),
    ("global_norm", global_norm),
    ("kernel", kernel),
    ("upcast", upcast),
    ("driver", driver),
    ("interpret", toolkit.interpret_default() if interpret is None else interpret),
    ("sequence_axes", context_parallel.axes()),  # the backward, traced later, runs on the same chip's slice
  )
  return _attention(quad_q, quad_k, lin_q, lin_k, v, bias, mask, segments, statics)
