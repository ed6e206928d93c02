"""Shared building blocks: dense projections, embeddings, norms and MLPs.

Every parameter carries `logical_axes` metadata (names such as 'embed', 'mlp', 'heads',
'vocab'); `lra_core.sharding` maps them to mesh axes with the rules in the config, so no layer
knows about devices. Parameters are stored in `param_dtype` (float32) and cast to the compute
`dtype` when used; norms and softmax statistics are computed in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.kernels import per_device, toolkit

Array = jax.Array
Initializer = Callable[..., Array]


def next_key(rngs: nnx.Rngs, stream: str = "params") -> Array:
  """The key `rngs.<stream>()` gives, leaving the stream's count where that call leaves it.

  flax's call writes the count back through an indexed update that compares the new value's
  `sharding` with the old one's; on a tracer that lookup raises an error whose message walks the whole
  trace so far, which makes building a model inside jit or eval_shape quadratic in its number of
  parameters (FLASH's 24-layer PG-19 model: 17 s of a 17.7 s eval_shape). Same keys, no lookup."""
  rng = getattr(rngs, stream)
  count = rng.count.get_value()
  rng.count.set_value(count + 1)  # a plain write: no sharding lookup on a tracer
  return jax.random.fold_in(rng.key.get_value(), count)  # the key flax's own call derives


def param(
  rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None], dtype=jnp.float32
) -> nnx.Param:
  """A parameter with logical axis names (one per dimension) for sharding."""
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}.")
  return nnx.Param(init(next_key(rngs), tuple(shape), dtype), logical_axes=tuple(axes))


def as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def contract(x: Array, kernel: Array, n_in: int) -> Array:
  """x [..., I1..In] times kernel [I1..In, O1..Om] -> [..., O1..Om]: one dot_general, or on CPU one
  2-D matmul [N, I] x [I, O] with every leading axis of x folded into N (free reshapes).

  Its gradients are then 2-D matmuls too, which XLA CPU lays out without a strided transpose of the
  fused activation gradient: the general contraction made CPU train steps up to 1.7x slower. The
  platform is the one the program is traced for (kernels/toolkit.py), so TPU programs compiled on a
  CPU host keep the dot_general, which the TPU compiler estimates no slower.
  """
  # (Not where a sequence is split over chips: GSPMD gathers the time axis to fold it into N.)
  if toolkit.platform() == "cpu" and not (x.ndim > n_in + 1 and per_device.sequence_axes(x.shape[1])):
    # [..., I1..In] -> [N, I]: the reshapes are free, and the gradients become 2-D matmuls as well.
    batch, size_in = x.shape[: x.ndim - n_in], math.prod(kernel.shape[:n_in])
    y = jnp.dot(x.reshape(-1, size_in), kernel.reshape(size_in, -1))
    return y.reshape(*batch, *kernel.shape[n_in:])
  dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
  return jax.lax.dot_general(x, kernel, (dims, ((), ())))


class Dense(nnx.Module):
  """y = x W (+ b), contracting the trailing `in_features` axes of x.

  `in_features` / `out_features` may be tuples, e.g. (D,) -> (H, Dh) for a head projection
  or (H, Dh) -> (D,) for the output projection; `axes` names all kernel dimensions. Without a
  `kernel_init` the kernel starts at variance 1 / fan-in, the fan-in being every input feature
  (D for a head projection, not H * Dh), drawn from `distribution` (variance_scaling's names).
  """

  def __init__(
    self,
    in_features: int | Sequence[int],
    out_features: int | Sequence[int],
    *,
    axes: Sequence[str | None],
    use_bias: bool = False,
    dtype=jnp.float32,
    kernel_init: Initializer | None = None,
    distribution: str = "truncated_normal",
    rngs: nnx.Rngs,
  ):
    self.in_features, self.out_features = as_tuple(in_features), as_tuple(out_features)
    n_in, n_out = len(self.in_features), len(self.out_features)
    if kernel_init is None:  # fan-in over every input axis: D for a head projection [D, H, Dh], not H * Dh
      kernel_init = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", distribution, in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + n_out))
      )
    self.kernel = param(rngs, kernel_init, self.in_features + self.out_features, axes)
    self.bias = param(rngs, jax.nn.initializers.zeros, self.out_features, tuple(axes)[n_in:]) if use_bias else None
    self.dtype = dtype

  def __call__(self, x: Array) -> Array:
    n_in = len(self.in_features)
    if x.shape[x.ndim - n_in :] != self.in_features:
      raise ValueError(f"Dense expects trailing input shape {self.in_features}, got {x.shape}.")
    # Parameters stay float32; the product runs in the compute dtype (bfloat16 under the precision policy).
    y = contract(x.astype(self.dtype), self.kernel[...].astype(self.dtype), n_in)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


EMBEDDINGS = ("scaled", "plain")


class Embed(nnx.Module):
  """Token embedding [V, D]; `attend` reuses it as a tied output projection.

  Lookups start at unit variance, so sinusoids and embeddings are comparable. `parameterisation`
  says what the table stores: "scaled" holds E / sqrt(D) and multiplies lookups by sqrt(D) (T5's
  form: Adam then moves E sqrt(D) times faster, and it weighs 1/sqrt(D) as much in a global-norm
  clip); "plain" holds E itself (the Transformer-VQ and Latte authors'). The model's function is the
  same either way; only the optimizer sees a difference. `scale_by_sqrt_dim=False` (with "scaled")
  keeps the table's D^-1/2 variance in the lookups (e.g. a class-label embedding). `multiplier`
  scales the lookups alone, in the compute dtype, after the table's own factor: Gemma's sqrt(D) over a
  table its tied output reads as is.
  """

  def __init__(
    self,
    vocab_size: int,
    features: int,
    *,
    dtype=jnp.float32,
    scale_by_sqrt_dim: bool = True,
    parameterisation: str = "scaled",
    multiplier: float = 1.0,
    rngs: nnx.Rngs,
  ):
    if parameterisation not in EMBEDDINGS:
      raise ValueError(f"embedding parameterisation {parameterisation!r} is not one of {EMBEDDINGS}.")
    plain = parameterisation == "plain"
    # Either way a lookup starts at unit variance: "plain" stores E ~ N(0, 1); "scaled" stores
    # E / sqrt(D) ~ N(0, 1/D) and multiplies it back on the way out. A multiplier shrinks the table as
    # much (Gemma's sqrt(D): E ~ N(0, 1/D), whose tied logits x E^T then start near unit variance too).
    init = jax.nn.initializers.normal(stddev=(1.0 if plain else features**-0.5) / multiplier)
    self.embedding = param(rngs, init, (vocab_size, features), ("vocab", "embed"))
    self.scale = features**0.5 if scale_by_sqrt_dim and not plain else 1.0
    self.dtype, self.multiplier = dtype, multiplier

  def __call__(self, ids: Array) -> Array:
    x = (jnp.take(self.embedding[...], ids, axis=0) * self.scale).astype(self.dtype)
    return x * jnp.asarray(self.multiplier, self.dtype) if self.multiplier != 1.0 else x

  def attend(self, x: Array) -> Array:
    """x [..., D] -> x E^T [..., V], E the embedding lookups return (whatever the table stores)."""
    logits = output_logits(x.astype(self.dtype), self.embedding[...].astype(self.dtype))
    # The table holds E / scale: multiply back so tied logits are x E^T whatever the table stores.
    return logits * self.scale if self.scale != 1.0 else logits


@jax.custom_vjp
def output_logits(x: Array, table: Array) -> Array:
  """x [..., D] times a [V,D] output table -> [..., V], with the gradient of a step's last product: its two
  products computed together, so that the logits' gradient ([B,T,V], the step's largest buffer) is freed
  before the layers' backward starts. Plain autodiff leaves XLA free to put the table's product after the
  layers (it feeds only the parameter gradient); with Pallas calls in a scanned, recomputed layer XLA:GPU
  did (PG-19 FLASH, remat=full, batch 2: 1.95 GiB of logits' buffers lived beside the layers' gradients)."""
  return jnp.einsum("...d,vd->...v", x, table)


def _output_logits_fwd(x: Array, table: Array):
  return output_logits(x, table), (x, table)


def _output_logits_bwd(saved, g: Array):
  x, table = saved
  dx = jnp.einsum("...v,vd->...d", g, table)
  dtable = jnp.einsum("...v,...d->vd", g, x)
  # dx is released to the layers only with dtable: no schedule can keep g alive through their backward
  return jax.lax.optimization_barrier((dx, dtable))


output_logits.defvjp(_output_logits_fwd, _output_logits_bwd)


def rms_normalize(x: Array, eps: float = 1e-6) -> Array:
  """x / rms(x) over the last axis, computed in float32 (norms without gain, e.g. on q and k)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


class LayerNorm(nnx.Module):
  def __init__(self, features: int, *, eps: float = 1e-6, use_bias: bool = True, rngs: nnx.Rngs):
    self.scale = param(rngs, jax.nn.initializers.ones, (features,), ("embed",))
    self.bias = param(rngs, jax.nn.initializers.zeros, (features,), ("embed",)) if use_bias else None
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)  # statistics in float32 whatever the compute dtype: bfloat16 sums drift
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...]
    if self.bias is not None:
      y = y + self.bias[...]
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) times a learned gain (plus a bias with `use_bias`). `offset`: the parameter stores the
  gain's offset from 1 and starts at 0, y = x / rms(x) (1 + w) (Gemma's form: a checkpoint's w is
  kept as is, and decay pulls the gain towards 1, not 0)."""

  def __init__(
    self,
    features: int,
    *,
    eps: float = 1e-6,
    use_scale: bool = True,
    use_bias: bool = False,
    offset: bool = False,
    rngs: nnx.Rngs,
  ):
    init = jax.nn.initializers.zeros if offset else jax.nn.initializers.ones
    self.scale = param(rngs, init, (features,), ("embed",)) if use_scale else None
    self.bias = param(rngs, jax.nn.initializers.zeros, (features,), ("embed",)) if use_bias else None
    self.eps, self.offset = eps, offset

  def __call__(self, x: Array) -> Array:
    y = rms_normalize(x.astype(jnp.float32), self.eps)
    if self.scale is not None:
      y = y * (1.0 + self.scale[...] if self.offset else self.scale[...])
    if self.bias is not None:
      y = y + self.bias[...]
    return y.astype(x.dtype)


class ScaleNorm(nnx.Module):
  """Nguyen & Salazar (2019): one learned scalar times x / rms(x) (as FLASH's pseudocode)."""

  def __init__(self, features: int, *, eps: float = 1e-5, rngs: nnx.Rngs):
    del features
    self.scale = param(rngs, jax.nn.initializers.ones, (), ())
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    y = rms_normalize(x.astype(jnp.float32), self.eps) * self.scale[...]
    return y.astype(x.dtype)


NORMS = {"layer": LayerNorm, "rms": RMSNorm, "rms_offset": functools.partial(RMSNorm, offset=True), "scale": ScaleNorm}


def make_norm(kind: str, features: int, *, eps: float = 0.0, rngs: nnx.Rngs) -> nnx.Module:
  """A norm of NORMS; `eps` 0 keeps the kind's own epsilon."""
  if kind not in NORMS:
    raise ValueError(f"norm {kind!r} is not one of {sorted(NORMS)}.")
  # Each kind keeps its own default epsilon (1e-6 layer / rms, 1e-5 scale) unless the config names one.
  return NORMS[kind](features, rngs=rngs, **({"eps": eps} if eps else {}))


@jax.custom_vjp
def silu(x: Array) -> Array:
  """x * sigmoid(x), whose backward pass keeps only x.

  Differentiating jax.nn.silu keeps both x and sigmoid(x) for the backward pass. Keeping x alone
  and recomputing the sigmoid (an elementwise op XLA fuses into the gradient's fusion) halves the
  activation memory traffic: for FLASH's GAU (d 768, e 1536) compiled for TPU v4 the estimated
  train step of the layer stack drops from 30.2 to 26.0 ms (`python -m lra_core.aot --hotspots`).
  The gradient is computed in float32 and returned in x's dtype.
  """
  return x * jax.nn.sigmoid(x)


def _silu_fwd(x: Array) -> tuple[Array, Array]:
  return silu(x), x  # the residual is x alone: the backward pass recomputes sigmoid(x)


def _silu_bwd(x: Array, g: Array) -> tuple[Array]:
  x32 = x.astype(jnp.float32)
  s = jax.nn.sigmoid(x32)
  # d/dx x s(x) = s + x s (1 - s) = s (1 + x (1 - s))
  return ((g.astype(jnp.float32) * s * (1.0 + x32 * (1.0 - s))).astype(x.dtype),)


silu.defvjp(_silu_fwd, _silu_bwd)


ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "relu": jax.nn.relu,
  "silu": silu,
  "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


class MLP(nnx.Module):
  """Feed-forward block: act(x W_u) W_o, or with `glu` the gated form (act(x W_u) * x W_v) W_o."""

  def __init__(
    self,
    features: int,
    hidden: int,
    *,
    activation: str = "gelu",
    glu: bool = False,
    use_bias: bool = False,
    dropout: float = 0.0,
    dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}.")
    self.activation = activation
    self.up = Dense(features, hidden, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.gate = (
      Dense(features, hidden, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs) if glu else None
    )
    self.down = Dense(hidden, features, axes=("mlp", "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x: Array, *, rngs: nnx.Rngs | None = None) -> Array:
    h = ACTIVATIONS[self.activation](self.up(x))
    if self.gate is not None:  # GLU: the activated branch times a linear one (Shazeer 2020)
      h = h * self.gate(x)
    return self.down(self.dropout(h, rngs=rngs))
