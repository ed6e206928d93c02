"""Shared layers against jax's own definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_core.models.blocks.layers import ACTIVATIONS, silu


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_silu_matches_jax_in_value_and_gradient(dtype, atol):
  x = jnp.asarray(np.random.default_rng(0).normal(0.0, 4.0, (4, 33)), dtype)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(4, 33)), dtype)

  def pullback(f):
    y, vjp = jax.vjp(jax.jit(f), x)
    return y, vjp(cotangent)[0]

  (y, g), (y_ref, g_ref) = pullback(silu), pullback(jax.nn.silu)
  assert y.dtype == g.dtype == dtype
  np.testing.assert_allclose(np.float32(y), np.float32(y_ref), atol=atol, rtol=atol)
  np.testing.assert_allclose(np.float32(g), np.float32(g_ref), atol=atol, rtol=atol)
  # Under remat (the rematerialised forward differentiates through the same rule) and vmap.
  g_remat = jax.grad(lambda v: jnp.sum(jax.checkpoint(silu)(v) * cotangent))(x)
  g_vmap = jax.vmap(jax.grad(lambda v, c: jnp.sum(silu(v) * c)))(x, cotangent)
  np.testing.assert_allclose(np.float32(g_remat), np.float32(g), atol=atol, rtol=atol)
  np.testing.assert_allclose(np.float32(g_vmap), np.float32(g), atol=atol, rtol=atol)
  assert ACTIVATIONS["silu"] is silu


def test_silu_backward_keeps_only_its_input():
  x = jnp.linspace(-4.0, 4.0, 64).reshape(8, 8)
  residuals = lambda f: jax.tree_util.tree_leaves(jax.vjp(f, x)[1])
  assert len(residuals(jax.nn.silu)) > 1  # x and sigmoid(x) (and more), the cost this avoids
  (kept,) = residuals(silu)
  np.testing.assert_array_equal(kept, x)
