"""Combiner (Ren et al. 2021, "Combiner: Full Attention Transformer with Sparse Computation Cost"),
the row-major axial variant (Combiner-Axial) that FLASH compares with (Hua et al. 2022, Section 4:
"we use the rowmajor-axial variant of Combiner"; Tables 8-10, Figures 5-6).

The transformer stack of models/transformer.py (Transformer+ of FLASH's Table 8: scaled sinusoid
+ RoPE, GELU MLP, 12 attention + 12 MLP layers) with this token mixer. Combiner treats attention
as a conditional expectation and factorises it: each query reads some keys directly and the rest
through summaries of regions, every position reachable in one layer. Row-major axial: time is cut
into rows of C tokens (`model.chunk`, G = T / C rows). A query i at row r, column c reads

  directly   the tokens of its own row (j <= i when causal);
  row k      (k < r when causal, k != r otherwise) through the row's summary seen from column c:
             the summary key ksum[k, c] scores the row as one entry, and its value is
             row_out[k, c] = sum_j softmax_j(q[k, c] . k_j / sqrt(d)) v_j over row k, the row's
             own (bidirectional) attention output at column c: q(j | row k) of Combiner.

One softmax covers the C direct scores and the G row scores, so the weights of all T positions sum
to one (`dense_reference` in tests/test_combiner.py builds that T x T matrix). Summary keys are
Combiner's "proj" row summary: ksum = W_2 norm(x + W_1 row_out), two d x d maps per layer (these
give Table 8's 124M against Transformer+'s 110M, Table 10's 562M against 486M), with RoPE at the
token's position, so q_i . ksum[k, c] sees the distance (r - k) C. Cost O(T (C + G) d).

Packed documents (segment_ids): row summaries attend within the summarised token's document,
and a query reads a row entry (k, c) only when token (k, c) is in its own document; positions
restart per document (Model.encode). A document then reads nothing of another; outputs equal a
document alone when it starts on a row boundary (tests/test_combiner.py).

Decoding keeps the current row's queries, keys, values and inputs, and every finished row's
summary keys and values: O(T d) per layer, like a key-value cache (the row summaries of a
finished row are computed once, when its last token arrives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.kernels.packed_documents import segment_starts
from lra_core.models import transformer
from lra_core.models.layers.attention import Attention, config_attention
from lra_core.models.layers.core import Dense, make_norm
from lra_core.models.layers.positions import apply_rope
from lra_core.protocol import PaperRow, Smoke

Array = jax.Array
MASKED = -1e30


def model_config(**overrides) -> ml_collections.ConfigDict:
  """The `config.model` section: Combiner-Axial in FLASH's Table 8 (C4 masked LM, d 768)."""
  c = transformer.model_config("transformer+")
  c.update(
    dict(
      name="combiner",
      variant="axial",  # row-major Combiner-Axial, the one variant here
      vocab_size=32128,
      d_model=768,
      num_layers=12,
      num_heads=12,
      d_ff=3072,
      chunk=128,  # C, the row length (the Combiner authors' setting for this variant)
      tie_embeddings=True,
    )
  )
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m = config.model
  if m.variant != "axial":
    raise ConfigError(f"model.variant {m.variant!r} is not one of ['axial'].")
  if m.chunk <= 0:
    raise ConfigError(f"model.chunk (the row length) must be positive, got {m.chunk}.")
  if m.num_kv_heads not in (0, m.num_heads):
    raise ConfigError("Combiner needs multi-head attention: model.num_kv_heads must be 0.")
  if m.window:
    raise ConfigError("Combiner attends to every position: model.window must be 0.")
  c = ml_collections.ConfigDict(config.to_dict())  # the shared fields, checked by the transformer's rules
  c.model.variant = "transformer+"
  transformer.validate_config(c)


# -- the factorised attention, as pure functions over rows ---------------------------------------------


def documents(segments: Array | None, b: int, t: int) -> Array:
  """Document index int32[B,T]: 0, 1, ... counting segment starts (None: one document per row)."""
  if segments is None:
    return jnp.zeros((b, t), jnp.int32)
  return jnp.cumsum(segment_starts(segments).astype(jnp.int32), axis=1) - 1


def _rows(x: Array, c: int) -> Array:
  """[B,T,...] -> [B,G,C,...] (T a multiple of C)."""
  return x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:])


def _softmax(scores: Array, allowed: Array) -> Array:
  """Softmax over the last axis of float32 scores; positions not allowed get weight 0 (a row with
  none allowed gets zeros)."""
  scores = jnp.where(allowed, scores, MASKED)
  weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
  weights = jnp.where(allowed, weights, 0.0)
  return weights / jnp.maximum(weights.sum(axis=-1, keepdims=True), 1e-30)


def row_summaries(q: Array, k: Array, v: Array, *, chunk: int, valid: Array, doc: Array) -> Array:
  """Each token's attention over its own row, bidirectional: row_out[i] = sum_j softmax_j(q_i . k_j
  / sqrt(D)) v_j over the valid keys j of i's row and document. q, k, v [B,T,H,D]; valid bool[B,T];
  doc int[B,T]; T a multiple of `chunk` -> [B,T,H,D] (float32)."""
  b, t, h, d = q.shape
  qr, kr, vr = (_rows(x, chunk) for x in (q, k, v))
  allowed = _rows(valid, chunk)[:, :, None, :] & (_rows(doc, chunk)[..., :, None] == _rows(doc, chunk)[..., None, :])
  scores = jnp.einsum("bgihd,bgjhd->bghij", qr, kr, preferred_element_type=jnp.float32) * d**-0.5
  weights = _softmax(scores, allowed[:, :, None])
  return jnp.einsum("bghij,bgjhd->bgihd", weights, vr.astype(jnp.float32)).reshape(b, t, h, d)


def axial_attention(
  q: Array,
  k: Array,
  v: Array,
  summaries: Array,
  summary_keys: Array,
  *,
  chunk: int,
  causal: bool,
  valid: Array,
  doc: Array,
) -> Array:
  """Combiner-Axial (row-major): q, k, v [B,T,H,D]; summaries (`row_summaries`) and summary_keys
  [B,T,H,D], the value and key of each token's row as seen from its column; valid bool[B,T]; doc
  int[B,T]; T a multiple of `chunk` -> [B,T,H,D]. One softmax over the query's own row (direct)
  and the entries (k, c) of the other rows at its column c (earlier rows when causal), each
  within the query's document."""
  b, t, h, d = q.shape
  c, g = chunk, t // chunk
  scale = d**-0.5
  qr, kr, vr, sr, ksr = (_rows(x, c) for x in (q, k, v, summaries, summary_keys))
  validr, docr = _rows(valid, c), _rows(doc, c)
  # direct: [B,G,H,C,C]
  local = jnp.einsum("bgihd,bgjhd->bghij", qr, kr, preferred_element_type=jnp.float32) * scale
  local_ok = validr[:, :, None, :] & (docr[..., :, None] == docr[..., None, :])
  if causal:
    local_ok = local_ok & jnp.tril(jnp.ones((c, c), bool))
  # rows: query (r, col) against entry (k, col): [B,G,H,C,G]
  rows = jnp.einsum("brchd,bkchd->brhck", qr, ksr, preferred_element_type=jnp.float32) * scale
  order = jnp.arange(g)
  before = order[None, :] < order[:, None] if causal else order[None, :] != order[:, None]  # [r, k]
  entry_doc, entry_ok = docr.transpose(0, 2, 1), validr.transpose(0, 2, 1)  # [B,C,G]: entry (k, col)
  rows_ok = before[None, :, None, :] & entry_ok[:, None] & (docr[..., None] == entry_doc[:, None])  # [B,G,C,G]
  weights = _softmax(
    jnp.concatenate([local, rows], axis=-1), jnp.concatenate([local_ok[:, :, None], rows_ok[:, :, None]], axis=-1)
  )
  direct, through = weights[..., :c], weights[..., c:]
  out = jnp.einsum("bghij,bgjhd->bgihd", direct, vr.astype(jnp.float32))
  out = out + jnp.einsum("brhck,bkchd->brchd", through, sr.astype(jnp.float32))
  return out.reshape(b, t, h, d).astype(v.dtype)


# -- the token mixer ---------------------------------------------------------------------------------------


class CombinerAttention(Attention):
  """Combiner-Axial self-attention: heads, projections and RoPE of blocks.Attention, plus the row
  summary keys W_2 norm(x + W_1 row_out) (Combiner's "proj" summary)."""

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs):
    super().__init__(**config_attention(m), causal=causal, dtype=dtype, rngs=rngs)
    head_dim = self.head_dim
    kw = dict(use_bias=m.use_bias, dtype=dtype, rngs=rngs)
    self.summary_in = Dense((m.num_heads, head_dim), m.d_model, axes=("heads", "head_dim", "embed"), **kw)
    self.summary_norm = make_norm(m.norm, m.d_model, rngs=rngs)
    self.summary_key = Dense(m.d_model, (m.num_heads, head_dim), axes=("embed", "heads", "head_dim"), **kw)
    self.chunk = m.chunk

  def _summary_keys(self, x: Array, summaries: Array, positions: Array) -> Array:
    """x [B,N,D] (the layer input), summaries [B,N,H,Dh], positions [N] or [B,N] -> [B,N,H,Dh]."""
    keys = self.summary_key(self.summary_norm(x + self.summary_in(summaries.astype(x.dtype))))
    if self.rope:
      keys = apply_rope(keys, positions, max_wavelength=self.rope_max_wavelength, fraction=self.rope_fraction)
    return keys

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x [B,T,D]; positions int[T] or [B,T] (per document with segments); mask bool[B,T], False =
    padding; segments int[B,T] packed documents. T need not be a multiple of C: the tail is padded."""
    del rngs
    b, t, _ = x.shape
    positions = jnp.arange(t) if positions is None else positions
    c = min(self.chunk, t)
    pad = -(-t // c) * c - t
    valid = jnp.ones((b, t), bool) if mask is None else mask
    doc = documents(segments, b, t)
    q, k, v = self._qkv(x, positions)
    if pad:
      widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)
      q, k, v, x, valid, doc = (jnp.pad(a, widths(a)) for a in (q, k, v, x, valid, doc))
      positions = jnp.pad(positions, [(0, 0)] * (positions.ndim - 1) + [(0, pad)], mode="edge")
    summaries = row_summaries(q, k, v, chunk=c, valid=valid, doc=doc)
    keys = self._summary_keys(x, summaries, positions)
    y = axial_attention(q, k, v, summaries, keys, chunk=c, causal=self.causal, valid=valid, doc=doc)
    return self.out(y[:, :t])

  # -- decoding ------------------------------------------------------------------------------------------

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    if not self.causal:
      raise ValueError("decoding needs causal attention; this layer is bidirectional.")
    h, dh, c = self.num_heads, self.head_dim, self.chunk
    g = -(-max_len // c)
    row = lambda *shape: jnp.zeros((batch_size, c) + shape, dtype)
    return {
      "q": row(h, dh),
      "k": row(h, dh),
      "v": row(h, dh),
      "x": row(self.summary_in.out_features[0]),
      "summary_keys": jnp.zeros((batch_size, g, c, h, dh), dtype),
      "summaries": jnp.zeros((batch_size, g, c, h, dh), dtype),
    }

  def decode(self, x: Array, cache: dict, position: Array) -> tuple[Array, dict]:
    """One token x [B,1,D] at `position` -> y [B,1,D], next cache; equals the forward pass there."""
    c = self.chunk
    col, row = position % c, position // c
    q, k, v = (a[:, 0] for a in self._qkv(x, position[None]))
    cache = dict(cache)
    for name, a in (("q", q), ("k", k), ("v", v), ("x", x[:, 0])):
      cache[name] = jax.lax.dynamic_update_index_in_dim(cache[name], a.astype(cache[name].dtype), col, 1)
    scale = self.head_dim**-0.5
    local = jnp.einsum("bhd,bjhd->bhj", q, cache["k"], preferred_element_type=jnp.float32) * scale
    entries = jax.lax.dynamic_index_in_dim(cache["summary_keys"], col, 2, keepdims=False)  # [B,G,H,Dh]
    values = jax.lax.dynamic_index_in_dim(cache["summaries"], col, 2, keepdims=False)
    rows = jnp.einsum("bhd,bkhd->bhk", q, entries, preferred_element_type=jnp.float32) * scale
    g = entries.shape[1]
    allowed = jnp.concatenate([jnp.arange(c) <= col, jnp.arange(g) < row])
    weights = _softmax(jnp.concatenate([local, rows], axis=-1), allowed)
    y = jnp.einsum("bhj,bjhd->bhd", weights[..., :c], cache["v"].astype(jnp.float32)) + jnp.einsum(
      "bhk,bkhd->bhd", weights[..., c:], values.astype(jnp.float32)
    )
    # A finished row: its summaries, seen from each column, for the rows after it.
    b = x.shape[0]
    ones = jnp.ones((b, c), bool)
    summaries = row_summaries(cache["q"], cache["k"], cache["v"], chunk=c, valid=ones, doc=jnp.zeros((b, c), jnp.int32))
    keys = self._summary_keys(cache["x"], summaries, row * c + jnp.arange(c))
    done = col == c - 1
    for name, a in (("summary_keys", keys), ("summaries", summaries)):
      written = jax.lax.dynamic_update_index_in_dim(cache[name], a.astype(cache[name].dtype), row, 1)
      cache[name] = jnp.where(done, written, cache[name])
    return self.out(y[:, None].astype(x.dtype)), cache


class Model(transformer.Model):
  """The transformer stack with Combiner-Axial attention (see the module docstring)."""

  mixer = staticmethod(CombinerAttention)


# -- family record --------------------------------------------------------------------------------

FAMILY = transformer.mixer_family(
  "combiner",
  Model,
  validate_config=validate_config,
  cannot_split=(
    "a query reads every row's summary at its column, so the summaries of all T tokens would have to pass "
    "between the chips as ring attention passes keys, and that ring is not built"
  ),
  smoke=Smoke(
    config="configs/c4/combiner.py:tiny",
    data="c4",
    causal="configs/c4/combiner.py:tiny,lm",
    light=("model.num_layers=1",),
    fuzz={
      "model.chunk": ["4", "16", "5", "0"],
      "model.num_heads": ["1", "2", "3", "0"],
      "model.variant": ["axial", "fixed"],
    },
  ),
  # Table 8 (C4 masked LM, d 768): 124M
  paper_rows=(PaperRow("configs/c4/combiner.py", 124e6, "FLASH Table 8, Combiner (C4 MLM)", tolerance=0.03),),
)
