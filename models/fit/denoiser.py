"""The FIT denoiser (Chen & Li 2023, section 4.2): pixel-space diffusion with FIT over sub-images.

An image [B,S,S,C] in [-1, 1] is cut into p x p patches (`patch_size`), each patch a data token
(stem Dense + LayerNorm + a learned position table shared by all groups). The patch grid is split
into `num_groups` square sub-images (groups); each group owns `latents_per_group` learned latents.
Per L(a)G(b) block: `a` local layers on each group's data (MLP only, as RIN and the paper's FIT
without local self-attention; `local_attention` adds self-attention), the group's latents read
its data (l2x), all latents read the condition tokens (l2c: the noise level, and the class
label when `num_classes` > 0), `b` global layers over all latents, and the data read their
group's latents back (x2l). The final data tokens go through LayerNorm + Dense back to pixels.

Latent self-conditioning (RIN): the latents of a previous call, through a residual MLP and a
LayerNorm whose scale starts at zero, are added to the initial latents. `num_groups` = 1 is RIN.
The noise level conditions the model as in pix2seq: the signal level gamma in [0, 1], scaled by
`time_scale`, as a sinusoid normalised over channels, then Dense-SiLU-Dense (ScalarEmbedding).
For classifier-free guidance (`diffusion.cond_dropout` > 0) the label table has one more row,
the null class `null_label` = num_classes, which training puts in place of dropped labels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core import diffusion
from lra_core.errors import ConfigError
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.models.fit import FITBlock, validate_widths
from lra_core.models.fit.groups import group_2d, parse_layers, ungroup_2d
from lra_core.models.layers import stack
from lra_core.models.layers.attention import CrossAttention
from lra_core.models.layers.core import ACTIVATIONS, MLP, Dense, Embed, LayerNorm, param, silu
from lra_core.models.layers.positions import sinusoid
from lra_core.protocol import Capabilities, Family, RunInfo, Smoke

Array = jax.Array


def model_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(
    dict(
      name="fit_denoiser",
      image_size=64,  # S: images are S x S x image_channels
      image_channels=3,
      patch_size=8,  # p: one data token per p x p patch
      num_groups=4,  # square number of sub-images (groups); 1 = RIN
      latents_per_group=32,  # m
      layers="L(0)G(4)L(1)G(4)L(1)G(4)L(1)G(4)L(1)",
      local_attention=False,  # self-attention in the local layers (off: RIN / FIT-denoiser)
      d_model=512,  # data tokens
      num_heads=16,
      d_ff=2048,
      d_latent=768,  # latents
      latent_heads=16,
      latent_d_ff=3072,
      num_classes=0,  # > 0: class-conditional (a label token beside the noise level)
      self_condition=True,  # latent self-conditioning
      time_scale=1000.0,  # the noise level is embedded as a sinusoid of gamma * time_scale
      activation="gelu",
      use_bias=True,
      dropout=0.0,
      attention_dropout=0.0,
      dtype="float32",
    )
  )
  c.update(MODEL_DEFAULTS)  # the layer-stacking switches every model section has
  c.update(overrides)
  return c


# -- pure functions ---------------------------------------------------------------------------------


def patch_grid(m) -> tuple[int, int, int]:
  """(P patches per image side, g groups per side, q patches per group side)."""
  side = m.image_size // m.patch_size
  groups_side = math.isqrt(m.num_groups)
  return side, groups_side, side // groups_side


def image_to_groups(x: Array, patch_size: int, group_patches: int) -> Array:
  """[B,S,S,C] -> [B, groups, q*q, p*p*C]: p x p patches, grouped into q x q-patch sub-images."""
  b, s, _, c = x.shape
  patches = group_2d(x.reshape(b, s * s * c), s, c, patch_size)  # [B, P*P, p*p*C], raster patches
  return group_2d(patches, s // patch_size, 1, group_patches)


def groups_to_image(x: Array, side: int, channels: int, patch_size: int, group_patches: int) -> Array:
  """Inverse of `image_to_groups`: [B, groups, q*q, p*p*C] -> [B,S,S,C]."""
  patches = ungroup_2d(x, side // patch_size, 1, group_patches)
  return ungroup_2d(patches, side, channels, patch_size).reshape(x.shape[0], side, side, channels)


def normalized_sinusoid(values: Array, dim: int) -> Array:
  """[B] -> [B, dim]: sin / cos features of `values`, standardised over the features."""
  e = sinusoid(values, dim)
  return (e - e.mean(-1, keepdims=True)) / (e.std(-1, keepdims=True) + 1e-6)


# -- modules ----------------------------------------------------------------------------------------


class ScalarEmbedding(nnx.Module):
  """gamma [B] -> [B, D]: normalised sinusoid of gamma * scale over D/4 channels, Dense-SiLU-Dense."""

  def __init__(self, features: int, *, scale: float, dtype, rngs: nnx.Rngs):
    self.dim, self.scale = features // 4, scale
    self.dense_0 = Dense(self.dim, features, axes=(None, "embed"), use_bias=True, dtype=dtype, rngs=rngs)
    self.dense_1 = Dense(features, features, axes=(None, "embed"), use_bias=True, dtype=dtype, rngs=rngs)

  def __call__(self, gamma: Array) -> Array:
    e = normalized_sinusoid(gamma.astype(jnp.float32) * self.scale, self.dim)
    return self.dense_1(silu(self.dense_0(e)))


class LatentSelfCondition(nnx.Module):
  """latents_prev [B,N,D] -> LN_0(h + MLP(LN(h))): LN_0's scale starts at zero, so a fresh model
  ignores the previous latents and learns how much to use them (RIN)."""

  def __init__(self, m, *, dtype, rngs: nnx.Rngs):
    self.mlp_norm = LayerNorm(m.d_latent, rngs=rngs)
    self.mlp = MLP(m.d_latent, m.latent_d_ff, activation=m.activation, use_bias=m.use_bias, dtype=dtype, rngs=rngs)
    self.out_norm = LayerNorm(m.d_latent, rngs=rngs)
    self.out_norm.scale = param(rngs, jax.nn.initializers.zeros, (m.d_latent,), ("embed",))

  def __call__(self, latents_prev: Array) -> Array:
    h = latents_prev + self.mlp(self.mlp_norm(latents_prev))
    return self.out_norm(h)


def validate_config(config) -> None:
  m = config.model
  for key in (
    "image_size",
    "image_channels",
    "patch_size",
    "num_groups",
    "latents_per_group",
    "d_model",
    "num_heads",
    "d_ff",
    "d_latent",
    "latent_heads",
    "latent_d_ff",
  ):
    if not isinstance(m[key], int) or m[key] <= 0:
      raise ConfigError(f"model.{key} must be a positive integer, got {m[key]!r}.")
  validate_widths(m)
  if m.d_latent % 8:
    raise ConfigError(
      f"model.d_latent {m.d_latent} is not a multiple of 8 (the noise level embedding "
      f"uses d_latent / 4 sinusoid channels, half sine and half cosine)."
    )
  if m.activation not in ACTIVATIONS:
    raise ConfigError(f"model.activation {m.activation!r} is not one of {sorted(ACTIVATIONS)}.")
  if m.num_classes < 0:
    raise ConfigError(f"model.num_classes must be >= 0 (0: unconditional), got {m.num_classes}.")
  blocks = parse_layers(m.layers)
  if blocks[-1][1]:
    raise ConfigError(
      f"model.layers {m.layers!r} ends with global layers, whose latents never reach the "
      f"data tokens the denoiser outputs; end with a local block such as L(1)."
    )
  if m.image_size % m.patch_size:
    raise ConfigError(f"model.patch_size {m.patch_size} does not divide model.image_size {m.image_size}.")
  side, groups_side, _ = patch_grid(m)
  if groups_side**2 != m.num_groups:
    raise ConfigError(f"model.num_groups {m.num_groups} is not a square number of sub-images (1, 4, 16, ...).")
  if side % groups_side:
    raise ConfigError(
      f"the {side}x{side} patch grid (model.image_size {m.image_size} / model.patch_size "
      f"{m.patch_size}) does not split into {groups_side}x{groups_side} groups "
      f"(model.num_groups {m.num_groups})."
    )
  seq_len = m.image_size**2 * m.image_channels
  if config.train.seq_len != seq_len:
    raise ConfigError(
      f"train.seq_len {config.train.seq_len} is not the {seq_len} pixel values of a "
      f"{m.image_size}x{m.image_size}x{m.image_channels} image (model.image_size)."
    )
  diffusion.validate_config(config)


class Model(nnx.Module):
  """(x_t [B,S,S,C], gamma [B]) -> (prediction [B,S,S,C] float32, latents [B, groups*m, d_latent])."""

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    self.dtype = jnp.dtype(m.dtype)
    self.side, self.channels, self.patch_size = m.image_size, m.image_channels, m.patch_size
    _, groups_side, self.group_patches = patch_grid(m)
    self.num_groups, self.m = groups_side**2, m.latents_per_group
    self.self_condition = m.self_condition
    self.spec = tuple(parse_layers(m.layers))
    patch_dim = m.patch_size**2 * m.image_channels
    normal = jax.nn.initializers.truncated_normal(0.02)
    kw = dict(use_bias=True, dtype=self.dtype, rngs=rngs)
    self.stem = Dense(patch_dim, m.d_model, axes=(None, "embed"), **kw)
    self.stem_norm = LayerNorm(m.d_model, rngs=rngs)
    # One data position table shared by all groups; one latent table for all groups' latents.
    self.data_positions = param(rngs, normal, (self.group_patches**2, m.d_model), (None, "embed"))
    self.latents = param(rngs, normal, (self.num_groups * self.m, m.d_latent), (None, "embed"))
    self.time_embed = ScalarEmbedding(m.d_latent, scale=m.time_scale, dtype=self.dtype, rngs=rngs)
    # None, or the extra label row of the null class (classifier-free guidance)
    self.null_label = run.null_label
    rows = m.num_classes + (self.null_label is not None)
    self.label_embed = (
      Embed(rows, m.d_latent, scale_by_sqrt_dim=False, dtype=self.dtype, rngs=rngs) if m.num_classes else None
    )
    self.latent_prev = LatentSelfCondition(m, dtype=self.dtype, rngs=rngs) if m.self_condition else None
    last = len(self.spec) - 1
    self.remat = m.remat
    self.blocks = nnx.List(
      [
        FITBlock(m, a, b, last=i == last, causal=False, local_attention=m.local_attention, dtype=self.dtype, rngs=rngs)
        for i, (a, b) in enumerate(self.spec)
      ]
    )
    # l2c: latents read the condition tokens, one cross-attention per block with global layers.
    self.l2c = nnx.List(
      [
        CrossAttention(
          m.d_latent,
          m.d_latent,
          heads=m.latent_heads,
          width=m.d_latent,
          use_bias=m.use_bias,
          dtype=self.dtype,
          rngs=rngs,
          impl=m.attention_impl,
        )
        for _, b in self.spec
        if b
      ]
    )
    self.out_norm = LayerNorm(m.d_model, rngs=rngs)
    self.out = Dense(m.d_model, patch_dim, axes=("embed", None), **kw)

  def latents_shape(self, batch_size: int) -> tuple[int, int, int]:
    return (batch_size, self.num_groups * self.m, self.latents.shape[-1])

  def condition_tokens(self, gamma: Array, labels: Array | None) -> Array:
    """[B, 1 or 2, d_latent]: the noise level token, then the label token if class-conditional
    (labels int[B] in 0..num_classes-1, or `null_label` for the null class)."""
    tokens = [self.time_embed(gamma)[:, None]]
    if self.label_embed is not None:
      if labels is None:
        raise ValueError("this denoiser is class-conditional (model.num_classes > 0); pass labels int32[B].")
      tokens.append(self.label_embed(labels)[:, None])
    return jnp.concatenate(tokens, axis=1).astype(self.dtype)

  def __call__(
    self,
    x_t: Array,
    gamma: Array,
    *,
    labels: Array | None = None,
    latents_prev: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> tuple[Array, Array]:
    b = x_t.shape[0]
    expected = (b, self.side, self.side, self.channels)
    if x_t.shape != expected:
      raise ValueError(f"x_t has shape {x_t.shape}; expected [B,S,S,C] = {expected}.")
    if gamma.shape != (b,):
      raise ValueError(f"gamma has shape {gamma.shape}; expected [B] = ({b},).")
    t, m = self.num_groups, self.m
    tokens = image_to_groups(x_t.astype(self.dtype), self.patch_size, self.group_patches)  # [B,t,n,p*p*C]
    n = tokens.shape[2]
    x = self.stem_norm(self.stem(tokens)) + self.data_positions[...].astype(self.dtype)
    x = x.reshape(b * t, n, -1)
    latents = jnp.broadcast_to(self.latents[...].astype(self.dtype), self.latents_shape(b))
    if self.latent_prev is not None:
      if latents_prev is None:  # no previous estimate: zeros, as at the first sampling step
        latents_prev = jnp.zeros(self.latents_shape(b), self.dtype)
      latents = latents + self.latent_prev(latents_prev.astype(self.dtype))
    elif latents_prev is not None:
      raise ValueError("latents_prev given, but this denoiser has no self-conditioning (model.self_condition).")
    cond = self.condition_tokens(gamma, labels)
    cond_kv = [l2c.kv(cond) for l2c in self.l2c]
    local_pos, global_pos = jnp.arange(n), jnp.arange(t * m)
    j = 0
    for blk in self.blocks:
      x = stack.apply(
        blk.local, x, lambda layer, x, r: layer(x, positions=local_pos, mask=None, rngs=r), remat=self.remat, rngs=rngs
      )
      if blk.l2x is None:
        continue
      latents = blk.l2x(latents.reshape(b * t, m, -1), x).reshape(b, t * m, -1)
      latents = self.l2c[j](latents, kv=cond_kv[j])
      j += 1
      latents = stack.apply(
        blk.global_layers,
        latents,
        lambda layer, x, r: layer(x, positions=global_pos, mask=None, rngs=r),
        remat=self.remat,
        rngs=rngs,
      )
      if blk.x2l is not None:
        x = blk.x2l(x, latents.reshape(b * t, m, -1))
    out = self.out(self.out_norm(x)).reshape(tokens.shape).astype(jnp.float32)
    return groups_to_image(out, self.side, self.channels, self.patch_size, self.group_patches), latents


# -- family record --------------------------------------------------------------------------------

FAMILY = Family(
  name="fit_denoiser",
  model=Model,
  tasks=("diffusion",),
  capabilities=Capabilities(self_condition=True),
  validate_config=validate_config,
  # An image is a few thousand patches at most: whole images fit a chip, so nothing asks for it.
  cannot_split=("its groups are square sub-images, each gathered from rows of patches that the chips would hold apart"),
  smoke=Smoke(
    config="configs/imagenet64/fit_denoiser.py:tiny",
    data="imagenet64",
    overrides=(
      "model.d_model=32",
      "model.d_latent=32",
      "model.d_ff=64",
      "model.latent_d_ff=64",
      "model.layers=L(1)G(2)L(1)",
    ),
    light=("model.layers=L(1)G(1)L(1)",),
    fuzz={
      "model.patch_size": ["2", "4", "3", "0"],
      "model.num_groups": ["1", "4", "3"],
      "model.latents_per_group": ["2", "4", "0"],
      "model.layers": ["L(1)G(1)L(1)", "L(1)G(1)", "L("],
      "model.self_condition": ["true", "false"],
      "diffusion.pred_type": ["eps", "x0", "v", "bogus"],
      "diffusion.sampler": ["ddim", "ddpm", "ddpm@small", "ddpm@tiny"],
      "diffusion.cond_dropout": ["0.0", "0.1", "1.0"],
      "diffusion.guidance": ["0.0", "-1.0"],
    },
  ),
)
