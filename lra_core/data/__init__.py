"""Datasets as random-access sources of examples, looked up by `config.data.name`.

A dataset is a module `lra_core/data/<name>.py` or `lra_core/data/lra/<name>.py` that declares
its facts in one record, `DATASET = Dataset(name=<name>, unit=..., tasks=..., ...)`: what one
target is, the tasks it serves, its splits, and whether its rows are packed documents. Everything
that depends on a dataset reads that record (`dataset(name)`), and `dataset_module(name)` finds the
module by its name and its record, so adding a dataset is one module here and a config file
(docs/data.md). Each module exposes

  make_source(config, split) -> Source   # split in its record's splits
  validate_config(config) -> None        # its settings and files: ConfigError (one sentence) before any work
  codec(config) -> (encode, decode)      # text <-> ids for sampling; `codec = None` for images

and the functions below call them for `config.data.name` after checking the task and split
against its record.

A `Source` has `__len__`, `__getitem__(i) -> dict[str, np.ndarray]` (one example, fixed
shapes for a given config) and `info: DataInfo`. Example fields by task (lra_core.task_kinds):

  per-token, causal (lm, image_ar) : inputs int32[T], targets int32[T], weights float32[T]
  per-token (mlm)                  : inputs int32[T], weights float32[T] (1 = real token)
  labelled (classify, diffusion)   : inputs int32[T], mask bool[T], targets int32[], weights float32[]
  labelled, two towers (retrieval) : inputs int32[2,T], mask bool[2,T], targets int32[], weights float32[]

plus, on datasets of packed documents, `segment_ids` int32[T] and (causal) `words` float32[T].
An all-zero example is padding: its weights are zero, so the pipeline pads a final partial
evaluation batch with zeros and metrics stay exact.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
from typing import Protocol

import ml_collections
import numpy as np

from lra_core import task_kinds
from lra_core.errors import ConfigError

SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One dataset's facts, declared once in its module as `DATASET` and read from there."""

  name: str  # config.data.name: the stem of the module that declares it
  unit: str  # what one target is (DataInfo.unit): bits-per-<unit> is reported for per-token tasks
  tasks: tuple[str, ...]  # the tasks (config.task, lra_core.task_kinds) it gives examples for
  splits: tuple[str, ...] = SPLITS  # the splits make_source opens
  packed_documents: bool = False  # rows hold documents end to end: examples carry segment_ids (causal: words)

  def check_task(self, task: str) -> None:
    """A one-sentence ConfigError unless this dataset serves `task`."""
    if task not in self.tasks:
      raise ConfigError(f"task {task!r} cannot use the {self.name} dataset; expected one of {list(self.tasks)}.")

  def check_split(self, split: str) -> None:
    """A one-sentence ConfigError unless `split` is one of this dataset's splits."""
    if split not in self.splits:
      raise ConfigError(f"split {split!r} is not one of {self.splits}.")


# The packages a dataset module may sit in: its stem is the dataset's name.
DATASET_FOLDERS = {
  "lra_core.data": pathlib.Path(__file__).resolve().parent,
  "lra_core.data.lra": pathlib.Path(__file__).resolve().parent / "lra",
}


@functools.cache
def _modules() -> dict[str, str]:
  """stem -> module of every public module in DATASET_FOLDERS (datasets and the helpers beside them)."""
  return {
    path.stem: f"{package}.{path.stem}"
    for package, folder in DATASET_FOLDERS.items()
    for path in sorted(folder.glob("*.py"))
    if not path.stem.startswith("_")
  }


def _declared(stem: str) -> Dataset | None:
  """The DATASET record of module `stem`, where it declares one under its own name."""
  record = importlib.import_module(_modules()[stem]).__dict__.get("DATASET")
  return record if isinstance(record, Dataset) and record.name == stem else None


@functools.cache
def dataset_names() -> tuple[str, ...]:
  """The name of every dataset: the modules above that declare a DATASET record (imports them all)."""
  return tuple(sorted(stem for stem in _modules() if _declared(stem)))


def dataset_module(name: str):
  """The module that reads dataset `name` (config.data.name)."""
  if not isinstance(name, str) or name not in _modules() or not _declared(name):
    raise ConfigError(
      f"data.name {name!r} is not a dataset (a module of lra_core/data or lra_core/data/lra with a DATASET record); "
      f"available: {list(dataset_names())}."
    )
  return importlib.import_module(_modules()[name])


def dataset(name: str) -> Dataset:
  """The record of dataset `name` (config.data.name)."""
  return dataset_module(name).DATASET


@dataclasses.dataclass(frozen=True)
class DataInfo:
  """What a model and a task need to know about a dataset."""

  vocab_size: int
  num_classes: int = 0  # classification tasks only
  unit: str = "token"  # the record's unit (text read with the bytes tokenizer: byte)
  pad_id: int = 0
  vocab: tuple[str, ...] = ()  # id -> token string, where the dataset has a small vocabulary


def example_fields(config) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """name -> (shape, dtype) of one training example of `config`, without opening any data.

  The fields are the table above for `config.task` at `train.seq_len`, plus `words` / `segment_ids`
  on datasets of packed documents; compiling a step ahead of time for a config (lra_core.aot)
  needs them, and the tests check them against the examples each dataset really gives.
  """
  t = config.train.seq_len
  kind = task_kinds.kind(config.task)
  i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
  if kind.labelled:
    shape = (kind.towers, t) if kind.towers > 1 else (t,)
    return {"inputs": (shape, i32), "mask": (shape, np.dtype(bool)), "targets": ((), i32), "weights": ((), f32)}
  if not kind.per_token:
    raise ConfigError(
      f"task {kind.name!r} has no example layout; expected a per-token task {list(task_kinds.names(per_token=True))} "
      f"or a labelled one {list(task_kinds.names(labelled=True))}."
    )
  fields = {"inputs": ((t,), i32)}
  if kind.causal:
    fields["targets"] = ((t,), i32)
  fields["weights"] = ((t,), f32)
  if dataset(config.data.name).packed_documents:
    if kind.causal:
      fields["words"] = ((t,), f32)
    fields["segment_ids"] = ((t,), i32)
  return fields


DOCUMENT_MASKS = ("auto", "true", "false")


def document_mask(config) -> bool:
  """Whether the model sees the documents of a packed row apart (`data.document_mask`): attention,
  recurrences and positions stop at document boundaries (kernels/segments.py). "auto" is on for
  rows of whole documents (`data.packing="pack"`, which masked LM reads) and off for "concat"
  windows, which run across documents on purpose (Transformer-XL / Transformer-VQ style, with a
  cache carried from window to window). Datasets without documents have no such key: off."""
  data = config.data
  setting = data.get("document_mask", "false") if dataset(data.name).packed_documents else "false"
  if setting == "auto":
    return data.get("packing", "concat") == "pack"
  return setting == "true"


def check_index(index: int, n: int, items: str = "examples") -> int:
  """A sequence-style index into `n` items (negative counts from the end) -> 0..n-1; else IndexError."""
  if not -n <= index < n:
    raise IndexError(f"example {index} is out of range for {n} {items}.")
  return int(index) % n


def labelled_example(inputs: np.ndarray, mask: np.ndarray, label) -> dict[str, np.ndarray]:
  """The fields of one classification example: inputs int32, mask bool, targets int32[], weights 1."""
  return {
    "inputs": np.asarray(inputs, np.int32),
    "mask": np.asarray(mask, bool),
    "targets": np.asarray(label, np.int32),
    "weights": np.asarray(1.0, np.float32),
  }


class Source(Protocol):
  info: DataInfo

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


def validate_config(config) -> None:
  """The configured dataset's checks, before any work: that it serves the task (its record), then
  its module's own (settings, files)."""
  module = dataset_module(config.data.name)
  module.DATASET.check_task(config.task)
  module.validate_config(config)


def make_source(config, split: str) -> Source:
  """The `split` examples of the configured dataset."""
  module = dataset_module(config.data.name)
  module.DATASET.check_task(config.task)
  module.DATASET.check_split(split)
  return module.make_source(config, split)


def text_codec(config):
  """(encode: str -> ids, decode: ids -> str) of the configured dataset."""
  codec = dataset_module(config.data.name).codec
  if codec is None:
    raise ConfigError(f"dataset {config.data.name!r} has no text encoding.")
  return codec(config)


def config_section(defaults: dict, overrides: dict) -> ml_collections.ConfigDict:
  """A dataset's `config.data` section: its defaults with `overrides` on known fields only."""
  section = ml_collections.ConfigDict(defaults)
  for key, value in overrides.items():
    if key not in defaults:
      raise ConfigError(
        f"data.{key} is not a field of the {defaults['name']} dataset; expected one of {sorted(defaults)}."
      )
    try:
      section[key] = value
    except TypeError as e:
      raise ConfigError(
        f"data.{key}={value!r} has type {type(value).__name__}; expected {type(defaults[key]).__name__}."
      ) from e
  return section
