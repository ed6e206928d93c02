"""lra_core: one trainer, many efficient long-sequence transformers (JAX, Flax NNX).

  cfg = lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["train.steps=10"])
  model = lra_core.build_model(cfg, seed=0)
  summary = lra_core.train.train_and_evaluate(cfg, workdir="/tmp/run")

The folders models/, kernels/ and configs/ beside lra_core/ are the subpackages lra_core.models,
lra_core.kernels and lra_core.configs: an install maps them so (pyproject.toml), and in a checkout
that is not installed `_CheckoutFolders` does.
"""

import importlib.abc
import importlib.util
import pathlib
import sys

from lra_core import startup

with startup.prepare():  # a command starts JAX without accelerator plugin noise (lra_core/startup.py)
  import jax  # noqa: F401

from lra_core.config import load_config  # noqa: E402
from lra_core.errors import CheckpointError, ConfigError, DataError, DecodingError, TrainingDiverged, UserError  # noqa: E402
from lra_core.registry import build_model  # noqa: E402

__all__ = [
  "load_config",
  "build_model",
  "UserError",
  "ConfigError",
  "DataError",
  "CheckpointError",
  "DecodingError",
  "TrainingDiverged",
]
__version__ = "0.1.0"


class _CheckoutFolders(importlib.abc.MetaPathFinder):
  """Finds lra_core.models / .kernels / .configs in a checkout's folders when nothing else does."""

  root = pathlib.Path(__file__).resolve().parent.parent

  def find_spec(self, fullname, path, target=None):
    if (
      fullname not in ("lra_core.models", "lra_core.kernels", "lra_core.configs")
      or not (self.root / "pyproject.toml").is_file()
    ):
      return None
    folder = self.root / fullname.removeprefix("lra_core.")
    return importlib.util.spec_from_file_location(
      fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )


sys.meta_path.append(_CheckoutFolders())  # last: an install's own mapping comes first
