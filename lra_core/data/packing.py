"""Documents -> one token stream -> fixed-length training sequences.

A `Corpus` is every document of a split tokenized and concatenated, each followed by eos:
`tokens[starts[d]:starts[d+1]]` is document d with its eos. It is built once per (files,
tokenizer) and kept in the on-disk cache (`cache.py`), so a later start only memory-maps it.

Two ways to cut the stream into examples of T tokens (`data.packing`):

  "concat"  window i is tokens [i*T, i*T + T] (T+1 tokens; targets = inputs shifted by one), so
            sequences run across document boundaries as in Transformer-XL / Transformer-VQ
            training on PG-19. Every position carries loss.
  "pack"    whole documents are placed one after another into rows (next-fit, in stream order;
            a document longer than a row is cut into row-sized pieces), the rest of a row is
            padding. Loss weight is 0 on padding and where the target lies in another
            document than the input, so no document is predicted from another's end.

Both give per-position `segment_ids` (1 for the first document in the row, 2 for the next, ...,
0 on padding) so a model can stop attention at document boundaries, and `words`: 1 where the
target token begins a whitespace-separated word, for word-level perplexity. Masked-LM rows
(`lm=False`) are T tokens of inputs without targets; the mlm task masks them on device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from lra_core.data import DataInfo, check_index
from lra_core.data.tokenizer import Tokenizer, encode_documents
from lra_core.errors import DataError

PACKINGS = ("concat", "pack")


@dataclasses.dataclass
class Corpus:
  tokens: np.ndarray   # uint16 (vocab <= 65536) or int32 [N]
  starts: np.ndarray   # int64 [D + 1]; document d is tokens[starts[d]:starts[d+1]], eos included

  @property
  def num_documents(self) -> int:
    return len(self.starts) - 1

  def document_of(self, positions: np.ndarray) -> np.ndarray:
    """Index of the document holding each stream position."""
    return np.searchsorted(self.starts, positions, side="right") - 1


def build_corpus(texts: Iterable[str], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
  """Tokenizes and concatenates documents, each followed by eos; arrays for `Corpus(**...)`."""
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
  pieces, starts, total = [], [0], 0
  eos = np.asarray([tokenizer.eos_id], dtype)
  for ids in encode_documents(tokenizer, texts):
    pieces.append(np.asarray(ids, dtype))
    pieces.append(eos)
    total += len(ids) + 1
    starts.append(total)
  tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
  return {"tokens": tokens, "starts": np.asarray(starts, np.int64)}


def pack_rows(starts: np.ndarray, row_len: int) -> np.ndarray:
  """[R, 2] (begin, end) stream ranges of rows of at most `row_len` tokens holding whole
  documents in order (next-fit); a longer document takes rows of its own, cut at row_len."""
  rows = []
  begin = int(starts[0])
  for d in range(len(starts) - 1):
    a, b = int(starts[d]), int(starts[d + 1])
    if b - begin > row_len and a > begin:   # the document does not fit after what is there
      rows.append((begin, a))
      begin = a
    while b - begin > row_len:              # a document longer than a row
      rows.append((begin, begin + row_len))
      begin += row_len
  if len(starts) > 1 and begin < int(starts[-1]):
    rows.append((begin, int(starts[-1])))
  return np.asarray(rows, np.int64).reshape(-1, 2)


class CorpusSequences:
  """Random-access fixed-length examples over a `Corpus`; see the module docstring."""

  def __init__(self, corpus: Corpus, tokenizer: Tokenizer, seq_len: int, *, packing: str = "concat",
               lm: bool = True, unit: str = "token", name: str = "corpus"):
    if packing not in PACKINGS:
      raise DataError(f"packing {packing!r} is not one of {PACKINGS}.")
    self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, seq_len
    self.packing, self.lm = packing, lm
    self.info = DataInfo(vocab_size=tokenizer.vocab_size, unit=unit, pad_id=tokenizer.pad_id)
    self.rows = pack_rows(corpus.starts, seq_len + lm) if packing == "pack" else None
    if len(self) == 0:
      raise DataError(f"{name} holds {len(corpus.tokens)} tokens, fewer than one sequence of "
                      f"{seq_len + lm}.")

  def __len__(self) -> int:
    if self.rows is not None:
      return len(self.rows)
    return max(0, (len(self.corpus.tokens) - self.lm) // self.seq_len)

  def _span(self, index: int) -> tuple[int, int]:
    if self.rows is not None:
      return int(self.rows[index, 0]), int(self.rows[index, 1])
    begin = index * self.seq_len
    return begin, begin + self.seq_len + self.lm

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    begin, end = self._span(check_index(index, len(self), "sequences"))
    length = self.seq_len + self.lm
    row = np.full(length, self.tokenizer.pad_id, np.int32)
    row[:end - begin] = self.corpus.tokens[begin:end]
    docs = self.corpus.document_of(np.arange(begin, end))
    segments = np.zeros(length, np.int32)
    segments[:end - begin] = docs - docs[0] + 1
    if not self.lm:
      return {"inputs": row, "weights": (segments > 0).astype(np.float32), "segment_ids": segments}
    inputs, targets = row[:-1], row[1:]
    real = (segments[1:] > 0) & (segments[1:] == segments[:-1] if self.packing == "pack" else True)
    words = self.tokenizer.word_starts(inputs, targets) & real
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": real.astype(np.float32),
        "segment_ids": segments[:-1],
        "words": words.astype(np.float32),
    }
