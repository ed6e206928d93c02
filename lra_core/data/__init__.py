"""Datasets as random-access sources of examples, looked up by `config.data.name`.

A dataset is a module `lra_core/data/datasets/<name>.py` or `lra_core/data/datasets/lra/<name>.py`
that declares its facts in one record, `DATASET = Dataset(name=<name>, unit=..., tasks=..., ...)`
(lra_core/dataset_record.py): what one target is, the tasks it serves, its splits, and whether its
rows are packed documents. Everything that depends on a dataset reads that record
(`registry.dataset(name)`), and the registry finds the module by its name and its record, as it
finds model families, so adding a dataset is one module in datasets/ and a config file (docs/data.md);
the helpers every dataset uses (pipeline, packing, tokenizers, files, cache, ...) stay here. Each module exposes

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
from typing import Protocol

import ml_collections
import numpy as np

from lra_core import registry, task_kinds
from lra_core.errors import ConfigError


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
  if registry.dataset(config.data.name).packed_documents:
    if kind.causal:
      fields["words"] = ((t,), f32)
    fields["segment_ids"] = ((t,), i32)
  return fields


DOCUMENT_MASKS = ("auto", "true", "false")


def document_mask(config) -> bool:
  """Whether the model sees the documents of a packed row apart (`data.document_mask`): attention,
  recurrences and positions stop at document boundaries (kernels/packed_documents.py). "auto" is on for
  rows of whole documents (`data.packing="pack"`, which masked LM reads) and off for "concat"
  windows, which run across documents on purpose (Transformer-XL / Transformer-VQ style, with a
  cache carried from window to window). Datasets without documents have no such key: off."""
  data = config.data
  setting = data.get("document_mask", "false") if registry.dataset(data.name).packed_documents else "false"
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
  module = registry.dataset_module(config.data.name)
  module.DATASET.check_task(config.task)
  module.validate_config(config)


def make_source(config, split: str) -> Source:
  """The `split` examples of the configured dataset (its module checks the split against its record)."""
  module = registry.dataset_module(config.data.name)
  module.DATASET.check_task(config.task)
  return module.make_source(config, split)


def text_codec(config):
  """(encode: str -> ids, decode: ids -> str) of the configured dataset."""
  codec = registry.dataset_module(config.data.name).codec
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
