"""Every registered family's paper configs, built one layer deep: for the tests that look at each
family's parameters (names, initial values) without paying for its depth. Names repeat per layer,
so one layer shows every kind of parameter a config has."""

import lra_core

# Families without paper rows: their main config.
MAIN_CONFIGS = {
  "linear_transformer": ["configs/enwik8/linear_transformer.py"],
  "fit_denoiser": ["configs/imagenet64/fit_denoiser.py"],
}
# How each family says "one layer" (FIT: a local, a global and a local layer, so both cross-attentions exist).
ONE_LAYER = {
  "fit": ["model.layers=L(1)G(1)L(1)"],
  "fit_denoiser": ["model.layers=L(1)G(1)L(1)"],
  "block_transformer": ["model.num_layers=1", "model.encoder_layers=1"],
}


def specs(family) -> list[str]:
  return MAIN_CONFIGS.get(family.name) or [row.config for row in family.paper_rows]


def one_layer(family, spec: str, overrides=()):
  return lra_core.load_config(spec, ONE_LAYER.get(family.name, ["model.num_layers=1"]) + list(overrides))
