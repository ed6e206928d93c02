"""Combiner-Axial (models/combiner.py): the factorised attention against the T x T matrix of its
definition, causality, decoding, packed documents, the Table 8 parameter count."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import lra_core
import oracles
import tiers
from lra_core import registry
from lra_core.errors import ConfigError
from lra_core.models import combiner
from lra_core.protocol import RunInfo


def dense_reference(q, k, v, summary_keys, *, chunk, causal, seg):
  """The attention of query i = (row r, column c) as T weights, from Combiner's definition: its own
  row directly (exp(q_i.k_j / sqrt(D)), j <= i when causal), and each other row k (k < r when
  causal) through entry (k, c): exp(q_i.ksum[k, c] / sqrt(D)) spread over row k by q(j | row k) =
  softmax_j(q[k, c].k_j / sqrt(D)); one normaliser for all; only within a document."""
  b, t, h, d = q.shape
  q, k, v, ks = (np.asarray(x, np.float64) for x in (q, k, v, summary_keys))
  out = np.zeros((b, t, h, d))
  for bb in range(b):
    for hh in range(h):
      weights = np.zeros((t, t))
      for i in range(t):
        r, c = divmod(i, chunk)
        for j in range(r * chunk, min((r + 1) * chunk, t)):
          if seg[bb, j] == seg[bb, i] and (not causal or j <= i):
            weights[i, j] += np.exp(q[bb, i, hh] @ k[bb, j, hh] / np.sqrt(d))
        for row in range(t // chunk):
          e = row * chunk + c
          if row == r or (causal and row > r) or seg[bb, e] != seg[bb, i]:
            continue
          members = [j for j in range(row * chunk, (row + 1) * chunk) if seg[bb, j] == seg[bb, e]]
          inner = np.array([np.exp(q[bb, e, hh] @ k[bb, j, hh] / np.sqrt(d)) for j in members])
          weights[i, members] += np.exp(q[bb, i, hh] @ ks[bb, e, hh] / np.sqrt(d)) * inner / inner.sum()
      weights /= weights.sum(axis=1, keepdims=True)
      out[bb, :, hh] = weights @ v[bb, :, hh]
  return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [False, True])
def test_factorised_attention_equals_its_dense_definition(causal, documents):
  b, t, h, d, c = 2, 12, 2, 4, 4
  q, k, v, ks = (jax.random.normal(jax.random.key(i), (b, t, h, d)) for i in range(4))
  seg = np.array([[1] * 6 + [2] * 6, [1] * 3 + [2] * 9]) if documents else np.ones((b, t), int)
  doc = combiner.documents(jnp.asarray(seg), b, t)
  valid = jnp.ones((b, t), bool)
  summaries = oracles.compiled(combiner.row_summaries, q, k, v, chunk=c, valid=valid, doc=doc)
  got = oracles.compiled(combiner.axial_attention, q, k, v, summaries, ks, chunk=c, causal=causal, valid=valid, doc=doc)
  np.testing.assert_allclose(got, dense_reference(q, k, v, ks, chunk=c, causal=causal, seg=seg), atol=1e-5)


def make_config(task="lm", seq_len=16, **model):
  c = ml_collections.ConfigDict()
  c.task = task
  c.model = combiner.model_config(
    **{**dict(vocab_size=23, d_model=16, num_layers=2, num_heads=2, d_ff=32, chunk=4, norm="layer"), **model}
  )
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  combiner.validate_config(c)
  return c


def make_model(config):
  model = combiner.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=0))
  model.eval()
  return model


def tokens(b=2, t=16):
  return jax.random.randint(jax.random.key(1), (b, t), 0, 23)


@pytest.mark.parametrize("chunk", tiers.quick([4, 5], keep=[0], ids=["4", "5"]))
def test_decoder_is_causal_and_decode_matches_forward(chunk):
  model = make_model(make_config(chunk=chunk))
  x = tokens()
  logits = oracles.forward(model, x)
  oracles.assert_no_future_leakage(model, x, logits, (0, 3, 6, 13), vocab=23, shift=5, changed_atol=1e-4)
  oracles.assert_decode_matches_forward(model, x, logits)


def test_bidirectional_padding_does_not_change_real_tokens():
  model = make_model(make_config(task="mlm"))
  x = tokens()
  mask = jnp.broadcast_to(jnp.arange(16) < 10, (2, 16))
  padded = jnp.concatenate([x[:, :10], x[:, 10:] * 0 + 7], 1)
  np.testing.assert_allclose(
    oracles.forward(model, padded, mask=mask, method="encode")[0][:, :10],
    oracles.forward(model, x[:, :10], method="encode")[0],
    atol=1e-5,
  )


@pytest.mark.parametrize("task", tiers.quick(["lm", "mlm"], keep=[1], ids=["lm", "mlm"]))
def test_packed_documents(task):
  """Exact with the second document on a row boundary (8 = 2 rows of 4); isolated otherwise."""
  model = make_model(make_config(task=task))
  apply = lambda rows, segs: oracles.forward(model, rows, segment_ids=segs)
  oracles.assert_documents_independent(apply, np.arange(3, 11) % 23, (np.arange(6) * 5 + 1) % 23, 16)
  oracles.assert_documents_isolated(apply, np.arange(3, 9) % 23, (np.arange(7) * 5 + 1) % 23, 16, vocab=23)


def test_table8_parameter_count():
  (row,) = combiner.FAMILY.paper_rows
  count = registry.parameter_count(lra_core.load_config(row.config))
  assert abs(count - row.count) / row.count < row.tolerance, count
  # the summary projections are what Combiner adds to Transformer+ (110M): two d x d maps per layer
  plus = registry.parameter_count(lra_core.load_config("configs/c4/transformer.py:mlm,plus"))
  assert count - plus == 12 * (2 * 768 * 768 + 1)


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="model.chunk .* must be positive"):
    make_config(chunk=0)
  with pytest.raises(ConfigError, match="model.variant 'fixed' is not one of"):
    make_config(variant="fixed")
