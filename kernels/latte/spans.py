"""Chunk-parallel passes for causal Latte: the sequence cut into spans of `span` tokens that run side by side,
so that a GPU's SMs fill at a training shape.

The causal scan is a chain of T / C dependent blocks per (batch, head, value tile): at B 8, T 8,192 and C4
Latte's widths the GPU's loop driver launches 256 such programs, two per SM of an H100, each walking 512
blocks. Cut into G spans of S tokens:

  1. each span's own state, the sums over the document open at its end (`reference.document_state`): one
     O(S L D) product per span, all of them at once;
  2. the state each span starts from: the given state folded with the spans before it, restarting at a
     document that starts inside one (`fold`: a log-depth associative scan over G, as kernels/context_parallel.py
     folds the chips' states; `reference.merge_states` rescales both sums to the larger max);
  3. the core over B G rows of S tokens, each row from its own starting state: G times the programs, each
     a chain of S / C blocks.

The output equals the unsplit scan's to float32 rounding (the same sums, added in another order). The
gradient needs nothing of its own: the core's VJP gives each row's starting state its gradient (the
kernels' `pallas._causal_bwd` computes it on chip), and JAX's VJP of the fold and of `document_state`
carries it on to the earlier spans' keys and values, O(T L D) more work in XLA.

kernels/latte/__init__.py applies this to either impl when a span is given, and by default to the kernels
on GPU (`pallas.default_span`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from lra_core.kernels import context_parallel
from lra_core.kernels.latte import reference

Array = jax.Array


def fold(own, fresh: Array, first, merge: Callable = reference.merge_states):
  """The state before each span: `first` (the sequence's given state, leaves [B,...]) merged with the `own`
  states (leaves [B,G,...]) of the spans before it in time order, restarting after the last of them whose
  `fresh` (bool [B,G]) is True (its own state sums a document that starts inside it, so the earlier ones drop
  out). `merge(earlier, later)`: associative (`reference.merge_states`; a sum for the linear sums)."""

  # [first, own_0 .. own_G-2] scanned inclusively: at g the fold of `first` and the spans before g
  shifted = jax.tree.map(lambda f, x: jnp.concatenate([f[:, None], x[:, :-1]], axis=1), first, own)
  restarts = jnp.concatenate([jnp.zeros_like(fresh[:, :1]), fresh[:, :-1]], axis=1)
  return jax.lax.associative_scan(context_parallel.restarting(merge), (shifted, restarts), axis=1)[0]


def causal(
  core: Callable,
  q: Array,
  k: Array,
  v: Array,
  *,
  span: int,
  state: dict[str, Array],
  segments: Array | None,
  latent_scale: Array | None,
) -> Array:
  """Causal Latte over spans of `span` tokens: `core(q, k, v, state=, segments=, latent_scale=)` is the
  unsplit core (`kernels.latte.causal_latte`'s arguments, [B,T,H,.]); its rows here are the B G spans, T
  padded to G spans (the padding's values reach no real output: only the spans before a span feed it)."""
  b, t, h, _ = q.shape
  g = -(-t // span)
  pad = lambda x, mode="constant": jnp.pad(x, [(0, 0), (0, g * span - t)] + [(0, 0)] * (x.ndim - 2), mode=mode)
  rows = lambda x: None if x is None else pad(x).reshape(b * g, span, *x.shape[2:])
  q, k, v, latent_scale = rows(q), rows(k), rows(v), rows(latent_scale)
  doc = reference.documents(pad(segments, "edge")) if segments is not None else jnp.zeros((b, g * span), jnp.int32)
  doc = doc.reshape(b, g, span)
  # the document of the token before each span: the given state's (document 0) before the first
  before = jnp.concatenate([jnp.zeros_like(doc[:, :1, 0]), doc[:, :-1, -1]], axis=1)  # [B,G]
  boundary = doc[:, :, 0] != before  # the span's first token starts a document: it starts from nothing
  fresh = doc[:, :, -1] != before  # a document starts inside the span: its own state drops the earlier ones
  span_segments = None if segments is None else doc.reshape(b * g, span)
  per_span = lambda tree: jax.tree.map(lambda x: x.reshape(b, g, *x.shape[1:]), tree)  # [B G,...] -> [B,G,...]
  # recomputed in the backward: the spans' exp weights ([B,T,H,L]) are not kept for the VJP
  own = jax.checkpoint(reference.document_state)(k, v, span_segments)
  start = fold(per_span(own), fresh, state)
  empty = per_span(reference.init_latte_state(b * g, h, q.shape[-1], v.shape[-1]))
  start = context_parallel.select(boundary, empty, start)
  start = jax.tree.map(lambda x: x.reshape(b * g, *x.shape[2:]), start)
  y = core(q, k, v, state=start, segments=span_segments, latent_scale=latent_scale)
  return y.reshape(b, g * span, h, -1)[:, :t]


# -- bidirectional Latte's scans, in the kernels' head-major layout (kernels/latte/pallas.py) -----------------


def count(length: int, span: int | None, block: int) -> tuple[int, int]:
  """(spans, tokens per span) of a scan over `length` tokens in blocks of `block`: the span rounded up to
  whole blocks; one span of the whole (padded) length where `span` is None or covers it."""
  whole = -(-length // block) * block
  if span is None or span >= whole:
    return 1, whole
  span = -(-span // block) * block
  return -(-length // span), span


def rows(x: Array, g: int) -> Array:
  """Head-major x [B,H,T,X] -> [B,H G,T/G,X]: each of the g spans a row of its own (the same bytes)."""
  b, h, t, w = x.shape
  return x.reshape(b, h * g, t // g, w)


def merge_rows(state: dict[str, Array], g: int) -> dict[str, Array]:
  """The reduction's states of the spans' rows, num [B,H G,D,L], den and max [B,H G,1,L] -> the whole
  sequence's [B,H,.,L]: both sums rescaled to the largest max (`reference.merge_states` over G at once)."""
  split = {n: x.reshape(x.shape[0], -1, g, *x.shape[2:]) for n, x in state.items()}
  m = split["max"].max(2)
  scale = jnp.exp(split["max"] - m[:, :, None])  # <= 1; 0 for a span of padding only
  return {"num": (scale * split["num"]).sum(2), "den": (scale * split["den"]).sum(2), "max": m}


def linear_starts(e: Array, v: Array, doc: Array, g: int) -> Array:
  """The linear sums' state each span starts from: e [B,H,T,X], v [B,H,T,Y] and the tokens' document
  indices doc [B,H,T,1] (float) -> num [B,H G,Y,X], the sum of v_s e_s over the tokens before the span in the
  document open at its start (the kernel keeps it only for the tokens that continue that document)."""
  b, h, t, x = e.shape
  split = lambda z: z.reshape(b * h, g, t // g, z.shape[-1])
  e, v, doc = split(e), split(v), split(doc)[..., 0]  # [B H,G,S,.]
  last = doc == doc[:, :, -1:]  # the tokens of the document open at a span's end
  own = jnp.einsum(
    "ngsy,ngsx->ngyx", jnp.where(last[..., None], v, 0.0), e, precision=jax.lax.Precision.HIGHEST
  )  # float32 sums of exponentials: no TF32 on GPU
  before = jnp.concatenate([doc[:, :1, 0], doc[:, :-1, -1]], axis=1)  # the token before each span's
  start = fold(own, doc[:, :, -1] != before, jnp.zeros_like(own[:, 0]), merge=jnp.add)
  return start.reshape(b, h * g, *start.shape[2:])
