"""Error types for mistakes a user can fix: each carries one sentence that names the bad value.

Everything the framework raises on bad input derives from `UserError`, so callers (and the
property tests) can tell a clear refusal from a bug.
"""

import importlib
import re


class UserError(Exception):
  """Base class: bad input, stated in one sentence."""


class ConfigError(UserError, ValueError):
  """A config key, type or value is wrong or inconsistent with another."""


class DataError(UserError, ValueError):
  """A dataset is missing, empty, corrupt or does not match the config."""


class CheckpointError(UserError, RuntimeError):
  """A checkpoint is missing, incomplete or does not match the model."""


class TrainingDiverged(UserError, FloatingPointError):
  """A loss, gradient or parameter became NaN or Inf."""


class StoreFailure(CheckpointError):
  """Writing a checkpoint failed, or did not finish within train.save_timeout_s. The store's writer
  threads may still be retrying: the command leaves without waiting for them (`leave_at_once`)."""

  leave_at_once = True


class DecodingError(UserError, ValueError):
  """A sampling setting, prompt or model does not fit what decoding expects."""


class ResourceError(UserError, RuntimeError):
  """A config needs more memory (or devices) than the machine has."""


class MissingExtra(UserError, ImportError):
  """An optional package is not installed; the sentence names the extra of lra_core that brings it."""


def optional_import(module: str, extra: str):
  """`module` imported, or MissingExtra naming `extra` (pyproject.toml) when its package is absent."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    package = module.partition(".")[0]
    if e.name is None or e.name.partition(".")[0] != package:
      raise  # the package is there but something it needs is not
    raise MissingExtra(f"{package} is not installed; install the {extra} extra: pip install -e \".[{extra}]\".") from e


def brief(message: object, limit: int = 300) -> str:
  """The first line of an error's message, for a sentence that quotes it, in at most `limit`
  characters. TensorStore's trailers (`[source locations=...]`, `See full TensorStore details`) go;
  a longer line loses its middle, where the paths run, never its end, where the cause is
  (`... ocdbt.process_0/d/...: [OS error: No space left on device]`)."""
  first = (str(message).strip().splitlines() or [""])[0]
  first = first.split(" See full TensorStore details")[0]
  first = re.sub(r"\s*\[source locations=.*", "", first).strip()  # the last of TensorStore's brackets
  if len(first) <= limit:
    return first
  head = limit // 3
  return f"{first[:head]} ... {first[-(limit - head - 5) :]}"
