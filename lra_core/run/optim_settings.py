"""The settings of `config.optim`: its fields and defaults (`default_config`), the schema of the
parameter groups (`GROUP_DEFAULTS`, `GROUP_INHERITED`), the checks that reject a bad section with one
sentence (`validate_config`), the resolution of the main settings and of each group into one flat dict
(`main_settings`, `group_settings`), and `keep_horizon`, which keeps a resumed run's schedules. The
optax transformation built from them is lra_core.run.optim's.

Settings from the papers (set them in config files; cite the table there too):

* Transformer-VQ (Lingle 2024, appendix C.1-C.2, Table 10): AdamW b1 0.9, b2 0.98,
  eps 1e-9, global-norm clip 0.1, lr 4e-4 (enwik8, ImageNet64 190M), weight decay 2e-4 on
  enwik8 and 0 elsewhere, not applied to 1-D tensors and on a constant schedule
  (`weight_decay_schedule='constant'`); Adafactor with relative step sizes, update clip 1.0,
  lr 0.01, beta1 0 (`momentum=0`), beta2_t = 1 - t^-0.8 (`decay_rate=0.8`) for PG-19 and
  ImageNet64 1.2B; linear warmup 10k steps, then cosine decay to 0.1x (`min_lr_ratio=0.1`);
  total steps 125k / 500k (Table 10). Codebooks (`c_sum`, `c_count`) are moved by SGD with
  lr 1 on "gradients" that equal p - EMA target: a group
  `{'name': 'codebook', 'pattern': r'(^|/)c_(sum|count)$', 'optimizer': 'sgd', 'lr': 1.0}`.
* pix2seq's RIN / FIT denoiser on ImageNet64 (configs/imagenet64/fit_denoiser.py): LAMB
  (You et al. 2020) at lr 2e-3, b2 0.999, eps 1e-8, weight decay 1e-2 (not on biases and norm
  scales, which also keep their plain Adam step), an EMA of the weights with decay 0.9999.
* Long Range Arena (Tay et al. 2021, appendix; public configs): Adam b1 0.9, b2 0.98,
  eps 1e-9 with decoupled weight decay scaled by the learning rate
  (`weight_decay_schedule='lr'`), schedule constant * linear_warmup * rsqrt_decay
  (`schedule='rsqrt'`: `lr` is the constant factor, not the peak).

Conventions:

* 'adam' is an alias of 'adamw': both apply decoupled weight decay, so weight_decay 0 gives
  plain Adam.
* Groups: each is a dict with 'name', 'pattern' (regex searched in the '/'-joined parameter
  path, see lra_core.run.optim.param_paths), 'optimizer' ('sgd' | 'adamw' | 'adam' | 'adafactor' |
  'none' = frozen) and 'lr' (not needed for 'none'); optional keys are listed in `GROUP_DEFAULTS` and
  `GROUP_INHERITED`. The first group whose pattern matches a path claims it; a group that
  matches no parameter is an error. Unlike the main recipe, a group defaults to a constant
  lr with no warmup, no weight decay and no momentum, because groups exist mostly for
  parameters that are not trained by the loss (EMA codebooks, frozen tables).
"""

import math
import re
from collections.abc import Mapping
from typing import Any

import ml_collections

from lra_core.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "adafactor", "sgd", "lamb")
GROUP_OPTIMIZERS = OPTIMIZERS + ("none",)
SCHEDULES = ("cosine", "linear", "constant", "rsqrt")
WEIGHT_DECAY_SCHEDULES = ("lr", "constant")
MAIN_LABEL = "main"

# Group keys that do NOT fall back to the main settings when left out.
GROUP_DEFAULTS = {
  "schedule": "constant",
  "warmup_steps": 0,
  "decay_steps": 0,
  "min_lr_ratio": 0.0,
  "weight_decay": 0.0,
  "weight_decay_schedule": "lr",
  "momentum": 0.0,
}
# Optimizer internals a group shares with the main settings unless it names them.
GROUP_INHERITED = (
  "b1",
  "b2",
  "eps",
  "factored",
  "min_dim_size_to_factor",
  "decay_rate",
  "clipping_threshold",
  "multiply_by_parameter_scale",
  "factored_eps",
)
_GROUP_REQUIRED = ("name", "pattern", "optimizer")
_GROUP_KEYS = frozenset(_GROUP_REQUIRED + ("lr",) + tuple(GROUP_DEFAULTS) + GROUP_INHERITED)

# key: (low, low_inclusive, high, high_inclusive); None means unbounded.
_RANGES = {
  "lr": (0.0, True, None, False),
  "warmup_steps": (0, True, None, False),
  "decay_steps": (0, True, None, False),
  "min_lr_ratio": (0.0, True, 1.0, True),
  "b1": (0.0, True, 1.0, False),
  "b2": (0.0, True, 1.0, False),
  "eps": (0.0, True, None, False),
  "weight_decay": (0.0, True, None, False),
  "clip_norm": (0.0, True, None, False),
  "momentum": (0.0, True, 1.0, False),
  "min_dim_size_to_factor": (1, True, None, False),
  "decay_rate": (0.0, False, 1.0, True),
  "clipping_threshold": (0.0, True, None, False),
  "factored_eps": (0.0, True, None, False),
}


def default_config() -> ml_collections.ConfigDict:
  """The `config.optim` section; every field has a concrete type for overrides."""
  c = ml_collections.ConfigDict()
  c.name = "adamw"  # 'adamw' | 'adam' (alias) | 'adafactor' | 'sgd' | 'lamb'
  c.lr = 1e-3  # peak lr; for schedule 'rsqrt' the constant factor
  c.schedule = "cosine"  # 'cosine' | 'linear' | 'constant' | 'rsqrt'
  c.warmup_steps = 0  # linear warmup from 0
  c.decay_steps = 0  # step where cosine/linear reach the floor; 0 -> train.steps
  c.min_lr_ratio = 0.0  # floor of cosine/linear decay, as a fraction of lr
  c.b1 = 0.9  # Adam
  c.b2 = 0.98
  c.eps = 1e-9
  c.weight_decay = 0.0  # decoupled; only on weights that mix features (see optim.decays)
  c.weight_decay_schedule = "lr"  # 'lr': lr(t) * wd * p; 'constant': wd * p
  c.clip_norm = 0.0  # global-norm clipping of the main group; 0 disables
  c.momentum = 0.0  # SGD heavy ball / Adafactor first moment; 0 = none
  # Adafactor (Shazeer & Stern 2018).
  c.factored = True  # factored second moments for matrices
  c.min_dim_size_to_factor = 128  # smaller matrices keep a full second moment
  c.decay_rate = 0.8  # beta2_t = 1 - t^-decay_rate
  c.clipping_threshold = 1.0  # update clipping by block RMS; 0 disables
  c.multiply_by_parameter_scale = True  # relative step sizes
  c.factored_eps = 1e-30  # added to squared gradients
  c.groups = ()  # tuple of group dicts; see the module docstring
  c.ema_decay = 0.0  # > 0: an EMA of the parameters, used to evaluate and sample; 0 = none
  c.ema_warmup = False  # True: the decay after n updates is min(ema_decay, (1 + n) / (10 + n))
  return c


# ------------------------------------------------------------------------------ validation


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError (one sentence) for a bad `config.optim` or `config.train.steps`."""
  total_steps = train_steps(config)
  main = main_settings(config.optim)
  _check_settings("optim", "name", main, OPTIMIZERS, total_steps)
  decay = config.optim.get("ema_decay", 0.0)
  if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
    raise ConfigError(f"optim.ema_decay {decay!r} is not in [0, 1); expected e.g. 0.9999, or 0 for no EMA.")
  groups = config.optim.groups
  if not isinstance(groups, (tuple, list)):
    raise ConfigError(f"optim.groups {groups!r} is not a tuple; expected a tuple of dicts.")
  names = set()
  for i, group in enumerate(groups):
    where = f"optim.groups[{i}]"
    settings = group_settings(main, group, where)
    if settings["name"] in names or settings["name"] == MAIN_LABEL:
      raise ConfigError(
        f"{where} name {settings['name']!r} is reserved or already used; "
        f"expected a unique name other than {MAIN_LABEL!r}."
      )
    names.add(settings["name"])
    _check_settings(where, "optimizer", settings, GROUP_OPTIMIZERS, total_steps)


def train_steps(config: ml_collections.ConfigDict) -> int:
  """`config.train.steps`, checked: raises ConfigError unless it is a positive integer."""
  steps = config.train.steps
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ConfigError(f"train.steps {steps!r} is not a positive integer; expected >= 1.")
  return steps


def main_settings(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """The optim section's main recipe as a flat dict keyed like a group's (`optimizer` for `name`)."""
  d = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
  d.pop("groups", None)
  d.pop("ema_decay", None)  # not optimizer settings: the train step keeps the average
  d.pop("ema_warmup", None)
  # Same key as in groups, where 'name' is the group's name.
  d["optimizer"] = d.pop("name")
  return d


def resolved(cfg: ml_collections.ConfigDict) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """The optim section's main recipe and each of its groups resolved against it (`group_settings`)."""
  main = main_settings(cfg)
  return main, [group_settings(main, g, f"optim.groups[{i}]") for i, g in enumerate(cfg.groups)]


def group_settings(main: Mapping[str, Any], group: Any, where: str) -> dict[str, Any]:
  """Resolves a group dict against GROUP_DEFAULTS and the main settings."""
  if not isinstance(group, Mapping) and not hasattr(group, "to_dict"):
    raise ConfigError(
      f"{where} {group!r} is not a dict; expected a dict with keys {', '.join(_GROUP_REQUIRED)} and lr."
    )
  group = dict(group.to_dict() if hasattr(group, "to_dict") else group)
  for key in group:
    if key not in _GROUP_KEYS:
      raise ConfigError(
        f"{where} key {key!r} is not a group setting; expected one of "
        f"{', '.join(sorted(_GROUP_KEYS))} (clip_norm applies to the main "
        "group only)."
      )
  for key in _GROUP_REQUIRED:
    if key not in group:
      raise ConfigError(f"{where} {group!r} has no {key!r}; expected keys {', '.join(_GROUP_REQUIRED)}.")
  if group["optimizer"] != "none" and "lr" not in group:
    raise ConfigError(f"{where} ({group['name']!r}) has no lr; expected an lr for optimizer {group['optimizer']!r}.")
  settings = {k: main[k] for k in GROUP_INHERITED}
  settings.update(GROUP_DEFAULTS)
  settings["lr"] = 0.0
  settings.update(group)
  for key in ("name", "pattern"):
    if not isinstance(settings[key], str) or not settings[key]:
      raise ConfigError(f"{where} {key} {settings[key]!r} is not a non-empty string; expected a string.")
  try:
    re.compile(settings["pattern"])
  except re.error as e:
    raise ConfigError(
      f"{where} pattern {settings['pattern']!r} is not a valid regular expression ({e}); expected a Python regex."
    ) from None
  return settings


def _check_settings(
  where: str, opt_key: str, s: Mapping[str, Any], optimizers: tuple[str, ...], total_steps: int
) -> None:
  """Checks one resolved set of settings; `opt_key` names the optimizer key in messages."""
  _check_choice(where, opt_key, s["optimizer"], optimizers)
  _check_choice(where, "schedule", s["schedule"], SCHEDULES)
  _check_choice(where, "weight_decay_schedule", s["weight_decay_schedule"], WEIGHT_DECAY_SCHEDULES)
  defaults = default_config()
  for key in _RANGES:
    if key not in s:  # clip_norm exists in the main settings only
      continue
    _check_type(where, key, s[key], type(defaults[key]))
    _check_range(where, key, s[key])
  for key in ("factored", "multiply_by_parameter_scale"):
    _check_type(where, key, s[key], bool)
  warmup, schedule = s["warmup_steps"], s["schedule"]
  if schedule in ("cosine", "linear"):
    horizon = s["decay_steps"] or total_steps
    if warmup > horizon:
      raise ConfigError(
        f"{where}.warmup_steps {warmup} exceeds the {schedule} decay horizon "
        f"{horizon} (decay_steps, or train.steps when it is 0); expected "
        f"warmup_steps <= {horizon}."
      )
  if s["optimizer"] == "lamb" and s["weight_decay"] > 0 and s["weight_decay_schedule"] != "lr":
    raise ConfigError(
      f"{where}.weight_decay_schedule {s['weight_decay_schedule']!r} does not apply to lamb, "
      "whose decay is part of the update the trust ratio scales; expected 'lr'."
    )
  if schedule == "rsqrt" and warmup < 1:
    raise ConfigError(f"{where}.warmup_steps {warmup} is not positive; schedule rsqrt expected warmup_steps >= 1.")


def _check_choice(where: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(f"{where}.{key} {value!r} is unknown; expected one of {', '.join(repr(c) for c in choices)}.")


def _check_type(where: str, key: str, value: Any, expected: type) -> None:
  ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
  if expected is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not ok:
    raise ConfigError(f"{where}.{key} {value!r} has type {type(value).__name__}; expected {expected.__name__}.")


def _check_range(where: str, key: str, value: float) -> None:
  lo, lo_incl, hi, hi_incl = _RANGES[key]
  bad = (
    not math.isfinite(value)
    or value < lo
    or (value == lo and not lo_incl)
    or (hi is not None and (value > hi or (value == hi and not hi_incl)))
  )
  if bad:
    lo_s = f"{'[' if lo_incl else '('}{lo}"
    hi_s = f"{hi}{']' if hi_incl else ')'}" if hi is not None else "inf)"
    raise ConfigError(f"{where}.{key} {value!r} is out of range; expected a value in {lo_s}, {hi_s}.")


# ------------------------------------------------------------------------------- resuming


DECAYING = ("cosine", "linear")  # the schedules whose horizon (decay_steps, else train.steps) shapes them


def keep_horizon(config: ml_collections.ConfigDict, saved: Mapping[str, Any]) -> list[str]:
  """Resuming the run whose config.json is `saved` with another train.steps keeps its learning-rate
  schedules: each decaying one whose decay_steps is 0 (the horizon follows train.steps) gets the saved
  run's horizon as decay_steps, so every step the saved run planned computes what it did and steps past
  it run at the schedule's floor. Sets them in `config` and in `saved` alike (where the saved run's
  horizon was its train.steps: the same schedule, now named), so the two compare equal; returns
  'key=value' for each set where train.steps differs from the horizon. (Where they are equal, a saved
  decay_steps naming that horizon is the schedule `config` computes too: it is set there, unreported.)"""
  old_steps, new_steps = saved.get("train", {}).get("steps"), config.train.steps
  if not isinstance(old_steps, int):
    return []
  kept = []

  def keep(new: Mapping[str, Any], old: Mapping[str, Any], where: str) -> int | None:
    if new.get("schedule", GROUP_DEFAULTS["schedule"]) not in DECAYING or new.get("decay_steps", 0):
      return None
    horizon = old.get("decay_steps", 0) or old_steps
    if horizon == new_steps:
      return horizon if old.get("decay_steps", 0) else None
    kept.append(f"{where}.decay_steps={horizon}")
    return horizon

  old_optim = saved.get("optim", {})
  horizon = keep(config.optim, old_optim, "optim")
  if horizon is not None:
    config.optim.decay_steps = old_optim["decay_steps"] = horizon
  old_groups = {g.get("name"): g for g in old_optim.get("groups", ()) if isinstance(g, dict)}
  groups = []
  for i, group in enumerate(config.optim.groups):
    group = dict(group)
    old = old_groups.get(group.get("name"), {})
    horizon = keep(group, old, f"optim.groups[{i}]")
    if horizon is not None:
      group["decay_steps"] = old["decay_steps"] = horizon
    groups.append(group)
  if groups != [dict(g) for g in config.optim.groups]:
    config.optim.groups = tuple(groups)
  return kept
