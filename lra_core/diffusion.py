"""Denoising diffusion in continuous time, as pure functions (Chen 2023, "On the importance of
noise scheduling for diffusion models"; pix2seq's models/diffusion_utils.py).

Time t in [0, 1] maps to the signal level gamma(t) (1 at t=0, ~0 at t=1), and
  x_t = sqrt(gamma) x0 + sqrt(1 - gamma) eps,   eps ~ N(0, I).
A denoiser predicts eps, x0 or v = sqrt(gamma) eps - sqrt(1 - gamma) x0 (`pred_type`); the
conversions below turn any of them into (x0, eps). Sampling walks t from 1 to 0 in `steps`
equal steps with DDIM (deterministic) or DDPM (ancestral) transitions and returns the last x0
estimate; a self-conditioning denoiser gets its previous step's latents back each step.

Samplers (`diffusion.sampler`, pix2seq's `sampler_name`): "ddim"; "ddpm" with the 'large'
variance beta = 1 - alpha; "ddpm@small" with the posterior variance
beta~ = (1 - gamma_prev) / (1 - gamma) * (1 - alpha) (Ho et al. 2020, section 3.2).

Classifier-free guidance (Ho & Salimans 2022): a denoiser trained with `cond_dropout` sees the
null class (label `model.null_label`) in place of the true one for that share of its training
examples; sampling with `guidance` w > 0 runs it with and without the label and uses
(1 + w) * pred(label) - w * pred(null), on the raw prediction (eps, x0 or v) as pix2seq does;
both passes read the conditional pass's latents for self-conditioning.

`normalize_noisy_input` (pix2seq's flag of that name): the denoiser sees x_t divided by its own
standard deviation over all pixels and channels of each example; the conversions to (x0, eps)
keep the unnormalised x_t.

Schedules are named as in pix2seq: "cosine", "sigmoid" (optionally "@start,end,tau"), "linear"
(gamma = 1 - t, pix2seq's "simple_linear"). Images live in [-1, 1] (pixel p -> p / 127.5 - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections

from lra_core.errors import ConfigError

Array = jax.Array
Schedule = Callable[[Array], Array]

SCHEDULES = ("cosine", "sigmoid", "linear")
PRED_TYPES = ("eps", "x0", "v")
SAMPLERS = ("ddim", "ddpm", "ddpm@small")
CLIP_MIN = 1e-9  # gamma never reaches 0, so x0 = (x_t - sqrt(1-g) eps) / sqrt(g) stays finite
# Chen 2023, Algorithm 1 defaults for (start, end, tau).
_DEFAULT_PARAMS = {"cosine": (0.0, 1.0, 1.0), "sigmoid": (-3.0, 3.0, 1.0)}


def default_config() -> ml_collections.ConfigDict:
  """The `config.diffusion` section read by the `diffusion` task."""
  return ml_collections.ConfigDict(
    dict(
      schedule="cosine",  # training gamma(t): cosine | sigmoid [@start,end,tau] | linear
      pred_type="eps",  # what the denoiser outputs: eps | x0 | v (the MSE target)
      self_cond_rate=0.5,  # share of examples that see their own first-pass latents
      sampler="ddim",  # ddim | ddpm (variance 1 - alpha) | ddpm@small (posterior variance)
      sample_steps=100,
      sample_schedule="",  # gamma(t) while sampling; "" -> schedule
      x0_clip=True,  # clip x0 estimates to [-1, 1] while sampling
      cond_dropout=0.0,  # share of training labels replaced by the null class (> 0: guidable;
      # no effect on an unconditional denoiser)
      guidance=0.0,  # classifier-free guidance scale w while sampling; 0 -> off
      normalize_noisy_input=False,  # the denoiser sees x_t / std(x_t) (per example)
    )
  )


# ------------------------------------------------------------------------------- Schedules


def cosine_schedule(t: Array, start: float = 0.0, end: float = 1.0, tau: float = 1.0) -> Array:
  """gamma(t) = cos(pi/2 (start + t (end - start)))^(2 tau), rescaled to [0, 1] and clipped."""
  y_start = math.cos(start * math.pi / 2) ** (2 * tau)
  y_end = math.cos(end * math.pi / 2) ** (2 * tau)
  y = jnp.cos((t * (end - start) + start) * math.pi / 2) ** (2 * tau)
  return jnp.clip((y - y_end) / (y_start - y_end), CLIP_MIN, 1.0)


def sigmoid_schedule(t: Array, start: float = -3.0, end: float = 3.0, tau: float = 1.0) -> Array:
  """gamma(t) = 1 - sigmoid((start + t (end - start)) / tau), rescaled to [0, 1] and clipped."""
  v_start = jax.nn.sigmoid(start / tau)
  v_end = jax.nn.sigmoid(end / tau)
  v = jax.nn.sigmoid((t * (end - start) + start) / tau)
  return jnp.clip((v_end - v) / (v_end - v_start), CLIP_MIN, 1.0)


def linear_schedule(t: Array) -> Array:
  return jnp.clip(1.0 - t, CLIP_MIN, 1.0)


def make_schedule(spec: str) -> Schedule:
  """'cosine', 'sigmoid@-3,3,1.1', 'linear' -> gamma(t)."""
  name, _, args = spec.partition("@")
  if name not in SCHEDULES or (args and name == "linear"):
    raise ConfigError(
      f"noise schedule {spec!r} is not one of {list(SCHEDULES)} (cosine and sigmoid may add '@start,end,tau')."
    )
  if name == "linear":
    return linear_schedule
  params = _DEFAULT_PARAMS[name]
  if args:
    try:
      params = tuple(float(a) for a in args.split(","))
    except ValueError:
      params = ()
    if len(params) != 3:
      raise ConfigError(f"noise schedule {spec!r} needs three numbers after '@': start,end,tau.")
  start, end, tau = params
  fn = cosine_schedule if name == "cosine" else sigmoid_schedule
  if tau <= 0 or start >= end or (name == "cosine" and not 0 <= start < end <= 1):
    raise ConfigError(f"noise schedule {spec!r} needs tau > 0 and start < end (within [0, 1] for cosine).")
  return lambda t: fn(t, start, end, tau)


def validate_config(config) -> None:
  """Checks `config.diffusion` (used by the task and by denoiser models at config load)."""
  if "diffusion" not in config:
    raise ConfigError("task 'diffusion' needs a config.diffusion section (lra_core.diffusion.default_config()).")
  d = config.diffusion
  make_schedule(d.schedule)
  make_schedule(d.sample_schedule or d.schedule)
  for key, allowed in (("pred_type", PRED_TYPES), ("sampler", SAMPLERS)):
    if d[key] not in allowed:
      raise ConfigError(f"diffusion.{key} {d[key]!r} is not one of {list(allowed)}.")
  if not 0.0 <= d.self_cond_rate <= 1.0:
    raise ConfigError(f"diffusion.self_cond_rate {d.self_cond_rate} is not in [0, 1].")
  if isinstance(d.sample_steps, bool) or not isinstance(d.sample_steps, int) or d.sample_steps < 1:
    raise ConfigError(f"diffusion.sample_steps must be a positive integer, got {d.sample_steps!r}.")
  for key in ("x0_clip", "normalize_noisy_input"):
    if not isinstance(d.get(key, False), bool):
      raise ConfigError(f"diffusion.{key} must be True or False, got {d[key]!r}.")
  cond_dropout, guidance = d.get("cond_dropout", 0.0), d.get("guidance", 0.0)
  if not 0.0 <= cond_dropout < 1.0:
    raise ConfigError(f"diffusion.cond_dropout {cond_dropout} is not in [0, 1).")
  if not (math.isfinite(guidance) and guidance >= 0.0):
    raise ConfigError(f"diffusion.guidance {guidance} is not a finite number >= 0.")
  if guidance > 0 and null_label(config) is None:
    raise ConfigError(
      f"diffusion.guidance {guidance} needs a class-conditional denoiser (model.num_classes > 0) "
      f"trained with diffusion.cond_dropout > 0 (the null class); set them or guidance 0."
    )


def null_label(config) -> int | None:
  """The label of the null class (model.num_classes) when `diffusion.cond_dropout` > 0, else None."""
  if config.diffusion.get("cond_dropout", 0.0) > 0 and config.model.get("num_classes", 0) > 0:
    return int(config.model.num_classes)
  return None


# ------------------------------------------------------------------------------- Forward process


def _expand(gamma: Array, x: Array) -> Array:
  """gamma [B] -> [B, 1, ..., 1] to broadcast against x [B, ...]."""
  return jnp.reshape(gamma, gamma.shape + (1,) * (x.ndim - gamma.ndim)).astype(jnp.float32)


def pixels_to_unit(pixels: Array) -> Array:
  """Intensities 0..255 (any int or float dtype) -> float32 in [-1, 1]."""
  return pixels.astype(jnp.float32) / 127.5 - 1.0


def unit_to_pixels(x: Array) -> Array:
  """[-1, 1] -> uint8 intensities (rounded, clipped)."""
  return jnp.clip(jnp.round((x + 1.0) * 127.5), 0, 255).astype(jnp.uint8)


def q_sample(x0: Array, gamma: Array, eps: Array) -> Array:
  """x_t = sqrt(gamma) x0 + sqrt(1 - gamma) eps; x0, eps [B, ...], gamma [B]."""
  g = _expand(gamma, x0)
  return jnp.sqrt(g) * x0 + jnp.sqrt(1.0 - g) * eps


def prediction_target(pred_type: str, x0: Array, eps: Array, gamma: Array) -> Array:
  """What a `pred_type` denoiser should output for (x0, eps) at level gamma."""
  if pred_type == "eps":
    return eps
  if pred_type == "x0":
    return x0
  if pred_type == "v":
    g = _expand(gamma, x0)
    return jnp.sqrt(g) * eps - jnp.sqrt(1.0 - g) * x0
  raise ValueError(f"pred_type {pred_type!r} is not one of {PRED_TYPES}.")


def normalize_input(x_t: Array) -> Array:
  """x_t [B, ...] divided by its standard deviation over all but the batch axis (per example)."""
  axes = tuple(range(1, x_t.ndim))
  return x_t / jnp.std(x_t, axis=axes, keepdims=True)


def x0_from_eps(x_t: Array, gamma: Array, eps: Array) -> Array:
  g = _expand(gamma, x_t)
  return (x_t - jnp.sqrt(1.0 - g) * eps) / jnp.sqrt(g)


def eps_from_x0(x_t: Array, gamma: Array, x0: Array) -> Array:
  g = _expand(gamma, x_t)
  return (x_t - jnp.sqrt(g) * x0) / jnp.sqrt(1.0 - g)


def x0_eps_from_prediction(
  pred_type: str, x_t: Array, gamma: Array, pred: Array, *, clip: bool = False
) -> tuple[Array, Array]:
  """(x0, eps) implied by a `pred_type` prediction. With `clip`, x0 is clipped to [-1, 1] and eps
  recomputed from it, so the pair stays consistent with x_t (pix2seq's truncate_noise)."""
  g = _expand(gamma, x_t)
  if pred_type == "eps":
    x0, eps = x0_from_eps(x_t, gamma, pred), pred
  elif pred_type == "x0":
    x0 = pred
    eps = eps_from_x0(x_t, gamma, pred)
  elif pred_type == "v":
    x0 = jnp.sqrt(g) * x_t - jnp.sqrt(1.0 - g) * pred
    eps = jnp.sqrt(1.0 - g) * x_t + jnp.sqrt(g) * pred
  else:
    raise ValueError(f"pred_type {pred_type!r} is not one of {PRED_TYPES}.")
  if clip:
    x0 = jnp.clip(x0, -1.0, 1.0)
    eps = eps_from_x0(x_t, gamma, x0)
  return x0, eps


# ------------------------------------------------------------------------------- Reverse process


def ddim_step(x0: Array, eps: Array, gamma_prev: Array) -> Array:
  """Deterministic step to level gamma_prev: sqrt(gamma_prev) x0 + sqrt(1 - gamma_prev) eps."""
  return q_sample(x0, gamma_prev, eps)


DDPM_VARIANCES = ("large", "small")


def ddpm_step(key: Array, x_t: Array, eps: Array, gamma: Array, gamma_prev: Array, *, variance: str = "large") -> Array:
  """Ancestral step from gamma to gamma_prev > gamma with alpha = gamma / gamma_prev: the mean of
  q(x_prev | x_t, x0) plus noise of variance beta = 1 - alpha ('large', pix2seq's default) or the
  posterior variance beta~ = (1 - gamma_prev) / (1 - gamma) * beta ('small'; 0 at the last step,
  where gamma_prev = 1) (Ho et al. 2020, section 3.2)."""
  if variance not in DDPM_VARIANCES:
    raise ValueError(f"ddpm variance {variance!r} is not one of {DDPM_VARIANCES}.")
  g, gp = _expand(gamma, x_t), _expand(gamma_prev, x_t)
  alpha = jnp.clip(jnp.exp(jnp.log(g) - jnp.log(gp)), 0.0, 1.0)
  mean = jax.lax.rsqrt(alpha) * (x_t - jax.lax.rsqrt(1.0 - g) * (1.0 - alpha) * eps)
  var = 1.0 - alpha
  if variance == "small":
    var = jnp.exp(jnp.log1p(-gp) - jnp.log1p(-g)) * var
  return mean + jnp.sqrt(var) * jax.random.normal(key, x_t.shape, x_t.dtype)


def guided_prediction(cond: Array, uncond: Array, guidance: float) -> Array:
  """Classifier-free guidance on raw predictions: (1 + w) * cond - w * uncond (pix2seq's form)."""
  return cond * (1.0 + guidance) - uncond * guidance


def sample(
  model,
  key: Array,
  shape: tuple[int, ...],
  steps: int,
  *,
  schedule: str = "cosine",
  pred_type: str = "eps",
  sampler: str = "ddim",
  labels: Array | None = None,
  x0_clip: bool = True,
  guidance: float = 0.0,
  normalize: bool = False,
) -> Array:
  """Images [B,S,S,C] in [-1, 1] drawn by `steps` reverse steps from t=1 to t=0.

  model(x_t, gamma, labels=, latents_prev=) -> (prediction, latents); a model whose
  `self_condition` is True gets the latents of its previous call (zeros at the first step).
  guidance w > 0 needs `labels` int[B] and a model whose `null_label` is not None: each step
  runs the model once on the 2B rows [labels; null] and combines the halves (`guided_prediction`);
  both halves read the conditional half's previous latents. `normalize`: the model sees
  `normalize_input(x_t)`.
  """
  if steps < 1:
    raise ValueError(f"steps must be positive, got {steps}.")
  if sampler not in SAMPLERS:
    raise ValueError(f"sampler {sampler!r} is not one of {SAMPLERS}.")
  if guidance < 0:
    raise ValueError(f"guidance must be >= 0, got {guidance}.")
  null = getattr(model, "null_label", None)
  if guidance and (labels is None or null is None):
    raise ValueError(
      "classifier-free guidance needs labels and a denoiser trained with a null class (diffusion.cond_dropout > 0)."
    )
  gamma_fn = make_schedule(schedule)
  b = shape[0]
  self_cond = model.self_condition
  k_init, k_steps = jax.random.split(key)
  x = jax.random.normal(k_init, shape, jnp.float32)
  latents = jnp.zeros(model.latents_shape(b), jnp.float32) if self_cond else None
  if guidance:
    labels = jnp.concatenate([labels, jnp.full_like(labels, null)])

  def denoise(x, gamma, latents):
    """-> (prediction [B,...] float32, the conditional latents or None)."""
    x_in = normalize_input(x) if normalize else x
    if not guidance:
      pred, new_latents = model(x_in, gamma, labels=labels, latents_prev=latents)
      return pred.astype(jnp.float32), new_latents
    twice = lambda a: None if a is None else jnp.concatenate([a, a])
    pred, new_latents = model(twice(x_in), twice(gamma), labels=labels, latents_prev=twice(latents))
    pred = pred.astype(jnp.float32)
    return guided_prediction(pred[:b], pred[b:], guidance), new_latents[:b]

  def body(i, carry):
    x, _, latents = carry
    t = jnp.full((b,), 1.0 - i / steps, jnp.float32)
    t_prev = jnp.maximum(t - 1.0 / steps, 0.0)
    gamma, gamma_prev = gamma_fn(t), gamma_fn(t_prev)
    pred, new_latents = denoise(x, gamma, latents)
    x0, eps = x0_eps_from_prediction(pred_type, x, gamma, pred, clip=x0_clip)
    if sampler == "ddim":
      x = ddim_step(x0, eps, gamma_prev)
    else:
      variance = sampler.partition("@")[2] or "large"
      x = ddpm_step(jax.random.fold_in(k_steps, i), x, eps, gamma, gamma_prev, variance=variance)
    return x, x0, (new_latents.astype(jnp.float32) if self_cond else None)

  _, x0, _ = jax.lax.fori_loop(0, steps, body, (x, jnp.zeros(shape, jnp.float32), latents))
  return x0


def sample_from_config(model, config, key: Array, batch_size: int, *, labels: Array | None = None) -> Array:
  """Images [B,S,S,C] in [-1, 1] drawn with the sampling settings of `config.diffusion`: sampler,
  sample_steps, sample_schedule ("" -> the training schedule), pred_type, x0_clip, guidance and
  normalize_noisy_input."""
  d, m = config.diffusion, config.model
  shape = (batch_size, m.image_size, m.image_size, m.image_channels)
  return sample(
    model,
    key,
    shape,
    d.sample_steps,
    schedule=d.sample_schedule or d.schedule,
    pred_type=d.pred_type,
    sampler=d.sampler,
    labels=labels,
    x0_clip=d.x0_clip,
    guidance=float(d.get("guidance", 0.0)),
    normalize=bool(d.get("normalize_noisy_input", False)),
  )
