"""Block Transformer (Ho et al. 2024): global-to-local language modelling for fast inference.

Three parts (Section 2):
  embedder       L_B tokens -> one input block embedding [D]: `lookup` (L_B token embeddings of
                 width D / L_B, concatenated; the paper's choice), `encoder` (a small bidirectional
                 transformer over the block, outputs concatenated and projected) or `cls` (the same
                 encoder read through CLS tokens, padding masked) - Appendix F.1.
  block_decoder  a causal transformer over block embeddings; its output for block i is the context
                 embedding that conditions the tokens of block i + 1.
  token_decoder  a causal transformer inside one block that sees the context embedding only:
                 `prefix` (a linear map to R prefix vectors, input [P_1..P_R, t_1..t_{L_B-1}]),
                 `summation` (MEGABYTE: L_B projections added to the inputs) or `cross`
                 (cross-attention to L_B projected states) - Appendix F.2.
Both decoders are Pythia / GPT-NeoX layers: parallel residual, LayerNorm, GELU MLP of 4D, biases,
rotary embedding on 25% of each head. Non-embedding size = 2 nL (12 D^2 + 13 D) (Table 3).

The token interface of docs/api.md holds: `model(tokens)[:, t]` predicts token t + 1 from tokens <= t.
If t ends a block, that is the first output of the next block's token decoder (context of the
block holding t); otherwise the token decoder of t's own block. Block 0's tokens read a learned
start context, so every position is predicted (the authors' code trains on blocks >= 1 only).

Padding and packed documents (`segment_ids`) follow rules written next to the lines of `Model.__call__`
that apply them: whole pad blocks are absent, so left padding never changes a row; no document ever
reads another.

Decoding: `decode_step` takes one token at a time (docs/api.md, "Capabilities"); `generate` is the fast batched path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.kernels import context_parallel as sequence_split
from lra_core.kernels.packed_documents import check_segments, segment_positions
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.models.block_transformer.embedders import EncoderEmbedder, LookupEmbedder
from lra_core.models.block_transformer.generation import generate
from lra_core.models.block_transformer.stacks import Stack, stack_config, token_sizes
from lra_core.models.block_transformer.uptraining import uptrain_params
from lra_core.models.layers.core import Dense, Embed, param
from lra_core.models.layers.heads import TaskHead
from lra_core.protocol import Capabilities, Family, PaperRow, RunInfo, Smoke

Array = jax.Array

EMBEDDERS = ("lookup", "encoder", "cls")
TOKEN_DECODERS = ("prefix", "summation", "cross")
# Parameters that map tokens in or out (not in the paper's non-embedding sizes).
EMBEDDING_PARAMS = ("embedder", "token_embed", "head", "context_proj", "start_context", "block_start")


def model_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(
    dict(
      name="block_transformer",
      vocab_size=50304,  # Pythia's padded GPT-NeoX vocabulary (Appendix G.1)
      pad_id=0,
      block_len=4,  # L_B
      embedder="lookup",  # lookup | encoder | cls
      embed_width=0,  # lookup: token embedding width; 0 -> d_model / block_len
      encoder_width=256,  # encoder / cls embedders: RoBERTa-like, 3 layers of 256 (F.1)
      encoder_layers=3,
      encoder_heads=8,  # the authors' embedder: 8 heads of 32 at width 256
      num_cls=3,
      token_decoder="prefix",  # prefix | summation | cross
      prefix_len=2,  # R
      d_model=256,  # block decoder
      num_layers=3,
      num_heads=8,
      d_ff=0,  # 0 -> 4 d_model
      token_d_model=0,  # token decoder; 0 -> the block decoder's value
      token_num_layers=0,
      token_num_heads=0,
      token_d_ff=0,
      rope_fraction=0.25,
      rope_max_wavelength=1e4,
      parallel_residual=True,
      use_bias=True,
      norm="layer",
      norm_eps=1e-5,  # every LayerNorm's epsilon: Pythia's layer_norm_eps (the authors' configs)
      activation="gelu",
      tie_embeddings=False,  # token decoder output tied to its input embedding (Pythia: untied)
      mask_pads=True,  # pads are masked in the token decoder and the encoder embedder
      zero_pad_outputs=False,  # encoder embedder: zero pad outputs before the projection (authors': no)
      dropout=0.0,
      dtype="float32",
    )
  )
  c.update(MODEL_DEFAULTS)  # the layer-stacking switches every model section has
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m = config.model
  for key in ("vocab_size", "block_len", "d_model", "num_layers", "num_heads"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}.")
  if m.embedder not in EMBEDDERS:
    raise ConfigError(f"model.embedder {m.embedder!r} is not one of {list(EMBEDDERS)}.")
  if m.token_decoder not in TOKEN_DECODERS:
    raise ConfigError(f"model.token_decoder {m.token_decoder!r} is not one of {list(TOKEN_DECODERS)}.")
  if m.token_decoder == "prefix" and m.prefix_len < 1:
    raise ConfigError(f"model.prefix_len must be >= 1 for the prefix token decoder, got {m.prefix_len}.")
  if m.embedder == "lookup" and not m.embed_width and m.d_model % m.block_len:
    raise ConfigError(
      f"model.d_model {m.d_model} is not a multiple of model.block_len {m.block_len} "
      "(the lookup embedder concatenates block_len embeddings; or set model.embed_width)."
    )
  if not 0 <= m.pad_id < m.vocab_size:
    raise ConfigError(f"model.pad_id {m.pad_id} is outside the vocabulary [0, {m.vocab_size}).")
  dt, _, ht, _ = token_sizes(m)
  widths = [("", m.d_model, m.num_heads), ("token_", dt, ht)]
  if m.embedder != "lookup":
    widths.append(("encoder_", m.encoder_width, m.encoder_heads))
  for prefix, width, heads in widths:
    if width % heads or (width // heads) % 2:
      raise ConfigError(
        f"model.{prefix}d_model {width} must split into model.{prefix}num_heads {heads} heads of an even width."
      )
  if config.train.seq_len % m.block_len:
    raise ConfigError(f"train.seq_len {config.train.seq_len} is not a multiple of model.block_len {m.block_len}.")
  # Only the text corpora pad documents into blocks; other datasets' sections have no block_padding.
  if "block_padding" in config.data and config.data.block_padding not in (0, m.block_len):
    raise ConfigError(f"data.block_padding {config.data.block_padding} differs from model.block_len {m.block_len}.")


class Model(nnx.Module):
  """tokens int32[B,T] -> logits float32[B,T,V]; see the module docstring."""

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    self.dtype = jnp.dtype(m.dtype)
    self.block_len, self.pad_id, self.vocab_size = m.block_len, m.pad_id, m.vocab_size
    self.mask_pads = m.mask_pads
    self.kind = m.token_decoder
    d, (dt, nt, ht, fft) = m.d_model, token_sizes(m)
    kw = dict(dtype=self.dtype, rngs=rngs)
    stacks = dict(scan=m.scan_layers, remat=m.remat, **kw)
    if m.embedder == "lookup":
      self.embedder = LookupEmbedder(m.vocab_size, m.block_len, m.embed_width or d // m.block_len, d, **kw)
    else:
      self.embedder = EncoderEmbedder(m, **kw)
    self.block_decoder = Stack(stack_config(m, d, m.num_heads, m.d_ff or 4 * d), m.num_layers, **stacks)
    self.zigzag = not m.dropout  # the block decoder's order when split over chips (_decode_blocks)
    # Block 0 (and a block after an absent one) reads this in place of a context embedding.
    self.start_context = param(rngs, jax.nn.initializers.normal(1.0), (d,), ("embed",))
    # prefix: R vectors from the context; summation / cross: L_B states (Appendix F.2).
    self.lead = m.prefix_len if self.kind == "prefix" else 1
    projected = m.prefix_len if self.kind == "prefix" else m.block_len
    self.context_proj = Dense(d, (projected, dt), axes=("embed", None, None), use_bias=m.use_bias, **kw)
    self.block_start = (
      None if self.kind == "prefix" else param(rngs, jax.nn.initializers.normal(1.0), (dt,), ("embed",))
    )
    self.token_embed = Embed(m.vocab_size, dt, **kw)
    self.token_decoder = Stack(
      stack_config(m, dt, ht, fft), nt, memory_width=dt if self.kind == "cross" else 0, **stacks
    )
    self.head = TaskHead("lm", dt, vocab_size=m.vocab_size, embed=self.token_embed if m.tie_embeddings else None, **kw)

  # -- pieces shared by the forward pass and decoding ------------------------------------------

  def contexts(self, h: Array, valid: Array) -> Array:
    """Block decoder outputs [..., D] -> the context each next block reads (start if absent)."""
    start = self.start_context[...].astype(h.dtype)
    return jnp.where(valid[..., None], h, start)

  def _lead(self, context: Array) -> tuple[Array, Array | None]:
    """context [B',D] -> the token decoder's first `lead` inputs [B',lead,Dt] (R prefix vectors, or
    the block-start vector plus projection 0 for summation) and the cross-attention memory."""
    proj = self.context_proj(context)  # [B',R|L,Dt]
    if self.kind == "prefix":
      return proj, None
    start = jnp.broadcast_to(self.block_start[...].astype(proj.dtype), (proj.shape[0], 1, proj.shape[-1]))
    if self.kind == "summation":
      return start + proj[:, :1], None
    return start, proj

  def token_inputs(self, context: Array, tokens: Array, offset) -> Array:
    """Inputs for the block's tokens [B',K] at offsets offset.. in the block (K < L_B); token i
    sits at decoder position lead + offset + i, where summation adds projection offset + i + 1."""
    e = self.token_embed(tokens)
    if self.kind == "summation":
      proj = self.context_proj(context)
      e = e + jax.lax.dynamic_slice_in_dim(proj, offset + 1, tokens.shape[1], axis=1).astype(e.dtype)
    return e

  def _blocks(self, tokens: Array) -> Array:
    """int[B,T] -> blocks int[B,N,L], the last right-padded."""
    b, t = tokens.shape
    tokens = jnp.pad(tokens, ((0, 0), (0, -t % self.block_len)), constant_values=self.pad_id)
    return tokens.reshape(b, -1, self.block_len)

  def key_mask(self, tokens: Array) -> Array | None:
    """Which token-decoder keys may be read: the `lead` inputs and every token but pads [B',lead+K]
    (None without pad masking)."""
    if not self.mask_pads:
      return None
    return jnp.concatenate([jnp.ones((*tokens.shape[:-1], self.lead), bool), tokens != self.pad_id], axis=-1)

  # -- forward --------------------------------------------------------------------------------

  def __call__(
    self, tokens: Array, *, mask: Array | None = None, segment_ids: Array | None = None, rngs: nnx.Rngs | None = None
  ) -> Array:
    """tokens int[B,T] -> logits [B,T,V]; segment_ids int[B,T]: the documents of a packed row
    (kernels/packed_documents.py); mask is unused (padding is the pad token itself)."""
    del mask
    if tokens.ndim != 2:
      raise ValueError(f"block_transformer expects tokens int[B,T], got shape {tokens.shape}.")
    check_segments(segment_ids, tokens.shape)
    b, t = tokens.shape
    n, L = -(-t // self.block_len), self.block_len
    blocks = self._blocks(tokens)
    if segment_ids is None:
      seg = block_seg = None
      read, positions = blocks, None
    else:
      seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, n * L - t)), mode="edge").reshape(b, n, L)
      # A block belongs to the document of its last token, and its embedding reads that document only:
      # the other documents' tokens in it count as pads.
      block_seg = seg[:, :, -1]
      read = jnp.where(seg == block_seg[..., None], blocks, self.pad_id)
      # The block decoder attends within a document, block positions counted from 0 at each, so a document
      # that starts on a block boundary gets exactly the outputs it gets alone at the start of a row.
      positions = segment_positions(block_seg)
    # A block of nothing but pads is absent: no block reads it and the block after it reads the start
    # context, so rows of different lengths share a batch by left padding and a row's predictions do not
    # depend on how many whole pad blocks precede it. Pads inside a block are read by the lookup embedder
    # like any token (Appendix H: train with data.block_padding), so a prompt's block alignment matters.
    valid = (read != self.pad_id).any(-1)
    with sequence_split.whole_rows():  # each block embedded on the chip holding it
      embedded = self.embedder(read, rngs=rngs)
    h = self._decode_blocks(embedded, positions, valid, block_seg, rngs)
    after = self.contexts(h, valid)  # [B,N,D]: the context after each block
    start = jnp.broadcast_to(self.start_context[...].astype(h.dtype), (b, 1, h.shape[-1]))
    # Block i's token decoder reads the context after block i-1 (block 0: the start context) and the
    # block's first L-1 tokens; output j predicts token iL + j, i.e. it is the logit at position iL + j - 1.
    # One row per block keeps each on the chip holding the block when mesh.sequence splits the blocks.
    before = jnp.concatenate([start, after[:, :-1]], axis=1)
    if seg is None:
      rows = None
      last_rows = None
    else:
      none = jnp.full((b, 1), -1, jnp.int32)
      rows = (seg[:, :, : L - 1], jnp.concatenate([none, block_seg[:, :-1]], axis=1))
      last_rows = (jnp.full((b, 1, L - 1), -1, jnp.int32), block_seg[:, -1:])
    y = self._decode_rows(before, blocks[:, :, : L - 1], rows, rngs).reshape(b, n * L, -1)
    if t < n * L:  # the last block is padded: its own outputs hold the last logits
      return self.head(y[:, 1 : t + 1])
    # The last logit (position t - 1) reads only the context after the last block: the first output of
    # a block past the input, whose tokens (pads) no kept output reads.
    pads = jnp.full((b, 1, L - 1), self.pad_id, blocks.dtype)
    last = self._decode_rows(after[:, -1:], pads, last_rows, rngs)[:, :1, 0]
    return self.head(jnp.concatenate([y[:, 1:], last], axis=1))

  def _decode_blocks(
    self, x: Array, positions: Array | None, valid: Array, segments: Array | None, rngs: nnx.Rngs | None
  ) -> Array:
    """The block decoder over block embeddings x [B,N,D]. Split over chips (mesh.sequence) it runs in
    the zig-zag order, which gives every chip of its ring attention equal work (kernels/context_parallel.py),
    where that is exact: without dropout, whose masks follow the layout."""
    b, n = x.shape[:2]
    if not (self.zigzag and sequence_split.balanced(n)):
      return self.block_decoder(x, positions=positions, mask=valid, segments=segments, rngs=rngs)
    order = dict(batch=b, length=n)
    positions = jnp.broadcast_to(jnp.arange(n) if positions is None else positions, (b, n))
    x, positions, valid, segments = sequence_split.to_zigzag((x, positions, valid, segments), **order)
    with sequence_split.zigzag_order():
      h = self.block_decoder(x, positions=positions, mask=valid, segments=segments, rngs=rngs)
    return sequence_split.from_zigzag(h, **order)

  def _decode_rows(
    self, contexts: Array, inputs: Array, documents: tuple[Array, Array] | None, rngs: nnx.Rngs | None
  ) -> Array:
    """The token decoder over rows of blocks -> outputs [B,N',L,Dt] of each target block.

    contexts [B,N',D] (the context each block reads), inputs int[B,N',L-1] (its first L-1 tokens);
    documents: None, or (token documents int[B,N',L-1], the context's document int[B,N'], -1 for
    the start context) for packed rows (`_decode_documents`)."""
    b, n = inputs.shape[:2]
    contexts, inputs = contexts.reshape(b * n, -1), inputs.reshape(b * n, -1)
    if documents is None:
      lead, memory = self._lead(contexts)
      x = jnp.concatenate([lead, self.token_inputs(contexts, inputs, 0).astype(lead.dtype)], axis=1)
      # With model.mask_pads (the authors' default) the token decoder reads no pad key; the encoder
      # embedders mask pads as keys too (_block_embedders.py).
      with sequence_split.whole_rows():  # a block's tokens: on the chip holding the block, whatever mesh.sequence
        y = self.token_decoder(x, mask=self.key_mask(inputs), memory=memory, rngs=rngs)
      y = y[:, self.lead - 1 : self.lead - 1 + self.block_len]
    else:
      token_seg, prev = documents
      y = self._decode_documents(contexts, inputs, token_seg.reshape(b * n, -1), prev.reshape(-1), rngs)
    return y.reshape(b, n, self.block_len, -1)

  def _decode_documents(
    self, contexts: Array, inputs: Array, token_seg: Array, prev: Array, rngs: nnx.Rngs | None
  ) -> Array:
    """The token decoder over packed documents -> outputs [M,L,Dt] of each target block.

    contexts [M,D] (the context the block reads), inputs int[M,L-1], token_seg int[M,L-1] (the
    inputs' documents), prev int[M] (the context's document, -1 for the start context). A token reads
    its own document's earlier tokens in the block and its document's context; a document that starts
    at offset s inside a block gets the outputs it gets alone after s pads.
    """
    L, r = self.block_len, self.lead
    # Each target block's decoder reads [lead(previous context), lead(start context), t_1..t_{L-1}] at
    # positions [0..R-1, 0..R-1, R..]. The first lead carries the previous block's document and gives
    # output 0 (the prediction at that block's last token); the second serves a document starting here.
    # fresh: tokens of a document other than the context's, i.e. one that starts in this block
    fresh = token_seg != prev[:, None]  # [M,L-1]
    # starting: the first such document (-2: none), the one the start-context lead serves. Tokens of a
    # continuing document read the previous context, those of the starting one the start context.
    if L > 1:
      first = jnp.take_along_axis(token_seg, jnp.argmax(fresh, axis=1)[:, None], axis=1)[:, 0]
      starting = jnp.where(fresh.any(1), first, -2)
    else:
      starting = jnp.full_like(prev, -2)
    start_context = self.start_context[...].astype(contexts.dtype)[None]
    lead_prev, memory = self._lead(contexts)
    lead_start, start_memory = self._lead(start_context)
    e = self.token_embed(inputs)
    if self.kind == "summation":
      proj_prev, proj_start = self.context_proj(contexts)[:, 1:L], self.context_proj(start_context)[:, 1:L]
      e = e + jnp.where(fresh[..., None], proj_start, proj_prev).astype(e.dtype)
    m = inputs.shape[0]
    x = jnp.concatenate([lead_prev, jnp.broadcast_to(lead_start, lead_prev.shape), e.astype(lead_prev.dtype)], axis=1)
    segments = jnp.concatenate(
      [jnp.repeat(prev[:, None], r, 1), jnp.repeat(starting[:, None], r, 1), token_seg], axis=1
    )
    positions = jnp.concatenate([jnp.arange(r), jnp.arange(r), r + jnp.arange(L - 1)])
    key_mask = None
    # When two documents start inside one block the second reads no context embedding: its pads are
    # left unmasked so each of its tokens has something to read.
    if self.mask_pads:
      other = fresh & (token_seg != starting[:, None])
      key_mask = jnp.concatenate([jnp.ones((m, 2 * r), bool), (inputs != self.pad_id) | other], axis=1)
    cross = {}
    if memory is not None:
      cross = dict(
        fresh_memory=jnp.broadcast_to(start_memory, memory.shape),
        fresh=jnp.concatenate([jnp.zeros((m, r), bool), jnp.ones((m, r), bool), fresh], axis=1),
      )
    with sequence_split.whole_rows():
      y = self.token_decoder(
        x, positions=positions, mask=key_mask, segments=segments, memory=memory, rngs=rngs, **cross
      )
    return jnp.concatenate([y[:, r - 1 : r], y[:, 2 * r :]], axis=1)

  # -- one token at a time (docs/api.md, "Capabilities") --------------------------------------------------------

  def start_block(self, context: Array, batch_size: int) -> tuple[Array, dict]:
    """Runs the token decoder's lead inputs for a new block: (logits of the block's first token
    [B,1,V], token-decoder state)."""
    x, memory = self._lead(context)
    caches = self.token_decoder.init_cache(batch_size, self.lead + self.block_len - 1, self.dtype)
    y, caches = self.token_decoder.decode_block(x, caches, jnp.arange(self.lead), 0, memory=memory)
    return self.head(y[:, -1:]), {"caches": caches, "context": context, "memory": memory}

  def init_decode_state(self, batch_size: int, max_len: int) -> dict:
    num_blocks = max(1, -(-max_len // self.block_len))
    start = jnp.broadcast_to(self.start_context[...].astype(self.dtype), (batch_size, self.start_context.shape[0]))
    _, token_state = self.start_block(start, batch_size)
    return {
      "index": jnp.zeros((), jnp.int32),
      "block": jnp.full((batch_size, self.block_len), self.pad_id, jnp.int32),
      "block_caches": self.block_decoder.init_cache(batch_size, num_blocks, self.dtype),
      "block_valid": jnp.zeros((batch_size, num_blocks), bool),
      "token": token_state,
    }

  def decode_step(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens int32[B,1] at position state['index'] -> logits float32[B,1,V] for the next token."""
    t = state["index"]
    j = t % self.block_len
    block = jax.lax.dynamic_update_slice_in_dim(state["block"], tokens.astype(jnp.int32), j, 1)
    state = dict(state, block=block, index=t + 1)

    def inside(state):  # the token decoder reads token t at its position lead + j
      token_state = state["token"]
      x = self.token_inputs(token_state["context"], tokens, j)
      y, caches = self.token_decoder.decode_block(
        x,
        token_state["caches"],
        (self.lead + j)[None],
        self.lead + j,
        memory=token_state["memory"],
        k_valid=self.key_mask(state["block"][:, :-1]),
      )
      return self.head(y), dict(state, token=dict(token_state, caches=caches))

    def finish(state):  # block complete: one block-decoder step, then the next block's lead inputs
      return self.advance_block(state, t // self.block_len)

    return jax.lax.cond(j == self.block_len - 1, finish, inside, state)

  def advance_block(self, state: dict, k: Array) -> tuple[Array, dict]:
    """The block in state['block'] is block k: embed it, run one block-decoder step, start the
    token decoder of block k + 1. -> (logits of block k + 1's first token [B,1,V], state)."""
    block = state["block"]
    valid = (block != self.pad_id).any(-1)
    block_valid = jax.lax.dynamic_update_slice_in_dim(state["block_valid"], valid[:, None], k, 1)
    e = self.embedder(block[:, None])
    h, caches = self.block_decoder.decode_block(e, state["block_caches"], k[None], k, k_valid=block_valid)
    logits, token_state = self.start_block(self.contexts(h[:, 0], valid), block.shape[0])
    return logits, dict(
      state, block_caches=caches, block_valid=block_valid, token=token_state, block=jnp.full_like(block, self.pad_id)
    )


# -- uptraining from a vanilla transformer (Section 3.7, Appendix N; _block_uptraining.py) -------


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices (kernels/context_parallel.py): whole blocks on each chip; the block decoder's
  attention over blocks as ring attention (kernels/softmax/ring.py); each block's token decoder on
  the chip holding the block."""
  local = (config.train.update_len or config.train.seq_len) // n
  if local % config.model.block_len:
    raise ConfigError(
      f"model.block_len {config.model.block_len} does not divide the {local} steps each of mesh.sequence={n} "
      "chips holds."
    )


def vanilla_config(config) -> ml_collections.ConfigDict:
  """The `config.model` of the vanilla Transformer this Block Transformer can be uptrained from:
  the same family (Pythia layers) and width, with num_layers + token_num_layers layers."""
  m = config.model
  c = stack_config(m, m.d_model, m.num_heads, m.d_ff or 4 * m.d_model)
  c.update(dict(vocab_size=m.vocab_size, num_layers=m.num_layers + token_sizes(m)[1], tie_embeddings=m.tie_embeddings))
  return c


# -- family record --------------------------------------------------------------------------------

MEGABYTE_85M = (
  "Table 4 labels this MEGABYTE model 85M, but its printed layers (a 4-layer token decoder of "
  "width 512 and an 11-layer block decoder of width 768) give 90.6M under the paper's own "
  "non-embedding formula 2 nL (12 D^2 + 13 D); the layer counts are kept as printed."
)
FAMILY = Family(
  name="block_transformer",
  model=Model,
  tasks=("lm",),
  capabilities=Capabilities(decode=True, uptrain=True, block_losses=True),
  validate_config=validate_config,
  context_parallel=context_parallel,
  # Before these keys: the norms' own epsilon, pads masked, the encoder embedder's pad outputs kept.
  upgrades={"norm_eps": 0.0, "mask_pads": True, "zero_pad_outputs": False},
  uptrain_params=uptrain_params,
  uptrain_source=vanilla_config,
  generate=generate,
  embedding_params=EMBEDDING_PARAMS,
  smoke=Smoke(
    config="configs/c4/block_transformer.py:tiny",
    data="c4",
    causal="configs/c4/block_transformer.py:tiny",
    overrides=("train.seq_len=32",),
    light=("model.num_layers=1", "model.token_num_layers=1"),
    fuzz={
      "model.block_len": ["2", "4", "3", "0"],
      "model.embedder": ["lookup", "encoder", "cls", "x"],
      "model.token_decoder": ["prefix", "summation", "cross_attention", "y"],
      "model.prefix_len": ["1", "2", "0"],
      "model.num_heads": ["2", "4", "3"],
    },
  ),
  # Tables 2-4 print 5M / 19M / 85M; 2 nL (12 D^2 + 13 D) gives 4.7M / 18.9M / 85.1M
  paper_rows=tuple(
    PaperRow(
      f"configs/c4/block_transformer.py:{size}",
      count,
      f"Block Transformer Table 3, block {size}, non-embedding",
      tolerance=0.02,
      counts="non_embedding",
    )
    for size, count in (
      ("5m", 4.7e6),
      ("19m", 18.9e6),
      ("85m", 85.1e6),
      ("302m", 302e6),
      ("805m", 805e6),
      ("1.2b", 1.2e9),
    )
  )
  + tuple(
    PaperRow(
      f"configs/c4/block_transformer.py:{size},megabyte",
      count,
      f"Block Transformer Table 4, MEGABYTE {size}, non-embedding",
      tolerance=0.02,
      counts="non_embedding",
      gap_reason=MEGABYTE_85M if size == "85m" else "",
    )
    for size, count in (("5m", 4.7e6), ("19m", 18.9e6), ("85m", 85.1e6))
  ),
)
