"""Every lookup by name: model families, datasets and tasks.

A model family is a module `models/<name>.py` or a package `models/<name>/` (lra_core.models.<name>)
with a `FAMILY` record (lra_core.protocol.Family); `config.model.name` picks it. Adding a family is that
module plus a config file: the trainer and the cross-family tests find it here, with no list to edit.
A dataset (`config.data.name`) is found the same way: a module of lra_core/data/datasets or
lra_core/data/datasets/lra named after it, with a `DATASET` record (lra_core.dataset_record.Dataset).
Tasks (`config.task`) are rows of lra_core.task_kinds.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import pathlib
import re

import jax
from flax import nnx

from lra_core import task_kinds
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError
from lra_core.protocol import Family, RunInfo


def package_dir(name: str) -> pathlib.Path:
  """The folder of the subpackage `lra_core.<name>` (models, kernels, configs), in a checkout or an install."""
  return package_folder(f"lra_core.{name}")


def package_folder(package: str) -> pathlib.Path:
  """The folder of `package`, found without importing it (its parent packages are imported)."""
  return pathlib.Path(importlib.util.find_spec(package).submodule_search_locations[0])


def family_files(models: pathlib.Path) -> dict[str, pathlib.Path]:
  """name -> file of every model family in the folder `models`: each public module at its top (one that
  lacks a FAMILY record is still named, so that `family` can say so), and each public module deeper that
  assigns FAMILY at its top level, a family's package standing for its __init__.py (models/fit/ is fit). A
  module inside a family's package is named by its path, `_` for `/` (models/fit/denoiser.py is
  fit_denoiser); the family's helpers beside it (models/fit/groups.py) and the shared layers
  (models/layers/) declare no FAMILY."""
  found = {}
  for path in sorted(models.rglob("*.py")):
    parts = path.relative_to(models).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if not parts or any(part.startswith("_") for part in parts):
      continue
    if path.parent == models or re.search(r"^FAMILY\s*=", path.read_text(), re.M):
      found["_".join(parts)] = path
  return found


@functools.cache
def family_modules() -> dict[str, str]:
  """name -> module of every model family (`family_files` of models/)."""
  root = package_dir("models")
  return {
    name: "lra_core.models." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for name, path in family_files(root).items()
  }


def family_names() -> tuple[str, ...]:
  """The names of every model family (`family_modules`)."""
  return tuple(sorted(family_modules()))


def family(name: str) -> Family:
  """The record of family `name` (config.model.name)."""
  if not isinstance(name, str) or name not in family_modules():
    raise ConfigError(f"model.name {name!r} is not a module in models/; available: {list(family_names())}.")
  module = family_modules()[name]
  record = importlib.import_module(module).__dict__.get("FAMILY")
  if not isinstance(record, Family) or record.name != name:
    where = pathlib.Path(importlib.util.find_spec(module).origin).relative_to(package_dir("models").parent)
    raise ConfigError(f"{where} defines no FAMILY record named {name!r} (lra_core.protocol.Family).")
  return record


def families() -> tuple[Family, ...]:
  """Every family's record, by name."""
  return tuple(family(name) for name in family_names())


# The packages a dataset module may sit in (the helpers every dataset uses stay in lra_core.data, apart):
# its stem is the dataset's name.
DATASET_PACKAGES = ("lra_core.data.datasets", "lra_core.data.datasets.lra")


@functools.cache
def dataset_modules() -> dict[str, str]:
  """stem -> module of every dataset module of DATASET_PACKAGES: the public modules that assign DATASET at
  their top level, found in their text, so that a helper beside them (the LRA Pathfinder image generator)
  is never imported to be ruled out."""
  return {
    path.stem: f"{package}.{path.stem}"
    for package in DATASET_PACKAGES
    for path in sorted(package_folder(package).glob("*.py"))
    if not path.stem.startswith("_") and re.search(r"^DATASET\s*[:=]", path.read_text(), re.M)
  }


def _declared(stem: str) -> Dataset | None:
  """The DATASET record of module `stem`, where it declares one under its own name."""
  record = importlib.import_module(dataset_modules()[stem]).__dict__.get("DATASET")
  return record if isinstance(record, Dataset) and record.name == stem else None


@functools.cache
def dataset_names() -> tuple[str, ...]:
  """The name of every dataset: the modules above whose DATASET record carries their name (imports each)."""
  return tuple(sorted(stem for stem in dataset_modules() if _declared(stem)))


def dataset_module(name: str):
  """The module that reads dataset `name` (config.data.name; its record is `.DATASET`)."""
  if not isinstance(name, str) or name not in dataset_modules() or not _declared(name):
    raise ConfigError(
      f"data.name {name!r} is not a dataset (a module of lra_core/data/datasets or lra_core/data/datasets/lra "
      f"with a DATASET record); available: {list(dataset_names())}."
    )
  return importlib.import_module(dataset_modules()[name])


def dataset(name: str) -> Dataset:
  """The record of dataset `name` (config.data.name)."""
  return dataset_module(name).DATASET


def task_class(name: str):
  """The objective of task `name` (config.task; lra_core.task_kinds names each one's class)."""
  module, _, cls = task_kinds.kind(name).objective.partition(":")
  return getattr(importlib.import_module(module), cls)


def build_model(config, seed: int = 0) -> nnx.Module:
  """A freshly initialised model for `config` (parameters float32, from `seed`)."""
  return family(config.model.name).model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))


def _size(state) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def parameter_count(config) -> int:
  """Trainable parameters of the model `config` builds, from shapes only (nothing is allocated)."""
  return _size(nnx.state(nnx.eval_shape(lambda: build_model(config)), nnx.Param))


def non_embedding_parameter_count(config) -> int:
  """Parameters outside the layers that map tokens in and out (the record's embedding_params), as
  papers size language models."""
  names = family(config.model.name).embedding_params
  flat = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: build_model(config)), nnx.Param))
  return sum(math.prod(v.shape) for path, v in flat if str(path[0]) not in names)


def parameter_counts(config) -> dict[str, int]:
  """Trainable parameters, the state the family counts beside them (Transformer-VQ's codebook
  statistics) and their total, from shapes only."""
  record = family(config.model.name)
  model = nnx.eval_shape(lambda: build_model(config))
  params = _size(nnx.state(model, nnx.Param))
  extra = _size(nnx.state(model, *record.counted_state)) if record.counted_state else 0
  return {"params": params, "codebook": extra, "total": params + extra}
