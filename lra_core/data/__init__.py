"""Datasets as random-access sources of examples, looked up by `config.data.name`.

A dataset module (named in lra_core.registry.DATASETS) exposes

  make_source(config, split) -> Source   # split in {"train", "validation", "test"}
  validate_config(config) -> None        # raise ConfigError (one sentence) before any work
  codec(config) -> (encode, decode)      # text <-> ids for sampling; `codec = None` for images

A `Source` has `__len__`, `__getitem__(i) -> dict[str, np.ndarray]` (one example, fixed
shapes for a given config) and `info: DataInfo`. Example fields by task:

  lm, image_ar : inputs int32[T], targets int32[T], weights float32[T]
  mlm          : inputs int32[T], weights float32[T] (1 = real token)
  classify     : inputs int32[T], mask bool[T], targets int32[], weights float32[]
  retrieval    : inputs int32[2,T], mask bool[2,T], targets int32[], weights float32[]

An all-zero example is padding: its weights are zero, so the pipeline pads a final partial
evaluation batch with zeros and metrics stay exact.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import ml_collections
import numpy as np

from lra_core import registry
from lra_core.errors import ConfigError

SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class DataInfo:
  """What a model and a task need to know about a dataset."""

  vocab_size: int
  num_classes: int = 0  # classification tasks only
  unit: str = "token"  # what one target is: bits-per-<unit> is reported for LMs
  pad_id: int = 0
  vocab: tuple[str, ...] = ()  # id -> token string, where the dataset has a small vocabulary


# Datasets whose token examples carry more than the task's fields (document-packed text corpora).
_PACKED_TEXT = ("c4", "pg19")


def example_fields(config) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """name -> (shape, dtype) of one training example of `config`, without opening any data.

  The fields are the table above for `config.task` at `train.seq_len`, plus the packed text
  corpora's `words` / `segment_ids`; compiling a step ahead of time for a config (lra_core.aot)
  needs them, and the tests check them against the examples each dataset really gives.
  """
  t = config.train.seq_len
  task = config.task
  i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
  if task in ("lm", "image_ar"):
    fields = {"inputs": ((t,), i32), "targets": ((t,), i32), "weights": ((t,), f32)}
    if config.data.name in _PACKED_TEXT:
      fields.update(words=((t,), f32), segment_ids=((t,), i32))
    return fields
  if task == "mlm":
    fields = {"inputs": ((t,), i32), "weights": ((t,), f32)}
    if config.data.name in _PACKED_TEXT:
      fields["segment_ids"] = ((t,), i32)
    return fields
  if task in ("classify", "retrieval", "diffusion"):
    shape = (2, t) if task == "retrieval" else (t,)
    return {"inputs": (shape, i32), "mask": (shape, np.dtype(bool)), "targets": ((), i32), "weights": ((), f32)}
  raise ConfigError(
    f"task {task!r} has no example layout; expected one of lm, image_ar, mlm, classify, retrieval or diffusion."
  )


DOCUMENT_MASKS = ("auto", "true", "false")


def document_mask(config) -> bool:
  """Whether the model sees the documents of a packed row apart (`data.document_mask`): attention,
  recurrences and positions stop at document boundaries (kernels/segments.py). "auto" is on for
  rows of whole documents (`data.packing="pack"`, which masked LM reads) and off for "concat"
  windows, which run across documents on purpose (Transformer-XL / Transformer-VQ style, with a
  cache carried from window to window). Datasets without documents have no such key: off."""
  data = config.data
  setting = data.get("document_mask", "false") if data.name in _PACKED_TEXT else "false"
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


def make_source(config, split: str) -> Source:
  if split not in SPLITS:
    raise ConfigError(f"split {split!r} is not one of {SPLITS}.")
  return registry.dataset_module(config.data.name).make_source(config, split)


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
