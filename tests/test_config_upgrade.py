"""Configs saved before a model key existed: `lra_core.checkpoints.saved_config.upgrade_config` adds the key
with the value the saved run built with (the family record's `upgrades`), in the one place that knows old layouts, so
models read every key of their section directly (no `.get(key, default)` in models/)."""

import json
import pathlib
import re

import pytest
from flax import nnx

import lra_core
from lra_core import registry
from lra_core.checkpoints.saved_config import from_saved, load_workdir_config, resume_conflicts, upgrade_config
from lra_core.layer_stacks import MODEL_DEFAULTS

MODELS = registry.package_dir("models")
FAMILIES = registry.families()


def saved_without(config, keys) -> dict:
  """`config` as the trainer saves it (config.json), with `keys` of its model section left out."""
  saved = json.loads(json.dumps(config.to_dict()))
  for key in keys:
    saved["model"].pop(key, None)
  return saved


def overrides(upgrades: dict, prefix: str = "model.") -> list[str]:
  """Command-line overrides setting each upgraded key (a section's keys one by one) to its value."""
  out = []
  for key, value in upgrades.items():
    out += overrides(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}={value}"]
  return out


def plain(value):
  """A section's value as JSON would hold it (a nested section as a dict)."""
  return value.to_dict() if hasattr(value, "to_dict") else value


def param_shapes(config) -> dict:
  model = nnx.eval_shape(lambda: registry.build_model(config))
  return {"/".join(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_upgrade_names_a_key_of_the_familys_section(family):
  section = lra_core.load_config(family.smoke.config).model
  assert set(family.upgrades) <= set(section), sorted(set(family.upgrades) - set(section))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.upgrades], ids=lambda f: f.name)
def test_a_config_saved_before_the_upgraded_keys_builds_the_model_it_built(family, tmp_path):
  config = lra_core.load_config(family.smoke.config)
  old = saved_without(config, [*family.upgrades, *MODEL_DEFAULTS])
  (tmp_path / "config.json").write_text(json.dumps(old))
  loaded = load_workdir_config(tmp_path)
  for key, value in {**MODEL_DEFAULTS, **family.upgrades}.items():
    assert plain(loaded.model[key]) == value, key
  explicit = lra_core.load_config(family.smoke.config, overrides(family.upgrades))
  assert param_shapes(loaded) == param_shapes(explicit)
  # Resuming the saved run with those values is no change; with today's defaults it is one, where they differ.
  assert resume_conflicts(old, explicit) == []
  changed = {k for k, v in family.upgrades.items() if plain(config.model[k]) != v}
  assert {c.split(":")[0] for c in resume_conflicts(old, config)} == {f"model.{k}" for k in changed}


def test_a_tied_transformer_vq_saved_before_output_scale_keeps_its_classifier(tmp_path):
  """Configs saved before output_scale tied the classifier as logits / d_model with no output bias."""
  config = lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.tie_embeddings=True"])
  assert "output_bias" in param_shapes(config)
  old = from_saved(saved_without(config, ["output_scale"]))
  assert old.model.output_scale == 0.0 and "output_bias" not in param_shapes(old)


def test_upgrade_keeps_what_was_saved_and_passes_unknown_layouts_through():
  saved = {"model": {"name": "fit", "output_bias": True, "remat": "full"}, "task": "lm"}
  up = upgrade_config(saved)
  assert up["model"]["output_bias"] is True and up["model"]["remat"] == "full"
  assert up["model"]["scan_layers"] is False and saved["model"] == {"name": "fit", "output_bias": True, "remat": "full"}
  assert upgrade_config({"model": {"name": "no_such_family"}})["model"] == {"name": "no_such_family", **MODEL_DEFAULTS}
  assert upgrade_config({"task": "lm"}) == {"task": "lm"}


# A `.get(` with a default on a config section: the fallback `upgrade_config` replaces. Reading a variable's
# metadata (which may lack logical axes) is not a config.
FALLBACK = re.compile(r"\.get\(")


def config_fallbacks(folder: pathlib.Path) -> list[str]:
  return [
    f"{path.relative_to(folder.parent)}:{i}"
    for path in sorted(folder.rglob("*.py"))
    for i, line in enumerate(path.read_text().splitlines(), 1)
    if FALLBACK.search(line.replace("get_metadata().get(", ""))
  ]


def test_models_read_their_config_without_fallbacks(tmp_path):
  assert config_fallbacks(MODELS) == []
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "x.py").write_text('eps = m.get("norm_eps", 0.0)\naxes = v.get_metadata().get("a")\n')
  assert config_fallbacks(tmp_path / "models") == ["models/x.py:1"]
