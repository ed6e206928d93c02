"""Scanned layer stacks in pure trees: the per-layer layout and the stacked one.

With `model.scan_layers` a stack of N layers is stored as one entry {STACKED: tree of [N, ...]}
in place of {0: tree, ..., N-1: tree} (models/layers/stack.py). `unscan_params` reads any tree in
the per-layer layout (`restack_like` and lra_core.run.state.scan_params go the other way), and
`per_layer_optimizer` lets the optimizer see that layout, so weight-decay masks, factored second
moments and parameter groups treat each layer as they do without scanning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The key under which a scanned stack's variables sit.
STACKED = "stacked_layers"

# model.remat: what the backward pass keeps of each layer (models/layers/stack.py maps the names).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# Fields every family's config.model has (lra_core.config adds them, family configs start from
# them): the layer-stacking switches, which trade memory and compile time for compute, and which
# kernel computes softmax attention (kernels/softmax/library.py: "auto" is the platform's own).
MODEL_DEFAULTS = {"remat": "none", "scan_layers": False, "attention_impl": "auto"}


def map_dicts(tree, fn, path: tuple = ()):
  """Rebuilds `tree` bottom-up, replacing each dict d at dict-key path p by fn(p, d); lists, tuples
  and named tuples (optimizer states) are walked through without adding to the path."""
  if isinstance(tree, dict):
    return fn(path, {k: map_dicts(v, fn, path + (k,)) for k, v in tree.items()})
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(map_dicts(v, fn, path) for v in tree))
  if isinstance(tree, (list, tuple)):
    return type(tree)(map_dicts(v, fn, path) for v in tree)
  return tree


def unscan_params(tree):
  """Each scanned stack {STACKED: tree of [N, ...]} -> {0: tree, ..., N-1: tree} (the layout of
  model.scan_layers=False); anything else is unchanged."""

  def split(_, d: dict):
    if set(d) != {STACKED}:
      return d
    leaves = [x for x in jax.tree.leaves(d[STACKED]) if np.ndim(x)]
    n = np.shape(leaves[0])[0]
    return {i: jax.tree.map(lambda x: x[i] if np.ndim(x) else x, d[STACKED]) for i in range(n)}

  return map_dicts(tree, split)


def restack_like(tree, like):
  """The per-layer entries of `tree` stacked wherever `like` holds a scanned stack (same paths)."""
  if isinstance(like, dict):
    if set(like) == {STACKED}:
      return {STACKED: jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[i] for i in range(len(tree))])}
    return {k: restack_like(tree[k], v) for k, v in like.items()}
  return tree


def per_layer_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` on the per-layer layout: its state is kept per layer, updates come back stacked."""

  def init(params):
    return tx.init(unscan_params(params))

  def update(updates, state, params=None):
    out, state = tx.update(unscan_params(updates), state, None if params is None else unscan_params(params))
    return restack_like(out, updates), state

  return optax.GradientTransformation(init, update)
