"""Context parallelism: one sequence's time axis split over the `sequence` mesh axes.

Under `lra_core.sharding.activate` with a `sequence` mesh axis of size n > 1, each chip holds T / n
consecutive steps of every row. Token-wise work (projections, MLPs, norms) needs nothing more; what
reads across time runs per chip in `per_chip` (a `jax.shard_map` with time split, 't' in the dims of
kernels/toolkit.py) and passes between chips only what crosses a boundary, in three kinds:

  a prefix of summaries  `fold_before` / `fold_after`: every chip's summary of its slice (Latte's
                         (num, den, max) of the document open at its end, a recurrence's (A, h)) is
                         merged with those of the chips before it (after it, for the backward
                         direction) into the state it starts from: a log-depth scan of `ppermute`s,
                         log2(n) + 1 rounds each sending one summary. (An all-gather of the n
                         summaries sends n: for Transformer-VQ's PG-19 cache over 64 chips, about 590 GiB
                         per chip and step against 44 GiB, docs/long_context.md.)
  a total                `total` / `maximum`: psum / pmax, for the bidirectional forms.
  a halo                 `before` / `after`: the last (first) few steps of the neighbouring chip
                         (`ppermute`), for what looks back a fixed distance: segment ids at the
                         boundary, Transformer-VQ's previous block, a window's neighbouring block.
  a ring                 `rotate`: a whole slice passed on to the next chip, n - 1 times, for what
                         reads every step: softmax attention's keys and values (ring attention).
  a gather               `gather`: every chip's slice at once, in time order: softmax attention's keys
                         and values for splash (kernels/softmax/library.py).

Inside `per_chip` the functions below act across chips; anywhere else they are the one-device case
(nothing before, nothing after, the total is the local sum), so a kernel written with them is the
same code split or not. Documents (kernels/packed_documents.py) cross chips like anything else: a summary
says whether its slice starts a new document (`fresh`), and a fold restarts there.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lra_core.kernels import per_device

Array = jax.Array
_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("sequence_axes", default=())
_ZIGZAG: contextvars.ContextVar[bool] = contextvars.ContextVar("zigzag_order", default=False)


def axes() -> tuple[str, ...]:
  """The mesh axes the time axis is split over in the per-chip function being traced; () outside."""
  return _AXES.get()


@contextlib.contextmanager
def within(names: tuple[str, ...]) -> Iterator[None]:
  """Traces as on one chip's slice split over `names` (() : unsplit). `per_chip` enters it; a
  custom_vjp's backward, traced after the forward has left it, enters it again."""
  token = _AXES.set(names)
  try:
    yield
  finally:
    _AXES.reset(token)


whole_rows = per_device.whole_rows  # rows one chip holds whole (a block's tokens, a group's)


def split(length: int) -> bool:
  """Whether a time axis of `length` steps would be split by `per_chip` here."""
  return not axes() and bool(per_device.sequence_axes(length))


def balanced(length: int) -> bool:
  """Whether a split time axis of `length` steps can be held in the zig-zag order (`to_zigzag`): it
  splits here and each chip's slice halves."""
  return split(length) and (length // per_device.sequence_slices(length)) % 2 == 0


def per_chip(
  fn: Callable, args: Sequence, dims: Sequence, out_dims, *, batch: int, heads: int, length: int, kv_heads=None
):
  """fn(*args) with the time axis (letter 't' of `dims`, kernels/toolkit.py `run_per_device`) split
  over the sequence mesh axes when the kernel mesh has them and they divide `length`; inside, the
  functions of this module act across the chips. Without a split (or already inside one): fn(*args)."""
  names = per_device.sequence_axes(length)
  if not names or axes():
    return fn(*args)

  def body(*local):
    with within(names):
      return fn(*local)

  kw = dict(batch=batch, heads=heads, kv_heads=kv_heads, length=length)
  return per_device.run_per_device(body, args, dims, out_dims, **kw)


def index() -> Array | int:
  """This chip's place along the split (0 for the first slice of time)."""
  return jax.lax.axis_index(axes()) if axes() else 0


def count() -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes())


def offset(local_length: int) -> Array | int:
  """The global time index of this chip's first step."""
  return index() * local_length


def steps_of(chip: Array | int, local_length: int) -> Array:
  """The global time index of each step chip `chip` holds: its slice of consecutive steps, or in the
  zig-zag order (`zigzag_order`) pieces `chip` and 2n-1-chip of the 2n pieces of local_length / 2."""
  if not zigzag():
    return chip * local_length + jnp.arange(local_length)
  half, n = local_length // 2, count()
  return jnp.concatenate([chip * half + jnp.arange(half), (2 * n - 1 - chip) * half + jnp.arange(half)])


def _shifted(x: Array, step: int) -> Array:
  """x from the chip `step` places before (step > 0) or after (step < 0); zeros where none is."""
  n = count()
  pairs = [(i, i + step) for i in range(n) if 0 <= i + step < n]
  return jax.lax.ppermute(x, axes(), pairs)


def rotate(x: Array) -> Array:
  """x from the chip before, the first chip receiving the last chip's: one step round the ring (ring
  attention's key-value slices, kernels/softmax/ring.py); x itself outside a split."""
  if not axes():
    return x
  n = count()
  return jax.lax.ppermute(x, axes(), [(i, (i + 1) % n) for i in range(n)])


def before(x: Array, steps: int, fill) -> Array:
  """The `steps` positions before this chip's slice along axis 1 of x [B,T,...]: the previous chip's
  last ones; `fill` on the first chip (and outside a split, where nothing comes before)."""
  edge = jnp.full((x.shape[0], steps) + x.shape[2:], fill, x.dtype)
  if not axes():
    return edge
  return jnp.where(index() == 0, edge, _shifted(x[:, -steps:], 1))


def after(x: Array, steps: int, fill) -> Array:
  """The `steps` positions after this chip's slice: the next chip's first ones; `fill` on the last."""
  edge = jnp.full((x.shape[0], steps) + x.shape[2:], fill, x.dtype)
  if not axes():
    return edge
  return jnp.where(index() == count() - 1, edge, _shifted(x[:, :steps], -1))


def select(pick: Array, a, b):
  """pytree select by a bool that broadcasts against the leading axes of every leaf (the batch; or batch
  and spans, kernels/latte/spans.py)."""
  return jax.tree.map(lambda x, y: jnp.where(pick.reshape(pick.shape + (1,) * (x.ndim - pick.ndim)), x, y), a, b)


def restarting(merge: Callable) -> Callable:
  """The associative step of a fold that restarts: (summary, fresh) of a run of slices, then of the next
  run -> of both, the later run's summary alone where a document starts in it (its `fresh`), else
  `merge(earlier, later)`. The chips' folds here and the spans' (kernels/latte/spans.py) scan with it."""

  def compose(a, c):
    (va, fa), (vc, fc) = a, c
    return select(fc, vc, merge(va, vc)), fa | fc

  return compose


def fold_before(value, merge: Callable, first, fresh: Array | None = None):
  """On chip i: `first` merged with the `value`s of chips 0 .. i-1 in time order, restarting at the
  last of them whose `fresh` is True (what its value sums starts on its slice: a document; the
  values before it drop out); `first` on chip 0 and outside a split. `merge(earlier, later)` must be
  associative; values are pytrees of [B, ...] arrays, fresh bool [B] (None: never). A log-depth scan
  over the chips (`_scan`): each chip sends log2(n) + 1 values, where an all-gather would send n."""
  return _fold(value, merge, first, fresh, reverse=False)


def fold_after(value, merge: Callable, last, fresh: Array | None = None):
  """The mirror of `fold_before`: the values of chips i+1 .. n-1 merged (in time order) with `last`,
  up to the first of them whose `fresh` is True (what its value sums ends on its slice: the values
  after it drop out)."""
  return _fold(value, merge, last, fresh, reverse=True)


def _fold(value, merge, edge, fresh, *, reverse: bool):
  if not axes():
    return edge
  b = jax.tree.leaves(value)[0].shape[0]
  fresh = jnp.zeros((b,), bool) if fresh is None else fresh
  ordered = (lambda x, y: merge(y, x)) if reverse else merge  # `earlier` of the direction folded in
  # the segment summary of a's chips followed by c's (in the direction folded)
  prefix = _scan((value, fresh), restarting(ordered), reverse)  # this chip's and every chip's before it, inclusive
  shift = -1 if reverse else 1
  n, me = count(), index()
  behind, stop = jax.tree.map(lambda x: _shifted(x, shift), prefix)  # the chips strictly before
  folded = select(stop, behind, ordered(edge, behind))
  first_chip = me == (n - 1 if reverse else 0)
  return jax.tree.map(lambda e, f: jnp.where(first_chip, e, f), edge, folded)


def _scan(summary, compose: Callable, reverse: bool):
  """Inclusive scan of `summary` over the chips in log2(n) rounds of ppermute (Hillis and Steele):
  round k composes the summary 2^k chips back into this one."""
  n, me, step = count(), index(), 1
  while step < n:
    back = jax.tree.map(lambda x: _shifted(x, -step if reverse else step), summary)
    reached = (me + step < n) if reverse else (me >= step)
    summary = jax.tree.map(lambda old, new: jnp.where(reached, new, old), summary, compose(back, summary))
    step *= 2
  return summary


def total(x: Array) -> Array:
  """The sum over the chips (psum); x itself outside a split."""
  return jax.lax.psum(x, axes()) if axes() else x


def maximum(x: Array) -> Array:
  return jax.lax.pmax(x, axes()) if axes() else x


# -- the linear recurrence h_t = a_t h_{t-1} + b_t ----------------------------------------------------


def _affine(first, then):
  """The composition of the maps h -> a h + b, `first` applied first."""
  (a1, b1), (a2, b2) = first, then
  return a1 * a2, a2 * b1 + b2


def affine_scan(a: Array, b: Array, *, reverse: bool = False) -> Array:
  """h_t = a_t h_{t-1} + b_t along axis 1 from h = 0 (reverse: h_t = a_t h_{t+1} + b_t), a broadcast
  to b's shape. O(log T) depth; split over chips, each chip's (prod a, h at its end) is folded into
  the h it starts from (`fold_before`), which reaches step t scaled by the product of a up to t."""
  a = jnp.broadcast_to(a, b.shape)
  prod, h = jax.lax.associative_scan(_affine, (a, b), axis=1, reverse=reverse)
  if not axes():
    return h
  end = 0 if reverse else -1
  summary = (prod[:, end], h[:, end])
  identity = (jnp.ones_like(summary[0]), jnp.zeros_like(summary[1]))
  # merge(earlier, later) in time order; backwards the later chip's map applies first. A restart
  # is a = 0: no `fresh` needed.
  if reverse:
    _, h_in = fold_after(summary, lambda earlier, later: _affine(later, earlier), identity)
  else:
    _, h_in = fold_before(summary, _affine, identity)
  return h + prod * h_in[:, None]


def linear_recurrence(a: Array, b: Array, *, reverse: bool = False, dims: str | None = None) -> Array:
  """`affine_scan` of a, b [B,T,...] (a broadcastable to b), per chip where the sequence axes split T.
  `dims`: b's letters for kernels/toolkit.py (default batch, time, then nothing split)."""
  dims = dims or "bt" + "." * (b.ndim - 2)
  a = jnp.broadcast_to(a, b.shape)
  fn = lambda a, b: affine_scan(a, b, reverse=reverse)
  heads = b.shape[dims.index("h")] if "h" in dims else 1
  return per_chip(fn, (a, b), (dims, dims), dims, batch=b.shape[0], heads=heads, length=b.shape[1])


# -- the load-balanced ("zig-zag") order ------------------------------------------------------------
# Causal attention over a split sequence gives the chip holding its end n times the first chip's work.
# Cut time into 2n pieces and give chip i pieces i and 2n-1-i: every chip then holds one early and one
# late piece, and a causal ring (kernels/softmax/ring.py) gives each the same work. A model reorders
# its activations once on the way in and once on the way out (two ppermutes each); token-wise work
# does not care, and attention masks by the true steps (`steps_of`).


@contextlib.contextmanager
def zigzag_order() -> Iterator[None]:
  """Traces a model part whose split sequence is held in the zig-zag order (`to_zigzag`)."""
  token = _ZIGZAG.set(True)
  try:
    yield
  finally:
    _ZIGZAG.reset(token)


def zigzag() -> bool:
  """Whether the split sequence being traced is held in the zig-zag order."""
  return _ZIGZAG.get() and bool(axes())


def zigzag_ahead(length: int) -> bool:
  """Outside `per_chip`: whether a time axis of `length` steps it splits is held in the zig-zag order."""
  return _ZIGZAG.get() and split(length)


def held_steps(n: int, local_length: int, zigzag_: bool) -> np.ndarray:
  """The global time index of every step, chip after chip, as n chips of `local_length` steps hold them
  (`steps_of` for all chips at once, in numpy for what is built before tracing)."""
  if not zigzag_:
    return np.arange(n * local_length, dtype=np.int32)
  half = local_length // 2
  pieces = [(c, 2 * n - 1 - c) for c in range(n)]
  return np.concatenate([p * half + np.arange(half, dtype=np.int32) for pair in pieces for p in pair])


def gather(x: Array) -> Array:
  """Every chip's slice of x [B,t,...] (time split here), as one [B,n t,...] array in time order on each
  chip (all_gather; its transpose hands each chip the gradient of its own slice); x outside a split."""
  if not axes():
    return x
  whole = jax.lax.all_gather(x, axes(), axis=1, tiled=True)
  if not zigzag():
    return whole
  # chip c's halves are pieces c and 2n-1-c: the first halves in chip order, then the second in reverse
  n, half = count(), x.shape[1] // 2
  by_chip = whole.reshape(x.shape[0], n, 2, half, *x.shape[2:])
  ordered = jnp.concatenate([by_chip[:, :, 0], by_chip[:, ::-1, 1]], axis=1)
  return ordered.reshape(whole.shape)


def _pieces(forward: bool) -> tuple[list, list]:
  """The ppermute pairs that move each chip's first and second half (forward: to the zig-zag order,
  piece c of 2n from chip c // 2 to chip c or 2n-1-c; else back)."""
  n = count()
  home = lambda c: c if c < n else 2 * n - 1 - c
  pairs = [[(i, home(2 * i + half)) for i in range(n)] for half in (0, 1)]
  return pairs if forward else [[(b, a) for a, b in p] for p in pairs]


def _reorder(x: Array, forward: bool) -> Array:
  """One chip's [B,t,...] in the zig-zag order (forward) or back to consecutive steps."""
  t = x.shape[1]
  if t % 2:
    raise ValueError(f"the zig-zag order halves each chip's slice; {t} steps do not halve.")
  even = index() % 2 == 0
  first, second = x[:, : t // 2], x[:, t // 2 :]
  by_half = _pieces(forward)
  if forward:  # chip k receives piece k (its first half) and piece 2n-1-k (its second), by parity of k
    got = [jax.lax.ppermute(part, axes(), pairs) for part, pairs in zip((first, second), by_half)]
    return jnp.where(even, jnp.concatenate(got, 1), jnp.concatenate(got[::-1], 1))
  # back: each piece returns along the pairs it came by (the first half came by the even pieces' pairs
  # on an even chip, by the odd pieces' pairs on an odd one)
  sent = (jnp.where(even, first, second), jnp.where(even, second, first))
  got = [jax.lax.ppermute(part, axes(), pairs) for part, pairs in zip(sent, by_half)]
  return jnp.concatenate(got, 1)


def to_zigzag(arrays, *, batch: int, length: int):
  """A pytree of [B,T,...] arrays (None kept) with the time axis split over the sequence axes, in the
  zig-zag order; unchanged where nothing splits T."""
  return _reorder_tree(arrays, True, batch=batch, length=length)


def from_zigzag(arrays, *, batch: int, length: int):
  """The inverse of `to_zigzag`."""
  return _reorder_tree(arrays, False, batch=batch, length=length)


def _reorder_tree(arrays, forward: bool, *, batch: int, length: int):
  leaves, tree = jax.tree.flatten(arrays)
  if not split(length) or not leaves:
    return arrays
  dims = ["bt" + "." * (x.ndim - 2) for x in leaves]
  run = lambda *xs: [_reorder(x, forward) for x in xs]
  out = per_chip(run, leaves, dims, dims, batch=batch, heads=1, length=length)
  return jax.tree.unflatten(tree, out)
