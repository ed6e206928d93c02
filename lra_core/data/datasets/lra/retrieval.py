"""LRA Retrieval: ACL Anthology Network (AAN) citation matching between two documents.

Files (the LRA release, `lra_release/tsv_data/`), read from `data.dir` (local or gs://):

  train       new_aan_pairs.train.tsv
  validation  new_aan_pairs.eval.tsv
  test        new_aan_pairs.test.tsv

Each line is one pair, tab-separated, no header and no quoting:
`label<TAB>id1<TAB>id2<TAB>text1<TAB>text2`. LRA parses the label as a float and casts it to
an int, so both `1` and `1.0` occur in the wild; anything other than 0 or 1 is refused here.

Encoding follows LRA's byte tokenizer (`tokenizer='char'`, tfds ByteTextEncoder): the UTF-8
bytes of each text, truncated to T bytes, each id = byte + 1 so that 0 stays padding; vocabulary
257. Example fields (the two texts stacked on the first axis, to feed one shared encoder):

  inputs  int32[2,T]   mask bool[2,T] (True = real byte)   targets int32[] (0/1)   weights float32[]

The truncated bytes of all texts live in one uint8 buffer with offsets, padded on access, so the
~147k train pairs at T=4000 take at most ~1.2 GB instead of ~4.7 GB as padded int32.
"""

from __future__ import annotations

import logging
import os

import ml_collections
import numpy as np
from etils import epath

from lra_core.data import DataInfo, check_index, config_section, files, labelled_example
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

DATASET = Dataset(name="retrieval", unit="byte", tasks=("retrieval",))

FILES = {
  "train": "new_aan_pairs.train.tsv",
  "validation": "new_aan_pairs.eval.tsv",
  "test": "new_aan_pairs.test.tsv",
}
BYTE_OFFSET = 1  # id = byte + 1; 0 is padding
VOCAB_SIZE = 256 + BYTE_OFFSET
NUM_COLUMNS = 5  # label, id1, id2, text1, text2

_DEFAULTS = dict(name=DATASET.name, dir="")


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def encode(text: str | bytes, seq_len: int) -> np.ndarray:
  """int32[<=T] ids of the first `seq_len` UTF-8 bytes of `text` (bytes + 1)."""
  raw = text.encode("utf-8") if isinstance(text, str) else text
  return np.frombuffer(raw[:seq_len], dtype=np.uint8).astype(np.int32) + BYTE_OFFSET


def decode(ids) -> str:
  """Text of ids; padding (0) is dropped and invalid UTF-8 becomes U+FFFD."""
  ids = np.asarray(ids, dtype=np.int64).reshape(-1)
  ids = ids[ids != 0] - BYTE_OFFSET
  if ids.size and (ids.min() < 0 or ids.max() > 255):
    bad = ids[(ids < 0) | (ids > 255)][0] + BYTE_OFFSET
    raise DataError(f"id {int(bad)} is outside the byte vocabulary [0, {VOCAB_SIZE}).")
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def split_path(config, split: str) -> str:
  """Path of the TSV file holding `split` under `data.dir`."""
  DATASET.check_split(split)
  if not config.data.dir:
    raise ConfigError(f"data.dir is empty; expected the folder holding {sorted(FILES.values())}.")
  files.expand(config.data.dir)  # a URL whose filesystem package is missing: ConfigError
  return os.path.join(os.path.expanduser(config.data.dir), FILES[split])


def _seq_len(config) -> int:
  seq_len = config.train.seq_len
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ConfigError(f"train.seq_len {seq_len!r} must be a positive integer.")
  return int(seq_len)


def validate_config(config) -> None:
  """Checks T and that the three TSV files exist and are non-empty (no parsing)."""
  _seq_len(config)
  for split in DATASET.splits:
    path = split_path(config, split)
    if not epath.Path(path).is_file():
      raise DataError(f"retrieval file {path!r} does not exist.")
    if files.size(path) == 0:
      raise DataError(f"retrieval file {path!r} is empty.")


def _parse_label(field: bytes, path: str, line_no: int) -> int:
  try:
    value = float(field)
  except ValueError:
    value = None
  if value not in (0.0, 1.0):
    shown = field.decode("utf-8", "replace")
    raise DataError(f"line {line_no} of {path!r} has label {shown!r}; expected 0 or 1.")
  return int(value)


def read_pairs(path: str, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Parses one AAN TSV file.

  Returns (buffer uint8[N] of truncated text bytes, offsets int64[2P+1] into it with text k of
  pair p at [offsets[2p+k], offsets[2p+k+1]), labels int8[P]).
  """
  if not epath.Path(path).is_file():
    raise DataError(f"retrieval file {path!r} does not exist.")
  buffer = bytearray()
  offsets = [0]
  labels = []
  # Binary lines: truncation counts bytes, as LRA's byte encoder does, and no decode is paid.
  with files.open_binary(path) as f:
    for line_no, line in enumerate(f, start=1):
      line = line.rstrip(b"\r\n")
      if not line:
        continue
      fields = line.split(b"\t")
      if len(fields) != NUM_COLUMNS:
        raise DataError(
          f"line {line_no} of {path!r} has {len(fields)} tab-separated columns; expected "
          f"{NUM_COLUMNS} (label, id1, id2, text1, text2)."
        )
      labels.append(_parse_label(fields[0], path, line_no))
      for text in fields[3:]:
        buffer += text[:seq_len]
        offsets.append(len(buffer))
  if not labels:
    raise DataError(f"retrieval file {path!r} holds no pairs.")
  # frombuffer shares the bytearray's memory: no second copy of the texts.
  return (np.frombuffer(buffer, dtype=np.uint8), np.asarray(offsets, np.int64), np.asarray(labels, np.int8))


class RetrievalPairs:
  """Random-access AAN pairs, padded to T on access."""

  info = DataInfo(vocab_size=VOCAB_SIZE, num_classes=2, unit=DATASET.unit)

  def __init__(self, buffer: np.ndarray, offsets: np.ndarray, labels: np.ndarray, seq_len: int):
    self.buffer, self.offsets, self.labels, self.seq_len = buffer, offsets, labels, seq_len

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = check_index(index, len(self), "pairs")
    inputs = np.zeros((2, self.seq_len), np.int32)
    mask = np.zeros((2, self.seq_len), bool)
    for k in range(2):
      begin, end = self.offsets[2 * index + k], self.offsets[2 * index + k + 1]
      inputs[k, : end - begin] = self.buffer[begin:end]
      inputs[k, : end - begin] += BYTE_OFFSET
      mask[k, : end - begin] = True
    return labelled_example(inputs, mask, self.labels[index])


def make_source(config, split: str) -> RetrievalPairs:
  """The AAN pairs of `split`, each text truncated to `train.seq_len` bytes."""
  seq_len = _seq_len(config)
  path = split_path(config, split)
  buffer, offsets, labels = read_pairs(path, seq_len)
  logging.info(
    "retrieval %s: %d pairs (%.1f%% positive), %d text bytes kept at T=%d",
    path,
    len(labels),
    100.0 * labels.mean(),
    buffer.size,
    seq_len,
  )
  return RetrievalPairs(buffer, offsets, labels, seq_len)


def codec(config):
  """(encode, decode) of this dataset's fixed vocabulary, for sampling (any config)."""
  return encode, decode
