"""Optimizers and learning-rate schedules built from `config.optim` (optax). The section's fields,
defaults, checks and the papers' settings are lra_core.run.optim_settings's; this module turns them
into the transformation, the schedules, the weight-decay masks and the EMA's decay.

One main recipe (optimizer + schedule + decoupled weight decay + clipping) applies to every
parameter, except those claimed by a parameter group (`groups`), which get their own transform.

Conventions:

* 'lamb' is optax.lamb's chain (Adam direction, + wd * p, times the trust ratio ||p|| / ||u||
  per tensor, times lr(t)), with this module's mask: parameters that are not decayed (below) get
  neither the decay nor the trust ratio (as pix2seq's LAMB excludes biases and LayerNorm from both). Its
  decay sits inside the trust ratio, so it needs weight_decay_schedule 'lr'.
* `ema_decay` d > 0 keeps an exponential moving average of the parameters in the train state,
  ema <- d * ema + (1 - d) * params after every update (starting from the initial parameters);
  evaluation and sampling then use it (lra_core.run.state, lra_core.run.steps). 0 (default) = none.
  `ema_warmup` uses min(d, (1 + n) / (10 + n)) for the update after n updates instead (as
  TensorFlow's ExponentialMovingAverage with num_updates), so a short run averages its recent weights
  rather than staying near its initial ones (1 / (1 - d) = 10,000 updates at 0.9999).
* Weight decay touches the weights that mix features (projection kernels, token embedding tables,
  gates) and nothing that adds to, scales or rotates activations, whatever its layout: parameters
  with ndim < 2 (scalars, biases, norm scales), and by name (`decays`, `UNDECAYED`) [heads, head_dim]
  biases, Transformer-VQ's per-head XL biases `xl_u` / `xl_v`, FLASH's per-dimension query/key
  scales and offsets `gamma` / `beta`, Latte's VAPOR frequencies and gate biases, learned position
  tables and FIT's latents. A scanned stack is decayed per layer (`per_layer_optimizer`), so its
  layer axis never turns a bias into a matrix. `decayed_paths` lists what a model decays.
  `weight_decay_schedule='lr'` subtracts lr(t) * wd * p (optax adamw, LRA);
  'constant' subtracts wd * p every step whatever the learning rate (Transformer-VQ).
* Clipping (`clip_norm`) applies to the main group only, and its global norm is taken over the
  main group's gradients only: group transforms see raw updates, so codebook EMA deltas are
  never clipped and never inflate the norm that clips the rest.
"""

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lra_core.errors import ConfigError
from lra_core.layer_stacks import per_layer_optimizer
from lra_core.run import optim_settings
from lra_core.run.optim_settings import MAIN_LABEL


def ema_decay(config) -> float:
  """`optim.ema_decay` (0.0 for configs saved before it existed): > 0 keeps an EMA of the weights."""
  return float(config.optim.get("ema_decay", 0.0))


def ema_rate(config, updates):
  """The EMA's decay for the update that follows `updates` updates (a traced step count is fine)."""
  decay = ema_decay(config)
  if not config.optim.get("ema_warmup", False):
    return decay
  n = jnp.asarray(updates, jnp.float32)
  return jnp.minimum(decay, (1.0 + n) / (10.0 + n))


def param_paths(params: Any) -> Any:
  """Returns a pytree like `params` whose leaves are '/'-joined key paths ('layers/0/q')."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _join_path(path), params)


def _join_path(path: tuple[Any, ...]) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


# ------------------------------------------------------------------------------- schedules


def make_schedule(cfg_optim: Any, total_steps: int) -> optax.Schedule:
  """Learning rate at each step for the main settings of `cfg_optim` (the optim section)."""
  return _schedule(optim_settings.main_settings(cfg_optim), total_steps)


def _schedule(s: Mapping[str, Any], total_steps: int) -> optax.Schedule:
  """Builds lr(step) from resolved settings; step 0 gives 0 under warmup, never NaN."""
  lr, kind = float(s["lr"]), s["schedule"]
  warmup = int(s["warmup_steps"])
  horizon = int(s["decay_steps"]) or int(total_steps)
  floor = float(s["min_lr_ratio"])

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    # warmup 0 means no warmup: the ratio is 1 from step 0.
    warm = jnp.minimum(1.0, step / warmup) if warmup > 0 else jnp.float32(1.0)
    if kind == "constant":
      return lr * warm
    if kind == "rsqrt":
      return lr * warm * jax.lax.rsqrt(jnp.maximum(step, float(warmup)))
    # max(.., 1) keeps the division finite when warmup fills the whole horizon.
    frac = jnp.clip((step - warmup) / max(horizon - warmup, 1), 0.0, 1.0)
    if kind == "cosine":
      decay = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:
      decay = 1.0 - frac
    return lr * warm * (floor + (1.0 - floor) * decay)

  return schedule


# ------------------------------------------------------------------------------ optimizers


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns the transform for `config.optim` and the main group's lr schedule (for logging).

  Params are a nested dict of arrays; groups are told apart by their '/'-joined paths.
  """
  optim_settings.validate_config(config)
  total_steps = optim_settings.train_steps(config)
  main, groups = optim_settings.resolved(config.optim)
  main_schedule = _schedule(main, total_steps)
  main_tx = _transform(main, main_schedule)
  if main["clip_norm"] > 0:
    main_tx = optax.chain(optax.clip_by_global_norm(main["clip_norm"]), main_tx)
  if not groups:
    return _per_layer(config, main_tx), main_schedule
  transforms = {MAIN_LABEL: main_tx}
  for g in groups:
    if g["optimizer"] == "none":
      transforms[g["name"]] = optax.set_to_zero()
    else:
      transforms[g["name"]] = _transform(g, _schedule(g, total_steps))
  tx = optax.multi_transform(transforms, _labeler(groups))
  return _per_layer(config, tx), main_schedule


def frozen(config: ml_collections.ConfigDict, params: Any) -> Any:
  """A tree like `params` of bools: True for a parameter of a frozen group (optimizer 'none'). The train
  step stops the gradient there, so the backward pass never forms those weights' gradients (a third of a
  step's matrix products when most of a model is frozen, as Gemma-Macchiato's Gemma weights are)."""
  names = {g["name"] for g in config.optim.groups if g["optimizer"] == "none"}
  if not names:
    return jax.tree.map(lambda _: False, params)
  _, groups = optim_settings.resolved(config.optim)
  return jax.tree.map(lambda label: label in names, _labeler(groups)(params))


def _per_layer(config, tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """With model.scan_layers, the optimizer still sees (and keeps its state for) each layer."""
  return per_layer_optimizer(tx) if config.get("model", {}).get("scan_layers", False) else tx


def _labeler(groups: list[dict[str, Any]]) -> Callable[[Any], Any]:
  """Maps a params tree to group labels; the first matching group wins."""
  compiled = [(g["name"], re.compile(g["pattern"]), g["pattern"]) for g in groups]

  def label_of(path: str) -> str:
    for name, regex, _ in compiled:
      if regex.search(path):
        return name
    return MAIN_LABEL

  def labels(params: Any) -> Any:
    tree = jax.tree.map(label_of, param_paths(params))
    used = set(jax.tree.leaves(tree))
    for name, _, pattern in compiled:
      # A typo in a pattern would otherwise silently hand codebooks to the main optimizer.
      if name not in used:
        raise ConfigError(
          f"optim group {name!r} pattern {pattern!r} matches no parameter "
          "path; expected at least one match (see param_paths)."
        )
    return tree

  return labels


def _transform(s: Mapping[str, Any], schedule: optax.Schedule) -> optax.GradientTransformation:
  """Optimizer core, then the learning rate and decoupled weight decay."""
  if s["optimizer"] == "lamb":
    return _lamb(s, schedule)
  core = _core(s)
  wd = float(s["weight_decay"])
  if wd == 0.0:
    return optax.chain(core, optax.scale_by_learning_rate(schedule))
  if s["weight_decay_schedule"] == "lr":
    return optax.chain(core, optax.add_decayed_weights(wd, mask=_decay_mask), optax.scale_by_learning_rate(schedule))
  # Added after the lr sign flip, so a negative rate subtracts wd * p at every step.
  return optax.chain(core, optax.scale_by_learning_rate(schedule), optax.add_decayed_weights(-wd, mask=_decay_mask))


def _lamb(s: Mapping[str, Any], schedule: optax.Schedule) -> optax.GradientTransformation:
  """optax.lamb's chain, with the decay and the trust ratio on the decayed parameters only (`decays`)."""
  parts = [optax.scale_by_adam(b1=s["b1"], b2=s["b2"], eps=s["eps"])]
  if float(s["weight_decay"]):
    parts.append(optax.add_decayed_weights(float(s["weight_decay"]), mask=_decay_mask))
  parts += [optax.masked(optax.scale_by_trust_ratio(), _decay_mask), optax.scale_by_learning_rate(schedule)]
  return optax.chain(*parts)


# Parameters named so add to, scale or rotate activations: no weight decay, whatever their rank. Matched
# against the last two parts of the '/'-joined path (a module's name, then the parameter's).
UNDECAYED = re.compile(r"(^|/)(\w*bias|beta|gamma|scale|xl_[uv]|vapor|latents|\w*positions(/table)?)$")


def decays(path: str, param: Any) -> bool:
  """Whether weight decay (and LAMB's trust ratio) applies to the parameter at `path` (see `param_paths`)."""
  return jnp.ndim(param) >= 2 and not UNDECAYED.search("/".join(path.split("/")[-2:]))


def decayed_paths(params: Any) -> list[str]:
  """The paths of the parameters weight decay applies to, in tree order."""
  return [path for path, p in zip(jax.tree.leaves(param_paths(params)), jax.tree.leaves(params)) if decays(path, p)]


def _decay_mask(params: Any) -> Any:
  return jax.tree_util.tree_map_with_path(lambda path, p: decays(_join_path(path), p), params)


def _core(s: Mapping[str, Any]) -> optax.GradientTransformation:
  """The descent direction before the learning rate: positive, like a gradient."""
  name = s["optimizer"]
  momentum = float(s["momentum"])
  if name in ("adamw", "adam"):
    return optax.scale_by_adam(b1=s["b1"], b2=s["b2"], eps=s["eps"])
  if name == "sgd":
    return optax.trace(decay=momentum) if momentum > 0 else optax.identity()
  parts = [
    optax.scale_by_factored_rms(
      factored=s["factored"],
      decay_rate=s["decay_rate"],
      min_dim_size_to_factor=s["min_dim_size_to_factor"],
      epsilon=s["factored_eps"],
    )
  ]
  if s["clipping_threshold"] > 0:
    parts.append(optax.clip_by_block_rms(s["clipping_threshold"]))
  if s["multiply_by_parameter_scale"]:
    parts.append(optax.scale_by_param_block_rms())
  if momentum > 0:
    parts.append(optax.ema(momentum, debias=False))
  return optax.chain(*parts)
