"""A pre-trained transformer's weights as a Latte-Macchiato model's (Latte, Section 4.5): every weight
outside attention kept as the checkpoint holds it (embeddings, every norm, the MLPs), each attention's
query, key, value and output projections become the Macchiato layer's sliding-window attention, and
the latent states' query and key (what the paper then trains) keep the run's own initialisation.

Grouped-query key-value heads are repeated to the query heads: the window attention then computes
what the checkpoint's attention computes inside the window (query head n read key-value head n //
groups; now it reads its own copy), and the latent part, which shares the values, starts from the same
values. The model must be a Macchiato (`window` > 0, latent states on) with the checkpoint's widths,
norms, MLP and output (`MATCHED` less what Macchiato replaces: the window, the alternation and the
key-value head count).
"""

from __future__ import annotations

import numpy as np

from lra_core.errors import ConfigError

# Latte's own parameters, under a layer's "attn": initialised by the run, not read from the checkpoint.
OWN = ("query", "key", "mixer", "vapor")
# what a Macchiato replaces of the checkpoint's attention: it need not match
REPLACED = ("window", "global_every", "num_kv_heads")
# checkpoint's attention projection -> the Macchiato layer's, and whether its heads are key-value heads
_ATTENTION = {
  "query": ("window_query", False),
  "key": ("window_key", True),
  "value": ("value", True),
  "out": ("out", False),
}


def check_model(m, folder: str, prefix: str) -> None:
  """One sentence unless config.model `m` is a Latte-Macchiato."""
  if not (m.window > 0 and m.latent):
    raise ConfigError(
      f"train.init_from {prefix}{folder}: a Latte run starts from a transformer checkpoint as Latte-Macchiato: "
      "set model.window (the paper: 128) with model.latent=True."
    )


def weights(m, section, theirs: dict[tuple[str, ...], np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
  """The checkpoint's parameters `theirs` ({path: array}, layers by index, as the transformer family
  holds them; `section` its config.model) under a Macchiato model's paths: attention projections
  renamed, key-value heads repeated; Latte's own parameters absent (`OWN`)."""
  groups = m.num_heads // (section.num_kv_heads or section.num_heads)
  out = {}
  for path, value in theirs.items():
    if len(path) > 3 and path[0] == "blocks" and path[2] == "attn":
      ours, grouped = _ATTENTION[path[3]]
      if grouped and groups > 1:  # [D, K, head_dim] -> [D, K * groups, head_dim], head n a copy of n // groups
        value = np.repeat(value, groups, axis=1)
      path = (*path[:3], ours, *path[4:])
    out[path] = value
  return out


def is_own(layer_path: tuple[str, ...]) -> bool:
  """Whether a layer's parameter (its path inside the layer) is one of Latte's own (`OWN`)."""
  return len(layer_path) > 1 and layer_path[0] == "attn" and layer_path[1] in OWN
