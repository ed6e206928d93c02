"""LRA Text: IMDB movie-review sentiment (Maas et al. 2011) read byte by byte.

Where the reviews come from (`data.source`):

  files  `data.dir` (a local folder or a gs:// one) holds the Stanford release `aclImdb_v1.tar.gz`,
         or its extracted `aclImdb/` folder (`aclImdb/{train,test}/{neg,pos}/<id>_<rating>.txt`),
         or is that folder itself.
  tfds   tfds `imdb_reviews` (config plain_text), prepared in array_record format under
         `data.dir` ("" -> ~/tensorflow_datasets).

Splits follow LRA (`text_classification/input_pipeline.py`): IMDB has no validation split, so
"train" reads the train reviews and both "validation" and "test" read the test reviews.

Encoding follows LRA's `tokenizer='char'` (tfds ByteTextEncoder): a review is the file's bytes
with surrounding whitespace stripped (what tfds `imdb_reviews` stores), each id = byte + 1 so that
0 stays padding (vocabulary 257), truncated to T = `train.seq_len` (the LRA paper uses 4000).

  inputs int32[T]   mask bool[T] (True = real byte)   targets int32[] (neg 0, pos 1)   weights float32[]

The files path reads every review once (tens of seconds for the full archive) into the lra_core
cache: one byte buffer with offsets, labels, ids and ratings per split, in the order (label folder,
numeric id). The texts are stored whole and cut to T on access, so one entry serves every T (about
33 MB per split of 25,000 reviews).

  python -m lra_core.data.datasets.lra.imdb stats --dir DIR [--seq_len 4000]
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import re
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence

import ml_collections
import numpy as np
from etils import epath

from lra_core import cli
from lra_core.data import DataInfo, cache, check_index, config_section, files, labelled_example, tfds_source
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError
from lra_core.runtime import fs

DATASET = Dataset(name="imdb", unit="byte", tasks=("classify",))

ARCHIVE = "aclImdb_v1.tar.gz"
FOLDER = "aclImdb"
LABELS = ("neg", "pos")  # label id = position, as tfds ClassLabel(names=["neg", "pos"])
FILE_SPLITS = ("train", "test")
# LRA validates on the test reviews: IMDB ships no validation split.
SPLIT_SOURCE = {"train": "train", "validation": "test", "test": "test"}
BYTE_OFFSET = 1  # id = byte + 1; 0 is padding
VOCAB_SIZE = 256 + BYTE_OFFSET
NUM_CLASSES = len(LABELS)
TFDS_NAME = "imdb_reviews/plain_text"
SOURCES = files.SOURCES

LAYOUT = f"{ARCHIVE} or an extracted {FOLDER}/{{train,test}}/{{neg,pos}}/<id>_<rating>.txt"
PREPARE = (
  "download http://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz, or set "
  "data.source=tfds after `tfds build imdb_reviews --file_format=array_record`"
)
_REVIEW = re.compile(r"^(\d+)_(\d+)\.txt$")
_MEMBER = re.compile(r"^(?:\./)?aclImdb/(train|test)/(neg|pos)/([^/]+)$")
_CACHE_VERSION = 1  # bump when the cached arrays change for the same input

_DEFAULTS = dict(
  name=DATASET.name,
  source="files",  # files | tfds
  dir="",  # folder with aclImdb_v1.tar.gz or aclImdb/; for tfds its data_dir
  cache_dir="",  # "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
)

_LOGGED: set[tuple] = set()


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def encode(text: str | bytes) -> np.ndarray:
  """int32 ids of the UTF-8 bytes of `text` (byte + 1), untruncated and unpadded."""
  raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(raw, np.uint8).astype(np.int32) + BYTE_OFFSET


def decode(ids) -> str:
  """Text of ids; padding (0) is dropped and invalid UTF-8 (a cut character) becomes U+FFFD."""
  ids = np.asarray(ids, dtype=np.int64).reshape(-1)
  ids = ids[ids != 0]
  if ids.size and (ids.min() < BYTE_OFFSET or ids.max() >= VOCAB_SIZE):
    bad = ids[(ids < BYTE_OFFSET) | (ids >= VOCAB_SIZE)][0]
    raise DataError(f"id {int(bad)} is outside the byte vocabulary [0, {VOCAB_SIZE}).")
  return (ids - BYTE_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- reading the release


def locate(data_dir: str) -> epath.Path:
  """The archive under `data_dir` if there is one, else the extracted aclImdb/ folder."""
  root = files.require_dir(data_dir, layout=LAYOUT, prepare=PREPARE)
  if (root / ARCHIVE).is_file():
    return files.require_file(root / ARCHIVE, layout=LAYOUT, prepare=PREPARE)
  for folder in (root / FOLDER, root):
    if all((folder / s / label).is_dir() for s in FILE_SPLITS for label in LABELS):
      return folder
  raise DataError(
    f"data.dir {str(root)!r} holds neither {ARCHIVE} nor the folders "
    f"{FOLDER}/{{train,test}}/{{neg,pos}}/; expected {LAYOUT} ({PREPARE})."
  )


def _parse_name(name: str, where: str) -> tuple[int, int]:
  m = _REVIEW.match(name)
  if not m:
    raise DataError(f"{where} is not named <id>_<rating>.txt; expected {LAYOUT} ({PREPARE}).")
  return int(m[1]), int(m[2])


def _archive_reviews(path: epath.Path) -> Iterator[tuple[str, int, int, int, bytes]]:
  try:
    with path.open("rb") as raw, tarfile.open(fileobj=raw, mode="r:gz") as archive:
      for member in archive:
        m = _MEMBER.match(member.name)
        if not m or not member.isfile():
          continue
        review_id, rating = _parse_name(m[3], f"member {member.name!r} of {str(path)!r}")
        text = archive.extractfile(member).read()
        yield m[1], LABELS.index(m[2]), review_id, rating, text
  except (tarfile.TarError, OSError, EOFError) as e:
    raise DataError(f"{str(path)!r} is not a readable gzip tar archive ({e}); expected {LAYOUT} ({PREPARE}).") from e


def _folder_files(folder: epath.Path) -> list[tuple[str, int, epath.Path]]:
  found = []
  for split in FILE_SPLITS:
    for label_id, label in enumerate(LABELS):
      found += [(split, label_id, path) for path in files.list_files(folder / split / label)]
  return found


def _folder_reviews(folder: epath.Path) -> Iterator[tuple[str, int, int, int, bytes]]:
  found = _folder_files(folder)
  for (split, label_id, path), text in zip(found, files.prefetch([p for _, _, p in found])):
    review_id, rating = _parse_name(path.name, f"file {str(path)!r}")
    yield split, label_id, review_id, rating, path.read_bytes() if text is None else text


def read_reviews(location: epath.Path) -> dict[str, np.ndarray]:
  """All labelled reviews of the archive or folder, per split: `<split>_bytes` uint8 (stripped
  texts end to end), `<split>_offsets` int64[N+1], `<split>_labels` int8, `<split>_ids` int32,
  `<split>_ratings` int8; sorted by (label, id)."""
  reviews = {s: [] for s in FILE_SPLITS}
  items = _archive_reviews(location) if location.is_file() else _folder_reviews(location)
  for split, label, review_id, rating, text in items:
    # tfds imdb_reviews stores f.read().strip(): the same bytes, so both sources agree.
    reviews[split].append((label, review_id, rating, text.strip()))
  arrays = {}
  for split, rows in reviews.items():
    rows.sort(key=lambda r: (r[0], r[1]))
    counts = np.bincount([r[0] for r in rows], minlength=NUM_CLASSES)
    for label, count in zip(LABELS, counts):
      if not count:
        raise DataError(
          f"{str(location)!r} holds no {FOLDER}/{split}/{label}/*.txt reviews; expected {LAYOUT} ({PREPARE})."
        )
    lengths = np.fromiter((len(r[3]) for r in rows), np.int64, len(rows))
    arrays[f"{split}_bytes"] = np.frombuffer(b"".join(r[3] for r in rows), np.uint8)
    arrays[f"{split}_offsets"] = np.concatenate([[0], np.cumsum(lengths)])
    arrays[f"{split}_labels"] = np.asarray([r[0] for r in rows], np.int8)
    arrays[f"{split}_ids"] = np.asarray([r[1] for r in rows], np.int32)
    arrays[f"{split}_ratings"] = np.asarray([r[2] for r in rows], np.int8)
  return arrays


def _fingerprint(location: epath.Path) -> list:
  if location.is_file():
    return cache.file_fingerprint([location])
  # 50k small files: a digest of the listing instead of a 5 MB key.
  found = _folder_files(location)
  stats = cache.file_fingerprint([p for _, _, p in found])
  listing = sorted(f"{s}/{LABELS[l]}/{p.name}:{size}:{mtime}" for (s, l, p), (_, size, mtime, _) in zip(found, stats))
  where = str(pathlib.Path(location).resolve()) if fs.is_local(location) else str(location)
  return [where, len(listing), hashlib.sha256("\n".join(listing).encode()).hexdigest()]


def load_reviews(location: epath.Path, cache_dir: str = "") -> dict[str, np.ndarray]:
  """`read_reviews(location)`, built once into the lra_core cache and memory-mapped after."""
  key = dict(kind="imdb", version=_CACHE_VERSION, input=_fingerprint(location))
  start = time.perf_counter()
  arrays = cache.cached_arrays("imdb", key, lambda: read_reviews(location), root=cache_dir)
  logging.info("imdb: %s ready in %.2f s", location, time.perf_counter() - start)
  return arrays


# ----------------------------------------------------------------------------- sources


def _example(text: np.ndarray, label: int, seq_len: int) -> dict[str, np.ndarray]:
  inputs = np.zeros(seq_len, np.int32)
  n = min(len(text), seq_len)
  inputs[:n] = text[:n]
  inputs[:n] += BYTE_OFFSET
  return labelled_example(inputs, inputs != 0, label)


class Reviews:
  """Reviews of one split from the cached arrays; memory maps are reopened after unpickling."""

  info = DataInfo(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, unit=DATASET.unit)

  def __init__(self, arrays: dict[str, np.ndarray], split: str, seq_len: int):
    self.split, self.seq_len = split, seq_len
    self.text, self.offsets, self.labels = (arrays[f"{split}_{k}"] for k in ("bytes", "offsets", "labels"))

  def __len__(self) -> int:
    return len(self.labels)

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = check_index(index, len(self), "reviews")
    begin, end = self.offsets[index], self.offsets[index + 1]
    return _example(self.text[begin : min(end, begin + self.seq_len)], self.labels[index], self.seq_len)

  def __getstate__(self):
    state = dict(self.__dict__)
    for k in ("text", "offsets", "labels"):
      if getattr(state[k], "filename", None):  # a memory map: pickle its file, not the data
        state[k] = ("npy", str(state[k].filename))
    return state

  def __setstate__(self, state):
    for k in ("text", "offsets", "labels"):
      if isinstance(state[k], tuple):
        state[k] = np.load(state[k][1], mmap_mode="r")
    self.__dict__.update(state)


class TfdsReviews:
  """Reviews of tfds imdb_reviews, encoded on access; reopened lazily after unpickling."""

  info = Reviews.info

  def __init__(self, split: str, data_dir: str, seq_len: int):
    self.split, self.data_dir, self.seq_len = split, data_dir, seq_len
    self._source = tfds_source.open_split(TFDS_NAME, split, data_dir)
    self._len = len(self._source)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = check_index(index, len(self), "reviews")
    if self._source is None:
      self._source = tfds_source.open_split(TFDS_NAME, self.split, self.data_dir)
    record = self._source[index]
    label = int(record["label"])
    if label not in (0, 1):
      raise DataError(f"tfds {TFDS_NAME} {self.split} example {index} has label {label}; expected 0 (neg) or 1 (pos).")
    return _example(np.frombuffer(record["text"], np.uint8), label, self.seq_len)

  def __getstate__(self):
    return dict(self.__dict__, _source=None)


# ----------------------------------------------------------------------------- config


def _seq_len(config) -> int:
  seq_len = config.train.seq_len
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ConfigError(f"train.seq_len {seq_len!r} must be a positive integer.")
  return int(seq_len)


def validate_config(config) -> None:
  """Checks T, source and that the release (or the tfds folder) is there; reads nothing."""
  _seq_len(config)
  data = config.data
  files.check_release_or_tfds(data, locate, tfds_name="imdb_reviews", prepare=PREPARE)


def make_source(config, split: str) -> Reviews | TfdsReviews:
  """The reviews of `split` (validation and test both read the test reviews, as LRA does)."""
  DATASET.check_split(split)
  validate_config(config)
  seq_len, data = _seq_len(config), config.data
  if data.source == "tfds":
    source = TfdsReviews(SPLIT_SOURCE[split], data.dir, seq_len)
  else:
    source = Reviews(load_reviews(locate(data.dir), data.cache_dir), SPLIT_SOURCE[split], seq_len)
  key = (data.source, data.dir, split, seq_len)
  if key not in _LOGGED:
    _LOGGED.add(key)
    note = " (IMDB has no validation split; LRA validates on the test reviews)" if split == "validation" else ""
    logging.info(
      "imdb %s: %d reviews from the %s split%s, bytes truncated to T=%d",
      split,
      len(source),
      SPLIT_SOURCE[split],
      note,
      seq_len,
    )
  return source


# ----------------------------------------------------------------------------- command line


def describe(source: Reviews) -> str:
  """Review count, label balance and byte-length statistics, with the share cut at T."""
  lengths = source.lengths
  pos = float(np.mean(source.labels))
  return (
    f"{len(source)} reviews, {100 * (1 - pos):.1f}% neg / {100 * pos:.1f}% pos; bytes mean "
    f"{lengths.mean():.1f} / median {np.median(lengths):g} / p95 {np.percentile(lengths, 95):.0f} / max "
    f"{lengths.max()}; {100 * np.mean(lengths > source.seq_len):.2f}% longer than T={source.seq_len}"
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.doc_parser("python -m lra_core.data.datasets.lra.imdb", __doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  stats = commands.add_parser("stats", help="print size, labels and byte lengths of both splits")
  stats.add_argument("--dir", required=True, help=f"folder with {ARCHIVE} or {FOLDER}/")
  stats.add_argument("--seq_len", type=int, default=4000)
  stats.add_argument("--cache_dir", default="")
  args = parser.parse_args(argv)
  try:
    arrays = load_reviews(locate(args.dir), args.cache_dir)
    for split in FILE_SPLITS:
      print(f"{split}: {describe(Reviews(arrays, split, args.seq_len))}")
  except (ConfigError, DataError) as e:
    sys.exit(f"error: {e}")


def codec(config):
  """(encode, decode) of this dataset's fixed vocabulary, for sampling (any config)."""
  return encode, decode


if __name__ == "__main__":
  main()
