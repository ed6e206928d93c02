"""One Transformer-VQ unit (Remark 3.2): the gated attention unit with vector-quantized keys, its EMA
k-means codebook, and the dropout masks the authors draw per sequence (sinusoids, LayerDrop) and per
window (residual branches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.kernels import context_parallel, vq
from lra_core.kernels.softmax import library as library_attention
from lra_core.models.layers.core import Dense, RMSNorm, next_key, param, rms_normalize, silu
from lra_core.models.layers.positions import sinusoid
from lra_core.sharding import target_platform

Array = jax.Array
# The authors' init: normal, variance 1 / fan-in (d_model also for head projections: Dense counts all inputs).
PROJ_INIT = dict(distribution="normal")


def dropout(x: Array, rate: float, key: Array | None, shape=None) -> Array:
  """Inverted dropout with an explicit key (None = off); `shape` broadcasts one mask (e.g. per row)."""
  if key is None or rate == 0.0:
    return x
  return apply_dropout(x, rate, jax.random.bernoulli(key, 1.0 - rate, x.shape if shape is None else shape))


def apply_dropout(x: Array, rate: float, keep: Array | None) -> Array:
  """Inverted dropout with a given mask (None = off)."""
  if keep is None or rate == 0.0:
    return x
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)  # kept units scaled up: eval needs no rescale


def residual_mask(res_key: Array, unit: Array | int, rate: float, shape: tuple) -> Array:
  """Unit `unit`'s residual dropout mask bool `shape` over a whole window (drawn from fold_in(res_key, unit))."""
  # One key per unit, folded from the window's: the unit index alone decides its mask, in any loop order.
  return jax.random.bernoulli(jax.random.fold_in(res_key, unit), 1.0 - rate, shape)


def residual_masks(res_key: Array | None, rate: float, num_units: int, shape: tuple) -> Array | None:
  """`residual_mask` of each of a window's N units, bool [N, *shape] (None: off), so that a run
  scanned block by block drops exactly what the unscanned one does."""
  if res_key is None or rate == 0.0:
    return None
  return jax.vmap(lambda i: residual_mask(res_key, i, rate, shape))(jnp.arange(num_units))


def ema_targets(c_sum: Array, c_count: Array, k_sum: Array, count: Array, rate: float) -> tuple[Array, Array]:
  """EMA k-means step: new = rate * old + (1 - rate) * statistics of this window."""
  return rate * c_sum + (1.0 - rate) * k_sum, rate * c_count + (1.0 - rate) * count


def codebook_usage(count: Array) -> tuple[Array, Array]:
  """Perplexity of the code assignment distribution and the number of unused codes, per head. count [..., S]."""
  p = count / jnp.maximum(count.sum(-1, keepdims=True), 1.0)
  # 0 log 0 = 0; the inner where keeps log's argument positive so the gradient of an unused code is not NaN.
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
  return jnp.exp(entropy), jnp.sum(count == 0, -1).astype(jnp.float32)


class Codebook(nnx.Variable):
  """EMA k-means statistics: model state updated by the forward pass, never by the optimizer."""


class VectorQuantizer(nnx.Module):
  """Per-head codebook C = c_sum / c_count, learned by EMA k-means (no gradient)."""

  def __init__(self, num_heads: int, n_code: int, d_k: int, *, ema_rate: float, rngs: nnx.Rngs):
    # Keys are RMS-normalised and scaled by Dk^-1/4, so their coordinates have that scale.
    init = jax.random.normal(next_key(rngs), (num_heads, n_code, d_k)) * d_k**-0.25
    self.c_sum = Codebook(init, logical_axes=("kv_heads", None, "head_dim"))
    # Counts start at 1, so each code starts at its initial vector: C = c_sum / c_count.
    self.c_count = Codebook(jnp.ones((num_heads, n_code)), logical_axes=("kv_heads", None))
    self.ema_rate = ema_rate

  def codebook(self) -> Array:
    # The floor keeps a code whose count decayed towards 0 (never assigned) finite instead of exploding.
    return jax.lax.stop_gradient(self.c_sum[...] / jnp.maximum(self.c_count[...], 0.01)[..., None])

  def update(self, k_sum: Array, count: Array) -> None:
    self.c_sum[...], self.c_count[...] = ema_targets(self.c_sum[...], self.c_count[...], k_sum, count, self.ema_rate)


class GAU(nnx.Module):
  """One gated attention unit with VQ (or full) attention and its own codebook."""

  def __init__(self, m, *, dtype, rngs: nnx.Rngs):
    d, h = m.d_model, m.num_heads
    self.h, self.hk = h, (1 if m.head_type == "mqa" else h)  # multi-query: one key / value head shared
    self.d_k, self.dv_head, self.d_v = m.d_k, m.d_v // h, m.d_v
    self.block_len, self.attention, self.reduction = m.block_len, m.attention, m.reduction
    self.compressive, self.n_code, self.impl = m.compressive, m.n_code, m.impl
    self.attention_impl = m.attention_impl  # the full mode's softmax (kernels/softmax/library.py)
    self.grad_through_cache = m.grad_through_cache
    self.chunk_blocks = m.chunk_blocks if m.reduction == "serial" else 0
    self.wavelength, self.dropsin, self.dropres = m.wavelength, m.dropsin, m.dropres
    self.norm = RMSNorm(d, use_bias=True, rngs=rngs)
    kw = dict(dtype=dtype, rngs=rngs, **PROJ_INIT)
    self.q_proj = Dense(d, (h, m.d_k), axes=("embed", "heads", "head_dim"), **kw)
    self.k_proj = Dense(d, (self.hk, m.d_k), axes=("embed", "kv_heads", "head_dim"), **kw)
    self.v_proj = Dense(d, (self.hk, self.dv_head), axes=("embed", "kv_heads", "head_dim"), **kw)
    self.g_proj = Dense(d, m.d_v, axes=("embed", "mlp"), **kw)
    self.out_proj = Dense(m.d_v, d, axes=("mlp", "embed"), **kw)
    if m.rel_bias:  # Transformer-XL: sinusoids projected by r_proj, and the content / position biases u, v
      self.r_proj = Dense(d, (h, m.d_k), axes=("embed", "heads", "head_dim"), **kw)
      self.xl_u = param(rngs, jax.nn.initializers.zeros, (h, m.d_k), ("heads", "head_dim"))
      self.xl_v = param(rngs, jax.nn.initializers.zeros, (h, m.d_k), ("heads", "head_dim"))
    else:
      self.r_proj = self.xl_u = self.xl_v = None
    self.quantizer = (
      VectorQuantizer(self.hk, m.n_code, m.d_k, ema_rate=m.ema_rate, rngs=rngs) if m.attention == "vq" else None
    )

  def projections(self, x: Array) -> tuple[Array, Array, Array, Array]:
    h = self.norm(x)
    # q and k are RMS-normalised and each scaled by Dk^-1/4: their product carries the usual Dk^-1/2.
    scale = self.d_k**-0.25
    q, k = rms_normalize(self.q_proj(h)) * scale, rms_normalize(self.k_proj(h)) * scale
    return q, k, silu(self.v_proj(h)), silu(self.g_proj(h))

  def relative(self, q: Array, key: Array | None) -> tuple[tuple[Array, Array] | None, Array]:
    """(rel_q, r table [H, L+1, Dk]) for the XL position term, and the content query q + u."""
    if self.r_proj is None:
      return None, q
    scale = self.d_k**-0.25
    # Distances 0..L cover a query's own and previous block (the window the exact part reads).
    table = sinusoid(jnp.arange(self.block_len + 1), self.r_proj.in_features[0], self.wavelength)
    table = dropout(table, self.dropsin, key)
    r = self.r_proj(table.astype(self.r_proj.dtype)).transpose(1, 0, 2) * scale
    return (q + self.xl_v[...] * scale, r), q + self.xl_u[...] * scale

  def chunk(self) -> int:
    """Blocks per step of the attention's scan (0: all at once), the platform's default resolved."""
    return self.chunk_blocks if self.chunk_blocks >= 0 else int(target_platform() == "cpu")

  def quantize(self, k: Array, weights: Array) -> tuple[Array, Array, Array, Array]:
    """Straight-through keys, codes, the commitment loss summed over the tokens of weight 1 (of the
    sum over heads; weights float [B,T], 0 on padding) and the codebook."""
    codebook = self.quantizer.codebook()
    z, _ = vq.quantize(jax.lax.stop_gradient(k), codebook, chunk=self.chunk() * self.block_len)
    c_z = vq.codewords(z, codebook).astype(k.dtype)
    commit = jnp.sum(jnp.sum(jnp.square(k.astype(jnp.float32) - c_z), axis=(-2, -1)) * weights)
    # Straight-through: the forward pass sees the codeword, the gradient flows to k as if unquantized.
    return k + jax.lax.stop_gradient(c_z - k), z, commit, codebook

  def __call__(
    self,
    x: Array,
    carry: dict | None,
    *,
    sin_key: Array | None,
    res_keep: Array | None,
    weights: Array,
    segments: Array | None = None,
  ) -> tuple[Array, dict | None, dict]:
    """x [B,T,D] -> residual branch [B,T,D], carry after the window, EMA statistics and the summed
    commitment loss of the tokens of weight 1 (weights float [B,T]: 0 on padding); segments int [B,T]
    or None (packed documents); res_keep bool [B,T,D] the residual dropout's mask (None: off)."""
    b, t, _ = x.shape
    q, k, v, g = self.projections(x)
    rel, q_content = self.relative(q, sin_key)
    aux = {}
    if self.quantizer is not None:
      k_hat, z, commit, codebook = self.quantize(k, weights)
      out, carry = vq.vq_attention_blocks(
        q_content,
        k_hat,
        z,
        v,
        codebook,
        block_len=self.block_len,
        reduction=self.reduction,
        carry=carry,
        rel=rel,
        compressive=self.compressive,
        impl=self.impl,
        segments=segments,
        grad_through_cache=self.grad_through_cache,
        chunk_blocks=self.chunk(),
        carry_gradient=self.impl == "xla",  # input_scan passes it to the next block; a window's end stops it
      )
      # A block-by-block (CPU) layout also sums the statistics by scatter, cheap there.
      count, k_sum = vq.code_statistics(z, jax.lax.stop_gradient(k), weights, self.n_code, scatter=self.chunk() > 0)
      aux = {"commit": commit, "count": count, "k_sum": k_sum}
    else:
      out = self.full_attention(q_content, k, v, rel, segments)
    out = out.reshape(b, t, self.d_v) * g
    return apply_dropout(self.out_proj(out), self.dropres, res_keep), carry, aux

  def full_attention(self, q: Array, k: Array, v: Array, rel, segments: Array | None) -> Array:
    """The `attention="full"` mode: causal softmax over every earlier key of the document, through the
    attention switch (kernels/softmax/library.py); q and k carry the Dk^-1/2 already."""
    xl = "Transformer-XL's position bias is added to the scores, and the kernels take no bias"
    impl = library_attention.chosen_for(self.attention_impl, xl if rel is not None else "")
    if impl == "xla" and (rel is not None or not context_parallel.split(q.shape[1])):
      return vq.dense_attention(q, k, v, window=self.block_len, rel=rel, segments=segments)
    # a kernel, or a sequence split over chips: ring attention (the reference's form there)
    return library_attention.self_attention(q, k, v, causal=True, segments=segments, scale=1.0, impl=impl)

  # -- decoding ----------------------------------------------------------------------------------

  def init_decode_state(self, batch_size: int, max_len: int, dtype) -> dict:
    if self.quantizer is not None:
      return vq.init_decode_state(batch_size, self.block_len, self.hk, self.n_code, self.d_k, self.dv_head, dtype)
    return {
      "k": jnp.zeros((batch_size, max_len, self.hk, self.d_k), dtype),
      "v": jnp.zeros((batch_size, max_len, self.hk, self.dv_head), dtype),
    }

  def decode(self, x: Array, state: dict, position: Array) -> tuple[Array, dict]:
    q, k, v, g = self.projections(x)
    rel, q_content = self.relative(q, None)
    if self.quantizer is not None:
      codebook = self.quantizer.codebook()
      z, _ = vq.quantize(k, codebook)  # no straight-through needed: decoding takes no gradient
      out, state = vq.decode_step(
        q_content,
        vq.codewords(z, codebook).astype(k.dtype),
        z,
        v,
        codebook,
        state,
        rel=rel,
        compressive=self.compressive,
      )
    else:
      keys = jax.lax.dynamic_update_slice_in_dim(state["k"], k.astype(state["k"].dtype), position, axis=1)
      values = jax.lax.dynamic_update_slice_in_dim(state["v"], v.astype(state["v"].dtype), position, axis=1)
      state = {"k": keys, "v": values}
      out = attend_cache(q_content, keys, values, position, rel)
    return self.out_proj(out.reshape(x.shape[0], 1, self.d_v) * g), state


def attend_cache(q: Array, keys: Array, values: Array, position: Array, rel) -> Array:
  """Full attention of one query [B,1,H,Dk] over a [B,N,Hk,.] cache filled up to `position`."""
  hk = keys.shape[2]
  qg = vq.group_heads(q, hk).astype(jnp.float32)
  scores = jnp.einsum("bihgk,bjhk->bhgij", qg, keys.astype(jnp.float32))
  distance = (position - jnp.arange(keys.shape[1]))[None, :]
  if rel is not None:
    rel_q, table = rel
    rq = vq.group_heads(rel_q, hk).transpose(0, 2, 3, 1, 4)
    scores = scores + vq.relative_bias(rq, vq.group_table(table, hk), distance)
  # Slots after `position` are unwritten zeros: masked by distance, not by content.
  weights = jax.nn.softmax(jnp.where(distance >= 0, scores, -vq.MASK), axis=-1)
  out = jnp.einsum("bhgij,bjhv->bihgv", weights, values.astype(jnp.float32))
  return out.reshape(q.shape[:3] + (values.shape[-1],)).astype(values.dtype)
