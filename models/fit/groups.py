"""FIT's pure functions: the layer string, tokens into groups (1-D with an overlap, 2-D patches) and
back, and which document and group offset each group's latents serve in a packed row."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from lra_core.errors import ConfigError

Array = jax.Array

_BLOCK = re.compile(r"L\((\d+)\)(?:G\((\d+)\))?")


def parse_layers(spec: str) -> list[tuple[int, int]]:
  """'L(4)G(2)L(4)' -> [(4, 2), (4, 0)]: (local, global) layers per block."""
  text = spec.replace(" ", "")
  if not text or _BLOCK.sub("", text):
    raise ConfigError(f"model.layers {spec!r} is not a string of blocks like 'L(4)G(2)L(4)'.")
  blocks = [(int(a), int(b or 0)) for a, b in _BLOCK.findall(text)]
  if any(g == 0 for _, g in blocks[:-1]):
    raise ConfigError(f"model.layers {spec!r}: every block but the last needs global layers, e.g. L(4)G(2).")
  return blocks


def group_2d(x: Array, side: int, channels: int, group_side: int) -> Array:
  """[B, S*S*C, ...] raster pixels -> [B, (S/g)^2, g*g*C, ...]: each group one g x g block."""
  b, rest = x.shape[0], x.shape[2:]
  s, g = side, group_side
  x = x.reshape(b, s // g, g, s // g, g, channels, *rest)
  x = jnp.moveaxis(x, 2, 3)  # [B, S/g, S/g, g, g, C, ...]
  return x.reshape(b, (s // g) ** 2, g * g * channels, *rest)


def ungroup_2d(x: Array, side: int, channels: int, group_side: int) -> Array:
  """Inverse of `group_2d`."""
  b, rest = x.shape[0], x.shape[3:]
  s, g = side, group_side
  x = x.reshape(b, s // g, s // g, g, g, channels, *rest)
  x = jnp.moveaxis(x, 3, 2)
  return x.reshape(b, s * s * channels, *rest)


def group_1d(x: Array, group_size: int, overlap: int = 0, pad_value=0) -> tuple[Array, Array]:
  """[B, L, ...] -> ([B, t, k+n, ...], valid bool[B, t, k+n]); L is padded to t*n at the end and
  each group starts with the last k = overlap items of the previous group (none for group 0)."""
  b, length, rest = x.shape[0], x.shape[1], x.shape[2:]
  t = -(-length // group_size)
  pad = t * group_size - length
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * len(rest), constant_values=pad_value)
  valid = jnp.broadcast_to(jnp.arange(t * group_size) < length, (b, t * group_size))
  x = x.reshape(b, t, group_size, *rest)
  valid = valid.reshape(b, t, group_size)
  if overlap:
    prev = jnp.pad(
      x[:, :-1, group_size - overlap :], [(0, 0), (1, 0)] + [(0, 0)] * (len(rest) + 1), constant_values=pad_value
    )
    prev_valid = jnp.arange(t)[:, None].repeat(overlap, 1)[None] > 0
    x = jnp.concatenate([prev, x], axis=2)
    valid = jnp.concatenate([jnp.broadcast_to(prev_valid, (b, t, overlap)), valid], axis=2)
  return x, valid


def shift_latents(latents: Array) -> Array:
  """[B,t,m,d]: group i gets the latents of group i-1, group 0 zeros (FIT-AR's causal x2l)."""
  return jnp.pad(latents[:, :-1], [(0, 0), (1, 0), (0, 0), (0, 0)])


def latent_documents(segments: Array, real: Array, *, last: bool) -> tuple[Array, Array]:
  """The document each group's latents serve, for packed rows: segments int[B,t,n] (a group's own
  tokens, prefix excluded), real bool[B,t,n] (a token of a document: nonzero id, not masked) ->
  (ids int32[B,t], offsets int32[B,t]): the id and in-group offset of the group's last (FIT-AR,
  `last`) or first (encoder) real token; of its last / first token when it has none (padding)."""
  n = segments.shape[-1]
  slots = jnp.arange(n, dtype=jnp.int32)
  if last:
    offset = jnp.where(real.any(-1), jnp.max(jnp.where(real, slots, -1), -1), n - 1)
  else:
    offset = jnp.where(real.any(-1), jnp.min(jnp.where(real, slots, n), -1), 0)
  ids = jnp.take_along_axis(segments, offset[..., None], axis=-1)[..., 0]
  return ids.astype(jnp.int32), offset.astype(jnp.int32)


def document_groups(positions: Array, offsets: Array) -> Array:
  """int32[B,t]: how many groups lie between group j and the group where the document of its
  latents starts (0 for that first group). positions int[B,t,n]: each own token's position
  in its document (kernels/packed_documents.py, on the row padded to t*n); offsets int[B,t] from
  `latent_documents`. A document's groups take the latent table's rows from 0, as alone in a row."""
  t, n = positions.shape[1:]
  where = jnp.arange(t, dtype=jnp.int32) * n + offsets  # the chosen token's row position
  start = where - jnp.take_along_axis(positions, offsets[..., None], axis=-1)[..., 0]
  return (jnp.arange(t, dtype=jnp.int32) - start // n).astype(jnp.int32)


def group_causal_positions(t: int, m: int) -> Array:
  """Position of each of the t*m latents for the global layers' causal mask: its group index, so
  a latent sees all latents of its own and earlier groups."""
  return jnp.repeat(jnp.arange(t), m)
