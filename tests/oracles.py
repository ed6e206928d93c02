"""Model-level oracles shared by the autoregressive model tests (the protocol in the README, "Adding a model")."""

import jax.numpy as jnp
import numpy as np
from flax import nnx


def assert_no_future_leakage(model, tokens, logits, cuts, *, vocab: int, shift: int, changed_atol: float):
  """Changing tokens after t leaves the logits at <= t unchanged (atol 1e-6) and changes later ones."""
  for t in cuts:
    perturbed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + shift) % vocab)
    out = model(perturbed)
    np.testing.assert_allclose(out[:, :t + 1], logits[:, :t + 1], atol=1e-6)
    assert not np.allclose(out[:, t + 1:], logits[:, t + 1:], atol=changed_atol)


def assert_decode_matches_forward(model, tokens, logits, atol: float = 1e-4):
  """Stepping decode_step through the tokens one at a time reproduces the full forward pass."""
  b, t = tokens.shape
  step = nnx.jit(lambda m, tok, st: m.decode_step(tok, st))
  state = model.init_decode_state(b, t)
  outs = []
  for i in range(t):
    out, state = step(model, tokens[:, i:i + 1], state)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), logits, atol=atol)
