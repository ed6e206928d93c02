"""Softmax self-attention on the platforms' own flash kernels, with the XLA reference as the fallback.

`self_attention(..., impl=)` is what every softmax self-attention layer calls in training and in a full
forward pass (decoding reads a cache: always the reference), and `cross_attention(..., impl=)` every
layer whose queries read another stream (FIT's latents and tokens, the Block Transformer's token
decoder reading its block's context). The implementations:

  "xla"     kernels/softmax/reference.py: the masked T x T scores, or the banded O(T window) form for a
            sliding window. The reference, and the CPU path.
  "splash"  jax's splash attention for TPU (jax.experimental.pallas.ops.tpu.splash_attention): a
            Mosaic flash kernel that never forms the scores and skips the blocks a causal or
            sliding-window mask empties; document ids as its segment ids; grouped and multi-query
            heads natively.
  "triton"  jax's Pallas flash attention for NVIDIA GPUs (jax.experimental.pallas.ops.gpu.attention,
            compiled through Triton): causal and document masks; grouped key-value heads are
            repeated to the query heads; no sliding window.
  "auto"    splash for a TPU target, triton for a GPU target, xla elsewhere (the platform the step is
            traced for: kernels/toolkit.py).

Both library kernels ship with jax, so they need no new dependency and move with the jax pin. cuDNN's
fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) needs the cuDNN library at
trace time and a device to build its graph, and takes no document ids; it stays for a GPU host.

A sequence split over chips (kernels/context_parallel.py) runs on splash with every chip's keys gathered
(`_split_splash`); "xla" there is ring attention (kernels/softmax/ring.py).

What a kernel cannot take falls back to "xla", with one log line saying why (once per reason): a mask
over given positions rather than the row order (FIT-AR's group-causal latents), attention dropout (it
acts on probabilities the kernels never form), a split sequence on GPU or with a sliding window (which
reads only the neighbouring chips' steps) or not whole 128-step blocks per chip, a sliding window on
GPU, a sequence shorter than one 128-step block (a longer one is padded to whole blocks). Padding
(`k_valid`) becomes a segment id of its own, so a valid query reads exactly the valid keys of its
document, as in "xla"; a padded query reads only padding there (the reference lets it read valid keys):
outputs at padded positions differ, and nothing downstream reads them.

Neither library kernel declares a cost, and a kernel is opaque to the compiler, so each call runs in a
named scope stating its matrix-product FLOPs per device (the blocks its mask leaves, from the kernel's
own block lists); the scope reaches the compiled program's op names, where `kernel_flops` reads it back
for the roofline (lra_core/cost/hlo_cost.py).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

from lra_core.kernels import context_parallel, per_device, toolkit
from lra_core.kernels.softmax import splash_lists
from lra_core.kernels.softmax.reference import attention_mask, dot_product_attention, local_attention
from lra_core.kernels.softmax.ring import ring_attention

Array = jax.Array
IMPLS = ("auto", "xla", "splash", "triton")
_BY_PLATFORM = {"tpu": "splash", "gpu": "triton"}
_log = logging.getLogger(__name__)
_NOTED: set[tuple[str, str]] = set()
_PADDING, _PADDED = -1, -2  # the kernels' segment ids of masked padding, and of the steps added to fill a block
_COST = re.compile(r"flash_flops_fwd(\d+)_dq(\d+)_dkv(\d+)")  # the cost scope (module docstring)


def resolve(impl: str) -> str:
  """The implementation `impl` names on the platform being traced for ("auto": its library kernel)."""
  if impl not in IMPLS:
    raise ValueError(f"attention implementation {impl!r} is not one of {list(IMPLS)}.")
  return _BY_PLATFORM.get(toolkit.platform(), "xla") if impl == "auto" else impl


def chosen_for(impl: str, why_not: str = "") -> str:
  """What a layer with a reference of its own runs: "xla" (its reference) where `impl` resolves to it, or
  where the layer gives `why_not`, the reason its attention cannot go to a kernel (logged once); else
  the kernel's name, to pass on as `impl`."""
  chosen = resolve(impl)
  if chosen != "xla" and why_not:
    _note(chosen, why_not)
    return "xla"
  return chosen


def reference(
  q, k, v, *, causal, window=0, k_valid=None, segments=None, positions=None, scale=None, soft_cap=0.0, probs_fn=None
) -> Array:
  """The "xla" path: banded for a window shorter than the sequence (masks by row order), ring attention
  for a sequence split over chips (kernels/softmax/ring.py), the full masked scores otherwise (by
  `positions` where given)."""
  t = q.shape[1]
  if window and t > window and positions is None:
    kw = dict(k_valid=k_valid, segments=segments, scale=scale, soft_cap=soft_cap, probs_fn=probs_fn)
    return local_attention(q, k, v, window=window, causal=causal, **kw)
  if (
    probs_fn is None and context_parallel.split(t) and not (window and positions is not None)
  ):  # a split sequence: the ring
    kw = dict(k_valid=k_valid, segments=segments, positions=positions, scale=scale, soft_cap=soft_cap)
    return ring_attention(q, k, v, causal=causal, **kw)
  positions = jnp.arange(t) if positions is None else positions
  mask = attention_mask(
    positions, positions, causal=causal, window=window, k_valid=k_valid, q_segments=segments, k_segments=segments
  )
  return dot_product_attention(q, k, v, mask=mask, scale=scale, soft_cap=soft_cap, probs_fn=probs_fn)


def self_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool,
  window: int = 0,
  k_valid: Array | None = None,
  segments: Array | None = None,
  positions: Array | None = None,
  scale: float | None = None,
  soft_cap: float = 0.0,
  probs_fn: Callable[[Array], Array] | None = None,
  impl: str = "xla",
) -> Array:
  """softmax(q k^T scale, masked) v over one sequence: q [B,T,H,D], k [B,T,K,D], v [B,T,K,Dv] ->
  [B,T,H,Dv]; masks as `kernels.softmax.reference.attention_mask` (causal, window, k_valid: bool[B,T] False =
  padding, segments: int[B,T] document ids). positions: int[T] or [B,T] the causal mask compares (None:
  the row order; any other order is the reference's alone). soft_cap: the scores' bound
  (`kernels.softmax.reference.cap`; 0 none). `impl` one of IMPLS."""
  chosen = resolve(impl)
  if chosen != "xla":
    why = _unsupported(chosen, q, k, v, window=window, probs_fn=probs_fn, positions=positions, soft_cap=soft_cap)
    if why:
      _note(chosen, why)
      chosen = "xla"
  if chosen == "xla":
    return reference(
      q,
      k,
      v,
      causal=causal,
      window=window,
      k_valid=k_valid,
      segments=segments,
      positions=positions,
      scale=scale,
      soft_cap=soft_cap,
      probs_fn=probs_fn,
    )
  b, t, h, d = q.shape
  scale = d**-0.5 if scale is None else scale
  ids = _ids(k_valid, segments, b, t)
  if context_parallel.split(t):  # whole blocks per chip (_unsupported): splash over the gathered keys
    return _split_splash(q, k, v, ids, causal=causal, scale=scale, soft_cap=soft_cap)
  if chosen == "splash":
    window = window if window and t > window else 0
    run = functools.partial(_splash, causal=causal, window=window, scale=scale, soft_cap=soft_cap)
  else:
    run = lambda q, k, v, ids, _: _triton(q, k, v, ids, causal=causal, scale=scale)
  # The kernels take whole 128-step blocks: the steps added at the end carry an id no query shares, so no
  # real query reads them (causal ones never could), and their outputs are dropped.
  pad = -t % 128
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=_PADDED)
  args, dims = (q, k, v, ids, ids), ("bth.", "btk.", "btk.", "bt", "bt")
  return per_device.run_per_device(run, args, dims, "bth.", batch=b, heads=h, kv_heads=k.shape[2])[:, :t]


def cross_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  k_valid: Array | None = None,
  mask: Array | None = None,
  scale: float | None = None,
  impl: str = "xla",
) -> Array:
  """softmax(q k^T scale, masked) v of one stream's queries over another stream's keys: q [B,Tq,H,D],
  k [B,Tk,K,D], v [B,Tk,K,Dv] -> [B,Tq,H,Dv]; k_valid: bool[B,Tk] (False: a key no query reads); mask:
  bool[B,Tq,Tk], which keys each query reads (both given: combined). A row whose keys are all masked
  reads all of them alike, in every implementation."""
  chosen = resolve(impl)
  if chosen != "xla":
    why = _cross_unsupported(chosen, q, k, k_valid=k_valid, mask=mask)
    if why:
      _note(chosen, why)
      chosen = "xla"
  if chosen == "xla":
    if k_valid is not None:
      mask = k_valid[:, None, :] if mask is None else mask & k_valid[:, None, :]
    return dot_product_attention(q, k, v, mask=mask, scale=scale)
  b, tq, h, d = q.shape
  tk = k.shape[1]
  scale = d**-0.5 if scale is None else scale
  # Queries all read as one document; the keys no query reads are padding. A row with no valid key reads
  # every key alike, as the reference's fully masked softmax does: its queries take the padding's id and
  # are zeroed (equal scores), which also gives them the reference's zero gradient.
  k_ids = _ids(k_valid, None, b, tk)
  q_ids = jnp.zeros((b, tq), jnp.int32)
  if k_valid is not None:
    some = jnp.any(k_valid, axis=1)
    q_ids = jnp.where(some[:, None], q_ids, _PADDING)
    q = jnp.where(some[:, None, None, None], q, 0)
  # Whole 128-step blocks, the added steps apart as in self_attention; an added query reads the keys
  # alike (finite), and its output is dropped.
  pad_q, pad_k = -tq % 128, -tk % 128
  q, q_ids = (
    jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0))),
    jnp.pad(q_ids, ((0, 0), (0, pad_q)), constant_values=_PADDED),
  )
  k, v = (jnp.pad(x, ((0, 0), (0, pad_k), (0, 0), (0, 0))) for x in (k, v))
  k_ids = jnp.pad(k_ids, ((0, 0), (0, pad_k)), constant_values=_PADDED)
  if chosen == "splash":
    run = functools.partial(_splash, causal=False, window=0, scale=scale, soft_cap=0.0)
  else:  # no ids (_cross_unsupported): the keys fill whole blocks and none is masked
    run = lambda q, k, v, *_: _triton(q, k, v, None, causal=False, scale=scale)
  # time is '.': these rows are whole (a split sequence falls back before here)
  args, dims = (q, k, v, q_ids, k_ids), ("b.h.", "b.k.", "b.k.", "b.", "b.")
  return per_device.run_per_device(run, args, dims, "b.h.", batch=b, heads=h, kv_heads=k.shape[2])[:, :tq]


def block(t: int, largest: int = 512) -> int:
  """The kernels' block along time: the largest power of two from 128 to `largest` dividing t (0: none)."""
  size = largest
  while size >= 128 and t % size:
    size //= 2
  return size if size >= 128 else 0


def kernel_flops(op_name: str) -> float | None:
  """The matrix-product FLOPs of one library-kernel call of a compiled program, read from its op name
  (`metadata={op_name=...}`: the cost scope around the call, and the kernel's name before "/pallas_call");
  None for a call outside any cost scope."""
  found = _COST.search(op_name)
  if found is None:
    return None
  fwd, dq, dkv = map(float, found.groups())
  kernel = op_name.removesuffix("/pallas_call").rsplit("/", 1)[-1]
  if "preprocess" in kernel:  # the GPU backward's rowwise sum(out * dout): no matrix product
    return 0.0
  if "dkv" in kernel:
    return dkv
  if "dq" in kernel:
    return dq
  if "backward" in kernel:  # the GPU kernel computes dq and dk, dv in one call
    return dq + dkv
  return fwd


def _cost_scope(pairs_fwd: int, pairs_bwd: int, d: int, dv: int) -> str:
  """The named scope stating a kernel call's FLOPs per device, from the (query, key) score entries its
  forward and its backward kernels compute (whole blocks, all heads and rows). Forward: scores and
  probabilities x values; dq: scores again, dprobs and dscores x keys; dk, dv: scores, dprobs, probs^T x
  dout and dscores^T x queries. Each product is 2 FLOPs per score entry and head dimension."""
  fwd, dq, dkv = 2 * pairs_fwd * (d + dv), 2 * pairs_bwd * (2 * d + dv), 4 * pairs_bwd * (d + dv)
  return f"flash_flops_fwd{fwd}_dq{dq}_dkv{dkv}"


def _live_blocks(n: int, size: int, causal: bool, window: int) -> int:
  """Of the n x n blocks of `size` steps, those where some query sees some key: the ones splash computes
  (its block lists skip the rest; the lists are traced values inside a jit, so counted here)."""
  if not window:
    return n * (n + 1) // 2 if causal else n * n
  # Key block i + j against query block i spans key - query offsets j*size - (size-1) .. j*size + (size-1);
  # the window keeps offsets -(window-1) .. 0 (causal) or .. window-1.
  behind, ahead = window - 1, 0 if causal else window - 1
  lowest, highest = max(-(n - 1), -((behind + size - 1) // size)), min(n - 1, (ahead + size - 1) // size)
  return sum(n - abs(j) for j in range(lowest, highest + 1))


def _unsupported(impl: str, q: Array, k: Array, v: Array, *, window: int, probs_fn, positions, soft_cap: float) -> str:
  t = q.shape[1]
  if positions is not None:
    return "the mask follows given positions (FIT-AR's group-causal latents), not the row order"
  if probs_fn is not None:
    return "attention dropout acts on the probabilities, which a flash kernel never forms"
  if context_parallel.axes():
    return "it runs inside another kernel's per-chip function: ring attention on the XLA core"
  if context_parallel.split(t):
    if impl == "triton":  # its causal mask aligns the queries with the keys: no chip's slice against the whole
      return "the GPU kernel takes no offset between queries and keys: ring attention on the XLA core"
    if window and t > window:
      return "a sliding window over a split sequence reads only its neighbours' steps, on the XLA core"
    n = per_device.sequence_slices(t)
    local = t // n
    if local % 128:
      return f"a chip's slice of {local} steps is not whole 128-step blocks: ring attention on the XLA core"
    lists = _split_lists_bytes(t, n, context_parallel.zigzag_ahead(t))
    if lists > SCALAR_MEMORY_BUDGET:
      return (
        f"splash's block lists for {t:,} steps over {n} chips would take {lists / 2**20:.1f} MiB of a chip's "
        f"scalar memory (at most {SCALAR_MEMORY_BUDGET / 2**20:.1f}): ring attention on the XLA core"
      )
  if t < 128:
    return f"the length {t} is shorter than the kernel's 128-step block"
  if impl == "triton":
    if window and t > window:
      return "the GPU kernel has no sliding window"
    if soft_cap:
      return "the GPU kernel has no soft cap on the scores"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
      return f"the GPU kernel needs one head width for q, k and v, not {q.shape[-1]} and {v.shape[-1]}"
  return ""


def _cross_unsupported(impl: str, q: Array, k: Array, *, k_valid, mask) -> str:
  tq, tk = q.shape[1], k.shape[1]
  if mask is not None:
    return (
      "the keys each query reads are given query by query (a [B,Tq,Tk] mask), which the kernels' masks cannot state"
    )
  if context_parallel.axes():
    return "the sequence is split over chips: ring attention runs on the XLA core"
  if min(tq, tk) < 128:
    return f"the {tq} queries or {tk} keys are fewer than the kernel's 128-step block"
  if impl == "triton":
    if k_valid is not None or tk % 128:
      return "the GPU kernel takes one id array for queries and keys, so no padded keys across two streams"
    if not (q.shape[-1] == k.shape[-1]):
      return f"the GPU kernel needs one head width for q, k and v, not {q.shape[-1]} and {k.shape[-1]}"
  return ""


def _note(impl: str, why: str) -> None:
  if (impl, why) not in _NOTED:
    _NOTED.add((impl, why))
    _log.info("attention: %s falls back to xla: %s.", impl, why)


def _ids(k_valid: Array | None, segments: Array | None, b: int, t: int) -> Array:
  """int32[B,T] ids for the kernels' segment masks: document ids, padding an id of its own (-1)."""
  ids = jnp.zeros((b, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
  return ids if k_valid is None else jnp.where(k_valid, ids, _PADDING)


def _splash(
  q: Array, k: Array, v: Array, q_ids: Array, k_ids: Array, *, causal: bool, window: int, scale: float, soft_cap: float
) -> Array:
  b, tq, h, _ = q.shape
  tk, kv_heads = k.shape[1], k.shape[2]
  if window:  # keys within `window` steps: behind only (causal), or on both sides
    one = masks.LocalMask((tq, tk), (window - 1, 0 if causal else window - 1), offset=0)
  else:
    one = masks.CausalMask((tq, tk)) if causal else masks.FullMask((tq, tk))
  # A window shorter than a block: blocks of about the window, so a query block reads its own and the
  # previous key block (2 x 128 keys for Latte-Macchiato's 128, not 2 x 512); the kernel works a whole
  # block it does not skip, so larger blocks than the window compute scores the mask then drops.
  largest = min(512, max(128, 1 << (window - 1).bit_length())) if window else 512
  size_q, size_k = block(tq, largest), block(tk, largest)
  make = splash.make_splash_mqa_single_device if kv_heads == 1 else splash.make_splash_mha_single_device
  kernel = make(
    masks.MultiHeadMask([one] * h),
    block_sizes=_block_sizes(size_q, size_k),
    attn_logits_soft_cap=soft_cap or None,  # capped after the scale, which q carries in
    interpret=toolkit.interpret_default(),
  )
  if tq == tk:  # self-attention: the blocks its mask keeps
    pairs = b * h * _live_blocks(tq // size_q, size_q, causal, window) * size_q * size_q
  else:  # two streams: every block
    pairs = b * h * tq * tk
  return _run_splash(kernel, q, k, v, q_ids, k_ids, scale=scale, pairs=pairs)


def _split_splash(q: Array, k: Array, v: Array, ids: Array, *, causal: bool, scale: float, soft_cap: float) -> Array:
  """Self-attention over a sequence split over chips (kernels/context_parallel.py) on splash: each chip gathers
  every chip's keys, values and ids (`context_parallel.gather`, in time order) and runs its own queries against
  them in one kernel call. The mask is the whole sequence's [T,T], made once with `q_seq_shards` = the
  chips, so its block lists split by query rows like the queries: each chip's kernel gets its rows'
  lists only and skips the key blocks they may not read (a causal chip's later ones). In the zig-zag
  order the mask's `q_sequence` lists the steps a chip's rows hold (pieces c and 2n-1-c), so every chip
  works the same number of blocks. The backward pass is splash's own; the gathered keys' and values'
  gradients go back to their chips as a reduce-scatter (the all-gather's transpose).

  Why not ring attention with splash at each step: a ring merges the steps by their log-sum-exp, and
  splash's log-sum-exp output (`save_residuals`) has no gradient. What gathering costs: every chip holds
  the whole row's keys and values (and their gradients) for one layer at a time."""
  b, t, h, _ = q.shape
  kv_heads = k.shape[2]
  n = per_device.sequence_slices(t)
  zigzag = context_parallel.zigzag_ahead(t)
  kernel, live = _whole_sequence_kernel(t, n, kv_heads, causal, zigzag, soft_cap, toolkit.interpret_default())

  def run(q, k, v, q_ids, k_ids, kernel):
    k, v, k_ids = (context_parallel.gather(x) for x in (k, v, k_ids))
    return _run_splash(kernel, q, k, v, q_ids, k_ids, scale=scale, pairs=q.shape[0] * q.shape[2] * live)

  # The block lists split over the chips along their query rows (axis 1; the queries' steps, axis 0),
  # as splash's own `manual_sharding_spec` splits them.
  rows = {"data_next": ".t.", "mask_next": ".t.", "block_mask": ".t.", "partial_mask_blocks": "...", "q_sequence": "t"}
  if not causal:  # one chip's lists, the same on every chip
    rows = {f: "." * len(d) for f, d in rows.items()}
  by_rows = lambda info: (
    None if info is None else info._replace(**{f: rows[f] for f in rows if getattr(info, f) is not None})
  )
  kernel_dims = jax.tree.map(by_rows, kernel, is_leaf=lambda x: isinstance(x, mask_info_lib.MaskInfo) or x is None)
  args, dims = (q, k, v, ids, ids, kernel), ("bth.", "btk.", "btk.", "bt", "bt", kernel_dims)
  return context_parallel.per_chip(run, args, dims, "bth.", batch=b, heads=h, kv_heads=kv_heads, length=t)


# Splash fetches its block lists into the chip's scalar memory (SMEM), 1 MiB on a v5p: libtpu took 0.75
# MiB of lists there (2,097,152 steps over 64 chips) and refused a 2 MiB list (a 16.8M-token Block
# Transformer row's); the rest is the kernel's other scalars.
SCALAR_MEMORY_BUDGET = 3 * 2**18


def _split_lists_bytes(t: int, n: int, zigzag: bool) -> int:
  """The most bytes of block lists (data_next and block_mask) `_split_splash`'s kernel for t steps over n
  chips puts in one chip's scalar memory: a row of query blocks may visit every key block."""
  size = _split_block(t // n, zigzag)
  rows, columns = t // n // size, t // size
  # block_mask int8; data_next (a key block's index) in the narrowest type holding columns - 1
  entry = 1 + (1 if columns <= 128 else 2 if columns <= 32768 else 4)
  return rows * columns * entry


def _split_block(local: int, zigzag: bool) -> int:
  """`_split_splash`'s square blocks: as on one chip; in the zig-zag order no larger than a piece where a
  piece holds whole blocks, so a block's rows are one piece's and its skipped key blocks the piece's."""
  return (zigzag and block(local // 2)) or block(local)


@functools.lru_cache(maxsize=16)
def _whole_sequence_kernel(
  t: int, n: int, kv_heads: int, causal: bool, zigzag: bool, soft_cap: float, interpret: bool
) -> tuple[splash.SplashAttentionKernel, int]:
  """The splash kernel over a whole [T,T] mask for queries split over n chips, and the (query, key)
  score entries per row and head that the busiest chip's blocks hold (for the cost scope)."""
  local = t // n
  size = _split_block(local, zigzag)
  sizes = _block_sizes(size, size)
  settings = dict(block_sizes=sizes, is_mqa=kv_heads == 1, soft_cap=soft_cap or None, interpret=interpret)
  # The block lists in numpy, at any length (splash's own make walks the mask block by block: an hour at
  # a million steps) and for any platform (its jnp lists would need a device of the one compiled for).
  if causal:
    steps = context_parallel.held_steps(n, local, zigzag)  # the step each query row holds: what the mask compares
    kernel = splash_lists.causal_kernel(steps, t, shards=n, **settings)
  else:  # every chip's rows read every key: one chip's [T/n,T] lists serve all
    kernel, n = splash_lists.full_kernel(local, t, **settings), 1
  blocks = np.asarray(kernel.fwd_mask_info.block_mask)  # [1, query blocks, key blocks (shrunk)]: 0 = skipped
  busiest = max(int((chip != 0).sum()) for chip in np.split(blocks[0], n, axis=0))
  return kernel, busiest * size * size


def _block_sizes(size_q: int, size_k: int) -> splash.BlockSizes:
  """One block size along the queries and one along the keys, for the forward and both backward kernels."""
  return splash.BlockSizes(
    **dict.fromkeys(("block_q", "block_q_dkv", "block_q_dq"), size_q),
    **dict.fromkeys(("block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute", "block_kv_dq"), size_k),
  )


def _run_splash(kernel, q: Array, k: Array, v: Array, q_ids: Array, k_ids: Array, *, scale: float, pairs: int) -> Array:
  """kernel (splash's, for these heads) over q [B,Tq,H,D], k, v [B,Tk,K,D] -> [B,Tq,H,Dv], in a cost
  scope of `pairs` score entries (all rows and heads) forward and backward."""
  dtype, kv_heads = q.dtype, k.shape[2]
  if not toolkit.bf16_matmuls():  # Mosaic takes no bfloat16 matmul on TPU v2 / v3: the kernel runs in float32
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,N,D] -> [B,N,T,D]
  q, k, v = heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v)
  if kv_heads == 1:  # multi-query: one [T,D] key and value
    k, v = k[:, 0], v[:, 0]
  run = lambda q, k, v, q_ids, k_ids: kernel(q, k, v, segment_ids=splash.SegmentIds(q=q_ids, kv=k_ids))
  with jax.named_scope(_cost_scope(pairs, pairs, q.shape[-1], v.shape[-1])):
    return heads_first(jax.vmap(run)(q, k, v, q_ids, k_ids)).astype(dtype)


def _triton(q: Array, k: Array, v: Array, ids: Array | None, *, causal: bool, scale: float) -> Array:
  h, kv_heads = q.shape[2], k.shape[2]
  if kv_heads != h:  # the kernel reads query head n's keys at head n
    k, v = (jnp.repeat(x, h // kv_heads, axis=2) for x in (k, v))
  size, size_k = block(q.shape[1], 128), block(k.shape[1], 128)
  sizes = gpu_attention.BlockSizes(
    block_q=size, block_k=size_k, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
  )
  b, t, h, d = q.shape
  # the forward's blocks of `size` and the backward's of 32: a causal kernel stops at the diagonal block
  # (two streams: every block)
  pairs = lambda width: (
    b * h * (_live_blocks(t // width, width, causal, 0) * width * width if t == k.shape[1] else t * k.shape[1])
  )
  with jax.named_scope(_cost_scope(pairs(size), pairs(32), d, v.shape[-1])):
    return gpu_attention.mha(
      q, k, v, ids, sm_scale=scale, causal=causal, block_sizes=sizes, interpret=toolkit.interpret_default()
    )
