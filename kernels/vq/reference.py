"""VQ-Attention (Lingle 2024, Transformer-VQ) in jnp: causal softmax attention over
vector-quantized keys, computed in linear time with a compressive cache.

Keys are replaced by their nearest codeword c_z. A query block of length L then attends to
  - the present block (causal) and the previous block exactly, and
  - every older key through the codebook: keys sharing code s contribute one score
    q.c_s + log(count_s) and the running MEAN of their values (Theorem 3.7 with the stable
    form of Remark 3.9), so the cost per block is O(L (S + 2L)), independent of T.
The per-block cache variables (count, mean) are a prefix reduction over block summaries,
computed by one of three equivalent reductions (Appendix E): `serial` (lax.scan), `matmul`
(lower-triangular weights) and `assoc` (lax.associative_scan).

Layout: [B,T,H,D] in the public functions; [B,R,L,H,D] (R blocks of L) inside. Queries may have
more heads than keys (H = Hk * G, multi-query when Hk = 1); the codebook has one book per key head.
The code id `S` (one past the codebook) marks an empty slot: its one-hot is all zeros.

Documents (`segments` int[B,T], packed rows: kernels/packed_documents.py): a query reads only keys of its
own segment. The exact part compares ids; the compressive cache holds one document, the one the
previous block begins with (`document_plan`): when a block is folded into the cache only its keys
of the next block's first document enter, the old cache is kept only if that document also began
the folded block, and a query reads the cache only if its document is the one that began the
previous block. A document's cache thus holds exactly its own keys older than the previous
block, wherever it starts relative to the blocks, so linear time == quadratic still holds.

`vq_attention_reference` is the quadratic oracle the tests compare against.

This file is the reference (impl="xla": `cached_attention`, decoding and the oracles) and imports
no Pallas code; kernels/vq/pallas.py is the kernel, differentiated through `cached_attention`;
kernels/vq/__init__.py checks arguments and dispatches on `impl` between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel

Array = jax.Array
MASK = 1e30
REDUCTIONS = ("serial", "matmul", "assoc")

sg = jax.lax.stop_gradient


# -- quantization ------------------------------------------------------------------------------


def quantize(k: Array, codebook: Array, *, chunk: int = 0) -> tuple[Array, Array]:
  """Nearest codeword ids and squared distances: k [B,T,H,Dk], codebook [H,S,Dk] -> int32 [B,T,H], [B,T,H].

  chunk > 0 dividing T: the distances are built `chunk` tokens at a time (a lax.map), so each
  [chunk, S] slab stays in a CPU's cache instead of spanning the sequence (8,192 tokens, 512 codes,
  2-core CPU: 18 ms by chunks of 512, 30 ms at once); the same ids and distances."""
  b, t = k.shape[:2]
  if chunk and context_parallel.split(t):  # token by token: each chip its own chunks (kernels/context_parallel.py)
    local = lambda k, codebook: quantize(k, codebook, chunk=chunk)
    return context_parallel.per_chip(
      local, (k, codebook), ("bth.", "h.."), ("bth", "bth"), batch=b, heads=k.shape[2], length=t
    )
  if 0 < chunk < t and t % chunk == 0:
    chunks = jnp.moveaxis(k.reshape((b, t // chunk, chunk) + k.shape[2:]), 1, 0)
    z, d2 = jax.lax.map(lambda x: quantize(x, codebook), chunks)
    return tuple(jnp.moveaxis(a, 0, 1).reshape((b, t) + a.shape[3:]) for a in (z, d2))
  k32, c32 = k.astype(jnp.float32), codebook.astype(jnp.float32)
  d2 = (  # |k - c|^2 expanded: one [T,Dk] x [Dk,S] matmul instead of a [T,S,Dk] difference
    jnp.sum(k32 * k32, -1)[..., None]
    - 2.0 * jnp.einsum("bthk,hsk->bths", k32, c32)
    + jnp.sum(c32 * c32, -1)[None, None]
  )
  return jnp.argmin(d2, -1).astype(jnp.int32), jax.nn.relu(jnp.min(d2, -1))  # relu: the expansion can round below 0


def codewords(z: Array, codebook: Array) -> Array:
  """c_z: z int32 [B,T,H], codebook [H,S,Dk] -> [B,T,H,Dk]."""
  return codebook[jnp.arange(codebook.shape[0]), z]


def code_statistics(z: Array, k: Array, weights: Array, n_code: int, *, scatter: bool = False) -> tuple[Array, Array]:
  """(count [H,S], k_sum [H,S,Dk]): the weighted number of tokens given each code and the weighted
  sum of their keys (z int32 [B,T,H], k [B,T,H,Dk], weights [B,T]), the codebook's k-means statistics.

  By a one-hot matmul (O(T S Dk), for matrix units), or with `scatter` by segment sums (O(T Dk);
  8,192 tokens, 512 codes, 2-core CPU: 0.3 ms against 17 ms). Rows are summed last, so a batch
  sharded over devices sums its shards."""
  b, t, h = z.shape
  if not scatter:
    onehot = jax.nn.one_hot(z, n_code, dtype=jnp.float32) * weights[:, :, None, None]  # [B,T,H,S]
    return onehot.sum((0, 1)), jnp.einsum("bths,bthk->hsk", onehot, k.astype(jnp.float32))
  ids = (z + n_code * jnp.arange(h)).reshape(b, t * h)  # one segment per (head, code)
  per_row = jax.vmap(lambda data, i: jax.ops.segment_sum(data, i, h * n_code))
  count = per_row(jnp.broadcast_to(weights[:, :, None], z.shape).reshape(b, t * h), ids).sum(0)
  k_sum = per_row((k.astype(jnp.float32) * weights[:, :, None, None]).reshape(b, t * h, -1), ids).sum(0)
  return count.reshape(h, n_code), k_sum.reshape(h, n_code, -1)


# -- cache variables -----------------------------------------------------------------------------


def block_summaries(z: Array, v: Array, n_code: int) -> tuple[Array, Array]:
  """Per block and code: mean of the values and count. z [B,R,L,H], v [B,R,L,H,Dv] -> [B,R,H,S,Dv], [B,R,H,S]."""
  delta = jax.nn.one_hot(z, n_code, dtype=jnp.float32)
  count = delta.sum(2)  # code S (no key) is outside the one-hot: it counts nowhere
  total = jnp.einsum("brlhs,brlhv->brhsv", delta, v.astype(jnp.float32))
  return total / jnp.maximum(count, 1.0)[..., None], count  # an empty code's mean is 0, weighted 0 by `merge`


def merge(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
  """Combines two (mean, count) summaries; associative, and stable (weights <= 1, no sums of values)."""
  (mean_a, count_a), (mean_b, count_b) = a, b
  count = count_a + count_b
  denom = jnp.maximum(count, 1.0)
  return (count_a / denom)[..., None] * mean_a + (count_b / denom)[..., None] * mean_b, count


def prefix_summaries(mean: Array, count: Array, reduction: str, reset: Array | None = None) -> tuple[Array, Array]:
  """Inclusive prefix merge along axis 1: mean [B,N,H,S,Dv], count [B,N,H,S]. `reset` bool [B,N]
  (optional): True at element n drops everything before it (a document boundary: the prefix restarts
  at n)."""
  # A reset zeroes only the prefix's counts: merge weighs its mean by them, so the mean drops out too,
  # and the scan keeps no masked copy of each step's [B,H,S,Dv] mean for the backward pass.
  if reset is None:
    reset = jnp.zeros(count.shape[:2], bool)
  if reduction == "serial":

    def step(acc, x):
      mean_x, count_x, r = x
      (mean_a, count_a) = acc
      acc = merge((mean_a, jnp.where(_lift(r, count_a), 0.0, count_a)), (mean_x, count_x))
      return acc, acc

    xs = (jnp.moveaxis(mean, 1, 0), jnp.moveaxis(count, 1, 0), jnp.moveaxis(reset, 1, 0))
    init = (jnp.zeros_like(xs[0][0]), jnp.zeros_like(xs[1][0]))
    _, (m, c) = jax.lax.scan(step, init, xs)
    return jnp.moveaxis(m, 0, 1), jnp.moveaxis(c, 0, 1)
  if reduction == "assoc":

    def combine(a, b):
      (mean_a, count_a, r_a), (mean_b, count_b, r_b) = a, b
      m, c = merge((mean_a, jnp.where(_lift(r_b, count_a), 0.0, count_a)), (mean_b, count_b))
      return m, c, r_a | r_b

    m, c, _ = jax.lax.associative_scan(combine, (mean, count, reset), axis=1)
    return m, c
  if reduction == "matmul":
    n = count.shape[1]
    g = jnp.arange(n)
    first = jax.lax.cummax(jnp.where(reset, g, 0), axis=1)  # [B,N]: where r's prefix starts
    # weights[b, r, g] = 1 for the elements g of r's prefix: first[r] <= g <= r
    weights = ((g[None, None, :] <= g[None, :, None]) & (g[None, None, :] >= first[:, :, None])).astype(jnp.float32)
    cum = jnp.einsum("brg,bghs->brhs", weights, count)  # [B,N,H,S]
    frac = jnp.einsum("brg,bghs->brghs", weights, count) / jnp.maximum(cum, 1.0)[:, :, None]
    return jnp.einsum("brghs,bghsv->brhsv", frac, mean), cum
  raise ValueError(f"reduction {reduction!r} is not one of {REDUCTIONS}.")


def _lift(flag: Array, x: Array) -> Array:
  """A per-(batch, element) flag [B] or [B,N] broadcast against x [B,(N,)...]."""
  return flag.reshape(flag.shape + (1,) * (x.ndim - flag.ndim))


def init_carry(
  batch_size: int, block_len: int, num_heads: int, n_code: int, d_k: int, d_v: int, dtype=jnp.float32
) -> dict[str, Array]:
  """The cache before position 0: an empty previous block and an empty compressive cache.

  `seg` int32 [B,L] holds the segment ids of the previous block (-1: no document), read only when
  the attention is given `segments`."""
  b, l, h = batch_size, block_len, num_heads
  return {
    "k": jnp.zeros((b, l, h, d_k), dtype),
    "v": jnp.zeros((b, l, h, d_v), dtype),
    "z": jnp.full((b, l, h), n_code, jnp.int32),  # code S: no key, masked and never folded
    "mean": jnp.zeros((b, h, n_code, d_v), jnp.float32),
    "count": jnp.zeros((b, h, n_code), jnp.float32),
    "seg": jnp.full((b, l), -1, jnp.int32),
  }


def document_plan(segments: Array, carry_segments: Array, block_len: int) -> dict[str, Array]:
  """Where documents cut the blocks: segments int [B,T], carry_segments int [B,L] (the carried
  previous block's ids) -> per block r of R (all [B,R,L] unless said):

    seg      the block's ids
    prev     the previous block's ids (block -1 is the carried one)
    reads    query i of block r reads the cache: its id is the one the previous block begins with
    enters   key j of the previous block enters the cache when it is folded (after block r): its id
             is the one block r begins with
    keep     [B,R]: the cache survives that fold (the previous block begins with block r's first
             document, which so began before the previous block)
  """
  b, t = segments.shape
  l = block_len
  seg = segments.astype(jnp.int32).reshape(b, t // l, l)
  prev = jnp.concatenate([carry_segments.astype(jnp.int32)[:, None], seg[:, :-1]], axis=1)
  return {
    "seg": seg,
    "prev": prev,
    "reads": seg == prev[..., :1],
    "enters": prev == seg[..., :1],
    "keep": prev[..., 0] == seg[..., 0],
  }


# -- attention -----------------------------------------------------------------------------------


def relative_bias(rel_q: Array, rel_table: Array, distance: Array) -> Array:
  """Transformer-XL position term (q + v).r_d for distances d in [0, L]; 0 outside.

  rel_q [..., Hk, G, I, Dk], rel_table [Hk, G, L+1, Dk], distance int [I, J] -> [..., Hk, G, I, J].
  """
  window = rel_table.shape[-2] - 1
  by_distance = jnp.einsum("...hgik,hgdk->...hgid", rel_q.astype(jnp.float32), rel_table.astype(jnp.float32))
  idx = jnp.clip(distance, 0, window)  # any valid index for distances outside [0, L]: masked below
  idx = jnp.broadcast_to(idx, by_distance.shape[:-1] + idx.shape[-1:])
  bias = jnp.take_along_axis(by_distance, idx, axis=-1)
  return jnp.where((distance >= 0) & (distance <= window), bias, 0.0)


def group_heads(x: Array, num_kv_heads: int) -> Array:
  """[..., H, D] -> [..., Hk, G, D]."""
  return x.reshape(x.shape[:-2] + (num_kv_heads, x.shape[-2] // num_kv_heads, x.shape[-1]))


def group_table(rel_table: Array, num_kv_heads: int) -> Array:
  """Relative position table [H, W+1, Dk] -> [Hk, G, W+1, Dk]."""
  return group_heads(rel_table.transpose(1, 0, 2), num_kv_heads).transpose(1, 2, 0, 3)


def _softmax_combine(recent: Array, recent_v: Array, cache: Array | None, cache_mean: Array | None) -> Array:
  """Normalises scores over the recent keys and the codebook jointly and mixes their values.

  recent [B,R,Hk,G,I,J] with recent_v [B,R,J,Hk,Dv]; cache [B,R,Hk,G,I,S] with cache_mean
  [B,R,Hk,S,Dv] -> [B,R,I,Hk,G,Dv]. The max is a constant for the gradient (softmax is
  shift-invariant) and the weights are normalised before touching the values.
  """
  m = recent.max(-1)
  if cache is not None:
    m = jnp.maximum(m, cache.max(-1))
  m = sg(m)[..., None]
  a_recent = jnp.exp(recent - m)  # <= 1: one max over the recent keys and the codes together
  denom = a_recent.sum(-1)
  if cache is not None:
    a_cache = jnp.exp(cache - m)
    denom = denom + a_cache.sum(-1)
  denom = denom[..., None]
  out = jnp.einsum("brhgij,brjhv->brihgv", a_recent / denom, recent_v.astype(jnp.float32))
  if cache is not None:
    out = out + jnp.einsum("brhgis,brhsv->brihgv", a_cache / denom, cache_mean)
  return out


def xl_bias_blocks(rel: tuple[Array, Array], num_kv_heads: int, block_len: int) -> Array:
  """Transformer-XL position term for every query block against its [previous, present] keys.

  rel = (rel_q [B,T,H,Dk], rel_table [H,L+1,Dk]) -> float32 [B,R,Hk,G,L,2L]: key j of the window
  is at distance L + i - j from query i; distances 0..L get (q + v).r_d, the rest 0.
  """
  rel_q, rel_table = rel
  b, t = rel_q.shape[:2]
  l = block_len
  rq = group_heads(rel_q, num_kv_heads).reshape(b, t // l, l, num_kv_heads, -1, rel_q.shape[-1])
  rq = rq.transpose(0, 1, 3, 4, 2, 5)  # [B,R,Hk,G,L,Dk]
  table = group_table(rel_table, num_kv_heads)
  by_distance = jnp.einsum("brhgik,hgdk->brhgid", rq.astype(jnp.float32), table.astype(jnp.float32))
  # Flipped, column c holds distance L - c; `skew` shifts row i right by i: column j holds distance L + i - j.
  return skew(jnp.flip(by_distance, -1), 2 * l)


def previous_blocks(x: Array, carried: Array, block_len: int) -> Array:
  """Each block's previous block: x [B,T,...] -> [B,R,L,...], block 0's being `carried` [B,L,...]."""
  b, t = x.shape[:2]
  blocks = x.reshape((b, t // block_len, block_len) + x.shape[2:])
  return jnp.concatenate([carried[:, None].astype(x.dtype), blocks[:, :-1]], axis=1)


def fold_codes(z_prev: Array, plan: dict | None, *, n_code: int) -> tuple[Array, Array]:
  """The codes each block's previous block folds into the cache with, z_prev [B,R,L,Hk] or the empty code S
  for a key that does not enter it (another document follows), and where the prefix over the carried
  cache and the folds restarts (bool [B,R+1]; a block that starts a new document drops the cache before)."""
  b, r = z_prev.shape[:2]
  if plan is None:
    return z_prev, jnp.zeros((b, r + 1), bool)
  z_fold = jnp.where(plan["enters"][..., None], z_prev, n_code)
  return z_fold, jnp.concatenate([jnp.zeros((b, 1), bool), ~plan["keep"]], axis=1)


def cache_variables(
  z_prev: Array, v_prev: Array, carry: dict, plan: dict | None, *, n_code: int, reduction: str
) -> tuple[Array, Array]:
  """The compressive cache every block reads, and the one after the last block: z_prev [B,R,L,Hk] and
  v_prev [B,R,L,Hk,Dv] each block's previous block (`previous_blocks`); `plan` from `document_plan` or
  None -> (mean [B,R+1,Hk,S,Dv], count [B,R+1,Hk,S]); block r reads index r, index R is the new carry's.

  Block n sees the carried cache, then the folds of the carried previous block and of blocks <= n-2 (the
  fold after block n adds block n - 1); with documents only the keys that enter, restarting where a fold
  drops the cache."""
  z_fold, reset = fold_codes(z_prev, plan, n_code=n_code)
  # Each block's previous block summarised per code (mean, count), after the carried cache ...
  mean_p, count_p = block_summaries(z_fold, v_prev, n_code)
  mean_seq = jnp.concatenate([carry["mean"][:, None], mean_p], axis=1)
  # The counts are of integer codes: the carried ones, like the window's own, have no gradient.
  count_seq = jnp.concatenate([sg(carry["count"])[:, None], count_p], axis=1)
  # ... and merged by a running (count-weighted) prefix: index r is what block r reads.
  return prefix_summaries(mean_seq, count_seq, reduction, reset)


def cached_attention(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  carry: dict,
  bias: Array | None,
  *,
  block_len: int,
  reduction: str,
  compressive: bool,
  segments: Array | None = None,
  grad_through_cache: bool = True,
  carry_gradient: bool = False,
) -> tuple[Array, dict]:
  """`kernels.vq.vq_attention_blocks` in XLA with the position term given as `xl_bias_blocks`' output;
  `segments` int [B,T] (optional) keeps each query to its own document (`document_plan`);
  `grad_through_cache=False` holds the state one block passes to the next constant in the backward
  pass (the authors' `grad_thru_cache=0`): the compressive cache's value means and the previous
  block's keys and values.
  The carry after the last block has its gradient stopped, as between update windows, unless
  `carry_gradient` (`chunked_attention`'s scan passes it from one chunk to the next)."""
  b, t, h, dk = q.shape
  hk, s = codebook.shape[0], codebook.shape[1]
  l = block_len
  r = t // l

  def blocks(x):
    return x.reshape((b, r, l) + x.shape[2:])

  qb, kb, zb, vb = blocks(group_heads(q, hk).astype(jnp.float32)), blocks(k_hat), blocks(z), blocks(v)
  k_prev, v_prev, z_prev = (previous_blocks(x, carry[n], l) for x, n in ((k_hat, "k"), (v, "v"), (z, "z")))
  if not grad_through_cache:  # the state passed from block to block is constant: the previous block too
    k_prev, v_prev = sg(k_prev), sg(v_prev)
  recent_k = jnp.concatenate([k_prev, kb], axis=2)  # [B,R,2L,Hk,Dk]
  recent_v = jnp.concatenate([v_prev, vb], axis=2)
  recent_z = jnp.concatenate([z_prev, zb], axis=2)  # [B,R,2L,Hk]

  i = jnp.arange(l)[:, None]
  j = jnp.arange(2 * l)[None, :]
  distance = l + i - j  # [L,2L]: the previous block's keys come first
  keep = (distance >= 0) & (recent_z != s).transpose(0, 1, 3, 2)[:, :, :, None, None, :]
  if not compressive:
    keep = keep & (distance <= l)
  plan = None if segments is None else document_plan(segments, carry["seg"], l)
  if plan is not None:
    recent_seg = jnp.concatenate([plan["prev"], plan["seg"]], axis=2)  # [B,R,2L]
    keep = keep & (plan["seg"][..., :, None] == recent_seg[..., None, :])[:, :, None, None]
  scores = jnp.einsum("brihgk,brjhk->brhgij", qb, recent_k.astype(jnp.float32))
  if bias is not None:
    scores = scores + bias
  scores = jnp.where(keep, scores, -MASK)

  cum_mean, cum_count = cache_variables(z_prev, v_prev, carry, plan, n_code=s, reduction=reduction)

  cache_scores = cache_mean = None
  if compressive:
    cache_mean = cum_mean[:, :r] if grad_through_cache else sg(cum_mean[:, :r])
    count = cum_count[:, :r]
    # a code's weight is count_s exp(q.c_s): its score gets log count_s; an empty code none
    log_count = jnp.where(count > 0, jnp.log(jnp.maximum(count, 1.0)), -MASK)
    cache_scores = jnp.einsum("brihgk,hsk->brhgis", qb, codebook.astype(jnp.float32))
    cache_scores = cache_scores + log_count[:, :, :, None, None, :]
    if plan is not None:
      # a query whose document is not the cache's reads no code
      cache_scores = jnp.where(plan["reads"][:, :, None, None, :, None], cache_scores, -MASK)

  out = _softmax_combine(scores, recent_v, cache_scores, cache_mean)
  out = out.reshape(b, t, h, v.shape[-1]).astype(v.dtype)
  new_carry = {
    "k": kb[:, -1],
    "v": vb[:, -1],
    "z": zb[:, -1],
    "mean": cum_mean[:, r],
    "count": cum_count[:, r],
    "seg": carry["seg"] if plan is None else plan["seg"][:, -1],
  }
  return out, (new_carry if carry_gradient else jax.tree.map(sg, new_carry))


def chunked_attention(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  carry: dict,
  rel: tuple[Array, Array] | None,
  *,
  block_len: int,
  chunk_blocks: int,
  reduction: str,
  compressive: bool,
  segments: Array | None = None,
  grad_through_cache: bool = True,
  carry_gradient: bool = False,
) -> tuple[Array, dict]:
  """`cached_attention` run `chunk_blocks` blocks at a time (a lax.scan over chunks, the cache carried
  from one to the next with its gradient), the position term built per chunk from `rel`. The same
  function; its largest arrays (scores and position terms [.., L, 2L] per block) then span one chunk
  instead of the whole sequence, so they stay in cache however long the sequence: the time per token
  stays flat instead of growing with the length. chunk_blocks <= 0, or at least the number of blocks:
  all at once. With carry_gradient the carry comes back with its gradient (a caller that runs a
  sequence block by block and passes it on), else held constant."""
  b, t = q.shape[:2]
  hk = codebook.shape[0]
  r = t // block_len
  opts = dict(
    block_len=block_len,
    reduction=reduction,
    compressive=compressive,
    grad_through_cache=grad_through_cache,
    carry_gradient=True,
  )

  def attend(carry, x):  # the blocks of x: its q, k_hat, z, v and, if given, rel_q and segments
    bias = xl_bias_blocks((x["rel_q"], rel[1]), hk, block_len) if "rel_q" in x else None
    out, carry = cached_attention(
      x["q"], x["k_hat"], x["z"], x["v"], codebook, carry, bias, segments=x.get("segments"), **opts
    )
    return carry, out

  xs = {"q": q, "k_hat": k_hat, "z": z, "v": v}
  if rel is not None:
    xs["rel_q"] = rel[0]
  if segments is not None:
    xs["segments"] = segments
  if chunk_blocks <= 0 or chunk_blocks >= r or r % chunk_blocks:
    new_carry, out = attend(carry, xs)
  else:
    n, c = r // chunk_blocks, chunk_blocks * block_len
    chunked = jax.tree.map(lambda x: jnp.moveaxis(x.reshape((b, n, c) + x.shape[2:]), 1, 0), xs)  # [N,B,C,...]
    new_carry, out = jax.lax.scan(attend, carry, chunked)
    out = jnp.moveaxis(out, 0, 1).reshape((b, t) + out.shape[3:])
  return out, (new_carry if carry_gradient else jax.tree.map(sg, new_carry))


def init_decode_state(
  batch_size: int, block_len: int, num_heads: int, n_code: int, d_k: int, d_v: int, dtype=jnp.float32
) -> dict[str, Array]:
  """Token-by-token cache: the previous and the present block ([B,2L,...]) plus the compressive cache."""
  state = init_carry(batch_size, 2 * block_len, num_heads, n_code, d_k, d_v, dtype)
  del state["seg"]  # decoding is one document
  return dict(state, index=jnp.zeros((), jnp.int32))


def decode_step(
  q: Array,
  k_hat: Array,
  z: Array,
  v: Array,
  codebook: Array,
  state: dict,
  *,
  rel: tuple[Array, Array] | None = None,
  compressive: bool = True,
) -> tuple[Array, dict]:
  """One position of `kernels.vq.vq_attention_blocks`, in O(L + S) time and memory whatever the context.

  q [B,1,H,Dk], k_hat [B,1,Hk,Dk], z [B,1,Hk], v [B,1,Hk,Dv]; `state` from `init_decode_state`.
  When a new block starts, the previous block is folded into the per-code counts and means and
  the present block becomes the previous one, exactly as in the blockwise form.
  """
  l = state["k"].shape[1] // 2
  s = codebook.shape[1]
  hk = codebook.shape[0]
  t = state["index"]
  a = t % l
  roll = (a == 0) & (t > 0)
  mean_prev, count_prev = block_summaries(state["z"][:, None, :l], state["v"][:, None, :l], s)
  folded = merge((state["mean"], state["count"]), (mean_prev[:, 0], count_prev[:, 0]))

  def shift(x, empty):
    moved = jnp.concatenate([x[:, l:], jnp.full_like(x[:, l:], empty)], axis=1)
    return jnp.where(roll, moved, x)

  keys, values, codes = shift(state["k"], 0), shift(state["v"], 0), shift(state["z"], s)
  mean = jnp.where(roll, folded[0], state["mean"])
  count = jnp.where(roll, folded[1], state["count"])
  slot = l + a
  keys = jax.lax.dynamic_update_slice_in_dim(keys, k_hat.astype(keys.dtype), slot, axis=1)
  values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), slot, axis=1)
  codes = jax.lax.dynamic_update_slice_in_dim(codes, z, slot, axis=1)

  qg = group_heads(q, hk).astype(jnp.float32)[:, None]  # [B,1,1,Hk,G,Dk]
  distance = (slot - jnp.arange(2 * l))[None, :]  # [1,2L]
  keep = (codes != s).transpose(0, 2, 1)[:, None, :, None, None, :]
  if not compressive:
    keep = keep & (distance <= l)
  scores = jnp.einsum("brihgk,bjhk->brhgij", qg, keys.astype(jnp.float32))
  if rel is not None:
    rel_q, rel_table = rel
    rq = group_heads(rel_q, hk)[:, None].transpose(0, 1, 3, 4, 2, 5)
    scores = scores + relative_bias(rq, group_table(rel_table, hk), distance)
  scores = jnp.where(keep, scores, -MASK)
  cache_scores = cache_mean = None
  if compressive:
    log_count = jnp.where(count > 0, jnp.log(jnp.maximum(count, 1.0)), -MASK)
    cache_scores = jnp.einsum("brihgk,hsk->brhgis", qg, codebook.astype(jnp.float32))
    cache_scores = cache_scores + log_count[:, None, :, None, None, :]
    cache_mean = mean[:, None]
  out = _softmax_combine(scores, values[:, None], cache_scores, cache_mean)
  out = out.reshape(q.shape[:3] + (v.shape[-1],)).astype(v.dtype)
  return out, {"k": keys, "v": values, "z": codes, "mean": mean, "count": count, "index": t + 1}


# -- quadratic oracles ---------------------------------------------------------------------------


def dense_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  window: int | None = None,
  rel: tuple[Array, Array] | None = None,
  sliding: bool = False,
  segments: Array | None = None,
) -> Array:
  """Quadratic causal softmax attention with the same optional position terms as the VQ core.

  q [B,T,H,Dk], k [B,T,Hk,Dk], v [B,T,Hk,Dv]. With `rel` = (rel_q, rel_table [H,window+1,Dk])
  keys at distance <= window get the XL bias; `sliding` masks keys farther than `window`;
  `segments` int [B,T] masks keys of other documents.
  """
  b, t, h, _ = q.shape
  hk = k.shape[2]
  qg = group_heads(q, hk).astype(jnp.float32)
  scores = jnp.einsum("bihgk,bjhk->bhgij", qg, k.astype(jnp.float32))
  distance = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
  keep = distance >= 0
  if rel is not None:
    rel_q, rel_table = rel
    rq = group_heads(rel_q, hk).transpose(0, 2, 3, 1, 4)
    by_distance = jnp.einsum(
      "...hgik,hgdk->...hgid", rq.astype(jnp.float32), group_table(rel_table, hk).astype(jnp.float32)
    )
    scores = scores + band_to_matrix(by_distance)
  if sliding:
    keep = keep & (distance <= window)
  if segments is not None:
    keep = keep & (segments[:, :, None] == segments[:, None, :])[:, None, None]
  weights = jax.nn.softmax(jnp.where(keep, scores, -MASK), axis=-1)
  out = jnp.einsum("bhgij,bjhv->bihgv", weights, v.astype(jnp.float32))
  return out.reshape(b, t, h, v.shape[-1]).astype(v.dtype)


def skew(x: Array, width: int) -> Array:
  """[..., I, C] -> [..., I, width] with out[i, k] = x[i, k - i] for 0 <= k - i < C, else 0.

  Row i is shifted right by i through one pad and reshape (Transformer-XL's relative shift), so
  no gather (and no scatter in the backward pass) is needed. Needs width >= C + I - 2.
  """
  *lead, i, c = x.shape
  flat = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (0, width + 1 - c)]).reshape(*lead, i * (width + 1))
  return flat[..., : i * width].reshape(*lead, i, width)


def band_to_matrix(by_distance: Array) -> Array:
  """[..., T, W+1] values at distances 0..W -> [..., T, T]: out[i, j] = by_distance[i, i - j] for
  0 <= i - j <= W, else 0."""
  t, w = by_distance.shape[-2], by_distance.shape[-1] - 1
  return skew(jnp.flip(by_distance, -1), w + t)[..., w:]


def vq_attention_reference(q: Array, k: Array, v: Array, codebook: Array, *, segments: Array | None = None) -> Array:
  """The quadratic definition: causal softmax attention over k replaced by its nearest codeword
  (within each query's document when `segments` int [B,T] is given)."""
  z, _ = quantize(sg(k), sg(codebook))
  return dense_attention(q, codewords(z, codebook), v, segments=segments)
