"""FIT: Far-reaching Interleaved Transformers (Chen & Li 2023), as an encoder and as FIT-AR.

Data tokens are split into t groups of n; each group owns m learned latents. A layer string such
as `L(4)G(2)L(4)G(2)L(4)` lists blocks: L(a) local layers on the data tokens of each group,
then (when G(b) follows) the group's latents read their data (`l2x`), b global layers run over
the latents of all groups, and the data read their group's latents back (`x2l`, not after the
last block). Data and latents have their own widths; every layer is pre-LN; the cross-attentions
normalise queries and keys / values, add a residual and have no MLP (pix2seq's FIT).

FIT-AR (section 3.2, Algorithm 2): local layers are causal, global layers see whole groups up to
their own (group-causal), and before `x2l` the latents are shifted one group right, so the data
of group i read the latents of group i-1 (group 0 reads zeros). `overlap` k > 0 (Appendix D)
prepends the last k tokens of the previous group to each group as conditioning-only prefix tokens.
Decoding keeps, per token, a local KV cache of one group and the previous group's latents; when a
group is complete its latents are computed once and the global layers extend a cache over groups.

Inputs: the encoder splits a sequence into groups of `group_size` (grouping "1d") or an image
(raster pixels, `image_channels` values each) into `group_side` x `group_side` blocks ("2d").

Packed documents (`segment_ids`, 1-D grouping): no token reads another document, and a document
that starts on a group boundary gets exactly its outputs alone; see `Model.forward_groups`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core import task_kinds
from lra_core.errors import ConfigError
from lra_core.kernels import context_parallel as sequence_split
from lra_core.kernels.packed_documents import check_segments, segment_positions
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.models.fit.groups import (
  document_groups,
  group_1d,
  group_2d,
  group_causal_positions,
  latent_documents,
  parse_layers,
  shift_latents,
  ungroup_2d,
)
from lra_core.models.layers import stack
from lra_core.models.layers.attention import CrossAttention
from lra_core.models.layers.core import ACTIVATIONS, MLP, Embed, LayerNorm, make_norm, param
from lra_core.models.layers.heads import POOLING, TaskHead, fold_towers
from lra_core.models.transformer import Block, softmax_attention
from lra_core.protocol import Capabilities, Family, PaperRow, RunInfo, Smoke

Array = jax.Array


def model_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(
    dict(
      name="fit",
      vocab_size=256,
      num_classes=0,
      layers="L(4)G(2)L(4)G(2)L(4)",
      grouping="1d",  # 1d: consecutive tokens | 2d: square image blocks
      group_size=64,  # 1d: data tokens per group (n)
      image_channels=1,  # 2d: tokens per pixel
      group_side=8,  # 2d: a group is a group_side x group_side block of pixels
      latents_per_group=8,  # m
      overlap=0,  # FIT-AR: prefix tokens from the previous group (Appendix D)
      d_model=256,  # data (local) layers
      num_heads=4,
      d_ff=1024,
      d_latent=256,  # latent (global) layers
      latent_heads=4,
      latent_d_ff=1024,
      max_len=0,  # longest sequence; 0 -> train.seq_len (sizes the latent table)
      activation="gelu",
      use_bias=True,
      dropout=0.0,
      attention_dropout=0.0,
      pooling="mean",  # classify / retrieval over the final data tokens
      classifier_hidden=0,
      tie_embeddings=True,
      output_bias=True,  # FIT-AR: a learned bias over the vocabulary on the logits (pix2seq's default)
      dtype="float32",
    )
  )
  c.update(MODEL_DEFAULTS)  # the layer-stacking switches every model section has
  c.update(overrides)
  return c


# -- modules ----------------------------------------------------------------------------------------


class FeedForwardBlock(nnx.Module):
  """x + MLP(LN(x)): a local layer without self-attention (RIN, the FIT denoiser)."""

  def __init__(self, m, *, dtype, rngs: nnx.Rngs):
    self.mlp_norm = make_norm("layer", m.d_model, rngs=rngs)
    self.mlp = MLP(m.d_model, m.d_ff, activation=m.activation, use_bias=m.use_bias, dtype=dtype, rngs=rngs)

  def __call__(self, x: Array, *, positions=None, mask=None, rngs: nnx.Rngs | None = None) -> Array:
    del positions, mask
    return x + self.mlp(self.mlp_norm(x), rngs=rngs)


def stack_config(m, width: int, heads: int, d_ff: int) -> ml_collections.ConfigDict:
  """The transformer-block settings of one stream (data or latents)."""
  return ml_collections.ConfigDict(
    dict(
      d_model=width,
      num_heads=heads,
      num_kv_heads=0,
      head_dim=0,
      d_ff=d_ff,
      norm="layer",
      norm_eps=0.0,  # 0: the norm kind's own epsilon (1e-6 for layer norm)
      parallel_residual=False,
      mlp="mlp",
      activation=m.activation,
      use_bias=m.use_bias,
      dropout=m.dropout,
      attention_dropout=m.attention_dropout,
      attention_impl=m.attention_impl,
      window=0,
      rope=False,
      rope_max_wavelength=1e4,
      rope_fraction=1.0,
      post_norms=False,
      attn_soft_cap=0.0,
      score_scale_dim=0,
      global_every=0,
    )
  )


class FITBlock(nnx.Module):
  """One L(a)G(b) block: local layers, then (b > 0) l2x, global layers and (not last) x2l.
  With model.scan_layers the a local and the b global layers are each one scanned stack."""

  def __init__(
    self, m, local: int, global_: int, *, last: bool, causal: bool, local_attention: bool = True, dtype, rngs: nnx.Rngs
  ):
    xm = stack_config(m, m.d_model, m.num_heads, m.d_ff)
    lm = stack_config(m, m.d_latent, m.latent_heads, m.latent_d_ff)
    make_local = (
      (lambda: Block(xm, causal=causal, dtype=dtype, rngs=rngs))
      if local_attention
      else (lambda: FeedForwardBlock(xm, dtype=dtype, rngs=rngs))
    )
    scan = m.scan_layers
    self.local = stack.make_layers(make_local, local, scan=scan)
    # The latents' causal mask compares their group index (the positions they are given), not the row order.
    group_causal = functools.partial(softmax_attention, mask_by_positions=True)
    self.global_layers = stack.make_layers(
      lambda: Block(lm, causal=causal, dtype=dtype, rngs=rngs, mixer=group_causal), global_, scan=scan
    )
    cross = dict(
      heads=min(m.num_heads, m.latent_heads),
      width=min(m.d_model, m.d_latent),
      use_bias=m.use_bias,
      dtype=dtype,
      rngs=rngs,
      impl=m.attention_impl,
    )
    self.l2x = CrossAttention(m.d_latent, m.d_model, **cross) if global_ else None
    self.x2l = CrossAttention(m.d_model, m.d_latent, **cross) if global_ and not last else None


def validate_widths(m) -> None:
  """Each stream's width splits into its heads, and the cross-attention's into its own."""
  for width, heads in (("d_model", "num_heads"), ("d_latent", "latent_heads")):
    if m[width] % m[heads]:
      raise ConfigError(f"model.{width} {m[width]} is not a multiple of model.{heads} {m[heads]}.")
  if min(m.d_model, m.d_latent) % min(m.num_heads, m.latent_heads):
    raise ConfigError(
      "the cross-attention width min(d_model, d_latent) is not a multiple of min(num_heads, latent_heads)."
    )


def validate_config(config) -> None:
  m = config.model
  for key in (
    "vocab_size",
    "d_model",
    "num_heads",
    "d_ff",
    "d_latent",
    "latent_heads",
    "latent_d_ff",
    "latents_per_group",
  ):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}.")
  validate_widths(m)
  parse_layers(m.layers)
  choices = {"grouping": ("1d", "2d"), "activation": tuple(ACTIVATIONS), "pooling": POOLING}
  for key, allowed in choices.items():
    if m[key] not in allowed:
      raise ConfigError(f"model.{key} {m[key]!r} is not one of {list(allowed)}.")
  causal = task_kinds.kind(config.task).causal
  seq_len = m.max_len or config.train.seq_len
  if m.max_len and m.max_len < config.train.seq_len:
    raise ConfigError(f"model.max_len {m.max_len} is shorter than train.seq_len {config.train.seq_len}.")
  if m.grouping == "2d":
    if causal:
      raise ConfigError(
        "FIT-AR groups a 1-D sequence (model.grouping '1d'); order the pixels by patches in "
        "the data (data.order 'patches') instead."
      )
    side = math.isqrt(seq_len // m.image_channels)
    if side * side * m.image_channels != seq_len:
      raise ConfigError(f"sequence length {seq_len} is not a square image of {m.image_channels} channels.")
    if m.group_side <= 0 or side % m.group_side:
      raise ConfigError(f"model.group_side {m.group_side} does not divide the image side {side}.")
  elif m.group_size <= 0:
    raise ConfigError(f"model.group_size must be positive, got {m.group_size}.")
  if not 0 <= m.overlap < m.group_size or (m.overlap and not causal):
    raise ConfigError(f"model.overlap {m.overlap} must be in [0, group_size) and is for FIT-AR only.")
  if task_kinds.kind(config.task).classifies and m.num_classes < 2:
    raise ConfigError(f"model.num_classes must be >= 2 for task {config.task!r}, got {m.num_classes}.")


class Model(nnx.Module):
  """inputs int32[B,L] -> logits [B,L,V] (FIT-AR, tasks lm / image_ar) or [B,C] (encoder)."""

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    self.task, self.towers = run.task, run.kind.towers
    self.causal = run.kind.causal
    self.dtype = jnp.dtype(m.dtype)
    self.max_len = m.max_len or run.seq_len
    self.grouping, self.channels, self.group_side = m.grouping, m.image_channels, m.group_side
    self.overlap, self.m = m.overlap, m.latents_per_group
    if m.grouping == "2d":
      self.side = math.isqrt(self.max_len // m.image_channels)
      self.group_size = m.group_side**2 * m.image_channels
    else:
      self.side, self.group_size = 0, m.group_size
    self.max_groups = -(-self.max_len // self.group_size)
    self.spec = tuple(parse_layers(m.layers))
    normal = jax.nn.initializers.truncated_normal(0.02)
    self.embed = Embed(m.vocab_size, m.d_model, dtype=self.dtype, rngs=rngs)
    # One data position table shared by all groups; one latent table for all groups' latents.
    self.data_positions = param(rngs, normal, (self.overlap + self.group_size, m.d_model), (None, "embed"))
    self.latents = param(rngs, normal, (self.max_groups * self.m, m.d_latent), (None, "embed"))
    self.embed_dropout = nnx.Dropout(m.dropout)
    self.remat = m.remat
    # Split over chips, FIT-AR's group-causal global layers run in the zig-zag order (every chip of their
    # ring equal work; kernels/context_parallel.py), where exact: without dropout, whose masks follow the layout.
    self.zigzag = self.causal and not m.dropout
    self.blocks = nnx.List(
      [
        FITBlock(m, a, b, last=i == len(self.spec) - 1, causal=self.causal, dtype=self.dtype, rngs=rngs)
        for i, (a, b) in enumerate(self.spec)
      ]
    )
    self.final_norm = LayerNorm(m.d_model, rngs=rngs)
    self.head = TaskHead(
      run.task,
      m.d_model,
      vocab_size=m.vocab_size,
      num_classes=m.num_classes,
      pooling=m.pooling,
      hidden=m.classifier_hidden,
      embed=self.embed if m.tie_embeddings and self.causal else None,
      output_bias=m.output_bias and self.causal,
      dtype=self.dtype,
      rngs=rngs,
    )

  # -- forward ----------------------------------------------------------------------------------

  def __call__(
    self, inputs: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> Array:
    """inputs int32[B,L] (retrieval [B,2,L]), mask bool (False = padding), segment_ids int[B,L]:
    the documents of a packed row (see `forward_groups`) -> logits."""
    if self.towers > 1:
      if segment_ids is not None:
        raise ValueError("segment_ids (packed documents) do not apply to two-tower retrieval.")
      inputs, mask = fold_towers(inputs, mask)
    x, valid = self.grouped_features(inputs, mask=mask, segment_ids=segment_ids, rngs=rngs)
    if self.causal:
      return self.head(self.ungroup(x, inputs.shape[1]))
    b = x.shape[0]
    return self.head(x.reshape(b, -1, x.shape[-1]), valid.reshape(b, -1))

  def encode(
    self, inputs: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> tuple[Array, Array]:
    """Final data features [B,L,D] of inputs int32[B,L], in input order, and valid bool[B,L]."""
    x, valid = self.grouped_features(inputs, mask=mask, segment_ids=segment_ids, rngs=rngs)
    return self.ungroup(x, inputs.shape[1]), self.ungroup(valid, inputs.shape[1])

  def ungroup(self, x: Array, length: int) -> Array:
    """Grouped [B,t,k+n,...] -> [B,L,...] in input order (FIT-AR's prefix slots dropped)."""
    if self.grouping == "2d":
      side = math.isqrt(length // self.channels)
      return ungroup_2d(x, side, self.channels, self.group_side)
    x = x[:, :, self.overlap :]
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]

  def grouped_features(
    self, inputs: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> tuple[Array, Array]:
    """inputs int32[B,L] -> (final data features [B,t,k+n,D], valid bool[B,t,k+n]) by group."""
    length = inputs.shape[1]
    if length > self.max_len:
      raise ValueError(f"input length {length} exceeds model max_len {self.max_len}.")
    segments = None
    if self.grouping == "2d":
      if segment_ids is not None:
        raise ValueError("segment_ids (packed documents) need model.grouping '1d'; a 2-D image is one document.")
      side = math.isqrt(length // self.channels)
      if side * side * self.channels != length or side % self.group_side:
        raise ValueError(f"input length {length} is not a square image of side divisible by {self.group_side}.")
      tokens = group_2d(inputs, side, self.channels, self.group_side)
      valid = jnp.ones(tokens.shape, bool) if mask is None else group_2d(mask, side, self.channels, self.group_side)
    else:
      tokens, valid = group_1d(inputs, self.group_size, self.overlap)
      if mask is not None:
        valid = valid & group_1d(mask, self.group_size, self.overlap, pad_value=False)[0]
      if segment_ids is not None:
        check_segments(segment_ids, inputs.shape)
        segments = group_1d(segment_ids.astype(jnp.int32), self.group_size, self.overlap, pad_value=-1)[0]
    return self.forward_groups(tokens, valid, segments=segments, rngs=rngs), valid

  def forward_groups(
    self, tokens: Array, valid: Array, *, segments: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> Array:
    """tokens int32[B,t,k+n] (valid: bool, False = padding) -> final data features [B,t,k+n,D].

    segments int32[B,t,k+n]: document ids of a packed row, grouped like the tokens (-1 on the
    slots grouping adds). Local attention is masked to the token's document; each group's latents
    serve one document (`latent_documents`: the group's last document in FIT-AR, whose next
    tokens read them; its first in the encoder), start from the latent table's rows counted from
    that document's first group, read (l2x) only its tokens and attend (global layers) only to
    latents of the same document; a token reads (x2l) its group's latents (FIT-AR: the previous
    group's) only when they serve its document, and otherwise the zero latents that group 0 of
    FIT-AR reads. A document that starts on a group boundary thus gets exactly its outputs alone
    at the start of a row; one that starts inside a group reads no other document, but its group
    split (and so its numbers) differs from alone.
    """
    b, t, n = tokens.shape
    m, k = self.m, self.overlap
    x = self.embed(tokens) + self.data_positions[...].astype(self.dtype)
    x = self.embed_dropout(x, rngs=rngs).reshape(b * t, n, -1)
    kv_valid = valid.reshape(b * t, n)
    table = self.latents[...].astype(self.dtype)
    # Global layers: group-causal positions (FIT-AR), or skip groups that are all padding.
    gpos = group_causal_positions(t, m)
    gmask = None if self.causal else jnp.repeat(valid.any(-1), m, axis=1)
    local_pos = jnp.arange(n)
    local_kw, global_kw = {}, {}
    if segments is None:
      latents = jnp.broadcast_to(table[: t * m], (b, t * m, table.shape[-1]))
    else:
      own = segments[:, :, k:]  # the group's own tokens (FIT-AR's prefix slots belong to the group before)
      # docs [B,t]: the one document each group's latents serve (FIT-AR: the group's last; encoder: its first)
      docs, offsets = latent_documents(own, valid[:, :, k:] & (own != 0), last=self.causal)
      # Latent rows counted from that document's first group, as if it started the row.
      rows = document_groups(segment_positions(own.reshape(b, -1)).reshape(own.shape), offsets)
      latents = table[(rows[..., None] * m + jnp.arange(m)).reshape(b, t * m)]
      local_kw, global_kw = {"segments": segments.reshape(b * t, n)}, {"segments": jnp.repeat(docs, m, axis=1)}
      kv_valid = kv_valid & (segments == docs[..., None]).reshape(b * t, n)  # l2x: the latents' document
      if self.causal:  # x2l reads the previous group's latents
        src_docs, has_src = jnp.pad(docs[:, :-1], ((0, 0), (1, 0))), jnp.arange(t) > 0
      else:
        src_docs, has_src = docs, jnp.ones((t,), bool)
      reads = ((segments == src_docs[..., None]) & has_src[:, None]).reshape(b * t, n, 1)
      x2l_mask = jnp.concatenate([jnp.broadcast_to(reads, (b * t, n, m)), ~reads], axis=-1)
    local_mask = valid.reshape(b * t, n)
    for blk in self.blocks:
      # A group's tokens and its latents are whole rows on the chip holding the group (mesh.sequence).
      with sequence_split.whole_rows():
        x = stack.apply(
          blk.local,
          x,
          lambda layer, x, r: layer(x, positions=local_pos, mask=local_mask, rngs=r, **local_kw),
          remat=self.remat,
          rngs=rngs,
        )
      if blk.l2x is None:
        continue
      with sequence_split.whole_rows():
        lat = blk.l2x(latents.reshape(b * t, m, -1), x, k_valid=kv_valid)
      latents = self._global(blk, lat.reshape(b, t * m, -1), gpos, gmask, global_kw, rngs)
      if blk.x2l is None:
        continue
      grouped = latents.reshape(b, t, m, -1)
      source = (shift_latents(grouped) if self.causal else grouped).reshape(b * t, m, -1)
      with sequence_split.whole_rows():
        if segments is None:
          x = blk.x2l(x, source)
          continue
        # One extra key: the zero latents (all m alike, so reading them is reading one), for tokens
        # whose source latents serve another document.
        key, value = blk.x2l.kv(source)
        key0, value0 = blk.x2l.kv(jnp.zeros((1, 1, source.shape[-1]), source.dtype))
        extend = lambda a, a0: jnp.concatenate([a, jnp.broadcast_to(a0, (b * t,) + a0.shape[1:])], axis=1)
        x = blk.x2l(x, kv=(extend(key, key0), extend(value, value0)), mask=x2l_mask)
    return self.final_norm(x).reshape(b, t, n, -1)

  def _global(self, blk, latents: Array, positions: Array, mask, kw: dict, rngs) -> Array:
    """The global layers over latents [B,G*M,D] masked by group `positions`, in the zig-zag order where
    the latents split over chips and `zigzag` holds (the group positions travel with the latents, so the
    ring masks by them in any order)."""
    b, n = latents.shape[:2]
    run = lambda x, positions, mask, kw: stack.apply(
      blk.global_layers,
      x,
      lambda layer, x, r: layer(x, positions=positions, mask=mask, rngs=r, **kw),
      remat=self.remat,
      rngs=rngs,
    )
    if not (self.zigzag and sequence_split.balanced(n)):
      return run(latents, positions, mask, kw)
    order = dict(batch=b, length=n)
    positions = jnp.broadcast_to(positions, (b, n))
    latents, positions, mask, kw = sequence_split.to_zigzag((latents, positions, mask, kw), **order)
    with sequence_split.zigzag_order():
      out = run(latents, positions, mask, kw)
    return sequence_split.from_zigzag(out, **order)

  # -- decoding (FIT-AR) --------------------------------------------------------------------------

  def init_decode_state(self, batch_size: int, max_len: int) -> dict:
    if not self.causal:
      raise ValueError(f"decoding needs FIT-AR (task lm / image_ar); task {self.task!r} builds an encoder.")
    if max_len > self.max_groups * self.group_size:
      raise ValueError(
        f"max_len {max_len} exceeds the latent table ({self.max_groups} groups of {self.group_size} tokens)."
      )
    groups = -(-max_len // self.group_size)
    width = self.overlap + self.group_size
    zeros = jnp.zeros((batch_size, self.m, self.latents.shape[-1]), self.dtype)
    state = {
      "index": jnp.zeros((), jnp.int32),
      "prefix": jnp.zeros((batch_size, self.overlap), jnp.int32),
      "local": [],
      "group_x": [],
      "prev_kv": [],
      "global": [],
    }
    for blk in self.blocks:
      state["local"].append([layer.attn.init_cache(batch_size, width, self.dtype) for layer in blk.local])
      if blk.l2x is not None:
        state["group_x"].append(jnp.zeros((batch_size, width, self.embed.embedding.shape[-1]), self.dtype))
        state["global"].append(
          [layer.attn.init_cache(batch_size, groups * self.m, self.dtype) for layer in blk.global_layers]
        )
      if blk.x2l is not None:
        state["prev_kv"].append(blk.x2l.kv(zeros))  # group 0 reads zero latents
    return state

  def _data_step(self, x: Array, state: dict, positions: Array) -> tuple[Array, dict]:
    """Data tokens x [B,S,D] at in-group `positions` [S] through all blocks, extending the local
    caches and the per-block group features."""
    slot = positions[0]
    local, group_x = [], []
    for i, blk in enumerate(self.blocks):
      caches = []
      for layer, cache in zip(blk.local, state["local"][i]):
        x, cache = layer.decode_block(x, cache, positions, slot)
        caches.append(cache)
      local.append(caches)
      if blk.l2x is not None:
        group_x.append(jax.lax.dynamic_update_slice_in_dim(state["group_x"][len(group_x)], x, slot, 1))
      if blk.x2l is not None:
        x = blk.x2l(x, kv=state["prev_kv"][len(group_x) - 1])
    return x, {**state, "local": local, "group_x": group_x}

  def _finish_group(self, state: dict, group: Array) -> dict:
    """Latents of the completed `group`: l2x over its data, global layers over the group cache;
    then the next group's prefix tokens (overlap) go through the data path."""
    b = state["prefix"].shape[0]
    lat = jax.lax.dynamic_slice_in_dim(self.latents[...], group * self.m, self.m).astype(self.dtype)
    lat = jnp.broadcast_to(lat, (b,) + lat.shape)
    width = self.overlap + self.group_size
    kv_valid = jnp.broadcast_to((jnp.arange(width) >= self.overlap) | (group > 0), (b, width))
    gpos = jnp.full((self.m,), group, jnp.int32)
    prev_kv, global_caches, j = [], [], 0
    for blk in self.blocks:
      if blk.l2x is None:
        continue
      lat = blk.l2x(lat, state["group_x"][j], k_valid=kv_valid)
      caches = []
      for layer, cache in zip(blk.global_layers, state["global"][j]):
        lat, cache = layer.decode_block(lat, cache, gpos, group * self.m)
        caches.append(cache)
      global_caches.append(caches)
      if blk.x2l is not None:
        prev_kv.append(blk.x2l.kv(lat))
      j += 1
    state = {
      **state,
      "prev_kv": prev_kv,
      "global": global_caches,
      "local": [[{**c, "pos": jnp.full_like(c["pos"], -1)} for c in caches] for caches in state["local"]],
    }
    if self.overlap:
      positions = jnp.arange(self.overlap)
      x = self.embed(state["prefix"]) + self.data_positions[: self.overlap].astype(self.dtype)
      _, state = self._data_step(x, state, positions)
    return state

  def decode_step(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens int32[B,1] at position state['index'] -> logits float32[B,1,V], next state."""
    index = state["index"]
    offset = index % self.group_size
    position = (self.overlap + offset)[None]
    x = self.embed(tokens) + jax.lax.dynamic_slice_in_dim(self.data_positions[...], position[0], 1).astype(self.dtype)
    x, state = self._data_step(x, state, position)
    logits = self.head(self.final_norm(x))
    if self.overlap:
      state["prefix"] = jnp.concatenate([state["prefix"][:, 1:], tokens.astype(jnp.int32)], axis=1)
    state = jax.lax.cond(
      offset == self.group_size - 1, lambda s: self._finish_group(s, index // self.group_size), lambda s: s, state
    )
    return logits, {**state, "index": index + 1}


# -- family record --------------------------------------------------------------------------------


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices (kernels/context_parallel.py): whole groups on each chip, their local
  layers on it; the global layers over every group's latents as ring attention (the group-causal ones
  masked by the group index their latents carry)."""
  m, local = config.model, (config.train.update_len or config.train.seq_len) // n
  if m.grouping != "1d":
    raise ConfigError(
      f"model.grouping {m.grouping!r} gathers each group from image rows that mesh.sequence={n} chips hold apart; "
      "a sequence splits with grouping '1d'."
    )
  if local % m.group_size:
    raise ConfigError(
      f"model.group_size {m.group_size} does not divide the {local} steps each of mesh.sequence={n} chips holds."
    )


FAMILY = Family(
  name="fit",
  model=Model,
  tasks=("lm", "image_ar", "classify", "retrieval"),
  capabilities=Capabilities(decode=True),
  validate_config=validate_config,
  context_parallel=context_parallel,
  upgrades={"output_bias": False},  # FIT-AR's logits had no bias before output_bias
  smoke=Smoke(
    config="configs/imagenet64/fit_ar.py:tiny,overlap",
    data="imagenet64",
    causal="configs/imagenet64/fit_ar.py:tiny,overlap",
    light=("model.layers=L(1)G(1)",),
    fuzz={
      "model.group_size": ["8", "16", "5", "0"],
      "model.latents_per_group": ["1", "4", "0"],
      "model.layers": ["L(1)G(1)L(1)", "L(2)", "G(1)", "L(1)X(2)", "L("],
      "model.overlap": ["0", "2", "-1", "16"],
      "model.latent_heads": ["1", "2", "3"],
      "model.d_latent": ["16", "32", "30"],
    },
  ),
  paper_rows=(PaperRow("configs/imagenet64/fit_ar.py", 153e6, "FIT Table 4, FIT-AR (ImageNet64)"),),
)
