"""Transformer baselines: causality, cached decoding == full forward, encoder padding, towers."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import oracles
from lra_core.models import transformer
from lra_core.protocol import RunInfo


def make_config(task="lm", variant="transformer", seq_len=12, **model):
  c = ml_collections.ConfigDict()
  c.task = task
  defaults = dict(
    vocab_size=23,
    d_model=32,
    num_layers=2,
    num_heads=4,
    d_ff=48,
    num_classes=3 if task in ("classify", "retrieval") else 0,
  )
  c.model = transformer.model_config(variant, **{**defaults, **model})
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  return c


def make_model(config, seed=0):
  model = transformer.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))
  model.eval()
  return model


DECODER_CASES = [
  dict(variant="transformer"),
  dict(variant="transformer+"),
  dict(variant="transformer++"),
  dict(variant="transformer++", num_kv_heads=1),  # multi-query
  dict(variant="transformer+", num_kv_heads=2, window=4),  # grouped, sliding window
  dict(variant="transformer", position="sinusoid", norm="rms", tie_embeddings=True),
]


@pytest.mark.parametrize("case", DECODER_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_decoder_is_causal_and_decode_matches_forward(case):
  model = make_model(make_config(**case))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 23)
  logits = oracles.forward(model, tokens)
  assert logits.shape == (2, 12, 23) and logits.dtype == jnp.float32

  oracles.assert_no_future_leakage(model, tokens, logits, (5,), vocab=23, shift=7, changed_atol=1e-3)
  oracles.assert_decode_matches_forward(model, tokens, logits)


def test_sliding_window_cache_is_bounded_and_decodes_past_it():
  model = make_model(make_config(window=3, seq_len=16))
  state = model.init_decode_state(1, 16)
  assert all(layer["key"].shape[1] == 3 for layer in state["layers"])
  tokens = jax.random.randint(jax.random.key(2), (1, 16), 0, 23)
  logits = oracles.forward(model, tokens)
  for i in range(16):
    out, state = oracles.forward(model, tokens[:, i : i + 1], state, method="decode_step")
    np.testing.assert_allclose(out[:, 0], logits[:, i], atol=1e-4)


@pytest.mark.slow
def test_jacobian_of_decoder_is_block_lower_triangular():
  """d logits_t / d embedding_s == 0 for s > t (checked through the embedding table input)."""
  model = make_model(make_config(variant="transformer++"))
  tokens = jax.random.randint(jax.random.key(3), (1, 6), 0, 23)
  x0 = model.embed(tokens)

  def from_embeddings(x):
    positions = jnp.arange(6)
    pos = model.positions(positions)
    h = x if pos is None else x + pos
    for block in model.blocks:
      h = block(h, positions=positions, mask=None, rngs=None)
    return model.head(model.final_norm(h))[0].sum(-1)  # [T]

  jac = oracles.compiled(jax.jacobian(from_embeddings), x0)[:, 0]  # [T_out, T_in, D]
  upper = np.triu(np.ones((6, 6), bool), k=1)
  assert np.abs(np.asarray(jac))[upper].max() == 0.0
  assert np.abs(np.asarray(jac))[~upper].max() > 0.0


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_encoder_ignores_padding(pooling):
  model = make_model(make_config(task="classify", pooling=pooling))
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 1, 23)
  mask = jnp.arange(12)[None] < jnp.array([[12], [7]])
  logits = oracles.forward(model, tokens, mask=mask)
  assert logits.shape == (2, 3)
  garbage = jnp.where(mask, tokens, (tokens * 5 + 3) % 23)
  np.testing.assert_allclose(oracles.forward(model, garbage, mask=mask), logits, atol=1e-5)
  # ... while real tokens do matter.
  changed = tokens.at[1, 2].set((tokens[1, 2] + 1) % 23)
  assert not np.allclose(oracles.forward(model, changed, mask=mask)[1], logits[1], atol=1e-5)


def test_encoder_is_bidirectional():
  model = make_model(make_config(task="mlm"))
  tokens = jax.random.randint(jax.random.key(5), (1, 12), 0, 23)
  changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 23)
  assert not np.allclose(oracles.forward(model, changed)[0, 2], oracles.forward(model, tokens)[0, 2], atol=1e-5)
  with pytest.raises(ValueError, match="causal"):
    model.init_decode_state(1, 12)


def test_two_towers_encode_documents_separately():
  model = make_model(make_config(task="retrieval", pooling="cls"))
  docs = jax.random.randint(jax.random.key(6), (2, 2, 12), 1, 23)
  mask = jnp.ones((2, 2, 12), bool).at[:, 1, 9:].set(False)
  logits = oracles.forward(model, docs, mask=mask)
  assert logits.shape == (2, 3)
  # Tower features of document 1 do not depend on document 2 (no cross-attention).
  features, _ = oracles.forward(model, docs[:, 0], mask=mask[:, 0], method="encode")
  other = docs.at[:, 1].set((docs[:, 1] + 3) % 23)
  folded, _ = oracles.forward(model, other.reshape(4, 12), mask=mask.reshape(4, 12), method="encode")
  np.testing.assert_allclose(folded.reshape(2, 2, 13, -1)[:, 0], features, atol=1e-5)
  # The head is order-aware ([e1, e2, e1*e2, e1-e2]): swapping documents changes the logits.
  assert not np.allclose(oracles.forward(model, docs[:, ::-1], mask=mask[:, ::-1]), logits, atol=1e-5)


def test_learned_positions_limit_decoding_length():
  model = make_model(make_config(seq_len=8))
  with pytest.raises(ValueError, match="max_len"):
    model.init_decode_state(1, 9)
  with pytest.raises(ValueError, match="max_len"):
    model(jnp.zeros((1, 9), jnp.int32))


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = make_model(make_config(variant="transformer++", dtype="bfloat16"))
  params = nnx.state(model, nnx.Param)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, 23)
  logits = oracles.forward(model, tokens)
  assert logits.dtype == jnp.float32
  reference = oracles.forward(make_model(make_config(variant="transformer++")), tokens)
  np.testing.assert_allclose(logits, reference, atol=0.1)


def test_validate_config_errors():
  from lra_core.errors import ConfigError

  with pytest.raises(ConfigError, match="num_kv_heads"):
    transformer.validate_config(make_config(num_kv_heads=3))
  with pytest.raises(ConfigError, match="num_classes"):
    transformer.validate_config(make_config(task="classify", num_classes=1))
  with pytest.raises(ConfigError, match="max_len 8 is shorter"):
    transformer.validate_config(make_config(max_len=8, seq_len=12))
