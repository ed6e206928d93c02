"""Tests for lra_core.decoding: logit filters against hand-computed sets, sampling against
softmax frequencies, and `generate` against the full forward pass of a toy model.

Helpers stay in numpy where they can: on CPU every new eager JAX op shape is a compilation.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lra_core import decoding

VOCAB = 11
DIM = 16
FILL = np.finfo(np.float32).min

# Python side effects in decode_step run only while tracing: this counts compilations.
_DECODE_TRACES = collections.Counter()


class ToyRecurrentLM(nnx.Module):
  """Embedding -> tanh recurrence and causal running mean -> dropout -> vocab projection.

  The decode state (hidden state, running sum, position) is real, so stepping it has to
  reproduce the full forward pass.
  """

  def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.w_in = nnx.Linear(dim, dim, rngs=rngs)
    self.w_rec = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(2 * dim, vocab, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.dim = dim

  def _readout(self, h: jax.Array, mean: jax.Array) -> jax.Array:
    # Random-init logits are O(1); sharpen them so greedy argmax has clear margins.
    return 3.0 * self.out(self.dropout(jnp.concatenate([h, mean], axis=-1)))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int32[B,T] -> float32[B,T,V]; the mean is a cumsum, the recurrence a Python loop."""
    x = self.embed(tokens)
    steps = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.float32)[None, :, None]
    mean = jnp.cumsum(x, axis=1) / steps
    h = jnp.zeros((tokens.shape[0], self.dim))
    hs = []
    for t in range(tokens.shape[1]):
      h = jnp.tanh(self.w_in(x[:, t]) + self.w_rec(h))
      hs.append(h)
    return self._readout(jnp.stack(hs, axis=1), mean)

  def init_decode_state(self, batch_size: int, max_len: int) -> dict:
    del max_len  # constant-size state
    return {
      "h": jnp.zeros((batch_size, self.dim)),
      "total": jnp.zeros((batch_size, self.dim)),
      "pos": jnp.zeros((), jnp.int32),
    }

  def decode_step(self, tokens: jax.Array, state: dict) -> tuple[jax.Array, dict]:
    """int32[B,1] -> float32[B,1,V], next state."""
    _DECODE_TRACES["decode_step"] += 1
    x = self.embed(tokens[:, 0])
    h = jnp.tanh(self.w_in(x) + self.w_rec(state["h"]))
    total = state["total"] + x
    pos = state["pos"] + 1
    logits = self._readout(h, total / pos.astype(jnp.float32))
    return logits[:, None], {"h": h, "total": total, "pos": pos}


@pytest.fixture(scope="module")
def model() -> ToyRecurrentLM:
  # One compiled initialiser instead of an eager compilation per parameter shape.
  m = nnx.jit(lambda: ToyRecurrentLM(VOCAB, DIM, rngs=nnx.Rngs(0)))()
  m.eval()
  return m


def _prompt(batch: int, length: int, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int32)


@nnx.jit
def _forward_padded(model: ToyRecurrentLM, tokens: jax.Array) -> jax.Array:
  return model(tokens)


def _forward(model: ToyRecurrentLM, tokens: np.ndarray) -> np.ndarray:
  """model(tokens) [B,T] -> [B,T,V], run on a zero-padded [4,12] buffer so every call
  shares one compilation. The toy model is causal and rows never mix, so the padding
  cannot reach the returned logits."""
  batch, length = tokens.shape
  buffer = np.zeros((4, 12), np.int32)
  buffer[:batch, :length] = tokens
  return np.asarray(_forward_padded(model, buffer))[:batch, :length]


@pytest.fixture(scope="module")
def greedy_case(model) -> tuple[np.ndarray, np.ndarray]:
  """A prompt [B,P] and its greedy continuation [B,P+N] from the full forward pass: the
  argmax of model(tokens) on the growing sequence, one token at a time."""
  prompt = _prompt(3, 4)
  tokens = prompt
  for _ in range(6):
    nxt = np.argmax(_forward(model, tokens)[:, -1], axis=-1).astype(np.int32)
    tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
  return prompt, tokens


def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _within_bound(counts: np.ndarray, probs: np.ndarray, sigmas: float = 5.0) -> bool:
  """Every empirical frequency lies within `sigmas` binomial standard deviations."""
  n = counts.sum()
  sd = np.sqrt(probs * (1 - probs) / n)
  return bool(np.all(np.abs(counts / n - probs) <= sigmas * sd + 1e-12))


# ---------------------------------------------------------------------------------------
# The toy model itself honours the protocol (otherwise the generate tests prove nothing)
# ---------------------------------------------------------------------------------------


def test_toy_decode_matches_forward(model):
  tokens = _prompt(3, 7)
  step = nnx.jit(lambda m, t, s: m.decode_step(t, s))
  state = model.init_decode_state(3, 7)
  steps = []
  for t in range(7):
    logits, state = step(model, tokens[:, t : t + 1], state)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), _forward(model, tokens), atol=1e-5)


# ---------------------------------------------------------------------------------------
# filter_logits
# ---------------------------------------------------------------------------------------

# Dyadic probabilities (exact in float32): token 1 -> 1/2, 3 -> 1/4, 0 and 2 -> 1/8 (a tie).
_NUCLEUS_LOGITS = np.log(np.array([0.125, 0.5, 0.125, 0.25], np.float32))


@pytest.mark.parametrize(
  "top_p, kept",
  [
    (0.01, {1}),  # below the argmax's mass: the argmax alone
    (0.45, {1}),
    (0.55, {1, 3}),
    (0.70, {1, 3}),
    (0.80, {1, 3, 0}),  # needs one of the tied 1/8 tokens: the lower id wins
    (0.95, {0, 1, 2, 3}),
    (1.00, {0, 1, 2, 3}),
  ],
)
def test_nucleus_keeps_expected_set(top_p, kept):
  out = np.asarray(decoding.filter_logits(_NUCLEUS_LOGITS, top_p=top_p))
  assert set(np.flatnonzero(out > FILL).tolist()) == kept
  assert np.all(np.isfinite(out))
  idx = sorted(kept)
  np.testing.assert_array_equal(out[idx], _NUCLEUS_LOGITS[idx])


def test_nucleus_ties_and_rows_are_independent():
  logits = np.array(
    [
      [0.0, 0.0, 0.0, 0.0],  # uniform: mass 0.4 needs two tokens, lowest ids
      [0.0, 0.0, 0.0, 10.0],  # peaked: argmax alone
    ],
    np.float32,
  )
  keep = np.asarray(decoding.filter_logits(logits, top_p=0.4)) > FILL
  np.testing.assert_array_equal(keep, [[True, True, False, False], [False, False, False, True]])


def test_nucleus_keeps_rare_tokens_at_top_p_one():
  # The mass before the last token rounds to 1.0 in float32; top_p=1 must still keep it.
  logits = np.array([0.0, 0.0, -30.0], np.float32)
  keep = np.asarray(decoding.filter_logits(logits, top_k=3, top_p=1.0)) > FILL
  np.testing.assert_array_equal(keep, [True, True, True])


def test_top_k_keeps_exactly_k_with_ties():
  logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
  keep = np.asarray(decoding.filter_logits(logits, top_k=2)) > FILL
  np.testing.assert_array_equal(keep, [[False, True, True, False, False], [True, True, False, False, False]])
  # k >= V keeps everything unchanged.
  np.testing.assert_array_equal(decoding.filter_logits(logits, top_k=9), logits)


def test_top_k_then_top_p_renormalises_over_kept_tokens():
  # After top-2 the kept probabilities are 4/7 and 3/7: top_p=0.5 is reached by the first
  # alone, though its mass before renormalisation (0.4) would not reach it.
  logits = np.log(np.array([0.4, 0.2, 0.3, 0.1], np.float32))
  keep = np.asarray(decoding.filter_logits(logits, top_k=2, top_p=0.5)) > FILL
  np.testing.assert_array_equal(keep, [True, False, False, False])
  keep = np.asarray(decoding.filter_logits(logits, top_k=2, top_p=0.65)) > FILL
  np.testing.assert_array_equal(keep, [True, False, True, False])


def test_temperature_scales_and_zero_keeps_argmax():
  logits = np.array([2.0, -1.0, 0.5], np.float32)
  np.testing.assert_allclose(decoding.filter_logits(logits, temperature=0.5), logits / 0.5)
  out = np.asarray(decoding.filter_logits(logits, temperature=0.0))
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out > FILL, [True, False, False])
  # Filtered entries must not turn a softmax into NaN.
  probs = jax.nn.softmax(decoding.filter_logits(logits, top_k=1, top_p=0.5))
  np.testing.assert_allclose(probs, [1.0, 0.0, 0.0])


def test_bad_settings_are_refused():
  logits = np.zeros((2, 4), np.float32)
  for kwargs in [
    dict(temperature=-1.0),
    dict(temperature=float("nan")),
    dict(top_k=-1),
    dict(top_k=1.5),
    dict(top_k=True),
    dict(top_p=0.0),
    dict(top_p=1.5),
  ]:
    with pytest.raises(decoding.DecodingError):
      decoding.filter_logits(logits, **kwargs)


# ---------------------------------------------------------------------------------------
# sample_token
# ---------------------------------------------------------------------------------------

_FREQ_LOGITS = np.array([1.5, 0.5, 0.0, -1.0, -2.0], np.float32)
_DRAWS = 40_000


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_frequencies_match_tempered_softmax(temperature):
  logits = np.broadcast_to(_FREQ_LOGITS, (_DRAWS, 5))
  draws = decoding.sample_token(jax.random.key(7), logits, temperature=temperature)
  assert draws.dtype == jnp.int32 and draws.shape == (_DRAWS,)
  counts = np.bincount(np.asarray(draws), minlength=5)
  assert _within_bound(counts, _softmax(_FREQ_LOGITS / temperature))
  # The bound has power: the untempered distribution is rejected where T != 1.
  if temperature != 1.0:
    assert not _within_bound(counts, _softmax(_FREQ_LOGITS))


def test_sample_frequencies_with_top_k():
  logits = np.broadcast_to(_FREQ_LOGITS, (_DRAWS, 5))
  draws = decoding.sample_token(jax.random.key(8), logits, temperature=0.8, top_k=3)
  counts = np.bincount(np.asarray(draws), minlength=5)
  assert counts[3] == 0 and counts[4] == 0
  expected = np.zeros(5)
  expected[:3] = _softmax(_FREQ_LOGITS[:3] / 0.8)
  assert _within_bound(counts, expected)


def test_sample_greedy_and_determinism():
  logits = np.random.default_rng(3).normal(size=(6, VOCAB)).astype(np.float32)
  greedy = decoding.sample_token(jax.random.key(0), logits, temperature=0.0)
  np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
  a = decoding.sample_token(jax.random.key(5), logits)
  b = decoding.sample_token(jax.random.key(5), logits)
  np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------


def test_greedy_generate_matches_full_forward_argmax(model, greedy_case):
  prompt, expected = greedy_case
  out = decoding.generate(
    model, prompt, max_new_tokens=expected.shape[1] - prompt.shape[1], key=jax.random.key(0), temperature=0.0
  )
  assert out.dtype == jnp.int32 and out.shape == expected.shape
  np.testing.assert_array_equal(out, expected)


def test_top_k_one_equals_greedy_and_reuses_the_compiled_program(model, greedy_case):
  prompt, expected = greedy_case
  n = expected.shape[1] - prompt.shape[1]
  before = _DECODE_TRACES["decode_step"]
  out = decoding.generate(model, prompt, max_new_tokens=n, key=jax.random.key(42), temperature=1.3, top_k=1)
  np.testing.assert_array_equal(out, expected)
  traced = _DECODE_TRACES["decode_step"] - before
  assert traced > 0
  # A cloned module (new arrays, same structure), a new key and new temperature / top_p
  # values: the same program runs, untraced.
  out = decoding.generate(
    nnx.clone(model), prompt, max_new_tokens=n, key=jax.random.key(43), temperature=0.6, top_k=1, top_p=0.9
  )
  np.testing.assert_array_equal(out, expected)
  assert _DECODE_TRACES["decode_step"] - before == traced


def test_generate_runs_a_train_mode_model_in_eval_mode(model, greedy_case):
  prompt, expected = greedy_case
  m = nnx.clone(model)
  m.train()
  out = decoding.generate(
    m, prompt, max_new_tokens=expected.shape[1] - prompt.shape[1], key=jax.random.key(0), temperature=0.0
  )
  assert m.dropout.deterministic is False  # the caller's module keeps its mode
  np.testing.assert_array_equal(out, expected)


def test_first_sampled_token_follows_tempered_model_distribution(model):
  n, temperature = 4000, 0.8
  prompt = np.broadcast_to(_prompt(1, 3, seed=4), (n, 3))
  out = np.asarray(decoding.generate(model, prompt, max_new_tokens=1, key=jax.random.key(11), temperature=temperature))
  np.testing.assert_array_equal(out[:, :3], prompt)
  counts = np.bincount(out[:, 3], minlength=VOCAB)
  probs = _softmax(_forward(model, prompt[:1])[0, -1] / temperature)
  assert _within_bound(counts, probs)


_SAMPLED = dict(prompt=_prompt(8, 2, seed=5), max_new_tokens=12, temperature=2.0)


def test_same_key_same_samples_other_key_differs(model):
  a = decoding.generate(model, key=jax.random.key(3), **_SAMPLED)
  b = decoding.generate(model, key=jax.random.key(3), **_SAMPLED)
  c = decoding.generate(model, key=jax.random.key(4), **_SAMPLED)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_eos_rows_are_padded_after_eos(model):
  eos, pad, p = 2, 0, _SAMPLED["prompt"].shape[1]
  free = np.asarray(decoding.generate(model, key=jax.random.key(3), **_SAMPLED))
  out = np.asarray(decoding.generate(model, key=jax.random.key(3), eos_id=eos, pad_id=pad, **_SAMPLED))
  np.testing.assert_array_equal(out[:, :p], _SAMPLED["prompt"])
  padded_rows = 0
  for row_free, row in zip(free[:, p:], out[:, p:]):
    hits = np.flatnonzero(row_free == eos)
    if hits.size == 0:
      np.testing.assert_array_equal(row, row_free)
      continue
    # Rows advance independently under one key, so up to EOS the run is unchanged.
    first = hits[0]
    np.testing.assert_array_equal(row[: first + 1], row_free[: first + 1])
    assert np.all(row[first + 1 :] == pad)
    padded_rows += int(first + 1 < row.size)
  assert padded_rows >= 2, "seed gives too few rows with EOS before the end to test padding"
  assert np.any(np.all(free[:, p:] != eos, axis=1)), "seed gives no row without EOS"


def test_generate_refuses_bad_input(model):
  key = jax.random.key(0)
  bad = [
    (dict(prompt=np.zeros((2, 0), np.int32)), "P >= 1"),
    (dict(prompt=np.zeros((4,), np.int32)), r"expected int\[B,P\]"),
    (dict(prompt=np.zeros((2, 3), np.float32)), r"expected int\[B,P\]"),
    (dict(max_new_tokens=-1), "max_new_tokens -1"),
    (dict(max_new_tokens=2.0), "max_new_tokens 2.0"),
    (dict(top_p=2.0), "top_p 2.0"),
    (dict(eos_id="2"), "eos_id"),
    (dict(key=0), "PRNG key"),
    (dict(key=jax.random.split(jax.random.key(0), 2)), "single PRNG key"),
  ]
  for override, message in bad:
    kwargs = dict(prompt=np.zeros((2, 3), np.int32), max_new_tokens=2, key=key)
    kwargs.update(override)
    with pytest.raises(decoding.DecodingError, match=message):
      decoding.generate(model, **kwargs)
  with pytest.raises(decoding.DecodingError, match="decode_step"):
    decoding.generate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), np.zeros((1, 1), np.int32), max_new_tokens=1, key=key)


def test_zero_new_tokens_returns_prompt(model):
  prompt = _prompt(2, 3)
  out = decoding.generate(model, prompt, max_new_tokens=0, key=jax.random.key(0))
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, prompt)
