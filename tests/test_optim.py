"""Tests for lra_core.run.optim and optim_settings: schedules against closed forms, masks, groups, validation."""

import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

import family_configs
from lra_core import registry
from lra_core.errors import ConfigError
from lra_core.run import optim, optim_settings


def _config(steps: int = 1000, **optim_overrides) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.optim = optim_settings.default_config()
  config.train = ml_collections.ConfigDict({"steps": steps})
  for key, value in optim_overrides.items():
    config.optim[key] = value
  return config


def _one_update(config, params, grads):
  tx, _ = optim.make_optimizer(config)
  # One compiled call is much faster than dispatching every optax op eagerly.
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


# ------------------------------------------------------------------------------ schedules


def _cosine_oracle(step, lr, warmup, horizon, floor):
  if step < warmup:
    return lr * step / warmup
  frac = min(1.0, (step - warmup) / (horizon - warmup))
  return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@pytest.mark.parametrize("step", [0, 5, 10, 35, 60, 85, 110, 150, 10_000])
def test_cosine_schedule_matches_closed_form(step):
  cfg = _config(steps=200, lr=2.0, schedule="cosine", warmup_steps=10, decay_steps=110, min_lr_ratio=0.1).optim
  got = float(optim.make_schedule(cfg, 200)(step))
  np.testing.assert_allclose(got, _cosine_oracle(step, 2.0, 10, 110, 0.1), rtol=1e-6, atol=1e-7)


def test_cosine_landmarks():
  sched = optim.make_schedule(_config(lr=2.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1).optim, 200)
  assert float(sched(0)) == 0.0
  np.testing.assert_allclose(float(sched(10)), 2.0, rtol=1e-6)  # warmup end = peak
  np.testing.assert_allclose(float(sched(60)), 2.0 * (0.1 + 0.9 * 0.5), rtol=1e-6)  # midway
  np.testing.assert_allclose(float(sched(110)), 0.2, rtol=1e-6)  # floor
  np.testing.assert_allclose(float(sched(500)), 0.2, rtol=1e-6)  # constant after


def test_decay_steps_zero_means_total_steps():
  sched = optim.make_schedule(_config(lr=1.0, schedule="linear", warmup_steps=0, min_lr_ratio=0.0).optim, 100)
  np.testing.assert_allclose(float(sched(0)), 1.0)
  np.testing.assert_allclose(float(sched(25)), 0.75, rtol=1e-6)
  np.testing.assert_allclose(float(sched(100)), 0.0, atol=1e-7)


def test_linear_and_constant_schedules():
  lin = optim.make_schedule(
    _config(lr=3.0, schedule="linear", warmup_steps=20, decay_steps=120, min_lr_ratio=0.2).optim, 500
  )
  np.testing.assert_allclose(float(lin(10)), 1.5, rtol=1e-6)
  np.testing.assert_allclose(float(lin(70)), 3.0 * (0.2 + 0.8 * 0.5), rtol=1e-6)
  np.testing.assert_allclose(float(lin(400)), 0.6, rtol=1e-6)
  const = optim.make_schedule(_config(lr=3.0, schedule="constant", warmup_steps=4).optim, 50)
  np.testing.assert_allclose([float(const(s)) for s in (0, 1, 4, 49)], [0, 0.75, 3, 3], rtol=1e-6)


def test_rsqrt_schedule_is_lra_linear_warmup_times_rsqrt_decay():
  sched = optim.make_schedule(_config(lr=0.5, schedule="rsqrt", warmup_steps=100).optim, 10)
  for step in (0, 1, 50, 100, 400, 10_000):
    expected = 0.5 * min(1.0, step / 100) / math.sqrt(max(step, 100))
    np.testing.assert_allclose(float(sched(step)), expected, rtol=1e-6)


def test_schedule_is_finite_at_step_zero_and_jittable():
  for schedule in optim_settings.SCHEDULES:
    cfg = _config(lr=1.0, schedule=schedule, warmup_steps=1 if schedule == "rsqrt" else 0)
    value = jax.jit(optim.make_schedule(cfg.optim, 10))(jnp.int32(0))
    assert np.isfinite(float(value))


# ---------------------------------------------------------------------------- weight decay


def _mixed_params():
  return {
    "dense": {"kernel": jnp.full((3, 4), 2.0), "bias": jnp.full((4,), 2.0)},
    "norm": {"scale": jnp.full((4,), 2.0)},
    "pos_scale": jnp.float32(2.0),
  }


@pytest.mark.parametrize("name", ["adamw", "adafactor", "sgd"])
def test_weight_decay_skips_params_with_ndim_below_two(name):
  params = _mixed_params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  common = dict(name=name, lr=0.5, schedule="constant", min_dim_size_to_factor=2)
  on = _one_update(_config(weight_decay=0.1, **common), params, zeros)
  off = _one_update(_config(weight_decay=0.0, **common), params, zeros)
  for path in (("dense", "bias"), ("norm", "scale")):
    np.testing.assert_array_equal(on[path[0]][path[1]], off[path[0]][path[1]])
  np.testing.assert_array_equal(on["pos_scale"], off["pos_scale"])
  # Decoupled decay scaled by the lr: -lr * wd * p on top of the zero-gradient step.
  np.testing.assert_allclose(on["dense"]["kernel"] - off["dense"]["kernel"], -0.5 * 0.1 * 2.0, rtol=1e-6)


# What every family decays (layer indices as *): the weights that mix features, never a bias, scale,
# offset, per-head XL bias, VAPOR frequency, position table or latent, whatever its rank.
DECAYED = {
  "transformer": [
    "blocks/*/attn/key/kernel",
    "blocks/*/attn/out/kernel",
    "blocks/*/attn/query/kernel",
    "blocks/*/attn/value/kernel",
    "blocks/*/mlp/down/kernel",
    "blocks/*/mlp/gate/kernel",
    "blocks/*/mlp/up/kernel",
    "embed/embedding",
    "head/out/kernel",
  ],
  "transformer_vq": [
    "classifier/kernel",
    "embed/embedding",
    "units/*/g_proj/kernel",
    "units/*/k_proj/kernel",
    "units/*/out_proj/kernel",
    "units/*/q_proj/kernel",
    "units/*/r_proj/kernel",
    "units/*/v_proj/kernel",
  ],
  "latte": [
    "blocks/*/attn/key/kernel",
    "blocks/*/attn/mixer/input_gate",
    "blocks/*/attn/mixer/kernel",
    "blocks/*/attn/mixer/recurrence_gate",
    "blocks/*/attn/out/kernel",
    "blocks/*/attn/query/kernel",
    "blocks/*/attn/value/kernel",
    "blocks/*/attn/window_key/kernel",
    "blocks/*/attn/window_query/kernel",
    "blocks/*/mlp/down/kernel",
    "blocks/*/mlp/gate/kernel",
    "blocks/*/mlp/up/kernel",
    "embed/embedding",
  ],
  "flash": [
    "blocks/*/attn/key/kernel",
    "blocks/*/attn/out/kernel",
    "blocks/*/attn/proj/kernel",
    "blocks/*/attn/query/kernel",
    "blocks/*/attn/value/kernel",
    "blocks/*/mlp/down/kernel",
    "blocks/*/mlp/up/kernel",
    "embed/embedding",
  ],
  "combiner": [
    "blocks/*/attn/key/kernel",
    "blocks/*/attn/out/kernel",
    "blocks/*/attn/query/kernel",
    "blocks/*/attn/summary_in/kernel",
    "blocks/*/attn/summary_key/kernel",
    "blocks/*/attn/value/kernel",
    "blocks/*/mlp/down/kernel",
    "blocks/*/mlp/up/kernel",
    "embed/embedding",
  ],
  "linear_transformer": [
    "blocks/*/attn/key/kernel",
    "blocks/*/attn/out/kernel",
    "blocks/*/attn/query/kernel",
    "blocks/*/attn/value/kernel",
    "blocks/*/mlp/down/kernel",
    "blocks/*/mlp/up/kernel",
    "embed/embedding",
    "head/out/kernel",
  ],
  "block_transformer": [
    f"{d}/layers/*/{m}/kernel"
    for d in ("block_decoder", "token_decoder")
    for m in ("attn/key", "attn/out", "attn/query", "attn/value", "mlp/down", "mlp/up")
  ]
  + ["context_proj/kernel", "embedder/table/embedding", "head/out/kernel", "token_embed/embedding"],
  "fit": [
    f"blocks/*/{layer}/attn/{m}/kernel"
    for layer in ("global_layers/*", "local/*")
    for m in ("key", "out", "query", "value")
  ]
  + [f"blocks/*/{layer}/mlp/{m}/kernel" for layer in ("global_layers/*", "local/*") for m in ("down", "up")]
  + [f"blocks/*/{x}/{m}/kernel" for x in ("l2x", "x2l") for m in ("key", "out", "query", "value")]
  + ["embed/embedding"],
  "fit_denoiser": [f"blocks/*/global_layers/*/attn/{m}/kernel" for m in ("key", "out", "query", "value")]
  + [f"blocks/*/{layer}/mlp/{m}/kernel" for layer in ("global_layers/*", "local/*") for m in ("down", "up")]
  + [f"{x}/{m}/kernel" for x in ("blocks/*/l2x", "blocks/*/x2l", "l2c/*") for m in ("key", "out", "query", "value")]
  + [
    "label_embed/embedding",
    "latent_prev/mlp/down/kernel",
    "latent_prev/mlp/up/kernel",
    "out/kernel",
    "stem/kernel",
    "time_embed/dense_0/kernel",
    "time_embed/dense_1/kernel",
  ],
}


def test_every_family_decays_only_the_weights_that_mix_features():
  assert set(DECAYED) == {family.name for family in registry.families()}
  for family in registry.families():
    decayed = set()
    for spec in family_configs.specs(family):
      config = family_configs.one_layer(family, spec)
      params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: registry.build_model(config)), nnx.Param))
      decayed |= {re.sub(r"/\d+(?=/|$)", "/*", path) for path in optim.decayed_paths(params)}
    assert sorted(decayed) == sorted(DECAYED[family.name]), family.name


def test_per_head_biases_and_scales_are_not_decayed_whatever_their_rank():
  params = {
    "attn": {
      "query": {"kernel": jnp.full((4, 2, 3), 2.0), "bias": jnp.full((2, 3), 2.0)},
      "xl_u": jnp.full((2, 3), 2.0),
      "gamma": jnp.full((4, 3), 2.0),
    },
    "mixer": {"input_gate": jnp.full((2, 3, 3), 2.0), "input_bias": jnp.full((2, 3), 2.0)},
    "positions": {"table": jnp.full((5, 4), 2.0)},
  }
  zeros = jax.tree.map(jnp.zeros_like, params)
  common = dict(name="adamw", lr=0.5, schedule="constant")
  on = _one_update(_config(weight_decay=0.1, **common), params, zeros)
  off = _one_update(_config(weight_decay=0.0, **common), params, zeros)
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), on, off)
  assert changed == {
    "attn": {"query": {"kernel": True, "bias": False}, "xl_u": False, "gamma": False},
    "mixer": {"input_gate": True, "input_bias": False},
    "positions": {"table": False},
  }


def test_constant_weight_decay_ignores_the_learning_rate():
  params = _mixed_params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  cfg = _config(lr=0.5, schedule="constant", weight_decay=0.1, weight_decay_schedule="constant")
  updates = _one_update(cfg, params, zeros)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 2.0, rtol=1e-6)
  np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)


# ---------------------------------------------------------------------------------- groups


def _vq_params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "layers": {
      0: {
        "attn": {"q": {"kernel": jax.random.normal(k1, (4, 4))}},
        "codebook": {"c_sum": jax.random.normal(k2, (2, 3, 4)), "c_count": jnp.ones((2, 3))},
        "norm": {"scale": jnp.ones((4,))},
      }
    }
  }


def test_codebook_group_gets_plain_sgd_and_main_gets_clipped_adamw():
  params = _vq_params(jax.random.key(0))
  grads = jax.tree.map(lambda p: 10.0 * jax.random.normal(jax.random.key(1), p.shape), params)
  lr, b1, b2, eps, wd, clip = 1e-2, 0.9, 0.98, 1e-9, 0.1, 1e-3
  cfg = _config(lr=lr, schedule="constant", b1=b1, b2=b2, eps=eps, weight_decay=wd, clip_norm=clip)
  cfg.optim.groups = ({"name": "codebook", "pattern": r"codebook/c_(sum|count)$", "optimizer": "sgd", "lr": 1.0},)
  tx, _ = optim.make_optimizer(cfg)
  new = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(grads, params)

  layer, new_layer, g = params["layers"][0], new["layers"][0], grads["layers"][0]
  for name in ("c_sum", "c_count"):
    np.testing.assert_allclose(
      new_layer["codebook"][name], layer["codebook"][name] - 1.0 * g["codebook"][name], rtol=0, atol=1e-6
    )
  # Oracle for the main group: the clip norm covers main-group gradients only.
  main = [np.asarray(g["attn"]["q"]["kernel"]), np.asarray(g["norm"]["scale"])]
  norm = math.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in main))
  scale = min(1.0, clip / norm)
  for path, decays in ((("attn", "q", "kernel"), True), (("norm", "scale"), False)):
    p, gg, got = layer, g, new_layer
    for k in path:
      p, gg, got = p[k], gg[k], got[k]
    gc = np.asarray(gg, np.float64) * scale
    m_hat, v_hat = gc, gc**2  # first step: bias correction undoes (1 - b)
    step = m_hat / (np.sqrt(v_hat) + eps) + (wd * np.asarray(p) if decays else 0.0)
    np.testing.assert_allclose(got, np.asarray(p) - lr * step, rtol=1e-5, atol=1e-7)


def test_none_group_freezes_parameters():
  params = _vq_params(jax.random.key(2))
  cfg = _config(lr=0.1, schedule="constant", weight_decay=0.5, clip_norm=1.0)
  cfg.optim.groups = ({"name": "frozen", "pattern": "codebook", "optimizer": "none"},)
  tx, _ = optim.make_optimizer(cfg)

  def step(carry, _):
    p, state = carry
    updates, state = tx.update(jax.tree.map(jnp.ones_like, p), state, p)
    return (optax.apply_updates(p, updates), state), None

  (current, _), _ = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), None, length=3))(params)
  before, after = params["layers"][0], current["layers"][0]
  for name in ("c_sum", "c_count"):
    np.testing.assert_array_equal(after["codebook"][name], before["codebook"][name])
  assert not np.allclose(after["attn"]["q"]["kernel"], before["attn"]["q"]["kernel"])


def test_first_matching_group_wins_and_unmatched_group_is_an_error():
  params = _vq_params(jax.random.key(3))
  grads = jax.tree.map(jnp.ones_like, params)
  cfg = _config(lr=0.1, schedule="constant")
  cfg.optim.groups = (
    {"name": "sums", "pattern": "c_sum", "optimizer": "sgd", "lr": 2.0},
    {"name": "codes", "pattern": "codebook", "optimizer": "none"},
  )
  updates = _one_update(cfg, params, grads)["layers"][0]["codebook"]
  np.testing.assert_allclose(updates["c_sum"], -2.0)
  np.testing.assert_array_equal(updates["c_count"], 0.0)
  cfg.optim.groups = ({"name": "typo", "pattern": "codebok", "optimizer": "none"},)
  tx, _ = optim.make_optimizer(cfg)
  with pytest.raises(ConfigError, match="codebok"):
    tx.init(params)


def test_param_paths_joins_str_and_int_keys():
  params = {"layers": {0: {"attn": {"q": {"kernel": jnp.zeros((2, 2))}}}}, "emb": jnp.zeros(3)}
  paths = optim.param_paths(params)
  assert paths == {"layers": {0: {"attn": {"q": {"kernel": "layers/0/attn/q/kernel"}}}}, "emb": "emb"}


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
  "overrides, bad",
  [
    (dict(name="adamx"), "adamx"),
    (dict(schedule="cosin"), "cosin"),
    (dict(weight_decay_schedule="step"), "step"),
    (dict(lr=-0.1), "-0.1"),
    (dict(weight_decay=-1e-4), "-0.0001"),
    (dict(clip_norm=-1.0), "-1.0"),
    (dict(b2=1.0), "b2"),
    (dict(min_lr_ratio=1.5), "1.5"),
    (dict(warmup_steps=2000), "2000"),
    (dict(schedule="linear", decay_steps=50, warmup_steps=60), "60"),
    (dict(schedule="rsqrt", warmup_steps=0), "rsqrt"),
    (dict(groups=({"name": "cb", "pattern": "c_sum(", "optimizer": "sgd", "lr": 1.0},)), "c_sum("),
    (dict(groups=({"name": "cb", "pattern": "c_sum", "optimizer": "lion", "lr": 1.0},)), "lion"),
    (dict(groups=({"name": "cb", "pattern": "c_sum", "optimizer": "sgd"},)), "lr"),
    (dict(groups=({"name": "cb", "pattern": "c_sum", "optimizer": "sgd", "lr": 1.0, "clip_norm": 1.0},)), "clip_norm"),
    (dict(groups=({"name": "cb", "pattern": "c_sum", "optimizer": "sgd", "lr": -1.0},)), "-1.0"),
    (dict(groups=({"name": "cb", "pattern": "c_sum", "optimizer": "sgd", "lr": 1.0, "warmup_steps": 2.5},)), "2.5"),
    (dict(groups=({"name": "main", "pattern": "c_sum", "optimizer": "none"},)), "main"),
    (dict(name="lamb", weight_decay=1e-2, weight_decay_schedule="constant"), "lamb"),
    (dict(ema_decay=1.0), "ema_decay 1.0"),
    (dict(ema_decay=-0.5), "ema_decay -0.5"),
  ],
)
def test_bad_config_raises_one_sentence_config_error(overrides, bad):
  cfg = _config(steps=1000)
  for key, value in overrides.items():
    cfg.optim[key] = value
  with pytest.raises(ConfigError) as info:
    optim.make_optimizer(cfg)
  message = str(info.value)
  assert bad in message
  assert message.endswith(".") and "expected" in message


def test_bad_total_steps_is_a_config_error():
  with pytest.raises(ConfigError, match="train.steps 0"):
    optim_settings.validate_config(_config(steps=0))


def test_default_config_fields_have_concrete_types_and_validate():
  cfg = optim_settings.default_config()
  assert all(value is not None for value in cfg.values())
  optim_settings.validate_config(_config())


# ------------------------------------------------------------------------------- adafactor


def test_adafactor_reduces_a_quadratic_loss():
  key_w, key_t = jax.random.split(jax.random.key(4))
  params = {"w": jax.random.normal(key_w, (8, 6)), "b": jnp.ones((6,))}
  target = {"w": jax.random.normal(key_t, (8, 6)), "b": jnp.zeros((6,))}
  # min_dim_size_to_factor 4 makes 'w' use the factored second moment.
  cfg = _config(
    steps=200, name="adafactor", lr=0.05, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1, min_dim_size_to_factor=4
  )
  tx, _ = optim.make_optimizer(cfg)

  def loss_fn(p):
    return sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)

  def step(carry, _):
    p, state = carry
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, state = tx.update(grads, state, p)
    return (optax.apply_updates(p, updates), state), loss

  state = tx.init(params)
  assert state is not None
  (final, _), losses = jax.jit(lambda c: jax.lax.scan(step, c, None, length=200))((params, state))
  assert np.all(np.isfinite(losses))
  assert float(loss_fn(final)) < 0.2 * float(losses[0])


# ------------------------------------------------------------------------------------ lamb


def _lamb_steps(tx, params, grads_seq):
  """Parameters after applying `tx` to each gradient tree of `grads_seq` in turn (one jitted scan)."""

  def step(carry, grads):
    p, state = carry
    updates, state = tx.update(grads, state, p)
    return (optax.apply_updates(p, updates), state), None

  return jax.jit(lambda p, g: jax.lax.scan(step, (p, tx.init(p)), g)[0][0])(params, grads_seq)


def test_lamb_is_optax_lamb_on_matrices():
  # Every tensor has ndim >= 2, so the decay and the trust ratio apply everywhere: optax.lamb exactly.
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  params = {"a": jax.random.normal(k1, (4, 6)), "b": {"c": jax.random.normal(k2, (3, 5)) * 3.0}}
  grads = jax.tree.map(lambda p: jax.random.normal(k3, (4,) + p.shape), params)  # 4 steps
  cfg = _config(name="lamb", lr=2e-3, schedule="constant", b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)
  ours = _lamb_steps(optim.make_optimizer(cfg)[0], params, grads)
  reference = _lamb_steps(optax.lamb(2e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2), params, grads)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), ours, reference)
  adam = _lamb_steps(
    optim.make_optimizer(_config(name="adamw", lr=2e-3, schedule="constant", b2=0.999, eps=1e-8, weight_decay=1e-2))[0],
    params,
    grads,
  )
  assert float(jnp.abs(ours["b"]["c"] - adam["b"]["c"]).max()) > 1e-3  # the trust ratio matters


def test_lamb_leaves_biases_and_norm_scales_without_decay_or_trust_ratio():
  params = _mixed_params()
  grads = jax.tree.map(lambda p: jnp.full((1,) + jnp.shape(p), 0.5), params)
  common = dict(lr=0.1, schedule="constant", b2=0.999, eps=1e-8, weight_decay=0.25)
  lamb = _lamb_steps(optim.make_optimizer(_config(name="lamb", **common))[0], params, grads)
  adam = _lamb_steps(optim.make_optimizer(_config(name="adamw", **dict(common, weight_decay=0.0)))[0], params, grads)
  for path in (("dense", "bias"), ("norm", "scale")):  # plain Adam: p - lr * sign(g) at step 1
    np.testing.assert_allclose(lamb[path[0]][path[1]], adam[path[0]][path[1]], rtol=1e-6)
    np.testing.assert_allclose(lamb[path[0]][path[1]], 2.0 - 0.1, rtol=1e-5)
  np.testing.assert_allclose(lamb["pos_scale"], adam["pos_scale"], rtol=1e-6)
  # The kernel: u = adam direction (1) + wd * p (0.5) = 1.5 everywhere, times ||p|| / ||u|| = 2 / 1.5:
  # a step of lr * 2 (without the trust ratio it would be lr * 1.5).
  np.testing.assert_allclose(lamb["dense"]["kernel"], 2.0 - 0.1 * 2.0, rtol=1e-5)
