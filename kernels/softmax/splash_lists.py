"""Splash attention's block lists for a causal mask over the steps each query row holds, built in numpy
at any length.

Splash (jax.experimental.pallas.ops.tpu.splash_attention) runs a grid of (query block, key block) pairs
and learns from block lists which pairs to visit: `block_mask` (0: no query of the block reads a key of
it, skipped; 1: some, masked in the kernel; 2: all) and `data_next` (the key block to fetch next, or for
the dk/dv kernel the query block), each row cut down to the blocks it visits ("shrinking the grid") and,
for a kernel split over chips by query rows (`q_seq_shards`), made per chip and padded to one width.
Splash's own `make_splash_mha` derives them by evaluating the mask block by block in a Python loop: at a
million steps in blocks of 512 that is 4M blocks and about an hour per list, where the split attention
of kernels/softmax/library.py needs them for every compile. Here they come from each block's first
and last step (a causal mask's block is full, empty or mixed by those alone), in a few vectorised numpy
operations, in splash's own layout; tests/test_split_splash.py checks them equal to splash's own for
masks small enough to build its way, in both orders and for 1 to 8 chips.
"""

from __future__ import annotations

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

EMPTY, MIXED, FULL = 0, 1, 2  # block_mask's values


def causal_blocks(q_steps: np.ndarray, kv_len: int, block_q: int, block_kv: int) -> np.ndarray:
  """[query blocks, key blocks] EMPTY / MIXED / FULL of the mask "query at step s reads keys 0..s", the
  query rows holding `q_steps` (keys in time order)."""
  rows = q_steps.reshape(-1, block_q)
  first_key = np.arange(0, kv_len, block_kv)
  last_key = first_key + block_kv - 1
  full = rows.min(1)[:, None] >= last_key[None, :]
  empty = rows.max(1)[:, None] < first_key[None, :]
  return np.where(empty, EMPTY, np.where(full, FULL, MIXED)).astype(np.int32)


def _next_visited(blocks: np.ndarray) -> np.ndarray:
  """For each block in row-major order, the column of the first visited block at or after it (wrapping
  to the first visited block): the block the kernel fetches next."""
  visited = np.flatnonzero(blocks.ravel())
  if visited.size == 0:
    return np.zeros_like(blocks)
  after = np.searchsorted(visited, np.arange(blocks.size))
  after[after == visited.size] = 0  # past the last visited block: the first one
  return (visited[after] % blocks.shape[1]).reshape(blocks.shape).astype(np.int32)


def _shrink(blocks: np.ndarray, data_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Each row cut down to its visited columns, in order, and padded with zeros to the widest row's count."""
  counts = (blocks != EMPTY).sum(1)
  width = int(counts.max())
  columns = np.argsort(blocks == EMPTY, axis=1, kind="stable")[:, :width]  # visited columns first, in order
  kept = np.arange(width)[None, :] < counts[:, None]
  pick = lambda a: np.where(kept, np.take_along_axis(a, columns, axis=1), 0)
  return pick(blocks), pick(data_next)


def _shrink_columns(blocks: np.ndarray, data_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The dk/dv kernel's form: each column cut down to its visited rows, in order, padded with zeros above
  them to the tallest column's count."""
  counts = (blocks != EMPTY).sum(0)
  height = int(counts.max())
  rows = np.argsort(blocks == EMPTY, axis=0, kind="stable")  # visited rows first, in order
  source = np.arange(height)[:, None] - (height - counts)[None, :]  # a column's rows sit at its bottom
  kept = source >= 0
  index = np.take_along_axis(rows, np.maximum(source, 0), axis=0)
  pick = lambda a: np.where(kept, np.take_along_axis(a, index, axis=0), 0)
  return pick(blocks), pick(data_next)


def _small(array: np.ndarray) -> np.ndarray:
  """The narrowest of int8, int16, int32 holding the array (splash keeps the lists in scalar memory)."""
  top = int(array.max(initial=0))
  return array.astype(np.int8 if top <= 127 else np.int16 if top <= 32767 else np.int32)


def mask_info(blocks: np.ndarray, q_steps: np.ndarray | None, shards: int, *, dkv: bool) -> mask_info_lib.MaskInfo:
  """The MaskInfo splash's `process_mask` (`process_mask_dkv` for dkv) makes of a mask with these blocks
  (computed in the kernel from `q_steps`, or None: no MIXED block), one head shard, `shards` query shards
  and the grid shrunk."""
  lists = []
  for part in np.split(blocks, shards, axis=0):
    if dkv:  # the dk/dv kernel walks key blocks outermost and fetches query blocks
      data_next = _next_visited(part.T).T
      lists.append(_shrink_columns(part, data_next))
    else:
      lists.append(_shrink(part, _next_visited(part)))
  axis = 0 if dkv else 1  # the chips' lists padded to one size: rows (dk/dv) or columns
  size = max(b.shape[axis] for b, _ in lists)
  pad = lambda a, mode: np.pad(a, [(0, size - a.shape[axis]) if i == axis else (0, 0) for i in range(2)], mode=mode)
  block_mask = np.concatenate([pad(b, "constant") for b, _ in lists], axis=0)
  data_next = np.concatenate([pad(d, "edge") for _, d in lists], axis=0)  # "edge": no new fetch
  return mask_info_lib.MaskInfo(
    data_next=_small(data_next)[None],
    mask_next=None,  # the mask is computed in the kernel (mask_function), never loaded
    block_mask=_small(block_mask)[None],
    partial_mask_blocks=None,
    q_sequence=None if q_steps is None else q_steps.astype(np.int32),
  )


def causal_kernel(
  q_steps: np.ndarray, kv_len: int, *, shards: int, block_sizes: splash.BlockSizes, **settings
) -> splash.SplashAttentionKernel:
  """What `splash.make_splash_mha` (`make_splash_mqa`) gives for `masks.CausalMask` with
  `q_sequence = q_steps` and `q_seq_shards = shards`, its block lists from `mask_info`, in numpy (made
  while a step is traced, for any platform: jnp arrays would need a device of it). `settings`: is_mqa,
  soft_cap, interpret."""
  blocks = lambda bq, bkv: causal_blocks(q_steps, kv_len, bq, bkv)
  causal = masks.CausalMask((len(q_steps), kv_len))  # its mask_function, evaluated in the kernel
  return _kernel(blocks, q_steps, shards, block_sizes, mask_function=causal.mask_function, **settings)


def full_kernel(q_len: int, kv_len: int, *, block_sizes: splash.BlockSizes, **settings) -> splash.SplashAttentionKernel:
  """What `splash.make_splash_mha` (`make_splash_mqa`) gives for `masks.FullMask((q_len, kv_len))` on one
  shard, in numpy; `settings` as `causal_kernel`'s."""
  blocks = lambda bq, bkv: np.full((q_len // bq, kv_len // bkv), FULL, np.int32)
  return _kernel(blocks, None, 1, block_sizes, mask_function=None, **settings)


def _kernel(blocks, q_steps, shards, sizes, *, mask_function, is_mqa: bool, soft_cap: float | None, interpret: bool):
  """The kernel of the lists `mask_info` makes of blocks(block_q, block_kv) for each of its three grids."""
  infos = [
    mask_info(blocks(bq, bkv), q_steps, shards, dkv=dkv)
    for bq, bkv, dkv in (
      (sizes.block_q, sizes.block_kv, False),  # the forward kernel
      (sizes.block_q_dq, sizes.block_kv_dq, False),
      (sizes.block_q_dkv, sizes.block_kv_dkv, True),
    )
  ]
  return splash.SplashAttentionKernel(
    *infos,
    block_sizes=sizes,
    is_mqa=is_mqa,
    save_residuals=False,
    mask_value=splash.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=soft_cap,
    residual_checkpoint_name=None,
    mask_function=mask_function,
    interpret=interpret,
  )
