"""lra_core: one trainer, many efficient long-sequence transformers (JAX, Flax NNX).

  cfg = lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["train.steps=10"])
  model = lra_core.build_model(cfg, seed=0)
  summary = lra_core.train.train_and_evaluate(cfg, workdir="/tmp/run")
"""

from lra_core.config import load_config
from lra_core.errors import (CheckpointError, ConfigError, DataError, DecodingError, TrainingDiverged,
                             UserError)
from lra_core.registry import build_model

__all__ = ["load_config", "build_model", "UserError", "ConfigError", "DataError", "CheckpointError",
           "DecodingError", "TrainingDiverged"]
__version__ = "0.1.0"
