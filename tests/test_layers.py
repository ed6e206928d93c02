"""Shared layers against jax's own definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lra_core.kernels import toolkit
from lra_core.models.layers.core import ACTIVATIONS, contract, next_key, output_logits, silu


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_logits_equal_the_plain_product_and_free_their_gradient_with_the_tables(dtype):
  """The tied output projection's product equals x E^T in value and in both gradients (the same two
  products, float32 exactly, bfloat16 to its rounding), and its backward ties the input's gradient to the
  table's (one optimization barrier holding both), so the logits' gradient cannot outlive it."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, 8)), dtype)
  table = jnp.asarray(rng.normal(size=(11, 8)), dtype)
  plain = lambda x, t: jnp.einsum("...d,vd->...v", x, t)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda x, t: jnp.sum(jnp.sin(f(x, t).astype(jnp.float32))), (0, 1)))
  got, want = loss(output_logits)(x, table), loss(plain)(x, table)
  tol = 0 if dtype == jnp.float32 else 1e-2
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol, rtol=tol)
  backward = str(jax.make_jaxpr(jax.grad(lambda x, t: jnp.sum(output_logits(x, t)), (0, 1)))(x, table))
  assert backward.count("optimization_barrier") == 1


@pytest.mark.parametrize("in_shape,out_shape", [((6,), (5,)), ((2, 3), (4,)), ((6,), (2, 3))])
def test_contract_layouts_agree_in_value_and_gradient(in_shape, out_shape):
  """Dense's contraction: the CPU layout (one 2-D matmul over folded axes) and the accelerators'
  (one dot_general), both run here, equal x . kernel over the trailing axes, forward and backward."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, *in_shape)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(*in_shape, *out_shape)), jnp.float32)
  n_in = len(in_shape)
  expected = np.tensordot(np.asarray(x, np.float64), np.asarray(kernel, np.float64), n_in)
  grads = []
  for platform in ("cpu", "tpu"):
    with toolkit.target(platform):
      y = contract(x, kernel, n_in)
      grads.append(jax.grad(lambda x, w: jnp.sum(jnp.sin(contract(x, w, n_in))), (0, 1))(x, kernel))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    assert y.shape == (2, 3, *out_shape)
  for a, b in zip(*grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_next_key_draws_the_keys_of_flax_streams_eagerly_and_traced():
  """The same keys and counts as `rngs.params()` / `rngs.dropout()`, so parameters initialise as with
  flax's own call (which, traced, walks the whole trace on every key: quadratic model builds)."""

  def draw(take):
    rngs = nnx.Rngs(params=3, dropout=4)
    keys = [jax.random.key_data(take(rngs, stream)) for stream in ("params", "params", "dropout", "params")]
    return keys, rngs.params.count.get_value(), rngs.dropout.count.get_value()

  ours = lambda rngs, stream: next_key(rngs, stream)
  flax_own = lambda rngs, stream: getattr(rngs, stream)()
  for run in (lambda f: draw(f), lambda f: jax.jit(lambda: draw(f))()):
    jax.tree.map(np.testing.assert_array_equal, run(ours), run(flax_own))
  assert [int(c) for c in draw(ours)[1:]] == [3, 1]
