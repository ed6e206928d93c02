"""Multi-head, multi-query and sliding-window softmax attention with a decoding cache, and
cross-attention between two streams.

The cache holds keys and values of the last S positions in a ring buffer, S = window for
sliding-window attention (constant memory per token) or the maximum length otherwise; each slot
remembers its position, so masking in decoding is the same position arithmetic as in training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.kernels.softmax.library import cross_attention, self_attention
from lra_core.kernels.softmax.reference import attention_mask, dot_product_attention
from lra_core.models.layers.core import Dense, LayerNorm
from lra_core.models.layers.positions import apply_rope, rope_dims, rope_inv_freq, rope_scaling_settings
from lra_core.sharding import constrain

Array = jax.Array


def head_width(m) -> int:
  """A head's width from a model config: model.head_dim, or (0, the default) d_model split over num_heads."""
  return m.head_dim or m.d_model // m.num_heads


def config_attention(m) -> dict:
  """The arguments of `Attention` that every family's model config sets alike (width, heads, RoPE,
  biases); a family adds its own (the Transformer: key-value heads, window, dropout, kernel)."""
  # A section without rope_scaling (FIT's layer sections, one saved before scaling existed) rotates plainly.
  scaled = "rope_scaling" in m
  return dict(
    features=m.d_model,
    num_heads=m.num_heads,
    head_dim=head_width(m),
    rope=m.rope,
    rope_max_wavelength=m.rope_max_wavelength,
    rope_fraction=m.rope_fraction,
    rope_scaling=dict(m.rope_scaling.items()) if scaled else None,
    rope_len=m.max_len if scaled else 0,  # transformer.Model resolves 0 to the run's length before its layers
    use_bias=m.use_bias,
  )


class Attention(nnx.Module):
  """Self-attention: H query heads over K key-value heads (K = H multi-head, K = 1 multi-query).

  causal: autoregressive mask. window > 0: sliding window (see kernels.softmax.reference.attention_mask).
  rope: rotary embedding of q and k on the first `rope_fraction` of each head; rope_scaling: how its
  frequencies stretch past the trained length (layers/positions.py ROPE_SCALING_DEFAULTS keys, None:
  plain); rope_len: the length the model runs at, which dynamic scaling and original_max_len 0 read.
  scale: the scores' factor (None: head_dim^-1/2); soft_cap > 0 bounds them (kernels/softmax/reference.py `cap`).
  impl: the kernel of the full forward pass (kernels/softmax/library.py); decoding reads its cache
  with the reference. mask_by_positions: the causal mask compares the positions each call is given
  (FIT-AR's latents: their group index, so a group's latents see each other) rather than the row
  order, which is all the library kernels take (they fall back to the reference for it).
  """

  def __init__(
    self,
    features: int,
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: int = 0,
    causal: bool = False,
    window: int = 0,
    rope: bool = False,
    rope_max_wavelength: float = 1e4,
    rope_fraction: float = 1.0,
    rope_scaling: Mapping[str, Any] | None = None,
    rope_len: int = 0,
    use_bias: bool = False,
    dropout: float = 0.0,
    scale: float | None = None,
    soft_cap: float = 0.0,
    impl: str = "xla",
    mask_by_positions: bool = False,
    dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    kv_heads = num_kv_heads or num_heads
    if num_heads % kv_heads:
      raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_heads}.")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
    self.causal, self.window, self.rope, self.impl = causal, window, rope, impl
    self.mask_by_positions = mask_by_positions
    self.scale, self.soft_cap = scale, soft_cap
    self.rope_max_wavelength, self.rope_fraction = rope_max_wavelength, rope_fraction
    scaling = rope_scaling_settings(rope_scaling)
    # Key-value pairs, hashable: a static attribute of the module; None for plain RoPE.
    self.rope_scaling = None if scaling["type"] == "none" else tuple(sorted(scaling.items()))
    self.rope_len = rope_len
    if rope and self.rope_scaling:  # a missing length fails here, at build, rather than at the first call
      rope_inv_freq(rope_dims(head_dim, rope_fraction)[0], scaling=scaling, length=rope_len)
    kw = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.query = Dense(features, (num_heads, head_dim), axes=("embed", "heads", "head_dim"), **kw)
    self.key = Dense(features, (kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), **kw)
    self.value = Dense(features, (kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), **kw)
    self.out = Dense((num_heads, head_dim), features, axes=("heads", "head_dim", "embed"), **kw)
    self.dropout = nnx.Dropout(dropout)

  def _qkv(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
    q, k, v = self.query(x), self.key(x), self.value(x)
    if self.rope:
      # The same fixed frequencies for every call, the full forward's and each decoding step's.
      kw = dict(max_wavelength=self.rope_max_wavelength, fraction=self.rope_fraction, length=self.rope_len)
      kw["scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
      q, k = apply_rope(q, positions, **kw), apply_rope(k, positions, **kw)
    # Name the layout the projections give q and k (heads over the rules' 'heads' axis), so RoPE and the
    # scores keep it rather than leaving the choice to the partitioner.
    return (
      constrain(q, ("batch", "length", "heads", "head_dim")),
      constrain(k, ("batch", "length", "kv_heads", "head_dim")),
      v,
    )

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x: [B,T,D]; positions: int[T] or [B,T] (default 0..T-1); mask: bool[B,T], False = padding;
    segments: int[B,T] document ids (kernels/packed_documents.py), None = one document per row."""
    t = x.shape[1]
    positions = jnp.arange(t) if positions is None else positions
    q, k, v = self._qkv(x, positions)
    # Attention dropout acts on the probabilities inside the core (None keeps the core's fast path).
    probs_fn = (lambda p: self.dropout(p, rngs=rngs)) if self.dropout.rate > 0 else None
    # Masks by row offsets unless told otherwise: per-document positions only feed RoPE, and within a
    # document they are consecutive like the row's.
    y = self_attention(
      q,
      k,
      v,
      causal=self.causal,
      window=self.window,
      k_valid=mask,
      segments=segments,
      positions=positions if self.mask_by_positions and (self.causal or self.window) else None,
      probs_fn=probs_fn,
      impl=self.impl,
      scale=self.scale,
      soft_cap=self.soft_cap,
    )
    return self.out(y)

  def cache_len(self, max_len: int) -> int:
    # A sliding window never reads further back than `window` keys: a ring of that size suffices.
    return min(self.window, max_len) if self.window else max_len

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict[str, Array]:
    if not self.causal:
      raise ValueError("decoding needs causal attention; this layer is bidirectional.")
    return empty_cache(batch_size, self.cache_len(max_len), self.num_kv_heads, self.head_dim, dtype)

  def decode(
    self, x: Array, cache: dict[str, Array], position: Array, *, k_valid: Array | None = None
  ) -> tuple[Array, dict[str, Array]]:
    """One step. x: [B,1,D], position: int32[] (same for the batch) -> y [B,1,D], new cache.
    k_valid: bool[B,S] per cache slot (after this write), False = a key this row must not read."""
    q, k, v = self._qkv(x, position[None])
    cache = write_cache(cache, k, v, position)  # written first: the token attends to itself
    return self.out(
      attend_cache(q, cache, position, window=self.window, k_valid=k_valid, scale=self.scale, soft_cap=self.soft_cap)
    ), cache

  def decode_block(
    self, x: Array, cache: dict[str, Array], positions: Array, slot: Array, *, k_valid: Array | None = None
  ) -> tuple[Array, dict[str, Array]]:
    """S tokens at once. x: [B,S,D], positions: int32[S], written to slots slot..slot+S-1; each
    query sees the cached keys whose position is <= its own (equal positions see each other).
    k_valid: bool[B,cache size] as in `decode`."""
    q, k, v = self._qkv(x, positions)
    cache = {
      "key": jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(cache["key"].dtype), slot, 1),
      "value": jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(cache["value"].dtype), slot, 1),
      "pos": jax.lax.dynamic_update_slice_in_dim(cache["pos"], positions.astype(jnp.int32), slot, 0),
    }
    # Masking by the slots' stored positions, not their indices: unwritten slots (-1) and later ones drop out.
    m = attention_mask(positions, cache["pos"], causal=True, window=self.window, k_valid=k_valid)
    y = dot_product_attention(
      q, cache["key"].astype(q.dtype), cache["value"].astype(q.dtype), mask=m, scale=self.scale, soft_cap=self.soft_cap
    )
    return self.out(y), cache


def empty_cache(batch_size: int, size: int, heads: int, width: int, dtype=jnp.float32) -> dict[str, Array]:
  """A ring buffer of `size` key / value slots [B,S,K,D], each remembering its position (-1: empty)."""
  shape = (batch_size, size, heads, width)
  return {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype), "pos": jnp.full((size,), -1, jnp.int32)}


def write_cache(cache: dict[str, Array], k: Array, v: Array, position: Array) -> dict[str, Array]:
  """Stores k, v [B,1,K,D] of `position` in ring-buffer slot position % S."""
  slot = position % cache["pos"].shape[0]  # a ring: with a window, position p overwrites p - S
  return {
    "key": jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(cache["key"].dtype), slot, 1),
    "value": jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(cache["value"].dtype), slot, 1),
    "pos": jax.lax.dynamic_update_index_in_dim(cache["pos"], position, slot, 0),
  }


def attend_cache(
  q: Array,
  cache: dict[str, Array],
  position: Array,
  *,
  window: int = 0,
  k_valid: Array | None = None,
  scale: float | None = None,
  soft_cap: float = 0.0,
) -> Array:
  """Causal (optionally windowed) attention of q [B,1,H,D] at `position` over the cached keys
  (k_valid: bool[B,S], False = a slot this row must not read); scale and soft_cap as the layer's."""
  m = attention_mask(position[None], cache["pos"], causal=True, window=window, k_valid=k_valid)
  k, v = cache["key"].astype(q.dtype), cache["value"].astype(q.dtype)
  return dot_product_attention(q, k, v, mask=m, scale=scale, soft_cap=soft_cap)


class CrossAttention(nnx.Module):
  """x + MHA(LN(x), LN(y)): queries from one stream (width dq), keys / values from the other (dkv),
  `heads` heads over `width` channels (pix2seq: the smaller stream's width and head count). impl: the
  kernel (kernels/softmax/library.py)."""

  def __init__(
    self, dq: int, dkv: int, *, heads: int, width: int, use_bias: bool, dtype, rngs: nnx.Rngs, impl: str = "xla"
  ):
    self.impl = impl
    hd = width // heads
    kw = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
    # Each stream has its own norm: the two carry activations of different widths and scales.
    self.q_norm = LayerNorm(dq, rngs=rngs)
    self.kv_norm = LayerNorm(dkv, rngs=rngs)
    self.query = Dense(dq, (heads, hd), axes=("embed", "heads", "head_dim"), **kw)
    self.key = Dense(dkv, (heads, hd), axes=("embed", "heads", "head_dim"), **kw)
    self.value = Dense(dkv, (heads, hd), axes=("embed", "heads", "head_dim"), **kw)
    self.out = Dense((heads, hd), dq, axes=("heads", "head_dim", "embed"), **kw)

  def kv(self, y: Array) -> tuple[Array, Array]:
    y = self.kv_norm(y)
    return self.key(y), self.value(y)

  def __call__(
    self,
    x: Array,
    y: Array | None = None,
    *,
    kv: tuple[Array, Array] | None = None,
    k_valid: Array | None = None,
    mask: Array | None = None,
  ) -> Array:
    """x [B,Tq,dq] reads y [B,Tk,dkv] (or its precomputed `kv`); k_valid: bool[B,Tk]; mask:
    bool[B,Tq,Tk], which keys each query reads (both: the two combined)."""
    k, v = self.kv(y) if kv is None else kv  # precomputed once when many queries read one memory
    q = self.query(self.q_norm(x))
    return x + self.out(cross_attention(q, k, v, k_valid=k_valid, mask=mask, impl=self.impl))
