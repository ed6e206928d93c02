"""Pieces the text corpora (PG-19, C4) share: setting checks, tokenizer resolution, and
sources over a tokenized corpus built once into the cache and memory-mapped afterwards."""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np
from etils import epath

from lra_core import registry, task_kinds
from lra_core.data import DOCUMENT_MASKS, cache, document_mask, files
from lra_core.data.packing import PACKINGS, Corpus, CorpusSequences, build_corpus
from lra_core.data.tokenizer import Tokenizer, make_tokenizer
from lra_core.errors import ConfigError, DataError

SOURCES = ("files", "tfds")


def check_settings(config) -> None:
  """Sequence length, packing, block padding and source: the checks that need no files."""
  seq_len = config.train.seq_len
  if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
    raise ConfigError(f"train.seq_len {seq_len!r} must be a positive integer.")
  if config.data.packing not in PACKINGS:
    raise ConfigError(f"data.packing {config.data.packing!r} is not one of {PACKINGS}.")
  mask = config.data.get("document_mask", "auto")
  if mask not in DOCUMENT_MASKS:
    raise ConfigError(f"data.document_mask {mask!r} is not one of {list(DOCUMENT_MASKS)}.")
  if document_mask(config) and config.data.packing == "concat" and _keeps_carry(config):
    raise ConfigError(
      f"data.document_mask with data.packing='concat' cannot go with model {config.model.name}'s "
      "state carried across windows (a window's first document may continue the last one); "
      "use data.packing='pack'."
    )
  block = block_padding(config.data)
  if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 0:
    raise ConfigError(f"data.block_padding {block!r} must be a non-negative integer (0 turns it off).")
  if block and seq_len % block:
    raise ConfigError(f"train.seq_len {seq_len} is not a multiple of data.block_padding {block}.")
  if config.data.source not in SOURCES:
    raise ConfigError(f"data.source {config.data.source!r} is not one of {SOURCES}.")


def _keeps_carry(config) -> bool:
  return registry.family(config.model.get("name")).keeps_carry(config)


def block_padding(data):
  """data.block_padding, 0 for a data section written before the setting existed."""
  return data.get("block_padding", 0)


def padding_seed(name: str) -> int:
  """The block-padding seed of the stream `name` ("pg19-train"): fixed, so runs and restarts pad
  alike, and independent of train.seed, so evaluation data is the same for every run."""
  return zlib.crc32(name.encode("utf-8"))


def tokenizer_spec(data) -> str:
  """ "bytes", or the SentencePiece model path with a relative path resolved under data.dir
  (which may be a gs:// URL: the model is then read from the bucket)."""
  spec = data.tokenizer
  if spec == "bytes" or not spec:
    return spec
  path = files.expand(spec, what="data.tokenizer")
  if not path.is_absolute() and data.dir:
    path = files.expand(data.dir) / path
  return str(path)


def load_tokenizer(data, *, hint: str) -> Tokenizer:
  """The configured tokenizer; a missing model file names the path and how to train one."""
  spec = tokenizer_spec(data)
  if spec and spec != "bytes" and not files.expand(spec, what="data.tokenizer").is_file():
    hint = hint.replace("<dir>", str(files.expand(data.dir))) if data.dir else hint
    raise DataError(
      f"data.tokenizer {spec!r} does not exist; expected \"bytes\" or a SentencePiece .model "
      f"file (relative paths resolve under data.dir), e.g. trained with `{hint}`."
    )
  return make_tokenizer(spec)


def tfds_fingerprint(records, split: str) -> list:
  """Fingerprints of the array_record shards behind a tfds split, and its dataset_info.json."""
  info = records.dataset_info
  base = files.parse_split(split)[0]
  folder = epath.Path(info.data_dir)  # not pathlib: that would turn gs://b into gs:/b
  paths = [folder / name for name in info.splits[base].filenames] + [folder / "dataset_info.json"]
  return cache.file_fingerprint([p for p in paths if p.exists()])


class TextSource(CorpusSequences):
  """`CorpusSequences` over a cached corpus; pickles its memory-mapped arrays as file names.

  `doc_ids[d]` is the id of document d (a PG-19 book id; a C4 document's index in its split).
  """

  def __init__(self, corpus: Corpus, tokenizer_spec: str, seq_len: int, *, doc_ids: np.ndarray, **kwargs):
    super().__init__(corpus, make_tokenizer(tokenizer_spec), seq_len, **kwargs)
    self.tokenizer_spec, self.doc_ids = tokenizer_spec, doc_ids

  def __getstate__(self):
    state = dict(super().__getstate__(), tokenizer=None, corpus=dict(vars(self.corpus)))
    state["doc_ids"] = _mapped_name(state["doc_ids"])
    state["corpus"] = {k: _mapped_name(v) for k, v in state["corpus"].items()}
    return state

  def __setstate__(self, state):
    state["doc_ids"] = _remap(state["doc_ids"])
    state["corpus"] = Corpus(**{k: _remap(v) for k, v in state["corpus"].items()})
    state["tokenizer"] = make_tokenizer(state["tokenizer_spec"])
    self.__dict__.update(state)


def _mapped_name(array):
  return ("memmap", array.filename) if isinstance(array, np.memmap) and array.filename else array


def _remap(value):
  return np.load(value[1], mmap_mode="r") if isinstance(value, tuple) else value


# Cache entries already logged, so the three splits and the trainer's repeated calls log once.
_LOGGED: set[str] = set()


def corpus_source(
  config,
  name: str,
  key: dict,
  documents: Callable[[], Iterator[tuple[int, str]]],
  *,
  tokenizer: Tokenizer,
  where: str,
  unit_name: str,
) -> TextSource:
  """A `TextSource` over the documents `documents()` yields as (id, text), tokenized once.

  `key` names the inputs (file fingerprints, slices); the tokenizer is added here. The cached
  entry holds `tokens`, `starts` and `doc_ids` (the id of each document, e.g. its book id).
  """
  data = config.data
  spec = tokenizer_spec(data)
  key = dict(key, tokenizer=tokenizer.fingerprint())
  built = []

  def build():
    start = time.perf_counter()
    ids = []

    def texts():
      for doc_id, text in documents():
        ids.append(doc_id)
        yield text

    arrays = build_corpus(texts(), tokenizer)
    arrays["doc_ids"] = np.asarray(ids, np.int64)
    built.append(time.perf_counter() - start)
    return arrays

  arrays = cache.cached_arrays(name, key, build, root=data.cache_dir)
  if len(arrays["starts"]) < 2:
    raise DataError(f"{where} holds no documents.")
  corpus = Corpus(tokens=arrays["tokens"], starts=arrays["starts"])
  entry = f"{name}-{cache.digest(key)}"
  if entry not in _LOGGED or built:
    _LOGGED.add(entry)
    how = f"tokenized in {built[0]:.1f} s" if built else "memory-mapped"
    logging.info(
      "%s: %d %s, %d tokens (tokenizer %s), %s from %s; cache %s",
      name,
      corpus.num_documents,
      unit_name,
      len(corpus.tokens),
      spec,
      how,
      where,
      cache.cache_root(data.cache_dir) / entry,
    )
  # The bytes tokenizer's targets are bytes, whatever the corpus's record says of its tokens.
  unit = "byte" if spec == "bytes" else registry.dataset(config.data.name).unit
  return TextSource(
    corpus,
    spec,
    int(config.train.seq_len),
    doc_ids=arrays["doc_ids"],
    packing=data.packing,
    lm=task_kinds.kind(config.task).causal,
    unit=unit,
    name=f"{name} ({where})",
    block_padding=int(block_padding(data)),
    padding_seed=padding_seed(name),
  )
