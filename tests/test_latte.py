"""Latte: kernels == the paper's quadratic formulas, causality, decode == forward, padding, counts."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import fixtures.c4
import fixtures.listops
import fixtures.retrieval
import lra_core
import oracles
from lra_core import kernels, registry
from lra_core.errors import ConfigError
from lra_core.kernels import latte as lk
from lra_core.kernels.softmax.reference import attention_mask, dot_product_attention
from lra_core.models import latte
from lra_core.models.layers.positions import apply_rope
from lra_core.protocol import RunInfo
from lra_core.train import train_and_evaluate


def rand(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def qkv(b=2, t=13, h=2, l=5, d=3, scale=1.0):
  return rand(1, (b, t, h, l), scale), rand(2, (b, t, h, l), scale), rand(3, (b, t, h, d))


def grads(fn, q, k, v):
  weights = jnp.cos(jnp.arange(v.shape[-1]) + jnp.arange(v.shape[1])[:, None, None])
  return oracles.compiled(jax.grad(lambda *a: (fn(*a) * weights).sum(), argnums=(0, 1, 2)), q, k, v)


# -- kernels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "t,chunk",
  [(13, 1), (13, 4), (16, 4), pytest.param(7, 32, marks=pytest.mark.slow), pytest.param(20, 7, marks=pytest.mark.slow)],
)
def test_causal_latte_equals_quadratic_formula_values_and_gradients(t, chunk):
  q, k, v = qkv(t=t)
  fast = lambda q, k, v: kernels.causal_latte(q, k, v, chunk=chunk)
  np.testing.assert_allclose(
    oracles.compiled(fast, q, k, v), oracles.compiled(lk.causal_latte_reference, q, k, v), atol=1e-5
  )
  for got, want in zip(grads(fast, q, k, v), grads(lk.causal_latte_reference, q, k, v)):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 5])
def test_causal_latte_is_stable_for_logits_spread_over_thousands(chunk):
  """Key logits over [-1500, 1500] (e^1500 overflows float32 by far): still the exact formula."""
  q, k, v = qkv(t=17, scale=1.0)
  k = 3000.0 * (jax.random.uniform(jax.random.key(4), k.shape) - 0.5)
  q = 300.0 * q
  fast = lambda q, k, v: kernels.causal_latte(q, k, v, chunk=chunk)
  np.testing.assert_allclose(
    oracles.compiled(fast, q, k, v), oracles.compiled(lk.causal_latte_reference, q, k, v), atol=1e-5
  )
  for got, want in zip(grads(fast, q, k, v), grads(lk.causal_latte_reference, q, k, v)):
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bidirectional_latte_equals_quadratic_formula_with_padding():
  q, k, v = qkv(t=11)
  mask = jnp.arange(11)[None] < jnp.array([[11], [6]])
  k = 500.0 * k  # large logits: the softmax over time is still exact
  fast = lambda q, k, v: kernels.bidirectional_latte(q, k, v, mask=mask)
  ref = lambda q, k, v: lk.bidirectional_latte_reference(q, k, v, mask=mask)
  np.testing.assert_allclose(oracles.compiled(fast, q, k, v), oracles.compiled(ref, q, k, v), atol=1e-5)
  for got, want in zip(grads(fast, q, k, v), grads(ref, q, k, v)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  # Padding changes nothing for the real tokens: row 1 equals its unpadded 6 tokens.
  alone = oracles.compiled(kernels.bidirectional_latte, q[1:, :6], k[1:, :6], v[1:, :6])
  np.testing.assert_allclose(oracles.compiled(fast, q, k, v)[1, :6], alone[0], atol=1e-6)


def test_latte_step_and_carried_state_continue_the_sequence():
  q, k, v = qkv(t=12)
  full = oracles.compiled(kernels.causal_latte, q, k, v)
  state = lk.init_latte_state(2, 2, 5, 3)
  outs = []
  for i in range(12):
    y, state = oracles.compiled(lk.latte_step, q[:, i], k[:, i], v[:, i], state)
    outs.append(y)
  np.testing.assert_allclose(jnp.stack(outs, 1), full, atol=1e-5)
  # Two pieces with the state carried between them equal one pass.
  b, h, l, d = 2, 2, 5, 3
  first = lk.init_latte_state(b, h, l, d)
  for i in range(5):
    _, first = oracles.compiled(lk.latte_step, q[:, i], k[:, i], v[:, i], first)
  rest = oracles.compiled(kernels.causal_latte, q[:, 5:], k[:, 5:], v[:, 5:], chunk=3, state=first)
  np.testing.assert_allclose(rest, full[:, 5:], atol=1e-5)


def test_kernel_shape_and_impl_errors_are_clear():
  q, k, v = qkv()
  with pytest.raises(ValueError, match=r"q and k of one shape"):
    kernels.causal_latte(q, k[..., :3], v)
  with pytest.raises(ValueError, match=r"v \[B,T,H,D\]"):
    kernels.bidirectional_latte(q, k, v[:, :4])
  with pytest.raises(ValueError, match=r"mask must be bool \[B,T\]"):
    kernels.bidirectional_latte(q, k, v, mask=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match=r"impl 'triton' is not one of"):
    kernels.causal_latte(q, k, v, impl="triton")


# -- the model -------------------------------------------------------------------------------------------


def make_config(task="lm", variant="latte", seq_len=16, **model):
  c = ml_collections.ConfigDict()
  c.task = task
  defaults = dict(
    vocab_size=23,
    d_model=32,
    num_layers=2,
    num_heads=2,
    d_ff=48,
    num_latents=8,
    chunk=3,
    window=4 if "swa" in variant else 0,
    num_classes=3 if task in ("classify", "retrieval") else 0,
  )
  c.model = latte.model_config(variant, **{**defaults, **model})
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  latte.validate_config(c)
  return c


def make_model(config, seed=0):
  model = latte.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))
  model.eval()
  return model


def tokens(b=2, t=16, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 23)


@pytest.mark.parametrize("variant", sorted(latte.VARIANTS))
def test_decoder_is_causal_and_decode_matches_forward(variant):
  model = make_model(make_config(variant=variant))
  x = tokens()
  logits = oracles.forward(model, x)
  assert logits.shape == (2, 16, 23)
  # across chunk (3) and window (4) boundaries
  oracles.assert_no_future_leakage(model, x, logits, (0, 6, 13), vocab=23, shift=5, changed_atol=1e-3)
  oracles.assert_decode_matches_forward(model, x, logits)


def test_decode_state_has_constant_size():
  model = make_model(make_config(variant="latte_rglru_swa++"))
  size = lambda st: sum(x.size for x in jax.tree.leaves(st))
  assert size(model.init_decode_state(2, 16)) == size(model.init_decode_state(2, 4096))


@pytest.mark.parametrize(
  "variant", [pytest.param(v, marks=pytest.mark.slow) if v == "latte_conv_swa++" else v for v in sorted(latte.VARIANTS)]
)
def test_bidirectional_padding_does_not_change_real_tokens(variant):
  model = make_model(make_config(task="classify", variant=variant))
  x = tokens()
  pooled = oracles.forward(model, x[:, :10], mask=jnp.ones((2, 10), bool))
  padded = jnp.concatenate([x[:, :10], jnp.zeros((2, 6), jnp.int32)], 1)
  mask = jnp.broadcast_to(jnp.arange(16) < 10, (2, 16))
  np.testing.assert_allclose(oracles.forward(model, padded, mask=mask), pooled, atol=1e-5)
  features, _ = oracles.forward(model, padded, mask=mask, method="encode")
  np.testing.assert_allclose(features[:, :10], oracles.forward(model, x[:, :10], method="encode")[0], atol=1e-5)


def quadratic_layer(layer, x, causal):
  """Eq. 13 and eq. 22 written out as T x T matrices from the layer's own projections."""
  t = x.shape[1]
  pos = jnp.arange(t)
  y = x if layer.mixer is None else layer.mixer(x)
  q, k, v = layer.query(y), layer.key(y), layer.value(x)
  p_all = jax.nn.softmax(q, -1)  # over L (+ 1) states
  allowed = (pos[:, None] >= pos[None, :]) if causal else jnp.ones((t, t), bool)
  logits = jnp.where(allowed[None, None, None], jnp.einsum("bshl->bhls", k)[:, :, :, None, :], -1e30)
  latent = jnp.einsum("bthl,bhlts->bhts", p_all[..., 1:] if layer.window else p_all, jax.nn.softmax(logits, -1))
  if layer.vapor is None:
    out = jnp.einsum("bhts,bshd->bthd", latent, v)
  else:  # eq. 22: y_t = sum_s a_ts R^(t-s) v_s
    angles = (pos[:, None] - pos[None, :]).astype(jnp.float32)[..., None, None] * layer.vapor[...]
    c, s = jnp.cos(angles), jnp.sin(angles)  # [T,S,H,W/2]
    v1, v2 = jnp.split(v, 2, -1)
    mix = lambda u, rot: jnp.einsum("bhts,bshw,tshw->bthw", latent, u, rot)
    out = jnp.concatenate([mix(v1, c) - mix(v2, s), mix(v2, c) + mix(v1, s)], -1)
  if layer.window:  # state 0: softmax attention over the window, with RoPE
    wq, wk = layer.window_query(x), layer.window_key(x)
    if layer.rope:
      wq, wk = apply_rope(wq, pos), apply_rope(wk, pos)
    m = attention_mask(pos, pos, causal=causal, window=layer.window)
    scores = jnp.einsum("bthd,bshd->bhts", wq, wk) * wq.shape[-1] ** -0.5
    local = jnp.einsum("bth,bhts->bhts", p_all[..., 0], jax.nn.softmax(jnp.where(m[:, None], scores, -1e30), -1))
    out = out + jnp.einsum("bhts,bshd->bthd", local, v)
  return layer.out(out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["latte", "latte_conv_swa++", "latte_rglru_swa++"])
def test_layer_equals_the_papers_quadratic_mixture(variant, causal):
  task = "lm" if causal else "classify"
  config = make_config(task=task, variant=variant, seq_len=12)
  layer = make_model(config).blocks[0].attn
  x = rand(5, (2, 12, 32))
  np.testing.assert_allclose(
    oracles.forward(layer, x), oracles.compiled(quadratic_layer, layer, x, causal=causal), atol=1e-5
  )


def test_rglru_scan_equals_its_recurrence_and_starts_in_the_papers_range():
  layer = latte.RGLRU(16, 4, c=8.0, causal=True, rngs=nnx.Rngs(params=0))
  a = jax.nn.sigmoid(layer.a_param[...]) ** 8.0
  assert 0.9 <= float(a.min()) and float(a.max()) <= 0.999 + 1e-6
  x = rand(6, (2, 9, 16))
  h, outs = layer.init_state(2, jnp.float32), []
  for i in range(9):
    y, h = oracles.forward(layer, x[:, i], h, method="step")
    outs.append(y)
  np.testing.assert_allclose(oracles.forward(layer, x), jnp.stack(outs, 1), atol=1e-5)
  both = latte.RGLRU(16, 4, c=8.0, causal=False, rngs=nnx.Rngs(params=0))
  backward = oracles.forward(layer, x[:, ::-1])[:, ::-1]
  np.testing.assert_allclose(oracles.forward(both, x), 0.5 * (oracles.forward(layer, x) + backward), atol=1e-5)


def test_local_attention_equals_dense_sliding_window():
  for causal in (True, False):
    for t, w in ((13, 4), (16, 4), (5, 8)):
      q, k, v = rand(1, (2, t, 4, 8)), rand(2, (2, t, 2, 8)), rand(3, (2, t, 2, 3))
      valid = jnp.arange(t)[None] < jnp.array([[t], [t - 2]])
      dense = jax.jit(
        lambda q, k, v, valid: dot_product_attention(
          q, k, v, mask=attention_mask(jnp.arange(t), jnp.arange(t), causal=causal, window=w, k_valid=valid)
        )
      )(q, k, v, valid)
      banded = jax.jit(lambda q, k, v, valid: kernels.local_attention(q, k, v, window=w, causal=causal, k_valid=valid))(
        q, k, v, valid
      )
      np.testing.assert_allclose(
        jnp.where(valid[..., None, None], banded, 0), jnp.where(valid[..., None, None], dense, 0), atol=1e-5
      )


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="num_latents 10 must be a positive multiple of model.num_heads 4"):
    make_config(num_latents=10, num_heads=4)
  with pytest.raises(ConfigError, match="model.mixer 'lstm' is not one of"):
    make_config(mixer="lstm")
  with pytest.raises(ConfigError, match=r"latte variant 'latte\+' is not one of"):
    latte.model_config("latte+")
  with pytest.raises(ConfigError, match="different Latte variants"):
    lra_core.load_config("configs/c4/latte.py:latte,latte++")


# -- paper sizes and the trainer ----------------------------------------------------------------------------


@pytest.mark.parametrize("row", latte.FAMILY.paper_rows, ids=lambda row: row.config.rpartition(":")[2])
def test_table1_parameter_counts_within_five_percent(row):
  count = registry.parameter_count(lra_core.load_config(row.config))
  assert abs(count - row.count) / row.count < 0.05, (row, count)


# latte_rglru_swa++ trains (causal) in test_tiny_lm_config_trains and tests/test_kill_resume.py, and
# the ListOps Latte classifier is traced under random configs in tests/test_config_fuzz.py.
@pytest.mark.parametrize("fixture,spec", [(fixtures.retrieval, "configs/lra/retrieval/latte.py:tiny,latte_conv++")])
def test_tiny_lra_configs_train(tmp_path, fixture, spec):
  config = lra_core.load_config(spec, fixture.build(tmp_path))
  summary = train_and_evaluate(config, tmp_path / "run")
  assert np.isfinite(summary["test_loss"])


@pytest.mark.slow
def test_tiny_lm_config_trains(tmp_path):
  # Killed and resumed runs of this config: tests/test_kill_resume.py.
  overrides = fixtures.c4.build(tmp_path) + ["train.steps=4", "train.checkpoint_every=2"]
  config = lra_core.load_config("configs/c4/latte.py:tiny,latte_rglru_swa++", overrides)
  whole = train_and_evaluate(config, tmp_path / "whole")
  assert np.isfinite(whole["test_loss"])
