"""Softmax attention, masks and position encodings against direct oracles."""

import jax.numpy as jnp
import numpy as np
import pytest

import oracles
from lra_core.kernels import toolkit
from lra_core.kernels.softmax.reference import attention_mask, dot_product_attention
from lra_core.models.layers.positions import apply_rope, sinusoid


def naive_attention(q, k, v, allowed, bias=None):
  """Per batch and head, softmax over allowed keys (plus bias [H|1,Tq,Tk]), in float64 numpy."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, tq, h, d = q.shape
  group = h // k.shape[2]
  out = np.zeros((b, tq, h, v.shape[-1]))
  for bi in range(b):
    for hi in range(h):
      kh = hi // group
      logits = q[bi, :, hi] @ k[bi, :, kh].T / np.sqrt(d)
      if bias is not None:
        logits = logits + bias[hi if bias.shape[0] == h else 0]
      logits = np.where(allowed[bi], logits, -np.inf)
      with np.errstate(invalid="ignore"):  # rows with no allowed key become NaN, compared nowhere
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
      out[bi, :, hi] = w @ v[bi, :, kh]
  return out


def attention_on(q, k, v, *, platform, **kwargs):
  """dot_product_attention traced for `platform` ('cpu', 'tpu'): the layout it picks is chosen at trace time."""
  with toolkit.target(platform):
    return dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal,window", [(True, 0), (True, 3), (False, 0), (False, 2)])
def test_attention_matches_naive(heads, kv_heads, causal, window):
  rng = np.random.default_rng(0)
  b, t, d = 2, 7, 8
  q = rng.normal(size=(b, t, heads, d)).astype(np.float32)
  k = rng.normal(size=(b, t, kv_heads, d)).astype(np.float32)
  v = rng.normal(size=(b, t, kv_heads, 5)).astype(np.float32)
  valid = np.ones((b, t), bool)
  valid[1, -2:] = False  # padding in the second row
  pos = np.arange(t)
  allowed = np.ones((b, t, t), bool) & valid[:, None, :]
  if causal:
    allowed &= pos[None, :, None] >= pos[None, None, :]
  if window:
    dist = pos[:, None] - pos[None, :]
    allowed &= ((dist >= 0) & (dist < window)) if causal else (np.abs(dist) < window)
  mask = oracles.compiled(
    attention_mask, jnp.arange(t), jnp.arange(t), causal=causal, window=window, k_valid=jnp.asarray(valid)
  )
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(mask), allowed.shape), allowed)
  out = np.asarray(oracles.compiled(dot_product_attention, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask))
  expected = naive_attention(q, k, v, allowed)
  rows = allowed.any(-1)  # a padded query with no key in its window reads nothing meaningful
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out[rows], expected[rows], atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("tq", [5, 1])
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_attention_bias_and_mask_follow_grouped_query_heads(heads, kv_heads, per_head, tq, platform):
  """Biases per head or shared, masks per query or broadcast over queries (Tq 1), land on the right
  query head of each key-value group, in the CPU layout (query rows) and the accelerators' (5-D
  grouped einsums), both run here."""
  rng = np.random.default_rng(2)
  b, tk, d = 2, 5, 8
  q = rng.normal(size=(b, tq, heads, d)).astype(np.float32)
  k = rng.normal(size=(b, tk, kv_heads, d)).astype(np.float32)
  v = rng.normal(size=(b, tk, kv_heads, 3)).astype(np.float32)
  bias = rng.normal(size=(heads if per_head else 1, tq, tk)).astype(np.float32)
  valid = np.ones((b, tk), bool)
  valid[0, -1] = False
  for mask in (
    attention_mask(jnp.arange(tk - tq, tk), jnp.arange(tk), causal=True, k_valid=jnp.asarray(valid)),
    jnp.asarray(valid)[:, None, :],
  ):
    allowed = np.broadcast_to(np.asarray(mask), (b, tq, tk))
    out = oracles.compiled(
      attention_on, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask, bias=jnp.asarray(bias), platform=platform
    )
    np.testing.assert_allclose(np.asarray(out), naive_attention(q, k, v, allowed, bias), atol=1e-5)


def test_multi_query_equals_multi_head_with_shared_keys():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 5, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 5, 1, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, 5, 1, 8)), jnp.float32)
  mask = attention_mask(jnp.arange(5), jnp.arange(5), causal=True)
  mqa = oracles.compiled(dot_product_attention, q, k, v, mask=mask)
  mha = oracles.compiled(dot_product_attention, q, jnp.repeat(k, 4, 2), jnp.repeat(v, 4, 2), mask=mask)
  np.testing.assert_allclose(mqa, mha, atol=1e-6)


def test_empty_cache_slots_and_fully_masked_rows_are_finite():
  q = jnp.ones((1, 1, 2, 4))
  k = v = jnp.ones((1, 3, 2, 4))
  mask = attention_mask(jnp.array([0]), jnp.array([-1, -1, -1]), causal=True)
  assert not mask.any()
  assert jnp.isfinite(oracles.compiled(dot_product_attention, q, k, v, mask=mask)).all()


def test_rope_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

  def score(m, n):
    return float(
      (oracles.compiled(apply_rope, q, jnp.array([m])) * oracles.compiled(apply_rope, k, jnp.array([n]))).sum()
    )

  assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-4)
  assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
  # Norms are preserved and a partial rotation leaves the tail untouched.
  rotated = oracles.compiled(apply_rope, q, jnp.array([5]), fraction=0.5)
  np.testing.assert_allclose(jnp.linalg.norm(rotated), jnp.linalg.norm(q), rtol=1e-5)
  np.testing.assert_array_equal(rotated[..., 8:], q[..., 8:])


def test_sinusoid_values():
  table = oracles.compiled(sinusoid, jnp.arange(4), dim=6, max_wavelength=100.0)
  freqs = 100.0 ** (-np.arange(3) / 3)
  expected = np.concatenate([np.sin(np.arange(4)[:, None] * freqs), np.cos(np.arange(4)[:, None] * freqs)], -1)
  np.testing.assert_allclose(table, expected, atol=1e-6)


def test_sinusoid_of_odd_width_pads_one_zero_feature():
  """An odd model width (found by tests/test_config_fuzz.py in Transformer-VQ's XL table) works."""
  table = oracles.compiled(sinusoid, jnp.arange(4), dim=7, max_wavelength=100.0)
  assert table.shape == (4, 7)
  np.testing.assert_allclose(
    table[:, :6], oracles.compiled(sinusoid, jnp.arange(4), dim=6, max_wavelength=100.0), atol=0
  )
  np.testing.assert_array_equal(table[:, 6], 0.0)
