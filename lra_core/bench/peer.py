"""A reference model to time our train step against: what a peer implementation must provide.

A peer is a plain JAX implementation of the same model at the same size, written the way its public
code base writes it (see lra_core/bench/peer_lm1b.py and peer_vq.py). The side-by-side benchmark
(scripts/peer_bench.py) times our trainer's full train step and the peer's step in one process,
interleaved, with the same optimizer built from the same config.

  Peer.init(key)                       -> (params, state)   params are trained; state is carried
                                                            (e.g. codebook statistics), may be {}
  Peer.loss(params, state, batch, key) -> (loss, new_state)  batch: {"inputs", "targets"} int32 [B,T]

The peer's step is value_and_grad of `loss` with respect to params, the optimizer update, and the
new state: nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class Peer(NamedTuple):
  name: str
  init: Callable[[jax.Array], tuple[Any, Any]]
  loss: Callable[[Any, Any, dict, jax.Array], tuple[jax.Array, Any]]
