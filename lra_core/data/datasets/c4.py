"""C4 (Raffel et al. 2020), English: causal and masked language modelling over web documents.

Sources (`data.source`):

  "files"  the allenai/c4 `en/` shards under `data.dir` (a local folder or a gs:// one): gzip JSON
           lines, one compact object per document with keys text, timestamp, url, in files named
           like c4-train.00000-of-01024.json.gz and c4-validation.00000-of-00008.json.gz.
  "tfds"   tfds `c4/en` 3.1.0 (features text, url, content-type, content-length, timestamp)
           prepared in array_record format under `data.tfds_dir`.

Splits come from file patterns (`data.train_files`, ...) or tfds split names (`data.tfds_splits`),
each optionally followed by a tfds-style document slice: "c4-validation.*.json.gz[:90%]" takes
the first 90% of the documents of the matching files (sorted by name, read in order). C4 has no
test split: an empty test setting reads the validation documents, and a log line says so.
With slices, the validation-only sample can supply all three splits:

  data.train_files="c4-validation.*.json.gz[:90%]" data.validation_files="c4-validation.*.json.gz[90%:]"

Documents are tokenized with `data.tokenizer` ("bytes", or a SentencePiece .model such as T5's
vocabulary gs://t5-data/vocabs/cc_all.32000/sentencepiece.model, or one trained with
`python -m lra_core.data.tokenizer --train --input=<dir>/c4-train.00000-of-01024.json.gz ...`)
and concatenated, each followed by eos; a split's token stream is built once into the cache.
It is held in memory while it is built (2 bytes per token), so for the full train split name a
subset of the 1024 shards in `data.train_files`.

Examples (`packing.CorpusSequences`; documents padded to whole blocks with `data.block_padding`),
T = train.seq_len:

  lm   inputs, targets int32[T]; weights, words float32[T]; segment_ids int32[T]
  mlm  inputs int32[T]; weights float32[T]; segment_ids int32[T] -- rows of whole documents with
       `data.packing="pack"`, masked on device by the mlm task (BERT's 15%).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
import zlib
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np
from etils import epath

from lra_core.data import cache, config_section, files, tfds_source
from lra_core.data import text as text_corpus
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

# Metrics count SentencePiece tokens, or bytes with data.tokenizer="bytes" (lra_core.data.text).
DATASET = Dataset(name="c4", unit="token", tasks=("lm", "mlm"), packed_documents=True)

TFDS_NAME = "c4/en"
LAYOUT = (
  "allenai/c4 en/ shards (gzip, one JSON object per line with text, timestamp and url) named "
  "like c4-train.00000-of-01024.json.gz"
)
PREPARE = (
  "download the en/ files of https://huggingface.co/datasets/allenai/c4 into data.dir, or set "
  "data.source=tfds with a tfds c4/en prepared in array_record format"
)
TOKENIZER_HINT = (
  "python -m lra_core.data.tokenizer --train --input=<dir>/c4-train.00000-of-01024.json.gz "
  "--model_prefix=<dir>/spm32k --vocab_size=32000` or T5's "
  "`gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
)
_FORMAT = 1
# A trailing [start:stop] on a file pattern is a document slice; a glob class has no colon.
_SLICE = re.compile(r"^(?P<pattern>.*?)(?P<slice>\[[^\[\]]*:[^\[\]]*\])?$")

_DEFAULTS = dict(
  name=DATASET.name,
  dir="",  # allenai/c4 en/ shards (source "files"); relative tokenizer paths resolve here
  source="files",  # files | tfds
  train_files="c4-train.*-of-01024.json.gz",
  validation_files="c4-validation.*-of-00008.json.gz",
  test_files="",  # C4 has no test split: "" -> validation_files
  tfds_dir="",  # tfds data_dir holding c4/en/3.1.0 (source "tfds")
  tfds_splits=("train", "validation", ""),  # train, validation, test ("" -> validation)
  tokenizer="bytes",  # "bytes" or a SentencePiece .model path
  packing="concat",  # concat | pack; masked LM reads packed rows of whole documents
  document_mask="auto",  # auto | true | false: attention and positions stop at document boundaries;
  # auto = on for "pack" rows, off for "concat" windows (lra_core.data.document_mask)
  block_padding=0,  # L > 0: 0..L-1 random pads before each document, pads after it to a multiple
  # of L (Block Transformer, App. H); train.seq_len % L == 0; 0 is off
  cache_dir="",  # token streams; "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
)


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def split_setting(data, split: str) -> str:
  """The file pattern (source "files") or tfds split (source "tfds") that `split` reads."""
  DATASET.check_split(split)
  if data.source == "tfds":
    if len(data.tfds_splits) != len(DATASET.splits):
      raise ConfigError(
        f"data.tfds_splits {tuple(data.tfds_splits)} has {len(data.tfds_splits)} entries; "
        f"expected 3 (train, validation, test)."
      )
    settings = dict(zip(DATASET.splits, data.tfds_splits))
  else:
    settings = dict(train=data.train_files, validation=data.validation_files, test=data.test_files)
  if split == "test" and not settings["test"]:
    return settings["validation"]
  if not settings[split]:
    raise ConfigError(f"the {split} split of c4 is set to ''; expected a file pattern or tfds split.")
  return settings[split]


def split_pattern(setting: str) -> tuple[str, str]:
  """ "c4-validation.*.json.gz[:90%]" -> ("c4-validation.*.json.gz", "[:90%]"); slice checked."""
  m = _SLICE.match(setting.strip())
  pattern, slice_ = m["pattern"], m["slice"] or ""
  if slice_:
    files.parse_split("files" + slice_)
  return pattern, slice_


def shard_files(data, split: str) -> tuple[list[epath.Path], str]:
  """The json.gz shards `split` reads, sorted by name, and the document slice to apply."""
  pattern, slice_ = split_pattern(split_setting(data, split))
  root = files.require_dir(data.dir, layout=LAYOUT, prepare=PREPARE)
  paths = files.require_files(root, pattern, layout=f"{LAYOUT} for the {split} split", prepare=PREPARE)
  return paths, slice_


def read_documents(path: epath.Path) -> Iterator[str]:
  """The "text" of every document in one shard (.json.gz, or plain .json lines)."""
  try:
    with files.open_binary(path) as raw:
      stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
      with io.TextIOWrapper(stream, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
          if not line.strip():
            continue
          try:
            record = json.loads(line)
          except json.JSONDecodeError:
            record = None
          if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(
              f"line {line_no} of {str(path)!r} is not a JSON object with a \"text\" string; expected {LAYOUT}."
            )
          yield record["text"]
  except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
    raise DataError(f"{str(path)!r} cannot be read as gzip UTF-8 JSON lines ({e}); expected {LAYOUT}.") from e


# ----------------------------------------------------------------------------- dataset interface

_NOTED: set[str] = set()


def _note_test(data, setting: str) -> None:
  explicit = data.tfds_splits[2] if data.source == "tfds" else data.test_files
  if not explicit and setting not in _NOTED:
    _NOTED.add(setting)
    logging.info("c4 has no test split: the test split reads the validation data %r.", setting)


def validate_config(config) -> None:
  """Settings, the tokenizer file and that every split's shards (or tfds split) exist."""
  text_corpus.check_settings(config)
  data = config.data
  for split in DATASET.splits:
    if data.source == "files":
      shard_files(data, split)
    else:
      tfds_source.open_split(TFDS_NAME, split_setting(data, split), data.tfds_dir)
  text_corpus.load_tokenizer(data, hint=TOKENIZER_HINT)


def make_source(config, split: str) -> text_corpus.TextSource:
  """Fixed-length rows over the concatenated documents of `split` (test: validation by default)."""
  text_corpus.check_settings(config)
  data = config.data
  tokenizer = text_corpus.load_tokenizer(data, hint=TOKENIZER_HINT)
  setting = split_setting(data, split)
  if split == "test":
    _note_test(data, setting)
  if data.source == "files":
    paths, slice_ = shard_files(data, split)
    key = dict(format=_FORMAT, source="files", files=cache.file_fingerprint(paths), slice=slice_)
    where = f"{files.expand(data.dir)}/{setting}"
    documents = _sliced(lambda: (t for p in paths for t in read_documents(p)), slice_)
  else:
    records = tfds_source.open_split(TFDS_NAME, setting, data.tfds_dir)
    key = dict(format=_FORMAT, source="tfds", split=setting, files=text_corpus.tfds_fingerprint(records, setting))
    where = f"tfds {TFDS_NAME} {setting} in {records.dataset_info.data_dir}"

    def documents():
      for i in range(len(records)):
        yield i, tfds_source.text(records[i]["text"])

  name = "c4-" + ("validation" if setting == split_setting(data, "validation") else split)
  return text_corpus.corpus_source(
    config, name, key, documents, tokenizer=tokenizer, where=where, unit_name="documents"
  )


def _sliced(texts: Callable[[], Iterator[str]], slice_: str) -> Callable[[], Iterator[tuple[int, str]]]:
  """(index, text) of the documents in `slice_` of `texts()`; a slice costs one counting pass."""

  def documents():
    start, stop = 0, None
    if slice_:
      total = sum(1 for _ in texts())
      start, stop = files.slice_range("files" + slice_, total)
    for i, text in enumerate(texts()):
      if stop is not None and i >= stop:
        break
      if i >= start:
        yield i, text

  return documents


def codec(config) -> tuple[Callable[[str], np.ndarray], Callable[..., str]]:
  """(encode: text -> ids, decode: ids -> text) of the configured tokenizer, for sampling."""
  tokenizer = text_corpus.load_tokenizer(config.data, hint=TOKENIZER_HINT)
  return tokenizer.encode, tokenizer.decode
