"""The Linear Transformer's attention against its quadratic form (the README's example family)."""

import jax
import numpy as np
import pytest

from lra_core.models.linear_transformer import linear_attention


def quadratic(q, k, v, causal, mask):
  """softmax attention's shape with exp(q.k) replaced by phi(q).phi(k): an explicit T x T matrix."""
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
  scores = np.einsum("bihd,bjhd->bhij", phi(q), phi(k))
  t = q.shape[1]
  allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
  allowed = allowed[None, None] & mask[:, None, None, :]
  scores = scores * allowed
  return np.einsum("bhij,bjhe->bihe", scores, v) / (scores.sum(-1).transpose(0, 2, 1)[..., None] + 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_equals_its_quadratic_form(causal):
  q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), (2, 11, 3, 4))) for i in range(3))
  mask = np.ones((2, 11), bool)
  mask[1, 8:] = False
  out = linear_attention(q, k, v, causal=causal, mask=mask)
  np.testing.assert_allclose(out, quadratic(q, k, v, causal, mask), rtol=1e-5, atol=1e-5)
