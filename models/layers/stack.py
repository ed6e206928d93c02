"""Stacks of repeated layers: built in a loop, optionally stacked and scanned, optionally rematerialised.

Two switches of `config.model` (lra_core.config adds them to every family):
  scan_layers  False: N separate layers (an nnx.List), applied one after another, so the compiled
               program holds N copies of the layer body. True: the N layers, built exactly as
               before (same rngs, same order), are stacked into one module whose variables carry a
               leading layer axis [N, ...] (logical axis "layers", mapped to no mesh axis), and a
               `jax.lax.scan` applies it: one layer body in the program.
  remat        "none" keeps every activation for the backward pass; "full" recomputes each layer
               in the backward pass and keeps only its input; "dots" keeps the outputs of every
               matmul; "dots_no_batch" keeps those of matmuls without batch dimensions (the
               projections, not attention scores).

The stacked module's variables sit under the key STACKED in the pure state dict, so
`lra_core.layer_stacks.unscan_params` splits them back into per-layer entries without knowing the model.
Layers applied here must not change their own variables (statistics leave through the outputs).
Dropout keys come from the caller's nnx.Rngs, whose state is carried from layer to layer, so a
scanned stack draws exactly the masks the loop draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.layer_stacks import REMAT_POLICIES, STACKED

Array = jax.Array

# What each remat name keeps for the backward pass (None: nothing but the layer's inputs).
POLICIES = {
  "full": None,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert set(POLICIES) | {"none"} == set(REMAT_POLICIES)


class Stacked(nnx.Module):
  """N layers of one structure as one module with variables [N, ...]; indexing gives layer i."""

  def __init__(self, layers: list[nnx.Module]):
    graphdef = nnx.graphdef(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
    for _, var in nnx.to_flat_state(stacked):
      axes = var.get_metadata().get("logical_axes")
      if axes is not None:
        var.set_metadata("logical_axes", ("layers",) + tuple(axes))
    setattr(self, STACKED, nnx.merge(graphdef, stacked))
    self.num_layers = len(layers)

  @property
  def body(self) -> nnx.Module:
    return getattr(self, STACKED)

  def __len__(self) -> int:
    return self.num_layers

  def __getitem__(self, i) -> nnx.Module:
    """Layer i as its own module (a copy holding slices: for reading, e.g. in decoding)."""
    if not -self.num_layers <= i < self.num_layers:
      raise IndexError(f"layer {i} of a stack of {self.num_layers}.")
    graphdef, state = nnx.split(self.body)
    # A copy: writes to it do not reach the stack (decoding only reads layers).
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))

  def __iter__(self):
    return (self[i] for i in range(self.num_layers))


def make_layers(
  make: Callable[..., nnx.Module], num_layers: int, *, scan: bool, indexed: bool = False
) -> nnx.List | Stacked:
  """`num_layers` layers from `make()` (`make(i)` with `indexed`: layers that differ by their index)
  called in a loop, stacked when `scan` (and there are any)."""
  layers = [make(i) if indexed else make() for i in range(num_layers)]
  return Stacked(layers) if scan and layers else nnx.List(layers)


def scan(
  stacks, fn: Callable, carry: Any, xs: Any = None, *, remat: str = "none", rngs: nnx.Rngs | None = None
) -> tuple[Any, Any]:
  """carry, y_i = fn(layer_i, carry, x_i, rngs) for each layer i; -> (carry, ys [N, ...] or None).

  `stacks` is one stack from make_layers, or a tuple of stacks of equal length whose layers i are
  applied together (fn gets the tuple). xs: per-layer inputs with a leading axis N (or None).
  """
  single = not isinstance(stacks, tuple)
  stacks = (stacks,) if single else stacks
  n = len(stacks[0])
  if n == 0:
    return carry, None
  pick = (lambda layers: layers[0]) if single else tuple
  at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  scanned = isinstance(stacks[0], Stacked)
  if not scanned and remat == "none":  # the plain loop
    ys = []
    for i in range(n):
      carry, y = fn(pick([s[i] for s in stacks]), carry, at(xs, i), rngs)
      ys.append(y)
    return carry, stack_trees(ys)

  # The Rngs' state travels through the loop or scan as a value, so every layer draws the dropout keys
  # the plain loop would draw, in the same order, also under remat and scan.
  rng_def, rng_state = nnx.split(rngs) if rngs is not None else (None, None)

  def layer_step(defs):
    def step(states, carry, x, rng_state):
      layers = [nnx.merge(d, s) for d, s in zip(defs, states)]
      r = None if rng_def is None else nnx.merge(rng_def, rng_state)
      carry, y = fn(pick(layers), carry, x, r)
      return carry, y, None if r is None else nnx.state(r)

    # Remat wraps one layer: the backward pass recomputes it from its input (and what the policy keeps).
    return step if remat == "none" else jax.checkpoint(step, policy=POLICIES[remat])

  if scanned:
    defs, states = zip(*(nnx.split(s.body) for s in stacks))
    step = layer_step(defs)

    def body(c, inputs):
      carry, rng_state = c
      layer_states, x = inputs
      carry, y, rng_state = step(layer_states, carry, x, rng_state)
      return (carry, rng_state), y

    (carry, rng_state), ys = jax.lax.scan(body, (carry, rng_state), (tuple(states), xs))
  else:
    ys = []
    for i in range(n):
      defs, states = zip(*(nnx.split(s[i]) for s in stacks))
      carry, y, rng_state = layer_step(defs)(states, carry, at(xs, i), rng_state)
      ys.append(y)
    ys = stack_trees(ys)
  if rngs is not None:  # hand the advanced counts back, as the plain loop would have left them
    nnx.update(rngs, rng_state)
  return carry, ys


def apply(stacks, x: Array, call: Callable, *, remat: str = "none", rngs: nnx.Rngs | None = None) -> Array:
  """x through every layer: x = call(layer, x, rngs) (see `scan` for `stacks`)."""
  x, _ = scan(stacks, lambda layer, x, _, r: (call(layer, x, r), None), x, remat=remat, rngs=rngs)
  return x


def stack_trees(ys: list) -> Any:
  """N trees of one structure -> one tree with a leading axis N (None if all are None)."""
  if all(y is None for y in ys):
    return None
  return jax.tree.map(lambda *a: jnp.stack(a), *ys)


def unstack(tree: Any, n: int) -> list:
  """A tree with a leading axis N -> N trees (per-layer carries kept as lists)."""
  return [jax.tree.map(lambda a: a[i], tree) for i in range(n)]
