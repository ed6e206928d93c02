"""Transformer baselines: Transformer, Transformer+ (RoPE) and Transformer++ (RoPE + GLU).

One pre-norm stack serves every task: a causal decoder for `lm` / `image_ar` (with a KV-cache
`init_decode_state` / `decode_step` and a one-pass prompt `prefill`), a bidirectional encoder for
`mlm`, `classify` (CLS or mean pooling) and two-tower `retrieval`. The variants follow Table 8 of
the FLASH paper:
  transformer   : learned absolute positions, GELU MLP, LayerNorm
  transformer+  : scaled sinusoid + RoPE, GELU MLP
  transformer++ : scaled sinusoid + RoPE, GELU-gated GLU
Options: multi-head / multi-query (num_kv_heads), sliding-window attention (window).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core import task_kinds
from lra_core.errors import ConfigError
from lra_core.kernels import context_parallel as sequence_split
from lra_core.kernels.packed_documents import check_segments, segment_positions
from lra_core.kernels.softmax.reference import cap
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.models.layers import stack
from lra_core.models.layers.attention import Attention, config_attention, head_width
from lra_core.models.layers.core import ACTIVATIONS, EMBEDDINGS, MLP, NORMS, Embed, make_norm, param
from lra_core.models.layers.heads import POOLING, TaskHead, fold_towers
from lra_core.models.layers.positions import ROPE_SCALING_DEFAULTS, AbsolutePositions, check_rope_scaling, rope_dims
from lra_core.protocol import Capabilities, Family, PaperRow, RunInfo, Smoke
from lra_core.sharding import constrain

Array = jax.Array

VARIANTS = {
  "transformer": dict(position="learned", rope=False, mlp="mlp"),
  "transformer+": dict(position="scaled_sinusoid", rope=True, mlp="mlp"),
  "transformer++": dict(position="scaled_sinusoid", rope=True, mlp="glu"),
}


def model_config(variant: str = "transformer", **overrides) -> ml_collections.ConfigDict:
  """The `config.model` section; `variant` picks position / MLP settings from VARIANTS."""
  if variant not in VARIANTS:
    raise ConfigError(f"transformer variant {variant!r} is not one of {sorted(VARIANTS)}.")
  c = ml_collections.ConfigDict(
    dict(
      name="transformer",
      variant=variant,
      vocab_size=256,
      num_classes=0,  # classification tasks
      d_model=256,
      num_layers=4,
      num_heads=4,
      num_kv_heads=0,  # 0 -> num_heads; 1 -> multi-query attention
      head_dim=0,  # 0 -> d_model // num_heads
      d_ff=1024,
      max_len=0,  # longest position; 0 -> train.seq_len
      position="learned",  # learned | sinusoid | scaled_sinusoid | none
      rope=False,
      rope_max_wavelength=1e4,
      rope_fraction=1.0,
      rope_scaling=dict(ROPE_SCALING_DEFAULTS),  # positions past the trained length (layers/positions.py)
      mlp="mlp",  # mlp | glu | none (blocks that mix and feed forward in one, e.g. GAU)
      activation="gelu",
      norm="layer",  # layer | rms | scale
      norm_eps=0.0,  # the norms' epsilon; 0 -> the kind's own (1e-6 layer and rms, 1e-5 scale)
      window=0,  # sliding-window attention; 0 -> full
      # a causal sequence split over chips (mesh.sequence): "auto" holds it in the zig-zag order, which
      # gives every chip of the ring equal work, where exact (no window, no dropout); "plain" never
      ring_order="auto",
      dropout=0.0,  # residual and embedding dropout
      attention_dropout=0.0,
      pooling="mean",  # classify / retrieval: cls | mean | max
      classifier_hidden=0,  # 0 -> d_model
      tie_embeddings=False,
      tied_scale=True,  # tied logits x E^T / d_model; False: x E^T (Gemma, whose lookups carry sqrt(d_model))
      embedding="scaled",  # what the table stores: "scaled" E / sqrt(d_model) (T5's) | "plain" E
      use_bias=False,
      parallel_residual=False,  # x + Mix(norm x) + MLP(norm x) (GPT-NeoX / Pythia) instead of in sequence
      post_norms=False,  # each branch's output normed before it joins the residual, too (Gemma 2)
      attn_soft_cap=0.0,  # attention scores bounded smoothly by +-this (kernels/softmax/reference.py `cap`); 0 none
      logit_soft_cap=0.0,  # the output logits likewise (Gemma 2: 50 and 30)
      score_scale_dim=0,  # scores scaled by score_scale_dim^-1/2; 0 -> the head width (Gemma's query_pre_attn_scalar)
      global_every=0,  # with a window: every global_every-th layer reads every key (Gemma 2: 2); 0 -> all windowed
      embed_normaliser=False,  # lookups times sqrt(d_model), the tied output reading the table as is (Gemma)
      dtype="float32",  # compute dtype; parameters stay float32
    )
  )
  c.update(MODEL_DEFAULTS)  # the layer-stacking switches every model section has
  c.update(VARIANTS[variant])
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m = config.model
  if m.variant not in VARIANTS:
    raise ConfigError(f"model.variant {m.variant!r} is not one of {sorted(VARIANTS)}.")
  for key in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}.")
  if m.embedding not in EMBEDDINGS:
    raise ConfigError(f"model.embedding {m.embedding!r} is not one of {list(EMBEDDINGS)}.")
  if not m.head_dim and m.d_model % m.num_heads:
    raise ConfigError(
      f"model.d_model {m.d_model} is not a multiple of model.num_heads {m.num_heads} (or set model.head_dim)."
    )
  if m.num_kv_heads and m.num_heads % m.num_kv_heads:
    raise ConfigError(f"model.num_heads {m.num_heads} is not a multiple of model.num_kv_heads {m.num_kv_heads}.")
  if m.rope and head_width(m) % 2:
    raise ConfigError("RoPE needs an even head dimension.")
  if "rope_scaling" in m:  # a family's own section may have none (config_attention rotates plainly then)
    scaled = m.rope_scaling.type
    # Other families' mixers rotate some keys with plain RoPE of their own (combiner's row summaries, GAU).
    if scaled != "none" and m.name != "transformer":
      raise ConfigError(f"model.rope_scaling.type {scaled!r} is for the transformer family, not model {m.name!r}.")
    check_rope_scaling(m.rope_scaling, rope=m.rope, dim=rope_dims(head_width(m), m.rope_fraction)[0])
  choices = {
    "position": AbsolutePositions.KINDS,
    "mlp": ("mlp", "glu", "none"),
    "norm": tuple(NORMS),
    "activation": tuple(ACTIVATIONS),
    "pooling": POOLING,
    "ring_order": ("auto", "plain"),
  }
  for key, allowed in choices.items():
    if m[key] not in allowed:
      raise ConfigError(f"model.{key} {m[key]!r} is not one of {list(allowed)}.")
  if m.max_len and m.max_len < config.train.seq_len:
    raise ConfigError(f"model.max_len {m.max_len} is shorter than train.seq_len {config.train.seq_len}.")
  if task_kinds.kind(config.task).classifies and m.num_classes < 2:
    raise ConfigError(f"model.num_classes must be >= 2 for task {config.task!r}, got {m.num_classes}.")
  if m.window < 0:
    raise ConfigError(f"model.window must be >= 0, got {m.window}.")
  for key in ("attn_soft_cap", "logit_soft_cap", "score_scale_dim", "global_every"):
    if m[key] < 0:
      raise ConfigError(f"model.{key} must be >= 0, got {m[key]}.")
  if m.global_every and not m.window:
    raise ConfigError(f"model.global_every {m.global_every} alternates windowed and global layers: set model.window.")
  if m.global_every and m.scan_layers:
    raise ConfigError(
      "model.global_every gives layers different windows, which one scanned layer cannot hold: set "
      "model.scan_layers=False."
    )


def layer_section(m, i: int):
  """The section layer i is built from: the model's, with no window on a global layer (global_every)."""
  every = m.global_every
  if not (every and m.window and (i + 1) % every == 0):
    return m
  m = m.copy_and_resolve_references()
  m.window = 0
  return m


def softmax_attention(m, *, causal: bool, dtype, rngs: nnx.Rngs, mask_by_positions: bool = False) -> Attention:
  return Attention(
    **config_attention(m),
    num_kv_heads=m.num_kv_heads,
    causal=causal,
    window=m.window,
    dropout=m.attention_dropout,
    scale=m.score_scale_dim**-0.5 if m.score_scale_dim else None,
    soft_cap=m.attn_soft_cap,
    impl=m.attention_impl,
    mask_by_positions=mask_by_positions,
    dtype=dtype,
    rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-norm residual block: x + Mix(norm(x)), then x + MLP(norm(x)) (no MLP with mlp "none");
  with `parallel_residual` both read the block input: x + Mix(norm1(x)) + MLP(norm2(x)) (GPT-NeoX);
  with `post_norms` each branch is normed again before it joins: x + norm(Mix(norm(x))) (Gemma 2).

  The token mixer is softmax attention here; other families pass their own (any module with
  `__call__(x, *, positions, mask, rngs)`, `init_cache(batch, max_len, dtype)` and
  `decode(x, cache, position)`). With document masking the mixer also gets `segments` int[B,T]
  (kernels/packed_documents.py) and `positions` [B,T] counted from each document's start.
  """

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs, mixer=softmax_attention):
    eps = m.norm_eps
    post = lambda: make_norm(m.norm, m.d_model, eps=eps, rngs=rngs) if m.post_norms else None
    self.attn_norm = make_norm(m.norm, m.d_model, eps=eps, rngs=rngs)
    self.attn = mixer(m, causal=causal, dtype=dtype, rngs=rngs)
    self.attn_post_norm = post()
    if m.mlp == "none":
      self.mlp_norm = self.mlp = self.mlp_post_norm = None
    else:
      self.mlp_norm = make_norm(m.norm, m.d_model, eps=eps, rngs=rngs)
      self.mlp = MLP(
        m.d_model, m.d_ff, activation=m.activation, glu=m.mlp == "glu", use_bias=m.use_bias, dtype=dtype, rngs=rngs
      )
      self.mlp_post_norm = post()
    self.dropout = nnx.Dropout(m.dropout)
    self.parallel = bool(m.parallel_residual)

  def _add_mlp(self, x: Array, h: Array, rngs: nnx.Rngs | None = None) -> Array:
    """x + h (the mixer's output h, post-normed with post_norms), plus the MLP of x (parallel residual)
    or of x + h (sequential)."""
    y = x + self.dropout(_normed(self.attn_post_norm, h), rngs=rngs)
    if self.mlp is None:
      return y
    m = _normed(self.mlp_post_norm, self.mlp(self.mlp_norm(x if self.parallel else y), rngs=rngs))
    return y + self.dropout(m, rngs=rngs)

  def __call__(
    self, x: Array, *, positions: Array, mask: Array | None, rngs: nnx.Rngs | None, segments: Array | None = None
  ) -> Array:
    seg = {} if segments is None else {"segments": segments}
    h = self.attn(self.attn_norm(x), positions=positions, mask=mask, rngs=rngs, **seg)
    return constrain(self._add_mlp(x, h, rngs), ("batch", "length", "embed"))

  def decode(self, x: Array, cache: dict, position: Array, **kwargs) -> tuple[Array, dict]:
    """One token; kwargs go to the mixer's decode (e.g. `k_valid` of softmax attention)."""
    h, cache = self.attn.decode(self.attn_norm(x), cache, position, **kwargs)
    return self._add_mlp(x, h), cache

  def decode_block(self, x: Array, cache: dict, positions: Array, slot: Array, **kwargs) -> tuple[Array, dict]:
    """Several tokens at once into cache slots slot.. (softmax attention; see Attention.decode_block)."""
    h, cache = self.attn.decode_block(self.attn_norm(x), cache, positions, slot, **kwargs)
    return self._add_mlp(x, h), cache


def _normed(norm: nnx.Module | None, h: Array) -> Array:
  return h if norm is None else norm(h)


class Model(nnx.Module):
  """inputs int32[B,T] ([B,2,T] for retrieval) -> logits [B,T,V] (token tasks) or [B,C].

  Subclasses swap the token mixer through the `mixer` class attribute (see Block).
  """

  mixer = staticmethod(softmax_attention)

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    self.task, self.towers = run.task, run.kind.towers
    self.causal = run.kind.causal
    self.dtype = jnp.dtype(m.dtype)
    self.max_len = m.max_len or run.seq_len
    if not m.max_len:  # the blocks' RoPE scaling reads the length the model runs at (config_attention)
      m = ml_collections.ConfigDict(m.to_dict())
      m.max_len = self.max_len
    multiplier = m.d_model**0.5 if m.embed_normaliser else 1.0
    self.embed = Embed(
      m.vocab_size, m.d_model, dtype=self.dtype, rngs=rngs, parameterisation=m.embedding, multiplier=multiplier
    )
    self.logit_soft_cap = m.logit_soft_cap
    use_cls = run.kind.classifies and m.pooling == "cls"
    # The CLS vector sits at position 0 and shifts the tokens by one.
    self.cls = param(rngs, jax.nn.initializers.normal(1.0), (m.d_model,), ("embed",)) if use_cls else None
    self.positions = AbsolutePositions(m.position, m.d_model, self.max_len + int(use_cls), dtype=self.dtype, rngs=rngs)
    self.embed_dropout = nnx.Dropout(m.dropout)
    self.remat = m.remat
    # The zig-zag order moves tokens between chips: exact for softmax attention masked by true steps, not
    # for a mixer that folds or windows by the row order, nor for dropout (its masks follow the layout).
    self.zigzag = (
      m.ring_order == "auto" and self.causal and not m.window and not m.dropout and self.mixer is softmax_attention
    )
    self.blocks = stack.make_layers(
      lambda i: Block(layer_section(m, i), causal=self.causal, dtype=self.dtype, rngs=rngs, mixer=self.mixer),
      m.num_layers,
      scan=m.scan_layers,
      indexed=True,
    )
    self.final_norm = make_norm(m.norm, m.d_model, eps=m.norm_eps, rngs=rngs)
    self.head = TaskHead(
      run.task,
      m.d_model,
      vocab_size=m.vocab_size,
      num_classes=m.num_classes,
      pooling=m.pooling,
      hidden=m.classifier_hidden,
      embed=self.embed if m.tie_embeddings else None,
      tied_scale=m.tied_scale,
      dtype=self.dtype,
      rngs=rngs,
    )

  def _embed(self, tokens: Array, positions: Array) -> Array:
    x = self.embed(tokens)
    pos = self.positions(positions)
    return x if pos is None else x + pos

  def __call__(
    self, inputs: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> Array:
    if self.towers > 1:
      inputs, mask = fold_towers(inputs, mask)
    x, mask = self.encode(inputs, mask=mask, segment_ids=segment_ids, rngs=rngs)
    return self._head(x, mask)

  def _head(self, x: Array, mask: Array | None = None) -> Array:
    """The task head's output, soft-capped with logit_soft_cap (Gemma 2's final logits)."""
    return cap(self.head(x, mask), self.logit_soft_cap)

  def encode(
    self, inputs: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> tuple[Array, Array | None]:
    """Final features [B,T(+1 with CLS),D] of inputs [B,T], and the matching mask. segment_ids
    int[B,T]: documents of a packed row, each attended and positioned on its own."""
    b, t = inputs.shape
    if t > self.max_len:
      raise ValueError(f"input length {t} exceeds model max_len {self.max_len}.")
    offset = int(self.cls is not None)
    if segment_ids is not None:
      check_segments(segment_ids, inputs.shape)
      if offset:
        raise ValueError("segment_ids (packed documents) do not apply to CLS pooling over one sequence.")
      positions = segment_positions(segment_ids)
    else:
      positions = jnp.arange(t + offset)
    x = self._embed(inputs, positions[..., offset:])
    if self.cls is not None:
      cls = self.cls[...].astype(x.dtype)[None, None]
      pos0 = self.positions(positions[:1])
      cls = cls if pos0 is None else cls + pos0
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, x.shape[-1])), x], axis=1)
      mask = None if mask is None else jnp.concatenate([jnp.ones((b, 1), bool), mask], axis=1)
    x = constrain(self.embed_dropout(x, rngs=rngs), ("batch", "length", "embed"))
    order = dict(batch=b, length=x.shape[1])
    zigzag = self.zigzag and sequence_split.balanced(x.shape[1])
    if zigzag:  # in once, out once: the blocks run in the balanced order (kernels/context_parallel.py)
      positions = jnp.broadcast_to(positions, x.shape[:2])
      x, positions, mask, segment_ids = sequence_split.to_zigzag((x, positions, mask, segment_ids), **order)
    with sequence_split.zigzag_order() if zigzag else contextlib.nullcontext():
      x = stack.apply(
        self.blocks,
        x,
        lambda block, x, r: block(x, positions=positions, mask=mask, rngs=r, segments=segment_ids),
        remat=self.remat,
        rngs=rngs,
      )
    if zigzag:
      x, mask = sequence_split.from_zigzag((x, mask), **order)
    return self.final_norm(x), mask

  # -- decoding (causal models) --------------------------------------------------------------

  def decode_limit(self) -> int | None:
    """The most tokens (prompt and new ones) decoding can hold: the learned position table's length;
    None for any number."""
    return self.max_len if self.positions.kind == "learned" else None

  def init_decode_state(self, batch_size: int, max_len: int) -> dict:
    if not self.causal:
      raise ValueError(f"decoding needs a causal model; task {self.task!r} builds an encoder.")
    if self.positions.kind == "learned" and max_len > self.max_len:
      raise ValueError(f"max_len {max_len} exceeds the learned position table ({self.max_len}).")
    return {
      "index": jnp.zeros((), jnp.int32),
      "layers": [blk.attn.init_cache(batch_size, max_len, self.dtype) for blk in self.blocks],
    }

  def decode_step(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens int32[B,1] at position state['index'] -> logits float32[B,1,V], next state."""
    position = state["index"]
    x = self._embed(tokens, position[None])
    caches = []
    for block, cache in zip(self.blocks, state["layers"]):
      x, cache = block.decode(x, cache, position)
      caches.append(cache)
    return self._head(self.final_norm(x)), {"index": position + 1, "layers": caches}

  @property
  def can_prefill(self) -> bool:
    """Whether every block's mixer is plain softmax attention: subclasses that swap it, including
    Attention subclasses with their own decode (flash.ChunkedAttention), have no parallel prefill."""
    return self.causal and all(type(block.attn) is Attention for block in self.blocks)

  def prefill(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens int32[B,P] at positions state['index'].. in one pass per chunk -> logits float32[B,1,V]
    of the last one and the state advanced by P: what P decode_steps give, up to float rounding.

    As for decode_step, index + P must not exceed the max_len given to init_decode_state. Windowed
    layers whose ring buffer wraps go chunk by chunk, `window` tokens at a time (see _prefill_block).
    Only for models whose `can_prefill` is true; decoding.generate checks it and otherwise
    feeds the prompt through decode_step.
    """
    if not self.can_prefill:
      raise ValueError(f"{type(self).__name__}.prefill needs plain softmax attention in every block; use decode_step.")
    length = tokens.shape[1]
    chunk = min(
      [length]
      + [block.attn.window for block, cache in zip(self.blocks, state["layers"]) if _ring_wraps(block.attn, cache)]
    )
    last = (length - 1) // chunk * chunk  # start of the final chunk; full chunks before it
    if last:
      chunks = tokens[:, :last].reshape(tokens.shape[0], last // chunk, chunk).swapaxes(0, 1)
      state, _ = jax.lax.scan(lambda s, t: (self._prefill_chunk(t, s)[1], None), state, chunks)
    x, state = self._prefill_chunk(tokens[:, last:], state)
    return self._head(self.final_norm(x[:, -1:])), state

  def _prefill_chunk(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens [B,C] -> final-block features [B,C,D] and the state advanced by C."""
    index = state["index"]
    positions = index + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = self._embed(tokens, positions)
    caches = []
    for block, cache in zip(self.blocks, state["layers"]):
      x, cache = _prefill_block(block, x, cache, positions)
      caches.append(cache)
    return x, {"index": index + tokens.shape[1], "layers": caches}


def _ring_wraps(attn: Attention, cache: dict) -> bool:
  """Whether the cache is a sliding window's ring buffer that decoding overwrites (False when
  max_len < window: then it holds every position, as for full attention)."""
  return 0 < attn.window <= cache["pos"].shape[0]


def _prefill_block(block: Block, x: Array, cache: dict, positions: Array) -> tuple[Array, dict]:
  """block.decode_block of C consecutive positions, leaving the cache C decode steps would leave.

  A cache that does not wrap has free slots index..index+C-1, so the keys go straight in. A wrapping
  ring buffer would evict keys the chunk's first queries still read (position index reads back to
  index - window + 1, whose slot the token after it overwrites), so the chunk attends over the
  buffer extended by C slots, and each slot then keeps its newest position. C <= window bounds the
  extension, as the forward pass bounds its band.
  """
  size, count = cache["pos"].shape[0], positions.shape[0]
  if not _ring_wraps(block.attn, cache):
    return block.decode_block(x, cache, positions, positions[0])
  widths = [(0, 0), (0, count), (0, 0), (0, 0)]  # [B,S,K,D]
  extended = {
    "key": jnp.pad(cache["key"], widths),
    "value": jnp.pad(cache["value"], widths),
    "pos": jnp.concatenate([cache["pos"], jnp.full((count,), -1, jnp.int32)]),
  }
  x, extended = block.decode_block(x, extended, positions, size)
  # Slot s ends with the newest chunk position p = s (mod size), if p is in the chunk (p >= index);
  # otherwise it keeps what it held.
  index, final = positions[0], positions[-1]
  slots = jnp.arange(size, dtype=jnp.int32)
  newest = final - (final - slots) % size
  source = jnp.where(newest >= index, size + newest - index, slots)
  return x, {
    "key": jnp.take(extended["key"], source, axis=1),
    "value": jnp.take(extended["value"], source, axis=1),
    "pos": extended["pos"][source],
  }


# -- family records -------------------------------------------------------------------------------

TASKS = ("lm", "image_ar", "mlm", "classify", "retrieval")
# Keys added to this section after runs were saved, with the value such a run built with: the
# table's stored form, the norms' own epsilon and residuals in sequence, none of Gemma 2's settings and no
# RoPE scaling
# (lra_core.checkpoints.saved_config.upgrade_config).
UPGRADES = {
  "embedding": "scaled",
  "norm_eps": 0.0,
  "parallel_residual": False,
  "ring_order": "auto",
  "post_norms": False,
  "attn_soft_cap": 0.0,
  "logit_soft_cap": 0.0,
  "score_scale_dim": 0,
  "global_every": 0,
  "embed_normaliser": False,
  "tied_scale": True,
  "rope_scaling": ROPE_SCALING_DEFAULTS,  # plain RoPE
}


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices (kernels/context_parallel.py): softmax attention as ring attention
  (kernels/softmax/ring.py), a sliding window's blocks whole on each chip."""
  m, window_len = config.model, config.train.update_len or config.train.seq_len
  local = window_len // n
  if m.attention_dropout:
    raise ConfigError(
      f"model.attention_dropout {m.attention_dropout} acts on attention probabilities, which ring attention never "
      f"forms whole: set it to 0 to split a sequence over mesh.sequence={n} chips."
    )
  if m.window and m.window < window_len and local % m.window:
    raise ConfigError(
      f"model.window {m.window} does not divide the {local} steps each of mesh.sequence={n} chips holds."
    )
  if task_kinds.kind(config.task).classifies and m.pooling == "cls":
    raise ConfigError(
      f"model.pooling 'cls' puts a step before the sequence, and its {window_len} + 1 steps do not split over "
      f"mesh.sequence={n} chips: use 'mean' or 'max'."
    )


def mixer_family(name: str, model, *, validate_config, smoke: Smoke, upgrades=(), **fields) -> Family:
  """The record of a family that is this stack with another token mixer (Latte, FLASH): the same
  tasks and section keys (UPGRADES, plus the family's own `upgrades`), and decoding step by step (a
  mixer other than softmax attention has no one-pass prefill)."""
  return Family(
    name=name,
    model=model,
    tasks=TASKS,
    capabilities=Capabilities(decode=True),
    validate_config=validate_config,
    smoke=smoke,
    upgrades=UPGRADES | dict(upgrades),
    **fields,
  )


BLOCK_PAPER = "configs/c4/block_transformer.py"
FAMILY = Family(
  name="transformer",
  model=Model,
  tasks=TASKS,
  capabilities=Capabilities(decode=True, prefill=True),
  validate_config=validate_config,
  context_parallel=context_parallel,
  upgrades=UPGRADES,
  smoke=Smoke(
    config="configs/lra/listops/transformer.py:tiny",
    data="listops",
    causal="configs/enwik8/transformer.py:tiny",
    overrides=("model.dropout=0.1",),
    light=("model.num_layers=1",),
    fuzz={
      "model.num_heads": ["1", "2", "3", "4", "0"],
      "model.num_kv_heads": ["0", "1", "2", "3"],
      "model.position": ["sinusoid", "learned", "rope", "none", "bogus"],
      "model.window": ["0", "4", "-1"],
      "model.vocab_size": ["8", "16", "64"],
      "model.num_classes": ["10", "4"],
    },
  ),
  paper_rows=(
    *(
      PaperRow(spec, count, f"FLASH {where}", tolerance=0.03)
      for spec, count, where in (
        ("configs/c4/transformer.py:mlm", 110e6, "Table 8, Transformer (C4 MLM)"),
        ("configs/c4/transformer.py:mlm,plus", 110e6, "Table 8, Transformer+ (C4 MLM)"),
        ("configs/c4/transformer.py:mlm,plusplus", 110e6, "Table 8, Transformer++ (C4 MLM)"),
        ("configs/pg19/transformer.py:flash", 486e6, "Table 10, Transformer+ (PG-19)"),
        ("configs/pg19/transformer.py:flash,plusplus", 486e6, "Table 10, Transformer++ (PG-19)"),
      )
    ),
    *(
      PaperRow(
        f"{BLOCK_PAPER}:{size},vanilla",
        count,
        f"Block Transformer Table 2, vanilla {size}, non-embedding",
        tolerance=0.02,
        counts="non_embedding",
      )
      for size, count in (("5m", 4.7e6), ("19m", 18.9e6), ("85m", 85.1e6), ("302m", 302e6))
    ),
  ),
)
