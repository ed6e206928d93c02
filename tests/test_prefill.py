"""Parallel prompt prefill (transformer.Model.prefill) against decode_step, and generate with and
without it. Each check runs as one jitted program: on CPU every eager op shape is a compilation."""

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from test_transformer import make_config, make_model

from lra_core import decoding
from lra_core.models import flash, latte, transformer
from lra_core.protocol import RunInfo

CASES = [
  dict(variant="transformer", parallel_residual=True),  # learned positions
  dict(variant="transformer+"),  # RoPE
  dict(variant="transformer++", num_kv_heads=1),  # RoPE + GLU, multi-query
  dict(variant="transformer+", window=3),  # ring buffer far shorter than the prompt
  dict(variant="transformer++", num_kv_heads=2, window=16),  # window > max_len: the cache never wraps
]


def _case_id(case):
  return "-".join(f"{k}={v}" for k, v in case.items())


def _tokens(batch, length, seed=1):
  return np.random.default_rng(seed).integers(0, 23, (batch, length), dtype=np.int32)


def _build(model_cls, config):
  # Eagerly: its op compilations are shared by every model here, a jitted initialiser's are not.
  model = model_cls(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=0))
  model.eval()
  return model


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


class PerToken(nnx.Module):
  """The decode protocol of `model` without its prefill: generate's token-by-token path."""

  def __init__(self, model):
    self.model = model

  def init_decode_state(self, batch_size, max_len):
    return self.model.init_decode_state(batch_size, max_len)

  def decode_step(self, tokens, state):
    return self.model.decode_step(tokens, state)


@nnx.jit
def _prefill_and_steps(model, tokens):
  """Twelve decode steps, against two prefills (7 tokens from an empty cache, then 3 from
  position 7, where a window has wrapped) and two decode steps."""

  def steps(state, tokens):
    def body(state, t):
      logits, state = model.decode_step(t[:, None], state)
      return state, logits[:, 0]

    return jax.lax.scan(body, state, tokens.T)

  ref_state, ref = steps(model.init_decode_state(2, 12), tokens)
  first, state = model.prefill(tokens[:, :7], model.init_decode_state(2, 12))
  second, state = model.prefill(tokens[:, 7:10], state)
  state, rest = steps(state, tokens[:, 10:])
  return ref, ref_state, (first, second, rest), state


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_equals_decode_steps(case):
  """Logits of the last prompt position, of the steps after it, and the cache left behind."""
  model = make_model(make_config(**case))
  ref, ref_state, (first, second, rest), state = _prefill_and_steps(model, _tokens(2, 12))
  assert first.shape == (2, 1, 23) and first.dtype == np.float32
  np.testing.assert_allclose(first[:, 0], ref[6], atol=1e-4)
  np.testing.assert_allclose(second[:, 0], ref[9], atol=1e-4)
  np.testing.assert_allclose(rest, ref[10:], atol=1e-4)
  assert int(state["index"]) == int(ref_state["index"]) == 12
  for got, want in zip(state["layers"], ref_state["layers"]):
    np.testing.assert_array_equal(got["pos"], want["pos"])
    np.testing.assert_allclose(got["key"], want["key"], atol=1e-5)
    np.testing.assert_allclose(got["value"], want["value"], atol=1e-5)


@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=_case_id)
def test_generate_prefills_in_one_call_and_matches_per_token_path(case, monkeypatch):
  model = make_model(make_config(**case))
  calls = []
  original = transformer.Model.prefill

  def counted(self, tokens, state):
    calls.append(tokens.shape)
    return original(self, tokens, state)

  monkeypatch.setattr(transformer.Model, "prefill", counted)
  prompt = _tokens(3, 7, seed=2)
  kwargs = dict(max_new_tokens=5, key=jax.random.key(0), temperature=0.0)
  out = np.asarray(decoding.generate(model, prompt, **kwargs))
  assert calls == [(3, 7)]  # the whole prompt at once
  np.testing.assert_array_equal(out, decoding.generate(PerToken(model), prompt, **kwargs))
  # Greedy: every new token is the argmax of the full forward pass over what precedes it.
  np.testing.assert_array_equal(np.argmax(_forward(model, out[:, :-1])[:, 6:], axis=-1), out[:, 7:])


def _other_mixer_config(module, variant, **model):
  c = ml_collections.ConfigDict(dict(task="lm", train=dict(seq_len=16)))
  c.model = module.model_config(variant, vocab_size=23, d_model=32, num_layers=2, num_heads=2, d_ff=48, **model)
  return c


@pytest.mark.parametrize(
  "module, variant, extra",
  [
    (flash, "mc_transformer++", dict(chunk=4)),
    (latte, "latte", dict(num_latents=8, chunk=3)),
  ],
  ids=["flash_chunked", "latte"],
)
def test_models_with_other_mixers_decline_prefill_and_still_generate(module, variant, extra):
  """flash.ChunkedAttention subclasses Attention but decodes differently: it must not be
  prefilled through Attention.decode_block."""
  model = _build(module.Model, _other_mixer_config(module, variant, **extra))
  assert not model.can_prefill
  with pytest.raises(ValueError, match="needs plain softmax attention"):
    model.prefill(_tokens(1, 3), {"index": 0, "layers": []})
  prompt = _tokens(2, 6, seed=3)
  out = np.asarray(decoding.generate(model, prompt, max_new_tokens=4, key=jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(out[:, :6], prompt)
  np.testing.assert_array_equal(np.argmax(_forward(model, out[:, :-1])[:, 5:], axis=-1), out[:, 6:])
