"""Context parallelism: one sequence's time axis split over the `sequence` mesh axes.

Under `lra_core.sharding.activate` with a `sequence` mesh axis of size n > 1, each chip holds T / n
consecutive steps of every row. Token-wise work (projections, MLPs, norms) needs nothing more; what
reads across time runs per chip in `per_chip` (a `jax.shard_map` with time split, 't' in the dims of
kernels/toolkit.py) and passes between chips only what crosses a boundary, in three kinds:

  a prefix of summaries  `fold_before` / `fold_after`: every chip's summary of its slice (Latte's
                         (num, den, max) of the document open at its end, a recurrence's (A, h)) is
                         all-gathered, and each chip folds those of the chips before it (after it,
                         for the backward direction) into the state it starts from. One collective
                         of n small states; a log-depth `ppermute` scan would need log2 n dependent
                         ones for the same bytes.
  a total                `total` / `maximum`: psum / pmax, for the bidirectional forms.
  a halo                 `before` / `after`: the last (first) few steps of the neighbouring chip
                         (`ppermute`), for what looks back a fixed distance: segment ids at the
                         boundary, a convolution's taps.

Inside `per_chip` the functions below act across chips; anywhere else they are the one-device case
(nothing before, nothing after, the total is the local sum), so a kernel written with them is the
same code split or not. Documents (kernels/segments.py) cross chips like anything else: a summary
says whether its slice starts a new document (`fresh`), and a fold restarts there.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from lra_core.kernels import toolkit

Array = jax.Array
_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("sequence_axes", default=())


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


def split(length: int) -> bool:
  """Whether a time axis of `length` steps would be split by `per_chip` here."""
  return not axes() and bool(toolkit.sequence_axes(length))


def per_chip(
  fn: Callable, args: Sequence, dims: Sequence, out_dims, *, batch: int, heads: int, length: int, kv_heads=None
):
  """fn(*args) with the time axis (letter 't' of `dims`, kernels/toolkit.py `run_per_device`) split
  over the sequence mesh axes when the kernel mesh has them and they divide `length`; inside, the
  functions of this module act across the chips. Without a split (or already inside one): fn(*args)."""
  names = toolkit.sequence_axes(length)
  if not names or axes():
    return fn(*args)

  def body(*local):
    with within(names):
      return fn(*local)

  kw = dict(batch=batch, heads=heads, kv_heads=kv_heads, length=length)
  return toolkit.run_per_device(body, args, dims, out_dims, **kw)


def index() -> Array | int:
  """This chip's place along the split (0 for the first slice of time)."""
  return jax.lax.axis_index(axes()) if axes() else 0


def count() -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes())


def offset(local_length: int) -> Array | int:
  """The global time index of this chip's first step."""
  return index() * local_length


def _shifted(x: Array, step: int) -> Array:
  """x from the chip `step` places before (step > 0) or after (step < 0); zeros where none is."""
  n = count()
  pairs = [(i, i + step) for i in range(n) if 0 <= i + step < n]
  return jax.lax.ppermute(x, axes(), pairs)


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


def _where(pick: Array, a, b):
  """pytree select by a scalar bool."""
  return jax.tree.map(lambda x, y: jnp.where(pick, x, y), a, b)


def fold_before(summary, combine: Callable, first):
  """combine(...combine(first, s_0)..., s_{i-1}) on chip i, s_j the chips' `summary` pytrees in time
  order; `first` on chip 0 (and outside a split). `combine(acc, s)` must be associative in its
  effect; it is applied in order, so it need not commute."""
  return _fold(summary, combine, first, reverse=False)


def fold_after(summary, combine: Callable, last):
  """The mirror of `fold_before`: combine(...combine(last, s_{n-1})..., s_{i+1}) on chip i."""
  return _fold(summary, combine, last, reverse=True)


def _fold(summary, combine, start, *, reverse: bool):
  if not axes():
    return start
  gathered = jax.tree.map(lambda s: jax.lax.all_gather(s, axes()), summary)  # [n, ...] in chip order
  n, me = count(), index()

  def step(acc, item):
    j, s = item
    reached = j > me if reverse else j < me
    return _where(reached, combine(acc, s), acc), None

  order = jnp.arange(n)
  if reverse:
    order, gathered = order[::-1], jax.tree.map(lambda g: g[::-1], gathered)
  return jax.lax.scan(step, start, (order, gathered))[0]


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
  fold = fold_after if reverse else fold_before
  _, h_in = fold(summary, _affine, identity)
  return h + prod * h_in[:, None]


def linear_recurrence(a: Array, b: Array, *, reverse: bool = False, dims: str | None = None) -> Array:
  """`affine_scan` of a, b [B,T,...] (a broadcastable to b), per chip where the sequence axes split T.
  `dims`: b's letters for kernels/toolkit.py (default batch, time, then nothing split)."""
  dims = dims or "bt" + "." * (b.ndim - 2)
  a = jnp.broadcast_to(a, b.shape)
  fn = lambda a, b: affine_scan(a, b, reverse=reverse)
  heads = b.shape[dims.index("h")] if "h" in dims else 1
  return per_chip(fn, (a, b), (dims, dims), dims, batch=b.shape[0], heads=heads, length=b.shape[1])
