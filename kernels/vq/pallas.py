"""VQ-Attention as one Pallas kernel: the public function, its gradient and the choice of driver.

`kernels.vq.reference.cached_attention` (XLA) builds the cache variables of every block at once, a [B,R,H,S,Dv]
tensor in HBM, and the scores of every block, [B,R,H,L,2L+S]. The kernel never holds more than one
block's scores, through one of two drivers (kernels/toolkit.py):

  "grid"      (TPU; interpret mode) kernels/vq/tpu_grid.py: the blocks of one (batch, head) in order, the
              compressive cache in on-chip scratch, values read in tiles of Dt columns and the queries of
              a block Lq rows at a time (`tpu_grid.block_sizes` fits them to the target's VMEM).
  "parallel"  (GPU) kernels/vq/gpu_parallel.py: every block attended at once from the cache XLA's prefix gives
              it (Triton keeps a program's working set in registers, where neither the cache nor a whole
              block's scores fit).

Documents (`segments`, see `kernels.vq.reference.document_plan`): each driver turns the plan into inputs its
block step reads with elementwise ops only (query and key ids, whether a query reads the cache, whether
a block's fold keeps the old cache).

Backward (`jax.custom_vjp`): kernels on both drivers. The grid driver's two, kernels/vq/grid_backward.py (the
blocks in order for dq, dk, the codebook's and the position term's gradients; then backwards for dv and the
cache's adjoint), from the inputs alone; the parallel driver's three, kernels/vq/gpu_backward.py (every block
at once from XLA's per-block cache, with the forward's output and log-normaliser), whose cache gradient goes
back through XLA's prefix. The XLA form's VJP is the tests' oracle.

kernels/vq/__init__.py checks the arguments and dispatches between this kernel and the reference,
kernels/vq/reference.py, on `impl`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lra_core.kernels import per_device, toolkit
from lra_core.kernels.vq import gpu_backward, gpu_parallel, grid_backward, grid_layout, tpu_grid

Array = jax.Array
DRIVERS = ("grid", "parallel")  # of kernels/toolkit.py: TPU (and interpret mode), GPU


def _kernel_call(
  q,
  k_hat,
  z,
  v,
  codebook,
  carry,
  bias,
  segments=None,
  *,
  block_len,
  value_block,
  query_block,
  compressive,
  driver,
  interpret,
  key_block=None,
  code_block=None,
  grad_through_cache=True,
  backward_query_block=None,
  backward_tiles=None,
):
  """[B,T,H,.] in, [B,T,H,Dv] out plus the cache per key-value head and (parallel driver) each query's
  log-normaliser [B,H,T,1], by the driver named (`grad_through_cache` and the `backward_` sizes are the
  backward's: the forward is the same either way)."""
  sizes = dict(block_len=block_len, value_block=value_block, query_block=query_block)
  if driver == "parallel":  # its log-normaliser too, which the parallel backward reads
    return gpu_parallel.attention(
      q,
      k_hat,
      z,
      v,
      codebook,
      carry,
      bias,
      segments,
      key_block=key_block,
      code_block=code_block,
      compressive=compressive,
      interpret=interpret,
      **sizes,
    )
  return *tpu_grid.attention(
    q, k_hat, z, v, codebook, carry, bias, segments, compressive=compressive, interpret=interpret, **sizes
  ), None


# The integer inputs (codes, document ids) travel apart from the floats, as residuals only: they have no
# cotangent. `statics` is a tuple of pairs, hashable as a nondiff argument must be.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  return _attention_fwd(q, k_hat, v, codebook, carry_float, bias, ints, statics)[0]


def _attention_fwd(q, k_hat, v, codebook, carry_float, bias, ints, statics):
  carry = dict(carry_float, z=ints["carry_z"], seg=ints["carry_seg"])
  out, mean, count, lse = _kernel_call(q, k_hat, ints["z"], v, codebook, carry, bias, ints["segments"], **dict(statics))
  # the parallel backward reads the output and its log-normaliser; the grid one recomputes from the inputs
  return (out, mean, count), (q, k_hat, v, codebook, carry_float, bias, ints, out if lse is not None else None, lse)


def _attention_bwd(statics, residuals, cotangents):
  """The grid driver's two backward kernels (kernels/vq/grid_backward.py) or the parallel driver's three
  (kernels/vq/gpu_backward.py)."""
  d = dict(statics)
  if d["driver"] == "grid":
    return _grid_gradients(residuals[:7], cotangents[0], d) + (None,)
  return _parallel_gradients(residuals, cotangents[0], d) + (None,)


def _parallel_gradients(residuals, dout, d: dict) -> tuple:
  """`gpu_backward.gradients` as the custom_vjp's cotangents."""
  q, k_hat, v, codebook, carry_float, bias, ints, out, lse = residuals
  carry = dict(carry_float, z=ints["carry_z"], seg=ints["carry_seg"])
  sizes = {n: d[n] for n in ("block_len", "compressive", "grad_through_cache")}
  names = ("value_block", "query_block", "key_block", "code_block")
  sizes.update(zip(names, d["backward_tiles"]))
  grads = gpu_backward.gradients(
    q,
    k_hat,
    ints["z"],
    v,
    codebook,
    carry,
    bias,
    ints["segments"],
    out,
    lse,
    dout,
    interpret=d["interpret"],
    **sizes,
  )
  cast = lambda x, like: x.astype(like.dtype)
  dcarry = {
    "k": cast(grads["carry_k"], carry_float["k"]),
    "v": cast(grads["carry_v"], carry_float["v"]),
    "mean": cast(grads["carry_mean"], carry_float["mean"]),
    "count": jnp.zeros_like(carry_float["count"]),  # counts of integer codes: no gradient
  }
  dbias = None if bias is None else cast(grads["bias"], bias)
  parts = ((grads["q"], q), (grads["k_hat"], k_hat), (grads["v"], v), (grads["codebook"], codebook))
  return (*(cast(g, like) for g, like in parts), dcarry, dbias)


def _grid_gradients(residuals, dout, d: dict) -> tuple:
  """`grid_backward.gradients` in the public layout: per key-value head (a group's query heads summed), the
  carried block's and cache's gradients apart, the position term's as `reference.xl_bias_blocks` gives it."""
  q, k_hat, v, codebook, carry_float, bias, ints = residuals
  b, t, h, _ = q.shape
  hk, l = codebook.shape[0], d["block_len"]
  carry = dict(carry_float, z=ints["carry_z"], seg=ints["carry_seg"])
  x = grid_layout.head_major(q, k_hat, ints["z"], v, codebook, carry, bias, ints["segments"], block_len=l)
  sizes = {n: d[n] for n in ("block_len", "value_block", "compressive", "grad_through_cache")}
  grads = grid_backward.gradients(
    x, dout.transpose(0, 2, 1, 3), query_block=d["backward_query_block"], interpret=d["interpret"], **sizes
  )
  per_kv_head = lambda x: x.reshape((x.shape[0], hk, h // hk) + x.shape[2:]).sum(2)  # [B,H,..] -> [B,Hk,..]
  public = lambda x, like: per_kv_head(x).transpose(0, 2, 1, 3).astype(like.dtype)  # -> [B,T,Hk,.]
  dk_prev = grads["dk_prev"]  # block r + 1 there is block r's share as the previous block; block 0 the carry's
  dk = grads["dk"] + jnp.concatenate([dk_prev[:, :, l:], jnp.zeros_like(dk_prev[:, :, :l])], axis=2)
  count = carry_float["count"].astype(jnp.float32)
  dcarry = {
    "k": public(dk_prev[:, :, :l], carry_float["k"]),
    "v": public(grads["dcarry_v"], carry_float["v"]),
    # the kernel carries sums, count * mean; the counts (of integer codes) have no gradient
    "mean": (per_kv_head(grads["dcarry_sum"]) * count[..., None]).astype(carry_float["mean"].dtype),
    "count": jnp.zeros_like(carry_float["count"]),
  }
  dcodebook = per_kv_head(grads["dcodebook"].sum(0)[None])[0].astype(codebook.dtype)
  dbias = None
  if bias is not None:  # [B,H,T,2L] -> [B,R,Hk,G,L,2L]
    g = h // hk
    dbias = grads["dbias"].reshape(b, hk, g, t // l, l, 2 * l).transpose(0, 3, 1, 2, 4, 5).astype(bias.dtype)
  dq = grads["dq"].transpose(0, 2, 1, 3).astype(q.dtype)
  return dq, public(dk, k_hat), public(grads["dv"], v), dcodebook, dcarry, dbias


_attention.defvjp(_attention_fwd, _attention_bwd)


def vq_attention_blocks(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  *,
  block_len: int,
  carry: dict,
  bias: Array | None = None,
  compressive: bool = True,
  driver: str | None = None,
  interpret: bool | None = None,
  tiles: tuple[int, ...] | None = None,
  segments: Array | None = None,
  grad_through_cache: bool = True,
) -> tuple[Array, dict]:
  """`kernels.vq.vq_attention_blocks` with impl="pallas": same arguments, with the position term as
  `kernels.vq.reference.xl_bias_blocks`' output; returns the output [B,T,H,Dv] and the carry after the last
  position (equal to the XLA form's). `driver`: "grid" (TPU, interpret) or "parallel" (GPU); by default the
  target's. `tiles`: the grid driver's (value tile width, query sub-block), by default `tpu_grid.block_sizes` for
  the target; the parallel driver's (value tile, query rows, key rows, codes), by default `gpu_parallel.tiles`.
  `segments` int [B,T]: packed documents, as in the XLA form."""
  dv, s = v.shape[-1], codebook.shape[1]
  driver = toolkit.driver(driver, gpu="parallel", drivers=DRIVERS)
  if tiles is None and driver == "parallel":
    tiles = gpu_parallel.tiles(dv, block_len=block_len, n_code=s)
  elif tiles is None:
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k_hat, v))
    tiles = tpu_grid.block_sizes(
      dv,
      block_len=block_len,
      n_code=s,
      d_k=q.shape[-1],
      itemsize=itemsize,
      has_bias=bias is not None,
      budget=toolkit.vmem_budget(),
      platform=toolkit.platform(),
      has_segments=segments is not None,
    )
  names = ("value tile", "query sub-block", "key tile", "code tile")[: len(tiles)]
  for name, tile, size, what in zip(
    names, tiles, (dv, block_len, block_len, s), ("d_v", "block_len", "block_len", "n_code")
  ):
    if tile <= 0 or size % tile:
      raise ValueError(f"{name} {tile} does not divide {what} {size}.")
  if len(tiles) != (4 if driver == "parallel" else 2):
    raise ValueError(
      f"tiles {tiles} has {len(tiles)} sizes; the {driver} driver takes {4 if driver == 'parallel' else 2}."
    )
  statics = (  # the driver and its tiles are decided here, outside the shard_map and the custom_vjp
    ("block_len", block_len),
    ("value_block", tiles[0]),
    ("query_block", tiles[1]),
    ("compressive", compressive),
    ("grad_through_cache", grad_through_cache),
    ("driver", driver),
    ("interpret", toolkit.interpret_default() if interpret is None else interpret),
  )
  if driver == "parallel":
    statics += (("key_block", tiles[2]), ("code_block", tiles[3]))
    backward = gpu_parallel.tiles(dv, block_len=block_len, n_code=s, kernel="vq_attention_backward")
    statics += (("backward_tiles", backward),)
  else:  # the backward's scores kernel keeps the whole cache: its query sub-block fits what remains
    sizes = dict(block_len=block_len, n_code=s, d_k=q.shape[-1], d_v=dv, value_block=tiles[0])
    sizes.update(itemsize=max(jnp.dtype(x.dtype).itemsize for x in (q, k_hat, v)), has_bias=bias is not None)
    backward_rows = grid_backward.query_block(
      tiles[1], budget=toolkit.vmem_budget(), has_segments=segments is not None, **sizes
    )
    statics += (("backward_query_block", backward_rows),)

  # Per device under a mesh: the kernel sees its shard of batch and heads (a Mosaic call cannot be partitioned).
  def one_device(q, k_hat, z, v, codebook, carry, bias, segments):
    carry_float = {"k": carry["k"], "v": carry["v"], "mean": carry["mean"], "count": carry["count"]}
    ints = {"z": z, "carry_z": carry["z"], "carry_seg": carry["seg"], "segments": segments}
    return _attention(q, k_hat, v, codebook, carry_float, bias, ints, statics)

  carry_dims = {"k": "b.k.", "v": "b.k.", "z": "b.k", "mean": "bk..", "count": "bk.", "seg": "b."}
  out, mean, count = per_device.run_per_device(
    one_device,
    (q, k_hat, z, v, codebook, carry, bias, segments),
    (
      "b.h.",
      "b.k.",
      "b.k",
      "b.k.",
      "k..",
      carry_dims,
      None if bias is None else "b.kg..",
      None if segments is None else "b.",
    ),
    ("b.h.", "bk..", "bk."),
    batch=q.shape[0],
    heads=q.shape[2],
    kv_heads=codebook.shape[0],
  )
  l = block_len
  tail = lambda x: x[:, -l:]  # the last block is the next window's carried block
  new_carry = {
    "k": tail(k_hat),
    "v": tail(v),
    "z": tail(z),
    "mean": mean,
    "count": count,
    "seg": carry["seg"] if segments is None else tail(segments).astype(jnp.int32),
  }
  return out, jax.tree.map(jax.lax.stop_gradient, new_carry)
