"""Latte (Dolga et al., "Latte: Latent Attention for Linear Time Transformers").

The transformer stack of models/transformer.py with its token mixer replaced by latent attention
(kernels.causal_latte / kernels.bidirectional_latte): L latent states split across H heads, query
and key projections D -> L and value / output D -> D, all without bias. The variants of Table 1:

  latte              LayerNorm, GELU MLP, VAPOR rotations of the values (Appendix B.3)
  latte++            RMSNorm, GELU-gated GLU MLP ("++"), VAPOR
  latte_conv++       "++" with a depthwise 1D convolution (kernel K) before the latent
                     probabilities (eq. 17)
  latte_rglru++      "++" with an RG-LRU layer (Griffin, De et al. 2024) there instead
  latte_conv_swa++   Latte-Macchiato (Def. 3): state 0 is sliding-window softmax attention with
  latte_rglru_swa++  RoPE, mixed with the L latent states under one softmax over L + 1 states

and the Table 2 baseline without Latte:

  rglru_swa++        "++" with the RG-LRU and sliding-window attention only (latent=False): the
                     window's q and k read RMSNorm(RG-LRU(x)), its values x

The convolution and the RG-LRU feed only the latent probabilities (q and k logits); values and
the window attention's q, k read the block input, so the window attention is the plain local
attention a pre-trained model would bring (Section 4.5). Bidirectional models (classification,
MLM) use Def. 1, a centred convolution, the RG-LRU run in both directions, and a window on both
sides. Causal models decode in constant memory per token: the eq. 12 state per layer, the
convolution's last K - 1 inputs or the RG-LRU state, and a ring buffer of `window` keys/values.

Packed documents (`segments` int[B,T], kernels/packed_documents.py): the latent sums, the window
attention, the convolution's taps and the RG-LRU state all keep to a token's own document, and
positions (VAPOR, RoPE) count from each document's start. `latent_dropout` drops p(l|t) in
training, as the authors' code does for causal Latte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.kernels import context_parallel as sequence_split
from lra_core.kernels import latte as latte_kernels
from lra_core.kernels.packed_documents import segment_starts
from lra_core.kernels.softmax.library import self_attention
from lra_core.models import transformer
from lra_core.models.layers.attention import attend_cache, empty_cache, head_width, write_cache
from lra_core.models.layers.core import Dense, RMSNorm, param
from lra_core.models.layers.positions import apply_rope, rotate_pairs
from lra_core.protocol import PaperRow, Smoke

Array = jax.Array

VARIANTS = {
  "latte": dict(norm="layer", mlp="mlp", mixer="none", window=0, vapor=True),
  "latte++": dict(norm="rms", mlp="glu", mixer="none", window=0, vapor=True),
  "latte_conv++": dict(norm="rms", mlp="glu", mixer="conv", window=0, vapor=False),
  "latte_conv_swa++": dict(norm="rms", mlp="glu", mixer="conv", window=128, vapor=False),
  "latte_rglru++": dict(norm="rms", mlp="glu", mixer="rglru", window=0, vapor=False),
  "latte_rglru_swa++": dict(norm="rms", mlp="glu", mixer="rglru", window=128, vapor=False),
  # Table 2's baseline: Latte-RGLRU-SWA++ without the latent states
  "rglru_swa++": dict(norm="rms", mlp="glu", mixer="rglru", window=128, vapor=False, latent=False),
}
MIXERS = ("none", "conv", "rglru")


def model_config(variant: str = "latte", **overrides) -> ml_collections.ConfigDict:
  """The `config.model` section; `variant` picks the Table 1 settings from VARIANTS."""
  if variant not in VARIANTS:
    raise ConfigError(f"latte variant {variant!r} is not one of {sorted(VARIANTS)}.")
  # The embedding table as the authors store it (E itself, not E / sqrt(d_model)): the same function, and
  # the same Adam steps on it as theirs.
  c = transformer.model_config("transformer", position="none", tie_embeddings=True, pooling="mean", embedding="plain")
  c.update(
    dict(
      name="latte",
      variant=variant,
      num_latents=128,  # L, split across the heads (L / H each)
      mixer="none",  # what feeds the latent probabilities: none | conv | rglru
      conv_kernel=3,  # K of eq. 17
      rglru_c=8.0,  # Griffin's constant c in a_t = a^(c r_t)
      vapor=False,  # Value-Acting POsitional Rotations (Appendix B.3)
      rope=True,  # RoPE on the window attention's q and k (Latte-Macchiato)
      latent=True,  # the latent attention; False: window attention alone (rglru_swa++)
      latent_dropout=0.0,  # dropout on p(l|t) in training (the authors' code: the layer dropout rate)
      chunk=0,  # time chunk of causal Latte; 0 -> per backend (kernels.latte)
      impl="xla",  # attention core: one of kernels.latte.IMPLS
    )
  )
  c.update(VARIANTS[variant])
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m = config.model
  if m.variant not in VARIANTS:
    raise ConfigError(f"model.variant {m.variant!r} is not one of {sorted(VARIANTS)}.")
  if m.mixer not in MIXERS:
    raise ConfigError(f"model.mixer {m.mixer!r} is not one of {list(MIXERS)}.")
  if m.impl not in latte_kernels.IMPLS:
    raise ConfigError(f"model.impl {m.impl!r} is not one of {list(latte_kernels.IMPLS)}.")
  if m.num_latents <= 0 or m.num_latents % m.num_heads:
    raise ConfigError(
      f"model.num_latents {m.num_latents} must be a positive multiple of model.num_heads "
      f"{m.num_heads} (the latent states are split across heads)."
    )
  width = head_width(m)
  if not m.head_dim and m.d_model % m.num_heads or width % 2 and (m.vapor or m.rope and m.window):
    raise ConfigError(
      f"model.d_model {m.d_model} must split into {m.num_heads} heads of even width, or model.head_dim be even "
      "(VAPOR and RoPE rotate pairs)."
    )
  if m.num_kv_heads and m.num_kv_heads != m.num_heads:
    raise ConfigError(
      f"model.num_kv_heads {m.num_kv_heads}: Latte's values and window keys have one head per query head "
      "(a grouped checkpoint's are repeated, lra_core/hf)."
    )
  if not 0.0 <= m.latent_dropout < 1.0:
    raise ConfigError(f"model.latent_dropout must be in [0, 1), got {m.latent_dropout}.")
  if not m.latent and (m.window <= 0 or m.vapor):
    raise ConfigError(
      "model.latent=False (window attention alone) needs model.window > 0 and model.vapor=False "
      "(VAPOR rotates the latent part's values)."
    )
  if m.mixer == "conv" and m.conv_kernel < 1:
    raise ConfigError(f"model.conv_kernel must be >= 1, got {m.conv_kernel}.")
  if m.chunk < 0:
    raise ConfigError(f"model.chunk must be >= 0, got {m.chunk}.")
  transformer.validate_config(_as_transformer(config))


def _as_transformer(config):
  """The shared fields checked by the transformer validator (its variant table does not apply)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.model.variant, c.model.rope = "transformer", False
  return c


# -- what feeds the latent probabilities (Section 2.4) --------------------------------------------


class Conv(nnx.Module):
  """Depthwise 1D convolution y_t = sum_i w_i x_{t-i} + b (eq. 17); centred when bidirectional."""

  def __init__(self, features: int, kernel: int, *, causal: bool, rngs: nnx.Rngs):
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=1)
    self.kernel = param(rngs, init, (kernel, features), (None, "embed"))
    self.bias = param(rngs, jax.nn.initializers.zeros, (features,), ("embed",))
    self.causal = causal

  def __call__(self, x: Array, segments: Array | None = None) -> Array:
    """x [B,T,D] -> [B,T,D]; segments int[B,T]: a tap reads zero where it would reach another document."""
    k, t = self.kernel.shape[0], x.shape[1]
    before = k - 1 if self.causal else k - 1 - k // 2  # centred: taps reach k // 2 ahead
    widths = ((0, 0), (before, k - 1 - before))
    xp = jnp.pad(x, widths + ((0, 0),))
    w = self.kernel[...].astype(x.dtype)
    # tap i reads x_{t - i} (shifted by k // 2 when centred)
    tap = lambda i: xp[:, k - 1 - i : k - 1 - i + t]
    if segments is not None:
      sp, read = jnp.pad(segments, widths, constant_values=-1), tap
      tap = lambda i: jnp.where((sp[:, k - 1 - i : k - 1 - i + t] == segments)[..., None], read(i), 0)
    return sum(tap(i) * w[i] for i in range(k)) + self.bias[...].astype(x.dtype)

  def init_state(self, batch: int, dtype) -> Array:
    return jnp.zeros((batch, self.kernel.shape[0] - 1, self.kernel.shape[1]), dtype)

  def step(self, x: Array, state: Array) -> tuple[Array, Array]:
    """x [B,D] with the last K-1 inputs [B,K-1,D] (oldest first) -> y [B,D], next state."""
    window = jnp.concatenate([state, x[:, None]], axis=1)  # x_{t-K+1} .. x_t
    w = self.kernel[...].astype(x.dtype)[::-1]  # w_{K-1} .. w_0
    return (window * w).sum(1) + self.bias[...].astype(x.dtype), window[:, 1:]


class RGLRU(nnx.Module):
  """Real-Gated Linear Recurrent Unit (Griffin, De et al. 2024, Section 2.4):
  r_t = sigmoid(W_a x_t + b_a), i_t = sigmoid(W_x x_t + b_x), a_t = sigmoid(Lambda)^(c r_t),
  h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t). Gates are block-diagonal (one block per head);
  a^c starts uniform in [0.9, 0.999]. Bidirectional: the mean of a forward and a backward pass."""

  def __init__(self, features: int, blocks: int, *, c: float, causal: bool, rngs: nnx.Rngs):
    width = features // blocks
    init = jax.nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=(0,)
    )
    zeros = jax.nn.initializers.zeros
    self.input_gate = param(rngs, init, (blocks, width, width), ("heads", None, None))
    self.input_bias = param(rngs, zeros, (blocks, width), ("heads", None))
    self.recurrence_gate = param(rngs, init, (blocks, width, width), ("heads", None, None))
    self.recurrence_bias = param(rngs, zeros, (blocks, width), ("heads", None))

    def a_init(key, shape, dtype):
      a = jax.random.uniform(key, shape, dtype, 0.9, 0.999) ** (1.0 / c)
      return jnp.log(a) - jnp.log1p(-a)  # Lambda = logit(a)

    self.a_param = param(rngs, a_init, (features,), ("embed",))
    self.c, self.causal, self.blocks = c, causal, blocks

  def _coefficients(self, x: Array) -> tuple[Array, Array]:
    """x [..., D] -> (a_t, b_t) of h_t = a_t h_{t-1} + b_t, float32."""
    x32 = x.astype(jnp.float32)
    xb = x32.reshape(*x.shape[:-1], self.blocks, -1)
    gate = lambda w, b: jax.nn.sigmoid(jnp.einsum("...hi,hij->...hj", xb, w[...]) + b[...]).reshape(x.shape)
    r, i = gate(self.recurrence_gate, self.recurrence_bias), gate(self.input_gate, self.input_bias)
    log_a = -self.c * jax.nn.softplus(-self.a_param[...]) * r
    # sqrt(1 - a^2) from expm1, floored so its gradient stays finite when a_t rounds to 1
    scale = jnp.sqrt(jnp.maximum(-jnp.expm1(2.0 * log_a), 1e-12))
    return jnp.exp(log_a), scale * i * x32

  def __call__(self, x: Array, segments: Array | None = None) -> Array:
    """x [B,T,D] -> [B,T,D]; segments int[B,T]: the state restarts at each document's first token
    (and, for the backward pass of the bidirectional layer, at each document's last)."""
    a, b = self._coefficients(x)
    a_forward = a_backward = a
    if segments is not None:
      starts = segment_starts(segments)
      a_forward = jnp.where(starts[..., None], 0.0, a)  # h_t = b_t at a first token
      ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
      a_backward = jnp.where(ends[..., None], 0.0, a)  # and, backwards, at a last one
    # h_t = a_t h_{t-1} + b_t in O(log T) depth; over a sequence split across chips, each chip's
    # final (prod a, h) reaches the later chips (kernels/context_parallel.py)
    h = sequence_split.linear_recurrence(a_forward, b)
    if not self.causal:
      h = 0.5 * (h + sequence_split.linear_recurrence(a_backward, b, reverse=True))
    return h.astype(x.dtype)

  def init_state(self, batch: int, dtype) -> Array:
    return jnp.zeros((batch, self.a_param.shape[0]), jnp.float32)

  def step(self, x: Array, h: Array) -> tuple[Array, Array]:
    a, b = self._coefficients(x)
    h = a * h + b
    return h.astype(x.dtype), h


# -- the token mixer ---------------------------------------------------------------------------------


class LatteAttention(nnx.Module):
  """Latent attention over H heads of L/H latent states; with `window` > 0, Latte-Macchiato; with
  `latent` False, the window attention alone, its q and k from RMSNorm(mixer(x)) (RGLRU-SWA++)."""

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs):
    h, d = m.num_heads, m.d_model
    latents, width = m.num_latents // h, head_width(m)
    self.causal, self.window, self.rope, self.dtype = causal, m.window, m.rope, dtype
    self.rope_max_wavelength = m.rope_max_wavelength
    # The window attention's scores as the model's softmax attention takes them (a pre-trained model's
    # query scale and soft cap: Gemma 2 -> Latte-Macchiato, lra_core/hf).
    self.window_scale = m.score_scale_dim**-0.5 if m.score_scale_dim else None
    self.window_soft_cap = m.attn_soft_cap
    self.attention_impl = m.attention_impl  # the sliding window's softmax (kernels/softmax/library.py)
    self.latent = m.latent
    self.chunk, self.impl = m.chunk or None, m.impl
    self.shape = (h, latents, width)
    kw = dict(dtype=dtype, rngs=rngs)
    if m.mixer == "conv":
      self.mixer = Conv(d, m.conv_kernel, causal=causal, rngs=rngs)
    elif m.mixer == "rglru":
      self.mixer = RGLRU(d, h, c=m.rglru_c, causal=causal, rngs=rngs)
    else:
      self.mixer = None
    if self.latent:
      # Macchiato: one more query logit per head, for state 0 (the window attention).
      self.query = Dense(d, (h, latents + bool(m.window)), axes=("embed", "heads", "latents"), **kw)
      self.key = Dense(d, (h, latents), axes=("embed", "heads", "latents"), **kw)
      self.window_norm = None
    else:  # Table 2's RGLRU-SWA++: Z = RMSNorm(y) feeds the window's q and k
      self.window_norm = RMSNorm(d, rngs=rngs)
    self.value = Dense(d, (h, width), axes=("embed", "heads", "head_dim"), **kw)
    if m.window:
      self.window_query = Dense(d, (h, width), axes=("embed", "heads", "head_dim"), **kw)
      self.window_key = Dense(d, (h, width), axes=("embed", "heads", "head_dim"), **kw)
    self.latent_dropout = nnx.Dropout(m.latent_dropout)
    self.out = Dense((h, width), d, axes=("heads", "head_dim", "embed"), **kw)
    # VAPOR: a learnable block-diagonal rotation R; R^t acts on the values (eq. 22). Angles start
    # at RoPE's frequencies.
    self.vapor = (
      param(
        rngs,
        lambda key, shape, dtype: jnp.broadcast_to(1e4 ** (-jnp.arange(shape[1], dtype=dtype) / shape[1]), shape),
        (h, width // 2),
        ("heads", None),
      )
      if m.vapor
      else None
    )

  def _rotate(self, x: Array, positions: Array, sign: float) -> Array:
    """x [B,T,H,W] times R^(sign * position)."""
    if self.vapor is None:
      return x
    angles = sign * positions.astype(jnp.float32)[..., None, None] * self.vapor[...]  # [(B,)T,H,W/2]
    return rotate_pairs(x, angles)

  def _mix(self, q: Array, latent: Array, local: Array | None, scale: Array | None) -> Array:
    """Latte-Macchiato, eq. 13: p(0|t) local + sum_{l>=1} p(l|t) latte_l, p over L + 1 states.
    The latent kernels normalise over l >= 1, so their output is scaled by 1 - p(0|t). `scale`
    [B,T,H,L+1] (latent dropout) multiplies p(l|t); its states l >= 1 went to the kernels."""
    if local is None:
      return latent
    p0 = jax.nn.sigmoid(q[..., 0] - jax.nn.logsumexp(q[..., 1:].astype(jnp.float32), -1))[..., None]
    kept = p0 if scale is None else p0 * scale[..., :1]
    return (kept * local + (1.0 - p0) * latent).astype(latent.dtype)

  def _latent_scale(self, shape: tuple[int, ...], rngs: nnx.Rngs | None) -> Array | None:
    """Latent dropout: keep mask / keep rate over p(l|t) [B,T,H,L(+1)] in training, else None."""
    drop = self.latent_dropout
    if drop.rate == 0.0 or drop.deterministic:
      return None
    return drop(jnp.ones(shape, jnp.float32), rngs=rngs)

  def _window_qk(self, x: Array, y: Array, positions: Array) -> tuple[Array, Array]:
    """The window attention's q and k: from x (Macchiato) or from RMSNorm(y) (RGLRU-SWA++)."""
    z = x if self.window_norm is None else self.window_norm(y)
    q, k = self.window_query(z), self.window_key(z)
    if self.rope:
      q, k = (apply_rope(x, positions, max_wavelength=self.rope_max_wavelength) for x in (q, k))
    return q, k

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x: [B,T,D]; positions int[T] or [B,T] (consecutive within a document); mask bool[B,T], False =
    padding (bidirectional); segments int[B,T] document ids of packed rows (kernels/packed_documents.py);
    rngs: the `dropout` stream for latent dropout in training."""
    t = x.shape[1]
    positions = jnp.arange(t) if positions is None else positions
    if mask is not None and not self.causal:
      x = jnp.where(mask[..., None], x, 0)  # padding feeds nothing into the convolution / RG-LRU
    y = x if self.mixer is None else self.mixer(x, segments)  # the latent logits read y, the values x
    v = self.value(x)
    local = None
    if self.window:
      wq, wk = self._window_qk(x, y, positions)
      kw = dict(k_valid=mask, segments=segments, scale=self.window_scale, soft_cap=self.window_soft_cap)
      local = self_attention(wq, wk, v, causal=self.causal, window=self.window, impl=self.attention_impl, **kw)
    if not self.latent:
      return self.out(local)
    q, k = self.query(y), self.key(y)
    scale = self._latent_scale(q.shape, rngs)
    lq, rotated = (q[..., 1:] if self.window else q), self._rotate(v, positions, -1.0)
    kw = dict(segments=segments, latent_scale=None if scale is None else scale[..., -lq.shape[-1] :], impl=self.impl)
    if self.causal:
      latent = latte_kernels.causal_latte(lq, k, rotated, chunk=self.chunk, **kw)
    else:
      latent = latte_kernels.bidirectional_latte(lq, k, rotated, mask=mask, **kw)
    latent = self._rotate(latent, positions, 1.0)
    return self.out(self._mix(q, latent, local, scale))

  # -- decoding ------------------------------------------------------------------------------------

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    if not self.causal:
      raise ValueError("decoding needs causal Latte; this layer is bidirectional.")
    h, latents, width = self.shape
    cache = {"latte": latte_kernels.init_latte_state(batch_size, h, latents, width)} if self.latent else {}
    if self.mixer is not None:
      cache["mixer"] = self.mixer.init_state(batch_size, dtype)
    if self.window:
      cache["window"] = empty_cache(batch_size, min(self.window, max_len), h, width, dtype)
    return cache

  def decode(self, x: Array, cache: dict, position: Array) -> tuple[Array, dict]:
    """One step. x: [B,1,D] at `position` -> y [B,1,D], next cache (constant size)."""
    positions = position[None]
    cache = dict(cache)
    y = x
    if self.mixer is not None:
      y, cache["mixer"] = self.mixer.step(x[:, 0], cache["mixer"])
      y = y[:, None]
    v = self.value(x)
    local = None
    if self.window:
      wq, wk = self._window_qk(x, y, positions)
      cache["window"] = write_cache(cache["window"], wk, v, position)
      kw = dict(scale=self.window_scale, soft_cap=self.window_soft_cap)
      local = attend_cache(wq, cache["window"], position, window=self.window, **kw)
    if not self.latent:
      return self.out(local), cache
    q, k = self.query(y), self.key(y)
    lq = q[..., 1:] if self.window else q
    rotated = self._rotate(v, positions, -1.0)
    latent, cache["latte"] = latte_kernels.latte_step(lq[:, 0], k[:, 0], rotated[:, 0], cache["latte"])
    latent = self._rotate(latent[:, None], positions, 1.0)
    return self.out(self._mix(q, latent, local, None)), cache


class Model(transformer.Model):
  """The transformer stack (embeddings, pre-norm blocks, task heads, decoding) with Latte mixers."""

  mixer = staticmethod(LatteAttention)


# -- family record --------------------------------------------------------------------------------


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices (kernels/context_parallel.py): every variant, the window attention's
  blocks of `window` steps kept whole on each chip."""
  m, local = config.model, (config.train.update_len or config.train.seq_len) // n
  if m.window and local % m.window:
    raise ConfigError(
      f"model.window {m.window} does not divide the {local} steps each of mesh.sequence={n} chips holds."
    )


FAMILY = transformer.mixer_family(
  "latte",
  Model,
  validate_config=validate_config,
  context_parallel=context_parallel,
  upgrades={"latent": True, "latent_dropout": 0.0},  # before the baselines without latents, and latent dropout
  smoke=Smoke(
    config="configs/c4/latte.py:tiny,latte_rglru_swa++",
    data="c4",
    causal="configs/c4/latte.py:tiny,latte_rglru_swa++",
    light=("model.num_layers=1",),
    fuzz={
      "model.num_latents": ["4", "8", "0"],
      "model.chunk": ["1", "4", "5", "0"],
      "model.num_heads": ["1", "2", "3"],
      "model.variant": ["latte", "latte++", "macchiato", "bad"],
      "model.mixer": ["none", "conv", "rglru", "bogus"],
    },
  ),
  # Table 1 (OpenWebText, GPT-2 BPE, tied embeddings) at Table 5's sizes
  paper_rows=tuple(
    PaperRow(f"configs/c4/latte.py:{variant}", count, f"Latte Table 1, {variant}")
    for variant, count in (
      ("latte", 111e6),
      ("latte++", 140e6),
      ("latte_conv++", 140e6),
      ("latte_conv_swa++", 153e6),
      ("latte_rglru++", 139e6),
      ("latte_rglru_swa++", 153e6),
    )
  ),
)
