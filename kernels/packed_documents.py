"""Document boundaries in packed rows, as pure functions every family shares.

A packed row holds several documents one after another. `segment_ids` int[B,T] numbers them
(1, 2, ... in the row; 0 for padding, which forms a segment of its own), as the data pipeline
produces them (lra_core/data/packing.py). With document masking a token only ever reads tokens
of its own segment: attention masks compare ids, recurrences (linear attention, the Latte scan,
the VQ cache, convolutions, RG-LRU) restart at a segment's first token, and positions count from
0 at each document, so a document gives the same outputs wherever it sits in a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel

Array = jax.Array


def segment_starts(segment_ids: Array) -> Array:
  """bool[B,T]: True at the first token of each segment (position 0 included). On one chip's slice
  of a split sequence (kernels/context_parallel.py) the first token starts a segment only where its id
  differs from the previous chip's last."""
  previous = context_parallel.before(segment_ids, 1, fill=-1)
  first = (segment_ids[:, :1] != previous) | (context_parallel.index() == 0)
  return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def segment_positions(segment_ids: Array) -> Array:
  """int32[B,T]: each token's position inside its segment (0 at the segment's first token)."""
  t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  start = jax.lax.cummax(jnp.where(segment_starts(segment_ids), t, 0), axis=1)
  return t - start


def same_segment(q_segments: Array, k_segments: Array) -> Array:
  """bool[B,Tq,Tk]: query and key lie in the same segment; q_segments [B,Tq], k_segments [B,Tk]."""
  return q_segments[:, :, None] == k_segments[:, None, :]


def shift_right(segment_ids: Array, steps: int = 1, fill: int = -1) -> Array:
  """segment_ids [B,T] moved `steps` positions later, `fill` in front: the id of the token
  `steps` back, for masks of causal convolutions and shifts."""
  return jnp.pad(segment_ids, ((0, 0), (steps, 0)), constant_values=fill)[:, : segment_ids.shape[1]]


def check_segments(segment_ids: Array | None, inputs_shape: tuple[int, ...]) -> None:
  """Raises ValueError (one sentence) unless segment_ids is None or int[B,T] of the inputs' B, T."""
  if segment_ids is None:
    return
  if tuple(segment_ids.shape) != tuple(inputs_shape[:2]):
    raise ValueError(
      f"segment_ids shape {tuple(segment_ids.shape)} does not match the inputs' batch and "
      f"length {tuple(inputs_shape[:2])}."
    )
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}.")
