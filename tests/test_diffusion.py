"""Pixel diffusion: noise schedules, prediction conversions, samplers, the FIT denoiser (grouping,
RIN / FIT shapes, latent self-conditioning), that the loss falls. The trainer's tiny run, its logs,
sample grids and evaluated checkpoint: tests/test_workdir_tools.py (one run for every check on it)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lra_core
import tiers
from fixtures import imagenet64 as fx
from lra_core import diffusion, registry
from lra_core.data import DataInfo
from lra_core.errors import ConfigError
from lra_core.models.fit import denoiser as fit_denoiser
from lra_core.run import image_samples
from lra_core.tasks import make_task

SPEC = "configs/imagenet64/fit_denoiser.py:tiny"
SCHEDULES = ["cosine", "sigmoid", "sigmoid@-3,3,1.1", "cosine@0.2,1,1", "linear"]


def _config(*overrides, spec=SPEC):
  return lra_core.load_config(spec, list(overrides))


@nnx.jit
def _forward(model, x, gamma, labels=None, latents_prev=None):
  """One jitted call: compiled once and kept in the persistent cache, unlike eager op-by-op runs."""
  return model(x, gamma, labels=labels, latents_prev=latents_prev)


def _images(n: int, size: int, offset: int = 0) -> np.ndarray:
  """uint8 [n, size, size, 3]: the fixture's smooth images, box-averaged."""
  big = fx.images(n, offset).astype(np.float64)
  f = 64 // size
  return big.reshape(n, size, f, size, f, 3).mean(axis=(2, 4)).round().astype(np.uint8)


# -- schedules and conversions ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", SCHEDULES)
def test_schedule_goes_from_clean_to_pure_noise_monotonically(spec):
  gamma = diffusion.make_schedule(spec)
  t = jnp.linspace(0.0, 1.0, 1001)
  g = np.asarray(gamma(t))
  assert abs(g[0] - 1.0) < 1e-6 and g[-1] < 1e-6
  assert np.all(np.diff(g) <= 1e-7) and np.all(np.diff(g[1:-1]) < 0)
  assert g.min() > 0  # clipped away from 0: x0 = (x_t - sqrt(1-g) eps) / sqrt(g) stays finite


def test_schedule_closed_forms():
  # Chen 2023: cosine gamma = cos(pi t / 2)^2; the sigmoid schedule is symmetric around t = 1/2.
  t = jnp.array([0.25, 0.5])
  np.testing.assert_allclose(
    diffusion.make_schedule("cosine")(t), np.cos(np.pi * np.array([0.25, 0.5]) / 2) ** 2, rtol=1e-6
  )
  assert abs(float(diffusion.make_schedule("sigmoid")(jnp.array(0.5))) - 0.5) < 1e-6
  np.testing.assert_allclose(diffusion.make_schedule("linear")(t), [0.75, 0.5])


@pytest.mark.parametrize("spec", ["cos", "sigmoid@1,2", "linear@0,1,1", "cosine@0,2,1", "sigmoid@3,-3,1"])
def test_bad_schedule_is_a_config_error(spec):
  with pytest.raises(ConfigError, match="noise schedule"):
    diffusion.make_schedule(spec)


@pytest.mark.parametrize("pred_type", diffusion.PRED_TYPES)
def test_prediction_targets_invert_to_x0_and_eps(pred_type):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x0 = jax.random.uniform(k1, (4, 8, 8, 3), minval=-1, maxval=1)
  eps = jax.random.normal(k2, x0.shape)
  gamma = jax.random.uniform(k3, (4,), minval=0.05, maxval=0.95)
  x_t = diffusion.q_sample(x0, gamma, eps)
  target = diffusion.prediction_target(pred_type, x0, eps, gamma)
  x0_hat, eps_hat = diffusion.x0_eps_from_prediction(pred_type, x_t, gamma, target)
  np.testing.assert_allclose(x0_hat, x0, atol=1e-5)
  np.testing.assert_allclose(eps_hat, eps, atol=1e-5)


def test_v_is_the_rotated_pair_and_clipping_keeps_x_t():
  k1, k2 = jax.random.split(jax.random.key(1))
  x0 = jax.random.uniform(k1, (2, 4, 4, 3), minval=-1, maxval=1)
  eps = jax.random.normal(k2, x0.shape)
  gamma = jnp.array([0.3, 0.8])
  g = gamma[:, None, None, None]
  # v = d x_t / d phi for x_t = cos(phi) x0 + sin(phi) eps, phi = arccos(sqrt(gamma)) (Salimans & Ho 2022)
  phi = jnp.arccos(jnp.sqrt(g))
  np.testing.assert_allclose(
    diffusion.prediction_target("v", x0, eps, gamma), -jnp.sin(phi) * x0 + jnp.cos(phi) * eps, atol=1e-5
  )
  x_t = diffusion.q_sample(x0, gamma, eps)
  wild = 3.0 * eps  # an x0 estimate far outside [-1, 1]
  x0_c, eps_c = diffusion.x0_eps_from_prediction("x0", x_t, gamma, wild, clip=True)
  assert float(jnp.abs(x0_c).max()) <= 1.0
  np.testing.assert_allclose(diffusion.q_sample(x0_c, gamma, eps_c), x_t, atol=1e-5)


def test_ddpm_step_mean_is_the_gaussian_posterior_mean():
  k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
  x0 = jax.random.uniform(k1, (3, 4, 4, 3), minval=-1, maxval=1)
  eps = jax.random.normal(k2, x0.shape)
  gamma, gamma_prev = jnp.array([0.2, 0.5, 0.7]), jnp.array([0.3, 0.6, 0.95])
  x_t = diffusion.q_sample(x0, gamma, eps)
  g, gp = gamma[:, None, None, None], gamma_prev[:, None, None, None]
  alpha = g / gp
  noise = jax.random.normal(k3, x0.shape)
  step = diffusion.ddpm_step(k3, x_t, eps, gamma, gamma_prev)
  # q(x_s | x_t, x0) for the variance-preserving process (Ho et al. 2020, eq. 7)
  posterior_mean = (jnp.sqrt(gp) * (1 - alpha) / (1 - g)) * x0 + (jnp.sqrt(alpha) * (1 - gp) / (1 - g)) * x_t
  np.testing.assert_allclose(step - jnp.sqrt(1 - alpha) * noise, posterior_mean, atol=1e-5)


def test_ddpm_small_variance_is_the_posterior_variance():
  k1, k2 = jax.random.split(jax.random.key(5))
  x_t, eps = jax.random.normal(k1, (3, 4, 4, 3)), jax.random.normal(k2, (3, 4, 4, 3))
  gamma, gamma_prev = jnp.array([0.2, 0.5, 0.7]), jnp.array([0.3, 0.6, 1.0])
  key = jax.random.key(9)
  mean = diffusion.ddpm_step(key, x_t, eps, gamma, gamma_prev, variance="large")
  noise = jax.random.normal(key, x_t.shape)
  alpha = (gamma / gamma_prev)[:, None, None, None]
  mean = mean - jnp.sqrt(1 - alpha) * noise  # the large step minus its noise
  small = diffusion.ddpm_step(key, x_t, eps, gamma, gamma_prev, variance="small")
  # beta~ = (1 - gamma_prev) / (1 - gamma) * beta (Ho et al. 2020, eq. 7); 0 at the last step.
  beta_tilde = (1 - gamma_prev)[:, None, None, None] / (1 - gamma)[:, None, None, None] * (1 - alpha)
  np.testing.assert_allclose(small, mean + jnp.sqrt(beta_tilde) * noise, atol=1e-5)
  np.testing.assert_allclose(small[2], mean[2], atol=1e-6)
  assert float(jnp.abs(small[0] - mean[0]).max()) > 1e-2
  with pytest.raises(ValueError, match="ddpm variance 'tiny'"):
    diffusion.ddpm_step(key, x_t, eps, gamma, gamma_prev, variance="tiny")


def test_normalized_input_has_unit_std_per_example():
  x = jax.random.normal(jax.random.key(0), (3, 4, 4, 3)) * jnp.array([0.5, 1.0, 3.0])[:, None, None, None]
  out = diffusion.normalize_input(x)
  np.testing.assert_allclose(out.std(axis=(1, 2, 3)), 1.0, rtol=1e-5)
  np.testing.assert_allclose(out * x.std(axis=(1, 2, 3), keepdims=True), x, rtol=1e-5)


# -- the denoiser -----------------------------------------------------------------------------------


def test_grouping_keeps_neighbouring_pixels_together_and_inverts():
  s, p, q = 16, 4, 2  # 4x4 patches, groups of 2x2 patches = 8x8-pixel sub-images
  y, x, c = np.meshgrid(np.arange(s), np.arange(s), np.arange(3), indexing="ij")
  coords = np.stack([y, x, c], -1).astype(np.float32)  # [S,S,3,3]: (y, x, channel) of each value
  image = jnp.asarray(coords[..., 0] * 1000 + coords[..., 1] * 10 + coords[..., 2])[None]
  groups = np.asarray(fit_denoiser.image_to_groups(image, p, q))
  assert groups.shape == (1, 4, 4, p * p * 3)
  for k in range(4):
    gy, gx = divmod(k, 2)
    values = groups[0, k]
    ys, xs = values // 1000, (values % 1000) // 10
    assert set(ys.ravel().astype(int)) == set(range(8 * gy, 8 * gy + 8))
    assert set(xs.ravel().astype(int)) == set(range(8 * gx, 8 * gx + 8))
    for j in range(4):  # each token is one p x p patch
      py, px = divmod(j, 2)
      assert set(ys[j].astype(int)) == set(range(8 * gy + 4 * py, 8 * gy + 4 * py + 4))
      assert set(xs[j].astype(int)) == set(range(8 * gx + 4 * px, 8 * gx + 4 * px + 4))
  back = fit_denoiser.groups_to_image(jnp.asarray(groups), s, 3, p, q)
  np.testing.assert_array_equal(back, image)


@pytest.mark.parametrize("groups,latents", [(1, 16), (4, 4), (16, 1)])
def test_rin_and_fit_shapes(groups, latents):
  config = _config(f"model.num_groups={groups}", f"model.latents_per_group={latents}")
  model = registry.build_model(config)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  pred, lat = _forward(model, x, jnp.array([0.1, 0.9]), jnp.array([3, 7]))
  assert pred.shape == (2, 8, 8, 3) and pred.dtype == jnp.float32
  assert lat.shape == (2, 16, 128) == model.latents_shape(2)
  assert bool(jnp.isfinite(pred).all())
  pred2, _ = _forward(model, x, jnp.array([0.1, 0.9]), jnp.array([3, 7]), lat)
  assert pred2.shape == pred.shape


def test_groups_are_independent_until_latents_mix_them():
  # With no global block (one L block), a pixel's prediction depends on its own group only.
  config = _config(
    "model.layers=L(2)",
    "model.local_attention=true",
    "model.self_condition=false",
    "model.num_classes=0",
    "model.num_groups=4",
  )
  model = registry.build_model(config)
  x = jax.random.normal(jax.random.key(0), (1, 8, 8, 3))
  pred = lambda x: _forward(model, x, jnp.array([0.5]))[0]
  bumped = x.at[0, 0:4, 0:4].add(1.0)  # group 0: the top-left 4x4 pixels
  delta = np.abs(np.asarray(pred(bumped) - pred(x)))[0]
  assert delta[0:4, 0:4].max() > 1e-3
  assert delta[4:].max() == 0 and delta[:, 4:].max() == 0


def test_self_conditioning_only_matters_once_its_norm_scale_is_nonzero():
  model = registry.build_model(_config())
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  gamma, labels = jnp.array([0.3, 0.6]), jnp.array([1, 2])
  prev_a = jax.random.normal(jax.random.key(1), model.latents_shape(2))
  prev_b = jax.random.normal(jax.random.key(2), model.latents_shape(2))
  out_a, _ = _forward(model, x, gamma, labels, prev_a)
  out_b, _ = _forward(model, x, gamma, labels, prev_b)
  np.testing.assert_array_equal(out_a, out_b)  # zero-initialised scale: a fresh model ignores them
  model.latent_prev.out_norm.scale[...] = jnp.ones_like(model.latent_prev.out_norm.scale[...])
  out_a, _ = _forward(model, x, gamma, labels, prev_a)
  out_b, _ = _forward(model, x, gamma, labels, prev_b)
  assert float(jnp.abs(out_a - out_b).max()) > 1e-3


def test_noise_level_and_label_condition_the_output():
  model = registry.build_model(_config("model.self_condition=false"))
  x = jax.random.normal(jax.random.key(0), (1, 8, 8, 3))
  base = _forward(model, x, jnp.array([0.5]), jnp.array([1]))[0]
  assert float(jnp.abs(_forward(model, x, jnp.array([0.6]), jnp.array([1]))[0] - base).max()) > 1e-4
  assert float(jnp.abs(_forward(model, x, jnp.array([0.5]), jnp.array([2]))[0] - base).max()) > 1e-4
  with pytest.raises(ValueError, match="class-conditional"):
    _forward(model, x, jnp.array([0.5]))


@pytest.mark.parametrize(
  "overrides,message",
  [
    (["model.patch_size=5"], "does not divide model.image_size"),
    (["model.num_groups=3"], "not a square number"),
    (["model.num_groups=9"], "does not split into 3x3 groups"),
    (["model.layers=L(1)G(1)"], "ends with global layers"),
    (["model.d_latent=132", "model.latent_heads=4"], "not a multiple of 8"),
    (["train.seq_len=768"], "is not the 192 pixel values"),
    (["diffusion.pred_type=score"], "diffusion.pred_type 'score'"),
    (["diffusion.schedule=cosine@1,0,1"], "noise schedule"),
    (["task=classify"], "not built for task 'classify'"),
    (["diffusion.sampler=ddpm@tiny"], "diffusion.sampler 'ddpm@tiny' is not one of"),
    (["diffusion.sample_steps=0"], "diffusion.sample_steps must be a positive integer, got 0"),
    (["diffusion.guidance=-1.0"], "diffusion.guidance -1.0 is not a finite number >= 0"),
    (["diffusion.cond_dropout=1.0"], r"diffusion.cond_dropout 1.0 is not in \[0, 1\)"),
    (["diffusion.cond_dropout=0.0", "diffusion.guidance=1.0"], "trained with diffusion.cond_dropout > 0"),
    (["model.num_classes=0", "diffusion.guidance=1.0"], "needs a class-conditional denoiser"),
  ],
)
def test_bad_settings_are_config_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    _config(*overrides)


def test_diffusion_reads_raster_images_only(tmp_path):
  config = _config(*fx.build(tmp_path), "data.order=patches")
  with pytest.raises(ConfigError, match="data.order 'raster'"):
    lra_core.data.make_source(config, "train")


# -- sampling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", diffusion.SAMPLERS)
def test_sampling_is_finite_and_deterministic_given_the_key(sampler):
  model = registry.build_model(_config())
  model.latent_prev.out_norm.scale[...] = jnp.ones_like(model.latent_prev.out_norm.scale[...])
  labels = jnp.array([0, 5])

  @nnx.jit(static_argnums=2)
  def draw(model, key, steps):
    return diffusion.sample(model, key, (2, 8, 8, 3), steps, schedule="cosine", sampler=sampler, labels=labels)

  for steps in (1, 3):
    a = draw(model, jax.random.key(0), steps)
    assert a.shape == (2, 8, 8, 3) and bool(jnp.isfinite(a).all())
    assert float(jnp.abs(a).max()) <= 1.0  # x0 estimates are clipped
    np.testing.assert_array_equal(a, draw(model, jax.random.key(0), steps))
    assert float(jnp.abs(a - draw(model, jax.random.key(1), steps)).max()) > 1e-4
  assert diffusion.unit_to_pixels(a).dtype == jnp.uint8


def test_sampling_settings_come_from_the_config():
  """diffusion.sampler / sample_steps / sample_schedule / x0_clip decide the draw."""
  config = _config(
    "diffusion.sample_steps=2", "diffusion.sampler=ddim", "diffusion.sample_schedule=linear", "diffusion.x0_clip=False"
  )
  model = registry.build_model(config)
  labels = jnp.array([0, 5])
  draw = lambda c: nnx.jit(lambda m, key: diffusion.sample_from_config(m, c, key, 2, labels=labels))(
    model, jax.random.key(0)
  )
  out = draw(config)
  d = config.diffusion
  # The same draw spelt out, compiled too: eager and jitted draws round differently (without x0
  # clipping the values reach 1e5, so float32 rounding alone is about 1e-2 there).
  same = nnx.jit(
    lambda m, key: diffusion.sample(
      m, key, out.shape, 2, schedule="linear", pred_type=d.pred_type, sampler="ddim", labels=labels, x0_clip=False
    )
  )(model, jax.random.key(0))
  np.testing.assert_allclose(out, same, rtol=1e-6, atol=1e-6)
  other = _config(
    "diffusion.sample_steps=3", "diffusion.sampler=ddim", "diffusion.sample_schedule=linear", "diffusion.x0_clip=False"
  )
  assert float(jnp.abs(out - draw(other)).max()) > 1e-5


def _draw(config, model, **options):
  """uint8 images through lra_core.sample (the trainer's and the CLI's path), fixed key and labels."""
  return image_samples.training_samples(config, model, jax.random.key(0), 2, labels=np.array([3, 7]), **options)


SMALL = (
  "model.d_model=32",
  "model.d_latent=32",
  "model.d_ff=64",
  "model.latent_d_ff=64",
  "model.layers=L(1)G(1)L(1)",
  "diffusion.sampler=ddim",
  "diffusion.sample_steps=3",
  "diffusion.sample_schedule=linear",
)


SAMPLING_KEYS = [
  "diffusion.sampler=ddpm",
  "diffusion.sampler=ddpm@small",
  "diffusion.sample_steps=4",
  "diffusion.sample_schedule=cosine",
  "diffusion.x0_clip=False",
  "diffusion.guidance=2.0",
  "diffusion.normalize_noisy_input=True",
]


@pytest.mark.parametrize("override", tiers.quick(SAMPLING_KEYS, keep=[1, 5], ids=SAMPLING_KEYS))
def test_each_sampling_key_changes_the_samples(override):
  """lra_core.sample reads every sampling key of config.diffusion (the model is the same one)."""
  base = _config(*SMALL)
  model = registry.build_model(base)
  model.latent_prev.out_norm.scale[...] = jnp.ones_like(model.latent_prev.out_norm.scale[...])
  # A zero stem bias before the LayerNorm would make a fresh model blind to the input's scale.
  model.stem.bias[...] = jax.random.normal(jax.random.key(2), model.stem.bias.shape)
  reference = _draw(base, model)
  np.testing.assert_array_equal(reference, _draw(base, model))
  changed = _draw(_config(*SMALL, override), model)
  assert changed.shape == reference.shape and not np.array_equal(changed, reference)
  if override == "diffusion.sampler=ddpm":  # --sampler / steps= / guidance= override the config
    np.testing.assert_array_equal(changed, _draw(base, model, sampler="ddpm"))


def test_guided_sampling_combines_conditional_and_null_class_predictions():
  config = _config(*SMALL)
  model = registry.build_model(config)
  assert model.null_label == 1000 and model.label_embed.embedding.shape[0] == 1001
  labels, key, shape = jnp.array([3, 7]), jax.random.key(4), (2, 8, 8, 3)
  guided = nnx.jit(
    lambda m, k: diffusion.sample(
      m, k, shape, 1, schedule="cosine", pred_type="x0", sampler="ddim", labels=labels, x0_clip=False, guidance=2.0
    )
  )(model, key)
  # One step from t=1: the x0 estimate is the guided prediction at the initial noise.
  x = jax.random.normal(jax.random.split(key)[0], shape)
  gamma = diffusion.make_schedule("cosine")(jnp.ones(2))
  cond, _ = _forward(model, x, gamma, labels)
  uncond, _ = _forward(model, x, gamma, jnp.full((2,), 1000))
  assert float(jnp.abs(cond - uncond).max()) > 1e-4
  np.testing.assert_allclose(guided, 3.0 * cond - 2.0 * uncond, atol=1e-5)
  plain = registry.build_model(_config(*SMALL, "diffusion.cond_dropout=0.0"))
  assert plain.null_label is None and plain.label_embed.embedding.shape[0] == 1000
  with pytest.raises(ValueError, match="null class"):
    diffusion.sample(plain, key, shape, 1, labels=labels, guidance=2.0)


def _prepared(config, n=64):
  task = make_task(config, DataInfo(vocab_size=256, num_classes=1000))
  images = _images(n, 8)
  batch = {
    "inputs": jnp.asarray(images.reshape(n, -1), jnp.int32),
    "targets": jnp.arange(n, dtype=jnp.int32),
    "weights": jnp.ones(n, jnp.float32),
  }
  return task, jax.jit(task.prepare)(batch, jax.random.key(11))


def test_conditioning_dropout_puts_the_null_class_in_training_only():
  config = _config(*SMALL, "diffusion.cond_dropout=0.5", "model.self_condition=false")
  task, batch = _prepared(config)
  off_task, off = _prepared(_config(*SMALL, "diffusion.cond_dropout=0.0", "model.self_condition=false"))
  assert "drop_label" not in off
  for name in off:  # the other draws are those of a run without dropout
    np.testing.assert_array_equal(batch[name], off[name])
  dropped = np.asarray(batch["drop_label"])
  assert 0.3 < dropped.mean() < 0.7
  model = registry.build_model(config)
  run = nnx.jit(
    lambda m, b, train: task.loss_and_metrics(m, b, normalizer=jnp.ones(()), rngs=nnx.Rngs(0) if train else None)[0],
    static_argnums=2,
  )
  loss = lambda b, train: float(run(model, b, train))
  manual = dict(batch, labels=jnp.where(batch["drop_label"], 1000, batch["labels"]))
  assert loss(batch, True) == pytest.approx(loss(manual, False), rel=1e-6)  # training: the null class
  assert abs(loss(batch, False) - loss(manual, False)) > 1e-6  # evaluation: the true labels


def test_normalize_noisy_input_scales_what_the_denoiser_sees():
  _, plain = _prepared(_config(*SMALL))
  _, scaled = _prepared(_config(*SMALL, "diffusion.normalize_noisy_input=True"))
  np.testing.assert_allclose(scaled["inputs"], diffusion.normalize_input(plain["inputs"]), rtol=1e-6)
  np.testing.assert_array_equal(scaled["targets"], plain["targets"])
  assert float(jnp.abs(scaled["inputs"] - plain["inputs"]).max()) > 1e-2


# -- training ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_diffusion_loss_decreases_on_a_tiny_image_set():
  config = _config()
  task = make_task(config, DataInfo(vocab_size=256, num_classes=1000))
  model = registry.build_model(config)
  images = _images(8, 8)
  batch = {
    "inputs": jnp.asarray(images.reshape(8, -1), jnp.int32),
    "targets": jnp.arange(8, dtype=jnp.int32),
    "weights": jnp.ones(8, jnp.float32),
  }
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(2e-3)
  opt_state = tx.init(params)

  def loss_fn(params, key):
    m = nnx.merge(graphdef, params, rest)
    prepared = task.prepare(batch, key)
    loss, metrics, _ = task.loss_and_metrics(m, prepared, normalizer=task.normalizer(prepared), rngs=None)
    return loss

  @jax.jit
  def step(params, opt_state, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # A fixed set of (t, noise) draws measures the loss before and after.
  eval_keys = jax.random.split(jax.random.key(123), 8)
  held_out = jax.jit(lambda p: jnp.mean(jax.vmap(lambda k: loss_fn(p, k))(eval_keys)))
  before = float(held_out(params))
  for i in range(40):
    params, opt_state, _ = step(params, opt_state, jax.random.key(i))
  after = float(held_out(params))
  assert np.isfinite(before) and after < 0.6 * before, (before, after)
