"""Position information: sinusoids, scaled sinusoids, learned tables and rotary embeddings.

Positions are explicit integer arrays, so the same code serves a full forward pass
(positions 0..T-1) and cached decoding (one position at a time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.models.layers.core import param

Array = jax.Array


# RoPE scaling: how the rotary frequencies stretch past the length a model was trained at, as Hugging
# Face folders name it (`rope_type` / `type`). `model.rope_scaling` holds these keys; `type` "none" is
# plain RoPE, and a key a type does not read keeps its default.
ROPE_SCALING_TYPES = ("none", "linear", "dynamic", "yarn", "llama3")
ROPE_SCALING_DEFAULTS = dict(
  type="none",
  factor=1.0,  # how many times the trained length the scaled model reads
  original_max_len=0,  # the length the frequencies were trained at; 0 -> model.max_len
  low_freq_factor=1.0,  # llama3: wavelengths over original_max_len / low_freq_factor are divided by factor
  high_freq_factor=4.0,  # llama3: those under original_max_len / high_freq_factor are kept
  beta_fast=32.0,  # yarn: dimensions turning more than beta_fast times over the trained length are kept
  beta_slow=1.0,  # yarn: those turning fewer than beta_slow times are interpolated by factor
  attention_factor=0.0,  # yarn: cos and sin times this; 0 -> 0.1 ln(factor) + 1
)


def sinusoid(positions: Array, dim: int, max_wavelength: float = 1e4) -> Array:
  """[..., T] int -> [..., T, dim] float32: concat(sin(p w), cos(p w)), w_i = max_wavelength^(-i/(dim/2));
  an odd `dim` gets a last feature of zeros, so every width works."""
  half = dim // 2
  inv_freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  parts = [jnp.sin(angles), jnp.cos(angles)]
  if dim % 2:  # a zero feature keeps an odd width (e.g. a 1-channel image model) without a special case
    parts.append(jnp.zeros(angles.shape[:-1] + (1,), jnp.float32))
  return jnp.concatenate(parts, axis=-1)


def apply_rope(x: Array, positions: Array, *, max_wavelength: float = 1e4, fraction: float = 1.0) -> Array:
  """Rotary embedding on the first `fraction` of the last axis of x [B,T,H,D] (positions [B,T] or [T]).

  Dimension pairs (i, i + d/2) of the rotated part are rotated by angle p * w_i, so
  <rope(q, m), rope(k, n)> depends on m - n only.
  """
  d = x.shape[-1]
  rot = int(d * fraction) // 2 * 2  # rotated dims come in pairs: round the fraction down to an even count
  if rot == 0:
    return x
  inv_freq = max_wavelength ** (-jnp.arange(rot // 2, dtype=jnp.float32) / (rot // 2))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [.., T, rot/2]
  angles = (angles[None] if positions.ndim == 1 else angles)[:, :, None, :]  # broadcast over heads
  rotated = rotate_pairs(x[..., :rot], angles)
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1) if rot < d else rotated


def rotate_pairs(x: Array, angles: Array) -> Array:
  """Rotates dimension pairs (i, i + d/2) of x [..., d] by angles [..., d/2] (broadcastable)."""
  # Half-split pairs (GPT-NeoX's layout, not interleaved): two slices instead of a strided gather.
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class AbsolutePositions(nnx.Module):
  """Absolute position embedding added to token embeddings.

  kind: 'learned' (a [max_len, D] table), 'sinusoid' (fixed), 'scaled_sinusoid' (fixed sinusoid
  times a learned scalar initialised to D^-0.5, as FLASH) or 'none'.
  """

  KINDS = ("learned", "sinusoid", "scaled_sinusoid", "none")

  def __init__(
    self, kind: str, features: int, max_len: int, *, max_wavelength: float = 1e4, dtype=jnp.float32, rngs: nnx.Rngs
  ):
    if kind not in self.KINDS:
      raise ValueError(f"position kind {kind!r} is not one of {self.KINDS}.")
    self.kind, self.features, self.max_len = kind, features, max_len
    self.max_wavelength, self.dtype = max_wavelength, dtype
    self.table = (
      param(rngs, jax.nn.initializers.normal(0.02), (max_len, features), (None, "embed")) if kind == "learned" else None
    )
    self.scale = (
      param(rngs, jax.nn.initializers.constant(features**-0.5), (), ()) if kind == "scaled_sinusoid" else None
    )

  def __call__(self, positions: Array) -> Array | None:
    """positions [B,T] or [T] -> [B|1, T, D], or None for kind 'none'."""
    if self.kind == "none":
      return None
    if positions.ndim == 1:
      positions = positions[None]
    if self.kind == "learned":
      # Clip: a position past the table (decoding beyond max_len) reads the last row instead of NaN.
      out = jnp.take(self.table[...], positions, axis=0, mode="clip")
    else:
      out = sinusoid(positions, self.features, self.max_wavelength)
      if self.scale is not None:
        out = out * self.scale[...]
    return out.astype(self.dtype)


class RelativePositionBias(nnx.Module):
  """FLASH's relative position bias b[i, j] = f(i - j), one scalar per pair (Code 4 of the paper).

  kind 'toeplitz': a learned weight per distance in (-n, n): 2n - 1 weights, N(0, 0.02); the paper
                   builds this for n < 512.
  kind 'rope':     <rope(a, i), rope(b, j)> with learned a, b [width] (N(0, 0.02)), a function of
                   i - j at any distance; the paper's choice for n >= 512.
  'auto' picks by n as the paper does.
  """

  KINDS = ("auto", "toeplitz", "rope")

  def __init__(self, n: int, *, kind: str = "auto", width: int = 128, rngs: nnx.Rngs):
    if kind not in self.KINDS:
      raise ValueError(f"relative bias kind {kind!r} is not one of {self.KINDS}.")
    self.kind = ("toeplitz" if n < 512 else "rope") if kind == "auto" else kind
    self.n = n
    init = jax.nn.initializers.normal(0.02)
    if self.kind == "toeplitz":
      self.weight = param(rngs, init, (2 * n - 1,), (None,))
    else:
      self.a = param(rngs, init, (width,), (None,))
      self.b = param(rngs, init, (width,), (None,))

  def __call__(self, q_positions: Array, k_positions: Array) -> Array:
    """int[I], int[J] -> float32[I, J]."""
    if self.kind == "toeplitz":
      distance = jnp.clip(q_positions[:, None] - k_positions[None, :], 1 - self.n, self.n - 1)
      return self.weight[...][distance + self.n - 1]  # weight index 0 is distance 1 - n
    # The same learned vector at every position, rotated there: the dot product depends on i - j only.
    rope = lambda w, pos: apply_rope(jnp.broadcast_to(w[...], (1, pos.shape[0], 1, w.shape[0])), pos)[0, :, 0]
    return rope(self.a, q_positions) @ rope(self.b, k_positions).T
