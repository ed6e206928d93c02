"""PG-19 (Rae et al. 2020): language modelling over whole Project Gutenberg books.

Sources (`data.source`):

  "files"  the release layout of gs://deepmind-gutenberg under `data.dir` (a local folder, or a
           gs:// folder holding a copy):
             <dir>/train/<id>.txt, <dir>/validation/<id>.txt, <dir>/test/<id>.txt   UTF-8 books
             <dir>/metadata.csv   no header; one `id,short_book_title,publication_date,url` per book
  "tfds"   tfds `pg19` 0.1.1 (features book_text, book_id, book_title, publication_date,
           book_link) prepared in array_record format under `data.tfds_dir`.

Every book needs its metadata.csv line, as the tfds builder requires. Each book is stripped of
surrounding whitespace, as the tfds builder does, so both sources give the same documents.
Books are tokenized with `data.tokenizer` ("bytes", or a SentencePiece .model such as the BPE 32k
vocabulary Transformer-VQ learned on the train split:
`python -m lra_core.data.tokenizer --train --input=<dir>/train --model_prefix=<dir>/spm_bpe32k`;
its normalizer turns line breaks into spaces) and concatenated, each followed by eos: in id
order from files, in stored order from tfds. The token stream of a split is built once and
memory-mapped from the cache afterwards. Metrics are per "byte" with the bytes tokenizer (the
one eos per book counts as a byte) and per "token" otherwise.

Examples (`packing.CorpusSequences`, `data.packing` "concat" or "pack", documents padded to whole
blocks with `data.block_padding`), T = train.seq_len:

  lm   inputs, targets int32[T]; weights, words float32[T]; segment_ids int32[T]
  mlm  inputs int32[T]; weights float32[T]; segment_ids int32[T]

`words` marks targets that begin a whitespace-separated word: total loss / number of words is
the word-level perplexity PG-19 results quote (Rae et al. 2020), reported as `word_perplexity`.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable

import ml_collections
import numpy as np
from etils import epath

from lra_core.data import cache, config_section, files, tfds_source
from lra_core.data.text import TextSource, check_settings, corpus_source, load_tokenizer, tfds_fingerprint
from lra_core.dataset_record import Dataset
from lra_core.errors import DataError

# Metrics count SentencePiece tokens, or bytes with data.tokenizer="bytes" (lra_core.data.text).
DATASET = Dataset(name="pg19", unit="token", tasks=("lm", "mlm"), packed_documents=True)

TFDS_NAME = "pg19"
METADATA = "metadata.csv"
METADATA_FIELDS = ("id", "short_book_title", "publication_date", "url")
LAYOUT = "the PG-19 release layout <dir>/{train,validation,test}/<id>.txt with <dir>/metadata.csv"
PREPARE = (
  "copy it with `gsutil -m cp -r gs://deepmind-gutenberg/* <dir>`, or set data.source=tfds "
  "with a tfds pg19 prepared in array_record format"
)
TOKENIZER_HINT = (
  "python -m lra_core.data.tokenizer --train --input=<dir>/train --model_prefix=<dir>/spm_bpe32k --vocab_size=32000"
)
# Bumped when the text that reaches the tokenizer changes, so old cache entries are not reused.
_FORMAT = 1

_DEFAULTS = dict(
  name=DATASET.name,
  dir="",  # release layout (source "files"); relative tokenizer paths resolve here
  source="files",  # files | tfds
  tfds_dir="",  # tfds data_dir holding pg19/0.1.1 (source "tfds"); "" -> ~/tensorflow_datasets
  tokenizer="bytes",  # "bytes" or a SentencePiece .model path
  packing="concat",  # concat | pack (see lra_core/data/packing.py)
  document_mask="auto",  # auto | true | false: attention and positions stop at document boundaries;
  # auto = on for "pack" rows, off for "concat" windows (lra_core.data.document_mask)
  block_padding=0,  # L > 0: 0..L-1 random pads before each document, pads after it to a multiple
  # of L (Block Transformer, App. H); train.seq_len % L == 0; 0 is off
  cache_dir="",  # token streams; "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
)


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


# ----------------------------------------------------------------------------- release files


def book_files(data_dir: str, split: str) -> list[epath.Path]:
  """The `<dir>/<split>/<id>.txt` books of a split, in increasing id order."""
  root = files.require_dir(data_dir, layout=LAYOUT, prepare=PREPARE)
  paths = files.require_files(root, f"{split}/*.txt", layout=LAYOUT, prepare=PREPARE)
  for path in paths:
    if not path.stem.isdigit():
      raise DataError(f"book file {str(path)!r} is not named <id>.txt with its Gutenberg id; expected {LAYOUT}.")
  return sorted(paths, key=lambda p: int(p.stem))


def read_metadata(data_dir: str) -> dict[int, tuple[str, str, str]]:
  """metadata.csv as {id: (short_book_title, publication_date, url)}; the file has no header."""
  root = files.require_dir(data_dir, layout=LAYOUT, prepare=PREPARE)
  path = files.require_file(root / METADATA, layout=LAYOUT, prepare=PREPARE)
  out = {}
  with files.open_text(path, newline="") as f:
    for line_no, row in enumerate(csv.reader(f), start=1):
      if not row:
        continue
      if len(row) < len(METADATA_FIELDS) or not row[0].strip().isdigit():
        raise DataError(
          f"line {line_no} of {str(path)!r} is not `{','.join(METADATA_FIELDS)}` with an "
          f"integer id (the file has no header row)."
        )
      # A title with an unquoted comma spills into the next fields; the url is always last.
      out[int(row[0])] = (",".join(row[1:-2]), row[-2], row[-1])
  if not out:
    raise DataError(f"{str(path)!r} lists no books; expected one `{','.join(METADATA_FIELDS)}` line per book.")
  return out


def check_metadata(data_dir: str, books: Iterable[epath.Path], metadata: dict) -> None:
  missing = [p for p in books if int(p.stem) not in metadata]
  if missing:
    raise DataError(
      f"book {str(missing[0])!r} has no line in {str(files.expand(data_dir) / METADATA)!r} "
      f"({len(missing)} books have none); expected one line per book in {LAYOUT}."
    )


def read_book(path: epath.Path) -> str:
  try:
    with files.open_text(path) as f:
      return f.read().strip()
  except UnicodeDecodeError as e:
    raise DataError(f"book {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}).") from e


# ----------------------------------------------------------------------------- dataset interface


def validate_config(config) -> None:
  """Settings, the tokenizer file and the release layout (or tfds preparation), before any work."""
  check_settings(config)
  data = config.data
  if data.source == "files":
    books = {split: book_files(data.dir, split) for split in DATASET.splits}
    metadata = read_metadata(data.dir)
    for paths in books.values():
      check_metadata(data.dir, paths, metadata)
  else:
    for split in DATASET.splits:
      tfds_source.open_split(TFDS_NAME, split, data.tfds_dir)
  load_tokenizer(data, hint=TOKENIZER_HINT)


def make_source(config, split: str) -> TextSource:
  """Fixed-length sequences over the concatenated books of `split`."""
  DATASET.check_split(split)
  check_settings(config)
  data = config.data
  tokenizer = load_tokenizer(data, hint=TOKENIZER_HINT)
  if data.source == "files":
    paths = book_files(data.dir, split)
    check_metadata(data.dir, paths, read_metadata(data.dir))
    key = dict(format=_FORMAT, source="files", files=cache.file_fingerprint(paths))
    where = str(files.expand(data.dir) / split)

    def documents():
      for path in paths:
        yield int(path.stem), read_book(path)
  else:
    records = tfds_source.open_split(TFDS_NAME, split, data.tfds_dir)
    key = dict(format=_FORMAT, source="tfds", split=split, files=tfds_fingerprint(records, split))
    where = f"tfds {TFDS_NAME} {split} in {records.dataset_info.data_dir}"

    def documents():
      for i in range(len(records)):
        record = records[i]
        yield int(record["book_id"]), tfds_source.text(record["book_text"])

  return corpus_source(config, f"pg19-{split}", key, documents, tokenizer=tokenizer, where=where, unit_name="books")


def codec(config) -> tuple[Callable[[str], np.ndarray], Callable[..., str]]:
  """(encode: text -> ids, decode: ids -> text) of the configured tokenizer, for sampling."""
  tokenizer = load_tokenizer(config.data, hint=TOKENIZER_HINT)
  return tokenizer.encode, tokenizer.decode
