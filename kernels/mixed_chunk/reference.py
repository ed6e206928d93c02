"""Attention cores of FLASH (Hua et al. 2022) in jnp: relu^2 attention and mixed chunk attention.

Shapes: B batch, T time, H heads (1 in a GAU), S query/key width, E value width, C chunk.

Mixed chunk attention (Section 3.2) splits time into chunks of C and adds two parts:
  local  inside each chunk, quadratic: kernel(scale * q_i . k_j + bias[i, j]) v_j, with j <= i
         when causal; kernel is relu^2 (FLASH), softmax (MC-TFM++) or the identity (linear
         attention's exact intra-chunk term);
  global across chunks, linear: lin_q_i . sum_h lin_scale * lin_k_h^T v_h, summed over all chunks
         (non-causal) or over the chunks before i's (causal: an exclusive cumulative sum).
With one chunk and the global part dropped this is quadratic attention; `relu2_attention` is that
quadratic form written as one T x T matrix, the oracle of the tests.

Decoding keeps, per layer, the global sum over finished chunks, the current chunk's partial sum
and the current chunk's keys and values: memory O(C (S + E) + S E) per head, whatever the length.
Padding (mask False) contributes nothing to either part; padded rows return garbage.

Packed documents (`segments`): each part reads the query's document only. The global sums then
run over chunks with restarts (`carried_sums`, an associative scan of G steps with a 0/1 carry
factor) and, non-causal, from both sides plus the query's own chunk; `global_layout` says which
keys each sum holds and which queries read it. Cross-chunk normalisation (`global_norm`): "sum"
(eqs. 7-8, Code 1) or "mean" (Codes 7-8 divide by the number of chunks summed).

This file is the reference (impl="xla") and imports no Pallas code; kernels/mixed_chunk/pallas.py is the
kernel, whose gradient the tests check against this file's VJP; kernels/mixed_chunk/__init__.py checks
arguments and dispatches on `impl` between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel

Array = jax.Array
LOCAL_KERNELS = ("relu2", "softmax", "linear")


def local_weights(scores: Array, allowed: Array, kernel: str) -> Array:
  """Attention weights from float32 scores [..., I, J]; positions not allowed get weight 0."""
  if kernel == "relu2":
    return jnp.where(allowed, jnp.square(jax.nn.relu(scores)), 0.0)
  if kernel == "softmax":
    scores = jnp.where(allowed, scores, -1e30)  # finite: a row with no key allowed stays NaN-free
    return jnp.where(allowed, jax.nn.softmax(scores, axis=-1), 0.0)  # ...and reads nothing
  if kernel == "linear":
    return jnp.where(allowed, scores, 0.0)
  raise ValueError(f"local kernel {kernel!r} is not one of {LOCAL_KERNELS}.")


def relu2_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  scale: float,
  bias: Array | None = None,
  causal: bool = False,
  mask: Array | None = None,
  kernel: str = "relu2",
) -> Array:
  """Quadratic GAU attention: y_i = sum_j relu(scale q_i . k_j + bias[i, j])^2 v_j.

  q, k [B,T,H,S], v [B,T,H,E], bias [T,T] (added to every head), mask bool[B,T] (False = padding
  key) -> [B,T,H,E]. `kernel` as in mixed_chunk_attention.
  """
  t = q.shape[1]
  scores = jnp.einsum("bihs,bjhs->bhij", q, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  allowed = jnp.ones((t, t), bool)
  if causal:
    allowed = jnp.tril(allowed)
  if mask is not None:
    allowed = allowed & mask[:, None, None, :]
  weights = local_weights(scores, allowed, kernel)
  return jnp.einsum("bhij,bjhe->bihe", weights.astype(v.dtype), v)


GLOBAL_NORMS = ("sum", "mean")


def documents(segments: Array | None, valid: Array, length: int) -> Array:
  """Document index int32[B,L] of segment ids int[B,T] (None: one document per row) over the
  padded length L >= T: 0, 1, ... counting segment starts, so ids are unique within a row even
  where a caller reuses a number; the padded tail (T..L) is one more document."""
  b, t = valid.shape
  if segments is None:
    # One document per row: everything computed from these ids would be constant, and XLA's TPU
    # compiler folds constants with its slow evaluator (FLASH on PG-19, 64 rows of 65,536 tokens on a
    # v5p-64: a 2,331 s compile, 169 s with the barrier, for 0.6 GiB more peak and 0.8% more step).
    seg = jax.lax.optimization_barrier(jnp.zeros((b, t), jnp.int32))
  else:
    seg = segments.astype(jnp.int32)
  if length > t:  # the tail gets a value no segment has at its start
    seg = jnp.concatenate([seg, jnp.broadcast_to(seg.min(axis=1, keepdims=True) - 1, (b, length - t))], axis=1)
  # A row starts a document; so does a chip's slice of a split sequence (kernels/context_parallel.py) unless
  # it continues the previous chip's last: that document is then -1 here, as the edge of `global_layout`.
  first = (seg[:, :1] != context_parallel.before(seg, 1, fill=-1)) | (context_parallel.index() == 0)
  starts = jnp.concatenate([first, seg[:, 1:] != seg[:, :-1]], axis=1)
  return jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1


def global_layout(doc: Array, valid: Array, *, causal: bool, global_norm: str) -> dict[str, Array]:
  """Which cross-chunk sums each token takes part in, with documents: doc int32[B,G,C] (from
  `documents`) and valid bool[B,G,C] (False = padding) ->

    fwd_w   [B,G,C]  key weight in the running sum carried forward (valid and of the document
                     the chunk ends with: only that one continues into later chunks)
    fwd_keep [B,G]   1 where chunk g's last document is chunk g-1's (the carried sum goes on),
                     0 where a document starts inside chunk g (the sum restarts)
    fwd_read [B,G,C] the query's document is the one open at the chunk's start, so the carried
                     sum is its document's earlier chunks
    bwd_*            the same from the right (non-causal: the later chunks of the document)
    scale   [B,G,C]  1 ("sum"), or 1 / the number of chunks holding keys of the query's document
                     (earlier chunks when causal, all of them otherwise; "mean", Code 7)
  All float32. Documents are contiguous, so these describe them exactly; tokens of a document
  that starts and ends inside one chunk read no other chunk."""
  b, g, c = doc.shape
  f32 = jnp.float32
  first, last = doc[:, :, 0], doc[:, :, -1]
  edge = jnp.full((b, 1), -1, doc.dtype)  # no document before the first chunk (-1: or the one continued there)
  # and none after the last, unless the next chip's slice continues this one's last document
  continued = context_parallel.after(doc[:, :1, :1] == -1, 1, fill=False)[:, 0]  # [B,1]
  prev_last = jnp.concatenate([edge, last[:, :-1]], axis=1)
  next_first = jnp.concatenate([first[:, 1:], jnp.where(continued, last[:, -1:], -2)], axis=1)
  out = dict(
    fwd_w=(valid & (doc == last[..., None])).astype(f32),
    fwd_keep=(last == prev_last).astype(f32),
    fwd_read=(doc == prev_last[..., None]).astype(f32),
  )
  if not causal:
    out.update(
      bwd_w=(valid & (doc == first[..., None])).astype(f32),
      bwd_keep=(first == next_first).astype(f32),
      bwd_read=(doc == next_first[..., None]).astype(f32),
    )
  if global_norm == "sum":
    out["scale"] = jnp.ones((b, g, c), f32)
    return out
  # The chunks holding valid keys of a document form a range [lo, hi] of chunk indices.
  flat, chunk_of = doc.reshape(b, g * c), jnp.broadcast_to(jnp.arange(g)[:, None], (g, c)).reshape(g * c)
  big = jnp.int32(g + 1)  # above every chunk index: a padding token never lowers a document's first chunk
  has = valid.reshape(b, g * c)
  index = flat + 1  # from 0: the document continued from the previous chip is -1
  n = g * c + 1
  lo = jax.vmap(lambda d, k: jax.ops.segment_min(jnp.where(k, chunk_of, big), d, num_segments=n))(index, has)
  hi = jax.vmap(lambda d, k: jax.ops.segment_max(jnp.where(k, chunk_of, -1), d, num_segments=n))(index, has)
  lo, hi = (jnp.take_along_axis(x, index, axis=1) for x in (lo, hi))  # back onto each token
  if context_parallel.axes():  # chunk indices over the whole sequence, its documents' ranges across chips
    lo, hi = _across_chips(
      lo + context_parallel.offset(g), jnp.where(hi >= 0, hi + context_parallel.offset(g), -1), flat, continued
    )
  lo, hi = lo.reshape(b, g, c), hi.reshape(b, g, c)
  chunk = jnp.arange(g)[:, None] + context_parallel.offset(g)
  top = jnp.minimum(hi, chunk - 1) if causal else hi  # causal: only the chunks before
  count = jnp.maximum(top - lo + 1, 0).astype(f32)
  out["scale"] = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
  return out


def _across_chips(lo: Array, hi: Array, doc: Array, continued: Array) -> tuple[Array, Array]:
  """The first and last chunk [B,T] with keys of each token's document, over the chips: a chip's
  first document, where it continues the previous chip's (-1), and its last, where the next chip
  continues it, take in the ranges the other chips hold of them (folded, restarting at the chip
  where a document starts or stops)."""
  none = (jnp.full(lo.shape[:1], jnp.iinfo(lo.dtype).max, lo.dtype), jnp.full(hi.shape[:1], -1, hi.dtype))
  widen = lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]))
  pick = lambda c, a, b: (jnp.where(c, a[0], b[0]), jnp.where(c, a[1], b[1]))
  # the last document's range, restarting at a chip where it starts
  before = context_parallel.fold_before((lo[:, -1], hi[:, -1]), widen, none, fresh=doc[:, -1] != -1)
  # the first document's range where it continues the chip before, ending at a chip it does not fill
  continues, whole = doc[:, 0] == -1, doc[:, 0] == doc[:, -1]
  first = pick(continues, (lo[:, 0], hi[:, 0]), none)
  after = context_parallel.fold_after(first, widen, none, fresh=~(continues & whole))
  col = lambda x: x[:, None]
  lo, hi = pick(doc == -1, widen((lo, hi), (col(before[0]), col(before[1]))), (lo, hi))
  return pick((doc == doc[:, -1:]) & continued, widen((lo, hi), (col(after[0]), col(after[1]))), (lo, hi))


def cross_chip_sums(
  lin_q: Array, lin_k: Array, v: Array, doc: Array, valid: Array, scale: Array, *, causal: bool, lin_scale: float
) -> Array:
  """What the other chips' keys add to this chip's global linear attention: [B,T,H,E] float32.

  On one chip's slice of a split sequence (kernels/context_parallel.py) the chunks see only this chip's
  keys. The tokens of the document continued from the previous chip (doc -1, `documents`) also read
  its sum of lin_k^T v over the chips before (each chip passes on its last document's sum; a fold
  restarts where that document starts); non-causal, the tokens of the last document read its sum
  over the chips after, where they continue it. `scale` [B,T] is `global_layout`'s (1 for "sum").
  """
  f32 = jnp.float32
  lq, lk, v = lin_q.astype(f32), lin_k.astype(f32), v.astype(f32)
  sums = lambda w: jnp.einsum("bths,bthe->bhse", jnp.where(w[:, :, None, None], lk, 0.0), v) * lin_scale
  rows = lambda pick, x: jnp.where(pick.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
  last, first = doc[:, -1:], doc[:, :1]

  add = lambda a, b: a + b
  # the sums of the last document, restarting at a chip where it starts
  value = sums(valid & (doc == last))
  before = context_parallel.fold_before(value, add, jnp.zeros_like(value), fresh=last[:, 0] != -1)
  out = jnp.einsum("bths,bhse->bthe", jnp.where((doc == -1)[:, :, None, None], lq, 0.0), before)
  if not causal:  # the first document's, where it continues the chip before, ending at a chip it does not fill
    continues, whole = first[:, 0] == -1, first[:, 0] == last[:, 0]
    value = rows(continues, sums(valid & (doc == first)))
    after = context_parallel.fold_after(value, add, jnp.zeros_like(value), fresh=~(continues & whole))
    out = out + jnp.einsum("bths,bhse->bthe", jnp.where((doc == last)[:, :, None, None], lq, 0.0), after)
  return out * scale[:, :, None, None]


def carried_sums(kv: Array, keep: Array, reverse: bool = False) -> Array:
  """The exclusive running sum with restarts: out[g] = keep[g-1] out[g-1] + kv[g-1] (out[0] = 0);
  reverse: from the right, out[g] = keep[g+1] out[g+1] + kv[g+1]. kv [B,G,...], keep [B,G]."""
  keep = keep.reshape(keep.shape + (1,) * (kv.ndim - 2))

  def combine(first, then):  # affine maps x -> a x + b, `first` applied first (in scan order)
    (a1, b1), (a2, b2) = first, then
    return a1 * a2, a2 * b1 + b2

  # O(log G) depth instead of a serial scan over the chunks
  _, inclusive = jax.lax.associative_scan(combine, (keep, kv), axis=1, reverse=reverse)
  zero = jnp.zeros_like(inclusive[:, :1])  # exclusive: shift by one chunk, the first reads nothing
  if reverse:
    return jnp.concatenate([inclusive[:, 1:], zero], axis=1)
  return jnp.concatenate([zero, inclusive[:, :-1]], axis=1)


def mixed_chunk_attention(
  quad_q: Array,
  quad_k: Array,
  lin_q: Array | None,
  lin_k: Array | None,
  v: Array,
  *,
  chunk: int,
  causal: bool,
  quad_scale: float,
  lin_scale: float,
  bias: Array | None = None,
  mask: Array | None = None,
  segments: Array | None = None,
  global_norm: str = "sum",
  kernel: str = "relu2",
) -> Array:
  """Local quadratic attention per chunk + global linear attention across chunks (eqs. 7, 8).

  quad_q, quad_k, lin_q, lin_k [B,T,H,S]; v [B,T,H,E]; bias [C,C] relative bias inside a chunk
  (sliced when T < C); mask bool[B,T], False = padding. lin_q = lin_k = None drops the global part
  (FLASH local-only); quad_q = None drops the local part (global-only). T need not be a multiple
  of C: the tail is padded and cut off.

  segments int[B,T] (packed documents, kernels/packed_documents.py): a query reads keys of its own
  document only. Locally the chunk's scores are masked; globally the cross-chunk sum holds only
  the query's document: causal, the chunks before the query's that hold it (the running sum
  restarts where a document starts, and a chunk holding two documents gives each only its own
  keys); non-causal, all of its document's keys (the chunks before, its own chunk, the chunks
  after). global_norm: "sum" (eqs. 7-8) or "mean" (Codes 7-8: the cross-chunk part divided by
  the number of chunks that hold keys of the query's document, earlier ones when causal).
  -> [B,T,H,E]
  """
  if global_norm not in GLOBAL_NORMS:
    raise ValueError(f"global_norm {global_norm!r} is not one of {GLOBAL_NORMS}.")
  b, t = v.shape[:2]
  c = min(chunk, t)
  g = -(-t // c)
  valid = jnp.ones((b, t), bool) if mask is None else mask
  plain = segments is None and global_norm == "sum"  # no restarts, no per-query factors: a plain prefix sum
  doc = None if plain else documents(segments, valid, g * c)
  if g * c != t:
    widths = lambda x: [(0, 0), (0, g * c - t)] + [(0, 0)] * (x.ndim - 2)
    quad_q, quad_k, lin_q, lin_k, v, valid = (
      None if x is None else jnp.pad(x, widths(x)) for x in (quad_q, quad_k, lin_q, lin_k, v, valid)
    )
  chunked = lambda x: None if x is None else x.reshape(b, g, c, *x.shape[2:])
  quad_q, quad_k, lin_q, lin_k, v, valid, doc = map(chunked, (quad_q, quad_k, lin_q, lin_k, v, valid, doc))
  same = None if doc is None else doc[:, :, :, None] == doc[:, :, None, :]  # [B,G,C,C]
  out = jnp.zeros(v.shape, jnp.float32)
  if quad_q is not None:
    scores = jnp.einsum("bgihs,bgjhs->bghij", quad_q, quad_k, preferred_element_type=jnp.float32) * quad_scale
    if bias is not None:
      scores = scores + bias[:c, :c].astype(jnp.float32)  # a chunk cut short by T: the top-left corner
    allowed = valid[:, :, None, None, :]
    if causal:
      allowed = allowed & jnp.tril(jnp.ones((c, c), bool))
    if segments is not None:
      allowed = allowed & same[:, :, None]
    weights = local_weights(scores, allowed, kernel)
    out = out + jnp.einsum("bghij,bgjhe->bgihe", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
  if lin_q is None:
    return out.reshape(b, g * c, *v.shape[3:])[:, :t].astype(v.dtype)
  lq = lin_q.astype(jnp.float32)  # the sums are float32: so is the query that reads them
  sums = lambda w: (  # per chunk, the weighted sum of lin_k^T v of its keys
    jnp.einsum("bgchs,bgche->bghse", jnp.where(w[..., None, None] > 0, lin_k, 0), v, preferred_element_type=jnp.float32)
    * lin_scale
  )
  if plain:
    kv = sums(valid)
    if causal:  # chunk g reads chunks 0..g-1: an exclusive cumulative sum over G steps, not T
      kv = jnp.concatenate([jnp.zeros_like(kv[:, :1]), jnp.cumsum(kv[:, :-1], axis=1)], axis=1)
    else:
      kv = kv.sum(axis=1, keepdims=True)
    out = out + jnp.einsum("bgchs,bghse->bgche", lq, kv)
    return out.reshape(b, g * c, *v.shape[3:])[:, :t].astype(v.dtype)
  lay = global_layout(doc, valid, causal=causal, global_norm=global_norm)
  read = lambda x, name: x * lay[name][..., None, None]
  glob = read(jnp.einsum("bgchs,bghse->bgche", lq, carried_sums(sums(lay["fwd_w"]), lay["fwd_keep"])), "fwd_read")
  if not causal:  # the later chunks of the document, and its keys in the query's own chunk
    later = carried_sums(sums(lay["bwd_w"]), lay["bwd_keep"], reverse=True)
    glob = glob + read(jnp.einsum("bgchs,bghse->bgche", lq, later), "bwd_read")
    own = jnp.einsum("bgihs,bgjhs->bghij", lq, lin_k, preferred_element_type=jnp.float32) * lin_scale
    own = jnp.where((same & valid[:, :, None, :])[:, :, None], own, 0.0)  # the query's document, real keys
    glob = glob + jnp.einsum("bghij,bgjhe->bgihe", own, v.astype(jnp.float32))
  out = out + glob * lay["scale"][..., None, None]
  return out.reshape(b, g * c, *v.shape[3:])[:, :t].astype(v.dtype)


def linear_attention_reference(
  q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, eps: float = 1e-6
) -> Array:
  """linear_attention as one T x T matrix (the oracle)."""
  fq, fk = jax.nn.relu(q), jax.nn.relu(k)
  ones = jnp.ones((*v.shape[:-1], 1), v.dtype)
  both = relu2_attention(fq, fk, jnp.concatenate([v, ones], -1), scale=1.0, causal=causal, mask=mask, kernel="linear")
  return (both[..., :-1] / (both[..., -1:] + eps)).astype(v.dtype)


# -- decoding ------------------------------------------------------------------------------------------


def init_chunk_state(
  batch: int,
  heads: int,
  chunk: int,
  qk_dim: int,
  v_dim: int,
  *,
  local: bool = True,
  linear: bool = True,
  dtype=jnp.float32,
) -> dict[str, Array]:
  """State of causal mixed chunk attention before position 0."""
  state = {}
  if local:  # the current chunk's keys and values
    state["keys"] = jnp.zeros((batch, chunk, heads, qk_dim), dtype)
    state["values"] = jnp.zeros((batch, chunk, heads, v_dim), dtype)
  if linear:
    state["kv"] = jnp.zeros((batch, heads, qk_dim, v_dim), jnp.float32)  # finished chunks
    state["partial"] = jnp.zeros((batch, heads, qk_dim, v_dim), jnp.float32)  # the current chunk
  return state


def chunk_step(
  quad_q: Array | None,
  quad_k: Array | None,
  lin_q: Array | None,
  lin_k: Array | None,
  v: Array,
  state: dict[str, Array],
  position: Array,
  *,
  chunk: int,
  quad_scale: float,
  lin_scale: float,
  bias_row: Array | None = None,
  kernel: str = "relu2",
  global_norm: str = "sum",
) -> tuple[Array, dict[str, Array]]:
  """One causal step at `position`: inputs [B,H,S] / [B,H,E], bias_row [C] (bias[i, :] for
  i = position mod C) -> y [B,H,E], next state. Equals mixed_chunk_attention at that position
  (None drops a part, as there; decoding is one document, so "mean" divides by position // C)."""
  i = position % chunk  # the slot of this position in the current chunk
  state = dict(state)
  out = jnp.zeros(v.shape, jnp.float32)
  if quad_q is not None:
    keys = jax.lax.dynamic_update_index_in_dim(state["keys"], quad_k.astype(state["keys"].dtype), i, 1)
    values = jax.lax.dynamic_update_index_in_dim(state["values"], v.astype(state["values"].dtype), i, 1)
    state["keys"], state["values"] = keys, values
    scores = jnp.einsum("bhs,bjhs->bhj", quad_q, keys, preferred_element_type=jnp.float32) * quad_scale
    if bias_row is not None:
      scores = scores + bias_row.astype(jnp.float32)
    weights = local_weights(scores, jnp.arange(chunk) <= i, kernel)  # slots after i: the previous chunk's
    out = out + jnp.einsum("bhj,bjhe->bhe", weights, values.astype(jnp.float32))
  if lin_q is not None:
    glob = jnp.einsum("bhs,bhse->bhe", lin_q.astype(jnp.float32), state["kv"])
    if global_norm == "mean":
      glob = glob / jnp.maximum(position // chunk, 1).astype(jnp.float32)
    out = out + glob
    partial = state["partial"] + jnp.einsum("bhs,bhe->bhse", lin_k, v, preferred_element_type=jnp.float32) * lin_scale
    done = i == chunk - 1  # the chunk is finished: it joins the global sum of the chunks after it
    state["kv"] = jnp.where(done, state["kv"] + partial, state["kv"])
    state["partial"] = jnp.where(done, jnp.zeros_like(partial), partial)
  return out.astype(v.dtype), state


def linear_step(
  q: Array, k: Array, v: Array, state: dict[str, Array], position: Array, *, chunk: int, eps: float = 1e-6
) -> tuple[Array, dict[str, Array]]:
  """One causal step of linear_attention: q, k [B,H,S], v [B,H,E] -> y [B,H,E], next state
  (init_chunk_state with v_dim E + 1)."""
  fq, fk = jax.nn.relu(q), jax.nn.relu(k)
  both, state = chunk_step(
    fq,
    fk,
    fq,
    fk,
    jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1),
    state,
    position,
    chunk=chunk,
    quad_scale=1.0,
    lin_scale=1.0,
    kernel="linear",
  )
  both = both.astype(jnp.float32)
  return (both[..., :-1] / (both[..., -1:] + eps)).astype(v.dtype), state
