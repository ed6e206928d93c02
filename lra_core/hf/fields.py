"""What the architectures of lra_core/hf share: config.json values read with one-sentence errors, each
tensor taken at the shape its config.json implies, and the rotary settings in both of Hugging Face's
layouts.

transformers 4 kept the rotary settings at the top level (GPT-NeoX's `rotary_pct` and `rotary_emb_base`,
other architectures' `partial_rotary_factor` and `rope_theta`) and their scaling in `rope_scaling`
({"type" or "rope_type": ..., "factor": ..., ...}): the "v4" layout. transformers 5 keeps all of them in
one `rope_parameters` ({"rope_type", "rope_theta", "partial_rotary_factor" and the type's keys}): "v5".
A folder is read in either, or both where they agree; a folder is written in one, by default the one
the installed transformers reads (`default_layout`).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re

import numpy as np
from flax import nnx

from lra_core.errors import CheckpointError, ConfigError
from lra_core.models.layers.core import NORMS, make_norm
from lra_core.models.layers.positions import ROPE_SCALING_DEFAULTS, ROPE_SCALING_TYPES

LAYOUTS = ("v5", "v4")
PARAMETERS, SCALING, THETA, FRACTION = "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"
# Hugging Face's rope_type for each type of our model.rope_scaling, and back
HF_TYPES = {ours: "default" if ours == "none" else ours for ours in ROPE_SCALING_TYPES}
OUR_TYPES = {theirs: ours for ours, theirs in HF_TYPES.items()}
# Hugging Face's name for each other key of our model.rope_scaling, and back
HF_KEYS = {
  ours: "original_max_position_embeddings" if ours == "original_max_len" else ours
  for ours in ROPE_SCALING_DEFAULTS
  if ours != "type"
}
OUR_KEYS = {theirs: ours for ours, theirs in HF_KEYS.items()}
# The keys transformers refuses a scaling type without: written whatever their value
REQUIRED = {
  "linear": ("factor",),
  "dynamic": ("factor",),
  "yarn": ("factor",),
  "llama3": ("factor", "original_max_len", "low_freq_factor", "high_freq_factor"),
}
# Keys read only at the value transformers assumes without them (yarn's bounds rounded outwards)
IMPLIED = {"truncate": True}
_TYPE_KEYS = ("rope_type", "type")
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def default_layout() -> str:
  """The layout the installed transformers reads: "v4" before version 5 (only the old keys), else "v5"."""
  try:
    version = importlib.metadata.version("transformers")
  except importlib.metadata.PackageNotFoundError:
    return "v5"
  major = re.match(r"\d+", version)
  return "v4" if major and int(major.group()) < 5 else "v5"


def layout_of(layout: str | None) -> str:
  """`layout`, or the default where None; one sentence for one that is not of LAYOUTS."""
  layout = layout or default_layout()
  if layout not in LAYOUTS:
    raise ConfigError(f"config.json layout {layout!r} is not one of {list(LAYOUTS)}.")
  return layout


def check_object(hf, where: str) -> dict:
  """`hf` when it is a JSON object (a dict), else one sentence naming `where` it came from."""
  if not isinstance(hf, dict):
    raise ConfigError(f"{where} is a JSON {_JSON_KINDS.get(type(hf), 'value')}, not an object of settings.")
  return hf


def as_number(value, label: str, kind=float):
  """`value` (a JSON number) as `kind`, int or float; one sentence naming `label` otherwise."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(f"{label} is {value!r}, not a number.")
  if kind is int and value != int(value):
    raise ConfigError(f"{label} is {value!r}, not a whole number.")
  return kind(value)


def number(hf: dict, key: str, default, name: str, kind=float):
  """config.json's `key` as `kind`, `default` where absent or null (a `default` of None: required)."""
  value = hf.get(key)
  if value is None:
    if default is None:
      raise ConfigError(f"the {name} config.json gives no {key!r}, which the model needs.")
    return default
  return as_number(value, f"{name} {key}", kind)


def flag(hf: dict, key: str, default: bool, name: str) -> bool:
  """config.json's `key`, true or false, `default` where absent or null."""
  value = hf.get(key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ConfigError(f"{name} {key} is {value!r}, not true or false.")
  return value


def word(hf: dict, keys: tuple[str, ...], default: str, allowed, name: str) -> str:
  """The first of `keys` config.json gives (else `default`), one of `allowed`."""
  key = next((k for k in keys if hf.get(k) is not None), keys[0])
  value = hf.get(key, default)
  if not isinstance(value, str) or value not in allowed:
    raise ConfigError(f"{name} {key} {value!r} is not one of {sorted(allowed)}.")
  return value


def written_activation(m, activations: dict[str, str], name: str) -> str:
  """The Hugging Face name (the first of `activations` {theirs: ours}) of model.activation."""
  theirs = {ours: theirs for theirs, ours in reversed(activations.items())}
  if m.activation not in theirs:
    raise ConfigError(f"model.activation {m.activation!r} has no {name} name; the ones that have: {sorted(theirs)}.")
  return theirs[m.activation]


def tensor(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
  """The checkpoint's tensor `name`, which must have `shape` (what the config.json implies)."""
  if name not in tensors:
    raise CheckpointError(f"the checkpoint lacks tensor {name!r}, which its config.json implies.")
  value = tensors[name]
  if tuple(value.shape) != tuple(shape):
    raise CheckpointError(
      f"tensor {name!r} has shape {list(value.shape)}, not the {list(shape)} its config.json implies."
    )
  return value


def norm_eps(m) -> float:
  """The norms' epsilon the model uses: model.norm_eps, or where 0 the norm kind's own (make_norm's)."""
  if m.norm not in NORMS:
    raise ConfigError(f"model.norm {m.norm!r} is not one of {sorted(NORMS)}.")
  # One feature is enough to read the epsilon make_norm resolves for the kind.
  return m.norm_eps or float(make_norm(m.norm, 1, rngs=nnx.Rngs(0)).eps)


def max_len(m, seq_len: int) -> int:
  """The length written as max_position_embeddings: model.max_len, or where 0 the run's `seq_len`. With
  dynamic scaling, the length its frequencies were trained at (original_max_len, where set): transformers
  reads that key as the trained length and rescales at each call's own length (it ignores
  original_max_position_embeddings for this type), where the model here rescales at its max_len, so the
  folder computes as the model does at inputs of max_len tokens."""
  scaling = dict(m.get("rope_scaling") or {})
  if scaling.get("type") == "dynamic" and scaling.get("original_max_len"):
    return int(scaling["original_max_len"])
  if m.max_len:
    return m.max_len
  if not seq_len:
    raise ConfigError(
      "model.max_len is 0 (the run's train.seq_len) and no seq_len was given to write as max_position_embeddings."
    )
  return seq_len


def _parameters(hf: dict, name: str) -> dict:
  """rope_parameters as one object ({} where absent); per-layer-type objects read as one where equal."""
  params = check_object(hf.get(PARAMETERS) or {}, f"{name} {PARAMETERS}")
  nested = [v for v in params.values() if isinstance(v, dict)]
  if nested and len(nested) == len(params):  # {"full_attention": {...}, "sliding_attention": {...}}
    if any(v != nested[0] for v in nested):
      raise ConfigError(f"{name} {PARAMETERS} differs between the layer types {sorted(params)}, which one model reads.")
    params = nested[0]
  return params


def _agreed(sources: list[tuple[str, object]], default, name: str, kind=float):
  """The value the present (non-null) `sources` [(key, value)] agree on, else `default`."""
  given = [(key, as_number(value, f"{name} {key}", kind)) for key, value in sources if value is not None]
  for key, value in given[1:]:
    if value != given[0][1]:
      raise ConfigError(_disagree(name, *given[0], key, value))
  return given[0][1] if given else default


def _disagree(name: str, key: str, value, other_key: str, other) -> str:
  """The sentence for two keys of a config.json that give one setting two values."""
  return f"the {name} config.json gives {key} {value!r} and {other_key} {other!r}: keep one of the two layouts."


def _scaling_of(given: dict, where: str, name: str) -> dict[str, tuple[str, object]]:
  """{our rope_scaling key: (its key in config.json, value)} of one Hugging Face object `where` (rope_scaling,
  or rope_parameters less the settings that are not scaling)."""
  named = [k for k in _TYPE_KEYS if given.get(k) is not None]
  for key in named:
    if not isinstance(given[key], str):
      raise ConfigError(f"{name} {where}.{key} is {given[key]!r}, not the name of a type.")
  if len({given[k] for k in named}) > 1:
    raise ConfigError(f"{name} {where} gives rope_type {given['rope_type']!r} and type {given['type']!r}.")
  if named and given[named[0]] not in OUR_TYPES:
    raise ConfigError(
      f"{name} {where}.{named[0]} {given[named[0]]!r} is not supported; the types read are {sorted(OUR_TYPES)}."
    )
  out = {}
  for key, value in given.items():
    label = f"{where}.{key}"
    if value is None or key in _TYPE_KEYS:
      continue
    if key in OUR_KEYS:
      ours = OUR_KEYS[key]
      out[ours] = (label, as_number(value, f"{name} {label}", type(ROPE_SCALING_DEFAULTS[ours])))
    elif key not in IMPLIED or value != IMPLIED[key]:
      implied = " and ".join(f"{k} {json.dumps(v)}" for k, v in IMPLIED.items())
      raise ConfigError(
        f"{name} {label} {json.dumps(value)} is not supported; the scaling keys read are "
        f"{sorted([*_TYPE_KEYS, *OUR_KEYS])} (and {implied})."
      )
  if named:
    out["type"] = (f"{where}.{named[0]}", given[named[0]])  # Hugging Face's name, as a disagreement names it
  elif out:
    raise ConfigError(f"{name} {where} gives {sorted(given)} but no rope_type.")
  return out


def rotary(hf: dict, name: str, *, fraction_keys, theta_keys, fraction: float, theta: float):
  """(rope_fraction, rope_max_wavelength, {model.rope_scaling key: value} of those given) of a config.json
  in either layout: `fraction_keys` and `theta_keys` the top-level keys the old layout keeps the first
  two under (`fraction` and `theta` where none is given); one sentence where the layouts disagree."""
  params = _parameters(hf, name)
  old = check_object(hf.get(SCALING) or {}, f"{name} {SCALING}")
  top = lambda keys: [(k, hf.get(k)) for k in keys]
  got_fraction = _agreed([(f"{PARAMETERS}.{FRACTION}", params.get(FRACTION)), *top(fraction_keys)], fraction, name)
  got_theta = _agreed([(f"{PARAMETERS}.{THETA}", params.get(THETA)), *top(theta_keys)], theta, name)
  scaling = _scaling_of({k: v for k, v in params.items() if k not in (THETA, FRACTION)}, PARAMETERS, name)
  for key, (label, value) in _scaling_of(old, SCALING, name).items():
    if key in scaling and scaling[key][1] != value:
      raise ConfigError(_disagree(name, *scaling[key], label, value))
    scaling[key] = (label, value)
  values = {key: value for key, (_, value) in scaling.items()}
  if "type" in values:
    values["type"] = OUR_TYPES[values["type"]]
  return got_fraction, got_theta, values


def rotary_json(m, layout: str, *, fraction_key: str, theta_key: str, with_fraction: bool, length: int) -> dict:
  """The config.json keys of our rotary settings in `layout` (`rotary` inverted): v5 one rope_parameters;
  v4 `fraction_key` (where `with_fraction`) and `theta_key` at the top level and the scaling in
  rope_scaling. `length` stands for an original_max_len of 0 where the type needs one written."""
  s = dict(ROPE_SCALING_DEFAULTS, **dict(m.get("rope_scaling") or {}))
  if s["type"] not in HF_TYPES:
    raise ConfigError(f"model.rope_scaling.type {s['type']!r} is not one of {list(ROPE_SCALING_TYPES)}.")
  needed = REQUIRED.get(s["type"], ())
  keys = [k for k in HF_KEYS if s[k] != ROPE_SCALING_DEFAULTS[k] or k in needed]
  if s["type"] == "dynamic":  # its trained length is max_position_embeddings (`max_len`)
    keys = [k for k in keys if k != "original_max_len"]
  # 0 reads as the model's length; a type that needs the key written gets that length
  named = {HF_KEYS[k]: (s[k] or length) if k == "original_max_len" else s[k] for k in keys}
  if layout == "v5":
    params = {"rope_type": HF_TYPES[s["type"]], THETA: m.rope_max_wavelength}
    return {PARAMETERS: {**params, **({FRACTION: m.rope_fraction} if with_fraction else {}), **named}}
  out = {theta_key: m.rope_max_wavelength, **({fraction_key: m.rope_fraction} if with_fraction else {})}
  if s["type"] != "none" or named:
    out[SCALING] = {"type": HF_TYPES[s["type"]], **named}
  return out
