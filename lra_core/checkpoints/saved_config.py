"""The config a run saved in its workdir (`<workdir>/config.json`) read back: older layouts upgraded to
today's (`upgrade_config`), the ConfigDict of a saved config (`from_saved`, `load_workdir_config`), and the
settings a resumed run may not change (`resume_conflicts`, `RESUMABLE_KEYS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import ml_collections

from lra_core import registry
from lra_core.config import apply_overrides, validate
from lra_core.errors import ConfigError, brief
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.runtime import fs

# Settings a resumed run may change: how it runs, not what it computes. Any other difference from
# the workdir's config.json stops a resumed run unless forced.
RESUMABLE_KEYS = (
  "mesh.",
  "sharding.",
  "data.dir",
  "data.cache_dir",
  "data.num_threads",
  "data.prefetch",
  "model.impl",
  "model.attention_impl",
  "model.remat",
  "train.steps",
  "train.log_every",
  "train.eval_every",
  "train.eval_batches",
  "train.eval_batch_size",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "train.test_at_end",
  "train.nan_check",
  "train.skip_nonfinite",
  "train.max_skipped_fraction",
  "train.save_timeout_s",
  "train.watchdog_factor",
  "train.watchdog_min_s",
  "train.memory_limit_gib",
  "train.init_from",
  "train.profile_steps",
  "train.compile_cache",
  "train.peak_flops",
  "train.sample_every",
  "train.tracker",
  "train.tracker_project",
)


def _flat_values(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat_values(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def upgrade_config(saved: dict) -> dict:
  """A config as a run saved it (config.json) in today's layout: each model key added since, absent
  from `saved`, with the value that builds the model the saved config built (MODEL_DEFAULTS, and the
  family record's `upgrades`). The one place that knows old layouts: models read their keys directly."""
  saved = _upgrade_mesh(saved)
  model = saved.get("model")
  if not isinstance(model, dict):
    return saved
  added = dict(MODEL_DEFAULTS)
  if model.get("name") in registry.family_names():
    added |= registry.family(model["name"]).upgrades
  return dict(saved, model={**added, **model})


def _upgrade_mesh(saved: dict) -> dict:
  """A config saved before the `sequence` mesh axis: mesh.sequence = 1 (what it ran with), and the
  time axis ruled onto that axis, so that a later `--config.mesh.sequence=N` splits it."""
  mesh, rules = saved.get("mesh"), (saved.get("sharding") or {}).get("rules")
  if not isinstance(mesh, dict) or "sequence" in mesh:
    return saved
  saved = dict(saved, mesh={**mesh, "sequence": 1})
  if isinstance(rules, list | tuple):
    rules = [[name, "sequence"] if name == "length" and target is None else [name, target] for name, target in rules]
    saved["sharding"] = dict(saved["sharding"], rules=rules)
  return saved


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The ConfigDict of a saved config.json (upgraded; JSON lists back to tuples), not yet validated."""
  return ml_collections.ConfigDict(_tuples(upgrade_config(saved)))


def resume_conflicts(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """`key: old -> new` for each setting that differs from a workdir's saved config.json and that
  a resumed run may not change (RESUMABLE_KEYS lists those it may). The saved config is upgraded
  first: a key added since it was saved is no difference when it has the value that config had."""
  old = _flat_values(upgrade_config(saved))
  new = _flat_values(json.loads(json.dumps(config.to_dict())))  # tuples -> lists, as saved
  out = []
  for key in sorted(set(old) | set(new)):
    if key.startswith(RESUMABLE_KEYS) or old.get(key, "<absent>") == new.get(key, "<absent>"):
      continue
    out.append(f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
  return out


def _tuples(value):
  """JSON lists back to the tuples config files use (sharding.rules, optim.groups, ...)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def load_workdir_config(workdir, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """The config a run saved as `<workdir>/config.json` (the trainer writes the whole config there),
  with `key=value` overrides applied, validated and locked; `workdir` may be local or gs://."""
  path = fs.path(workdir, what="workdir") / "config.json"
  if not path.parent.exists():
    raise ConfigError(f"workdir {str(workdir)!r} does not exist; give the workdir of a run the trainer wrote.")
  if not path.exists():
    raise ConfigError(
      f"workdir {str(workdir)!r} has no config.json; give --config=<spec>, or the workdir of a run the trainer wrote."
    )
  try:
    saved = json.loads(path.read_text())
  except ValueError as e:  # not JSON, or not text at all (damaged bytes: UnicodeDecodeError)
    raise ConfigError(
      f"{path} is not valid JSON ({type(e).__name__}: {brief(e)}); give --config=<spec> instead."
    ) from None
  config = from_saved(saved)
  apply_overrides(config, overrides)
  validate(config)
  config.lock()
  return config
