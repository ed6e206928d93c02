"""Byte-level language modelling over one file (enwik8-style data).

The file holds raw bytes, or is a `.zip` with one member (the layout of `enwik8.zip`), or a
`.gz`, local or in a bucket (data.dir=gs://bucket/enwik8). It is cut into contiguous train /
validation / test byte ranges by `data.split_fractions`; with (0.9, 0.05, 0.05) the full
10^8-byte enwik8 splits at 90M / 95M, the usual boundaries. Ids are the raw byte values
(vocabulary 256, no offset).

Example i of a split starting at byte s reads the T+1 bytes [s + i*T, s + i*T + T]:

  inputs  int32[T]    bytes s + i*T     ... s + i*T + T - 1
  targets int32[T]    bytes s + i*T + 1 ... s + i*T + T      (inputs shifted by one)
  weights float32[T]  all ones

so consecutive windows share one byte and a split of n bytes gives (n - 1) // T examples.
The `mlm` task reads the same windows and ignores `targets`.
"""

from __future__ import annotations

import functools
import gzip
import logging
import math
import os
import zipfile
import zlib
from collections.abc import Iterable, Sequence

import ml_collections
import numpy as np

from lra_core.data import DataInfo, cache, check_index, config_section, files
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError
from lra_core.runtime import fs

DATASET = Dataset(name="bytes", unit="byte", tasks=("lm", "mlm"))
VOCAB_SIZE = 256

_DEFAULTS = dict(
  name=DATASET.name,
  dir="",
  path="",  # full path of the file; when empty, dir/filename
  filename="",
  split_fractions=(0.9, 0.05, 0.05),  # train, validation, test
)

# Ranges already logged, so building the three splits logs the layout once.
_LOGGED: set[tuple] = set()
# Published files by name -> their size in bytes once decompressed: another size is warned about
# (a sample or a cut file trains, but its numbers are not comparable to the papers').
KNOWN_SIZES = {"enwik8": 100_000_000, "enwik8.zip": 100_000_000}


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def encode(text: str) -> list[int]:
  """UTF-8 bytes of `text` as ids."""
  return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
  """Text of byte ids; invalid UTF-8 (e.g. a window cut mid-character) becomes U+FFFD."""
  if not hasattr(ids, "__len__"):
    ids = list(ids)
  ids = np.asarray(ids, dtype=np.int64).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    bad = ids[(ids < 0) | (ids >= VOCAB_SIZE)][0]
    raise DataError(f"byte id {int(bad)} is outside [0, {VOCAB_SIZE}).")
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def file_path(data: ml_collections.ConfigDict) -> str:
  """The file a `data` section points at: `path`, else `dir/filename` (local, or gs://...)."""
  if data.path:
    files.expand(data.path, what="data.path")  # a URL whose filesystem package is missing: ConfigError
    return os.path.expanduser(data.path)
  if not data.filename:
    raise ConfigError("data.path and data.filename are both empty; expected the file holding the bytes.")
  folder = files.expand(data.dir)  # likewise
  path = os.path.join(os.path.expanduser(data.dir), data.filename)
  # A compressed filename (enwik8.zip) also finds the raw file beside it (enwik8) when it is not there.
  raw = data.filename.removesuffix(".zip").removesuffix(".gz")
  if raw != data.filename and not (folder / data.filename).exists() and (folder / raw).exists():
    return os.path.join(os.path.expanduser(data.dir), raw)
  return path


def load_bytes(path: str) -> np.ndarray:
  """All bytes of the file as uint8[N]: memory-mapped when raw, decompressed once when .zip/.gz;
  an object in a bucket is read into memory once per process."""
  file = files.expand(path, what="byte file")
  if not file.is_file():
    raise DataError(
      f"byte file {path!r} does not exist; set --config.data.dir to the folder that holds it (or "
      "--config.data.path to the file)."
    )
  # The key holds size, mtime and a content sample so a rewritten file is read again.
  _, size, mtime, sample = cache.file_fingerprint([path])[0]
  if size == 0:
    raise DataError(f"byte file {path!r} is empty.")
  data = _load_cached(files.absolute(path), size, mtime, sample)
  if data.size == 0:
    raise DataError(f"byte file {path!r} decompresses to zero bytes.")
  expected = KNOWN_SIZES.get(os.path.basename(path))
  if expected is not None and data.size != expected and (path, data.size) not in _LOGGED:
    _LOGGED.add((path, data.size))
    logging.warning(
      "%s holds %s bytes where the published %s has %s: a sample or a cut file, whose results are not "
      "comparable to published ones",
      path,
      f"{data.size:,}",
      os.path.basename(path).removesuffix(".zip"),
      f"{expected:,}",
    )
  return data


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, size: int, mtime_ns: int, sample: str) -> np.ndarray:
  del size, mtime_ns, sample
  lower = path.lower()
  if lower.endswith(".zip"):
    try:
      with files.expand(path).open("rb") as f, zipfile.ZipFile(f) as archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if len(members) != 1:
          names = [m.filename for m in members]
          raise DataError(f"zip file {path!r} holds members {names}; expected exactly one.")
        raw = archive.read(members[0])
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as e:  # a damaged archive
      raise DataError(f"zip file {path!r} is not a readable zip archive ({type(e).__name__}: {e}).") from e
    return np.frombuffer(raw, dtype=np.uint8)
  if lower.endswith(".gz"):
    try:
      with files.expand(path).open("rb") as f, gzip.GzipFile(fileobj=f) as stream:
        raw = stream.read()
    except (OSError, EOFError) as e:
      raise DataError(f"gzip file {path!r} is not a readable gzip stream ({e}).") from e
    return np.frombuffer(raw, dtype=np.uint8)
  if fs.is_local(path):
    return np.memmap(path, dtype=np.uint8, mode="r")
  return np.frombuffer(files.expand(path).read_bytes(), dtype=np.uint8)


def split_ranges(num_bytes: int, fractions: Sequence[float]) -> dict[str, tuple[int, int]]:
  """Contiguous [start, stop) byte ranges of train, validation and test, in file order."""
  _check_fractions(fractions)
  edges = [0]
  total = 0.0
  for f in fractions[:-1]:
    total += f
    edges.append(int(round(num_bytes * total)))
  edges.append(num_bytes)
  return {split: (edges[k], edges[k + 1]) for k, split in enumerate(DATASET.splits)}


def _check_fractions(fractions: Sequence[float]) -> None:
  if len(fractions) != len(DATASET.splits):
    raise ConfigError(
      f"data.split_fractions {tuple(fractions)} has {len(fractions)} entries; expected 3 (train, validation, test)."
    )
  if any(not f > 0 for f in fractions) or not math.isclose(sum(fractions), 1.0, rel_tol=0, abs_tol=1e-6):
    raise ConfigError(f"data.split_fractions {tuple(fractions)} must be positive and sum to 1.")


def _seq_len(config) -> int:
  seq_len = config.train.seq_len
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ConfigError(f"train.seq_len {seq_len!r} must be a positive integer.")
  return int(seq_len)


def _check_split(path: str, split: str, span: tuple[int, int], seq_len: int) -> None:
  length = span[1] - span[0]
  if length < seq_len + 1:
    raise DataError(
      f"split {split!r} of {path!r} holds {length} bytes; expected at least "
      f"train.seq_len + 1 = {seq_len + 1} for one window."
    )


def validate_config(config) -> None:
  """Checks fractions, file and that every split holds at least one window of T+1 bytes."""
  seq_len = _seq_len(config)
  _check_fractions(config.data.split_fractions)
  path = file_path(config.data)
  ranges = split_ranges(load_bytes(path).size, config.data.split_fractions)
  for split, span in ranges.items():
    _check_split(path, split, span, seq_len)


class ByteWindows:
  """Windows of T+1 bytes over [start, stop) of one file; random access, nothing copied.

  Pickling keeps only the path, so a data-loader worker maps (or decompresses) the file itself.
  """

  info = DataInfo(vocab_size=VOCAB_SIZE, unit=DATASET.unit)

  def __init__(self, path: str, start: int, stop: int, seq_len: int, data: np.ndarray | None = None):
    self.path, self.start, self.stop, self.seq_len = path, start, stop, seq_len
    self._data = data
    self._mtime: int | None = None  # of the mapped file, when first read

  @property
  def data(self) -> np.ndarray:
    if self._data is None:
      self._data = load_bytes(self.path)
    return self._data

  def __len__(self) -> int:
    return max(0, (self.stop - self.start - 1) // self.seq_len)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    begin = self.start + check_index(index, len(self), "windows") * self.seq_len
    if isinstance(self.data, np.memmap):
      self._check_mapped_file()
    window = np.asarray(self.data[begin : begin + self.seq_len + 1], dtype=np.int32)
    return {
      "inputs": window[:-1],
      "targets": window[1:],
      "weights": np.ones(self.seq_len, np.float32),
    }

  def _check_mapped_file(self) -> None:
    """The mapped file as it was when the run began: read past the end of a file cut short under it, a
    mapping kills the process (SIGBUS, no message), so that is a sentence; a file rewritten in place
    (its bytes read as they now are) is a warning, once."""
    stat = os.stat(self.path)
    if stat.st_size != self.data.size:
      raise DataError(
        f"byte file {self.path!r} changed while the run read it: it holds {stat.st_size:,} bytes where it held "
        f"{self.data.size:,}; put the original back and run again (it resumes from the last checkpoint)."
      )
    if self._mtime is None:
      self._mtime = stat.st_mtime_ns
    elif stat.st_mtime_ns != self._mtime:
      self._mtime = stat.st_mtime_ns
      logging.warning(
        "byte file %s was rewritten while the run read it: the windows read from now on are its new bytes", self.path
      )

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_data"] = None
    return state


ENWIK8_BYTES = 10**8


def _scale_note(num_bytes: int, fractions) -> str:
  """Says when the usual 90M/5M/5M enwik8 split is being scaled to a file of another length."""
  if num_bytes == ENWIK8_BYTES or tuple(fractions) != (0.9, 0.05, 0.05):
    return ""
  return (
    f" (the standard 90M/5M/5M split of the {ENWIK8_BYTES:,}-byte enwik8, scaled "
    f"proportionally to this file's {num_bytes:,} bytes)"
  )


def make_source(config, split: str) -> ByteWindows:
  """The `split` windows of the file named by `config.data`, each `train.seq_len` long."""
  DATASET.check_split(split)
  seq_len = _seq_len(config)
  path = file_path(config.data)
  data = load_bytes(path)
  ranges = split_ranges(data.size, config.data.split_fractions)
  _check_split(path, split, ranges[split], seq_len)
  key = (files.absolute(path), data.size, tuple(ranges.items()))
  if key not in _LOGGED:
    _LOGGED.add(key)
    logging.info(
      "bytes %s: %d bytes, split %s by data.split_fractions %s%s",
      path,
      data.size,
      ", ".join(f"{s} [{a}, {b})" for s, (a, b) in ranges.items()),
      tuple(config.data.split_fractions),
      _scale_note(data.size, config.data.split_fractions),
    )
  return ByteWindows(path, *ranges[split], seq_len, data=data)


def codec(config):
  """(encode, decode) of this dataset's fixed vocabulary, for sampling (any config)."""
  return encode, decode
