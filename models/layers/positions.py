"""Position information: sinusoids, scaled sinusoids, learned tables and rotary embeddings.

Positions are explicit integer arrays, so the same code serves a full forward pass
(positions 0..T-1) and cached decoding (one position at a time).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.models.layers.core import param

Array = jax.Array


# RoPE scaling: how the rotary frequencies stretch past the length a model was trained at, as Hugging
# Face folders name it (`rope_type` / `type`). `model.rope_scaling` holds these keys; `type` "none" is
# plain RoPE, and a key a type does not read keeps its default. The frequencies are pure functions of
# these keys and two lengths (rope_inv_freq): L0 = original_max_len, and the length the model runs at
# (model.max_len, the run's seq_len where that is 0), which dynamic scaling reads instead of each call's.
ROPE_SCALING_TYPES = ("none", "linear", "dynamic", "yarn", "llama3")
ROPE_SCALING_DEFAULTS = dict(
  type="none",
  factor=1.0,  # how many times the trained length the scaled model reads
  original_max_len=0,  # L0, the length the frequencies were trained at; 0 -> model.max_len (linear reads none)
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


def rope_dims(width: int, fraction: float = 1.0) -> tuple[int, int]:
  """(dim, rotated) of RoPE on the first `fraction` of a head of `width`: the frequencies are spread over
  dim = int(width * fraction) as base^(-2i/dim), i < ceil(dim / 2), one per rotated pair, so rotated =
  2 * ceil(dim / 2) (an odd dim rotates one more: width 16 at 0.2 -> dim 3, 4 dimensions rotated)."""
  dim = int(width * fraction)
  return dim, 2 * -(-dim // 2)


def rope_scaling_settings(scaling: Mapping[str, Any] | None) -> dict[str, Any]:
  """`scaling` with each key it leaves out at its ROPE_SCALING_DEFAULTS value (None: plain RoPE)."""
  settings = {**ROPE_SCALING_DEFAULTS, **(scaling or {})}
  unknown = sorted(set(settings) - set(ROPE_SCALING_DEFAULTS))
  if unknown:
    raise ValueError(f"RoPE scaling keys {unknown} are not among {list(ROPE_SCALING_DEFAULTS)}.")
  if settings["type"] not in ROPE_SCALING_TYPES:
    raise ValueError(f"RoPE scaling type {settings['type']!r} is not one of {list(ROPE_SCALING_TYPES)}.")
  return settings


def plain_inv_freq(dim: int, base: float) -> np.ndarray:
  """float64[ceil(dim/2)]: base^(-2i/dim), plain RoPE's inverse frequencies (radians per position)."""
  return float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def linear_inv_freq(dim: int, base: float, factor: float) -> np.ndarray:
  """Position interpolation: every frequency divided by `factor`, so factor x the trained length turns
  each pair as far as the trained length did."""
  return plain_inv_freq(dim, base) / factor


def dynamic_base(dim: int, base: float, factor: float, length: int, original_len: int) -> float:
  """NTK-aware scaling's base: base ((factor L / L0) - (factor - 1))^(dim / (dim - 2)) for a length L past
  the trained L0, else base. The lowest frequency then stretches by about L / L0 while the highest stays.

  L is fixed per model (the length it runs at), not each call's longest position as Hugging Face
  recomputes it: one set of frequencies serves the full forward and every cached decoding step, so
  decoding equals the forward pass."""
  if length <= original_len:
    return base
  return base * ((factor * length / original_len) - (factor - 1)) ** (dim / (dim - 2))


def yarn_inv_freq(
  dim: int, base: float, factor: float, original_len: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
  """YaRN's "NTK-by-parts" frequencies (arXiv 2309.00071, Section 3.2): pairs that turn more than
  beta_fast times over the trained length L0 keep their frequency, those turning fewer than beta_slow
  times are divided by `factor`, and a linear ramp over the pair index blends the pairs between."""
  inv = plain_inv_freq(dim, base)

  def pair_turning(turns: float) -> float:
    # The pair index i whose wavelength 2 pi base^(2i/dim) fits `turns` times into L0.
    return dim * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(base))

  # Whole pairs: the ramp starts at the last pair kept whole and ends at the first one interpolated whole.
  # The end is clamped to dim - 1 as Hugging Face's reference does (not dim/2 - 1, the last pair), so
  # checkpoints scaled there read the same frequencies; below that the clamp changes nothing.
  low = max(math.floor(pair_turning(beta_fast)), 0)
  high = min(math.ceil(pair_turning(beta_slow)), dim - 1)
  span = (high - low) or 1e-3  # low == high: a step at that pair, not a division by zero
  interpolated = np.clip((np.arange(inv.shape[0]) - low) / span, 0.0, 1.0)
  extrapolated = 1.0 - interpolated
  return inv / factor * (1.0 - extrapolated) + inv * extrapolated


def llama3_inv_freq(
  dim: int, base: float, factor: float, original_len: int, low_freq_factor: float, high_freq_factor: float
) -> np.ndarray:
  """Llama 3's frequencies: wavelengths 2 pi / w over L0 / low_freq_factor divided by `factor`, those
  under L0 / high_freq_factor kept, and those between blended by smooth = (L0 / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor): (1 - smooth) w / factor + smooth w."""
  inv = plain_inv_freq(dim, base)
  wavelength = 2 * math.pi / inv
  smooth = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  blended = (1.0 - smooth) * inv / factor + smooth * inv
  kept = np.where(wavelength < original_len / high_freq_factor, inv, blended)
  return np.where(wavelength > original_len / low_freq_factor, inv / factor, kept)


def rope_inv_freq(
  dim: int, *, max_wavelength: float = 1e4, scaling: Mapping[str, Any] | None = None, length: int = 0
) -> np.ndarray:
  """float64[ceil(dim/2)]: the inverse frequencies of RoPE over `dim` (rope_dims) under `scaling` (the
  ROPE_SCALING_DEFAULTS keys; None: plain). length: the length the model runs at, fixed for the model
  (its max_len): dynamic scaling's L, and L0 where original_max_len is 0."""
  s = rope_scaling_settings(scaling)
  kind, factor = s["type"], s["factor"]
  if kind == "none":
    return plain_inv_freq(dim, max_wavelength)
  if kind == "linear":
    return linear_inv_freq(dim, max_wavelength, factor)
  original = s["original_max_len"] or length
  if original <= 0:
    raise ValueError(f"RoPE scaling {kind!r} needs original_max_len or the model's length, got neither.")
  if kind == "dynamic":
    # L is the model's fixed length, not the longest position of each call (Hugging Face's choice, under
    # which a cached decoding step rotates otherwise than the full forward pass did).
    if length <= 0 or dim <= 2:
      raise ValueError(f"dynamic RoPE scaling needs the model's length and over 2 dimensions, got {length}, {dim}.")
    return plain_inv_freq(dim, dynamic_base(dim, max_wavelength, factor, length, original))
  if kind == "yarn":
    return yarn_inv_freq(dim, max_wavelength, factor, original, s["beta_fast"], s["beta_slow"])
  return llama3_inv_freq(dim, max_wavelength, factor, original, s["low_freq_factor"], s["high_freq_factor"])


def rope_attention_factor(scaling: Mapping[str, Any] | None = None) -> float:
  """What cos and sin are multiplied by: YaRN's attention_factor (0: 0.1 ln(factor) + 1, which tempers the
  softmax as the scores spread over more keys); 1 for the other types."""
  s = rope_scaling_settings(scaling)
  if s["type"] != "yarn":
    return 1.0
  return s["attention_factor"] or 0.1 * math.log(s["factor"]) + 1.0


def apply_rope(
  x: Array,
  positions: Array,
  *,
  max_wavelength: float = 1e4,
  fraction: float = 1.0,
  scaling: Mapping[str, Any] | None = None,
  length: int = 0,
) -> Array:
  """Rotary embedding on the first `fraction` of the last axis of x [B,T,H,D] (positions [B,T] or [T]).

  Dimension pairs (i, i + rot/2) of the rotated part (rope_dims) are rotated by angle p * w_i, so
  <rope(q, m), rope(k, n)> depends on m - n only. scaling: a mapping of the ROPE_SCALING_DEFAULTS keys
  (None: plain RoPE); length: the length the model runs at (rope_inv_freq), fixed, so that cached
  decoding rotates as the full forward pass does.
  """
  d = x.shape[-1]
  dim, rot = rope_dims(d, fraction)
  if rot == 0:
    return x
  if rot > d:
    raise ValueError(f"RoPE over int({d} x {fraction}) = {dim} dimensions rotates {rot}, more than the {d} there are.")
  if rope_scaling_settings(scaling)["type"] == "none":
    # Plain RoPE keeps the float32 arithmetic it always had: models without scaling give bit for bit the
    # outputs they gave before scaling existed.
    inv_freq = max_wavelength ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  else:
    inv_freq = rope_inv_freq(dim, max_wavelength=max_wavelength, scaling=scaling, length=length)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)  # computed in float64, rounded once
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [.., T, rot/2]
  angles = (angles[None] if positions.ndim == 1 else angles)[:, :, None, :]  # broadcast over heads
  rotated = rotate_pairs(x[..., :rot], angles, scale=rope_attention_factor(scaling))
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1) if rot < d else rotated


def rotate_pairs(x: Array, angles: Array, *, scale: float = 1.0) -> Array:
  """Rotates dimension pairs (i, i + d/2) of x [..., d] by angles [..., d/2] (broadcastable); the result
  times `scale` (YaRN's attention factor, on cos and sin)."""
  # Half-split pairs (GPT-NeoX's layout, not interleaved): two slices instead of a strided gather.
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def check_rope_scaling(scaling: Mapping[str, Any], *, rope: bool, dim: int) -> None:
  """Raises ConfigError (one sentence naming the key) for a `model.rope_scaling` section that cannot
  build: rope: whether the model rotates at all; dim: its RoPE dimension (rope_dims)."""
  key = "model.rope_scaling"
  unknown = sorted(set(scaling) - set(ROPE_SCALING_DEFAULTS))
  if unknown:
    raise ConfigError(f"{key} has unknown keys {unknown}; its keys are {list(ROPE_SCALING_DEFAULTS)}.")
  s = {**ROPE_SCALING_DEFAULTS, **scaling}
  kind = s["type"]
  if kind not in ROPE_SCALING_TYPES:
    raise ConfigError(f"{key}.type {kind!r} is not one of {list(ROPE_SCALING_TYPES)}.")
  if kind == "none":
    return
  if not rope:
    raise ConfigError(f"{key}.type {kind!r} scales rotary embeddings, which model.rope=False turns off.")
  if s["factor"] < 1:
    raise ConfigError(f"{key}.factor must be >= 1 for type {kind!r}, got {s['factor']}.")
  if s["original_max_len"] < 0:
    raise ConfigError(f"{key}.original_max_len must be >= 0 (0: model.max_len), got {s['original_max_len']}.")
  if kind == "dynamic" and dim <= 2:
    raise ConfigError(f"{key}.type 'dynamic' needs over 2 RoPE dimensions (head width x rope_fraction), got {dim}.")
  if kind == "llama3" and not 0 < s["low_freq_factor"] < s["high_freq_factor"]:
    raise ConfigError(
      f"{key}.high_freq_factor {s['high_freq_factor']} must exceed {key}.low_freq_factor {s['low_freq_factor']}, "
      "which must be positive."
    )
  if kind == "yarn" and not 0 < s["beta_slow"] < s["beta_fast"]:
    raise ConfigError(
      f"{key}.beta_fast {s['beta_fast']} must exceed {key}.beta_slow {s['beta_slow']}, which must be positive."
    )
  if kind == "yarn" and s["attention_factor"] < 0:
    raise ConfigError(f"{key}.attention_factor must be >= 0 (0: 0.1 ln(factor) + 1), got {s['attention_factor']}.")


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
