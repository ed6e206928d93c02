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

Block padding (`data.block_padding` L > 0, Block Transformer, Ho et al. 2024, Appendix H): the
examples are cut from a virtual padded stream in which document d gets r_d ~ uniform{0..L-1}
pad tokens before it and pads after it up to the next multiple of L, so every document starts
and ends on a block boundary and no block of L tokens holds two documents; a model then sees
prompts whose length is no multiple of L during training. Only r_d and the padded document
starts are kept (`block_layout`), drawn from a fixed seed so every run and restart sees the
same padding; a window is gathered from the tokens on demand (`padded_window`). Pads belong to
their document in `segment_ids`, and weights and words are 0 where the target is a pad.
"Concat" windows start at multiples of T (a multiple of L); "pack" places whole padded
documents into rows and cuts a longer one every T tokens, so its pieces stay block-aligned.
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
  tokens: np.ndarray  # uint16 (vocab <= 65536) or int32 [N]
  starts: np.ndarray  # int64 [D + 1]; document d is tokens[starts[d]:starts[d+1]], eos included

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


def pack_rows(starts: np.ndarray, row_len: int, step: int | None = None) -> np.ndarray:
  """[R, 2] (begin, end) stream ranges of rows of at most `row_len` tokens holding whole
  documents in order (next-fit); a longer document takes rows of its own, cut at row_len.

  With `step` < row_len a longer document's rows start every `step` tokens instead (for lm
  rows of T+1 tokens, step T keeps the pieces of a block-padded document block-aligned).
  """
  step = row_len if step is None else step
  rows = []
  begin = int(starts[0])
  for d in range(len(starts) - 1):
    a, b = int(starts[d]), int(starts[d + 1])
    if b - begin > row_len and a > begin:  # the document does not fit after what is there
      rows.append((begin, a))
      begin = a
    while b - begin > row_len:  # a document longer than a row
      rows.append((begin, begin + row_len))
      begin += step
  if len(starts) > 1 and begin < int(starts[-1]):
    rows.append((begin, int(starts[-1])))
  return np.asarray(rows, np.int64).reshape(-1, 2)


def block_layout(starts: np.ndarray, block: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(left [D], begins int64[D + 1]) of the block-padded stream: document d has left[d] pads
  (uniform in 0..block-1) and starts at begins[d], a multiple of `block`."""
  lengths = np.diff(np.asarray(starts, np.int64))
  left = np.random.default_rng(seed).integers(0, block, size=len(lengths))
  padded = (left + lengths + block - 1) // block * block
  begins = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(padded, out=begins[1:])
  # Small pad counts take a fraction of the memory on a corpus of many documents.
  return left.astype(np.min_scalar_type(block - 1)), begins


def padded_window(
  tokens: np.ndarray, starts: np.ndarray, layout: tuple[np.ndarray, np.ndarray], begin: int, end: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(ids int32, document, is_pad) of padded positions [begin, end) under `block_layout`."""
  left, begins = layout
  pos = np.arange(begin, end, dtype=np.int64)
  docs = np.searchsorted(begins, pos, side="right") - 1
  # Only the documents the window touches are read from `starts`, which may be memory-mapped.
  first_doc = int(docs[0])
  local = np.asarray(starts[first_doc : int(docs[-1]) + 2], np.int64)
  offset = pos - begins[docs] - left[docs]
  real = (offset >= 0) & (offset < np.diff(local)[docs - first_doc])
  ids = np.full(len(pos), pad_id, np.int32)
  count = int(real.sum())
  if count:
    # The real tokens of a window are one contiguous range of the unpadded stream (a document
    # is never empty: it holds its eos), so one slice reads them.
    i = int(np.argmax(real))
    source = int(local[docs[i] - first_doc] + offset[i])
    ids[real] = tokens[source : source + count]
  return ids, docs, ~real


class CorpusSequences:
  """Random-access fixed-length examples over a `Corpus`; see the module docstring."""

  def __init__(
    self,
    corpus: Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    packing: str = "concat",
    lm: bool = True,
    unit: str = "token",
    name: str = "corpus",
    block_padding: int = 0,
    padding_seed: int = 0,
  ):
    if packing not in PACKINGS:
      raise DataError(f"packing {packing!r} is not one of {PACKINGS}.")
    if block_padding < 0 or (block_padding and seq_len % block_padding):
      raise DataError(
        f"block_padding {block_padding} must be 0 or a positive divisor of the sequence length {seq_len}."
      )
    self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, seq_len
    self.packing, self.lm = packing, lm
    self.block_padding, self.padding_seed, self._layout = block_padding, padding_seed, None
    self.info = DataInfo(vocab_size=tokenizer.vocab_size, unit=unit, pad_id=tokenizer.pad_id)
    if packing != "pack":
      self.rows = None
    elif block_padding:
      self.rows = pack_rows(self.layout[1], seq_len + lm, step=seq_len)
    else:
      self.rows = pack_rows(corpus.starts, seq_len + lm)
    if len(self) == 0:
      padded = " (block-padded)" if block_padding else ""
      raise DataError(f"{name} holds {self.stream_len} tokens{padded}, fewer than one sequence of {seq_len + lm}.")

  @property
  def layout(self) -> tuple[np.ndarray, np.ndarray] | None:
    """`block_layout` of the corpus, or None without block padding; rebuilt after unpickling."""
    if self.block_padding and self._layout is None:
      self._layout = block_layout(self.corpus.starts, self.block_padding, self.padding_seed)
    return self._layout

  @property
  def stream_len(self) -> int:
    """Tokens in the stream the examples are cut from, block pads included."""
    return int(self.layout[1][-1]) if self.block_padding else len(self.corpus.tokens)

  def __getstate__(self):
    # The layout is O(documents) and follows from the seed, so it is not shipped to workers.
    return dict(self.__dict__, _layout=None)

  def __len__(self) -> int:
    if self.rows is not None:
      return len(self.rows)
    return max(0, (self.stream_len - self.lm) // self.seq_len)

  def _span(self, index: int) -> tuple[int, int]:
    if self.rows is not None:
      return int(self.rows[index, 0]), int(self.rows[index, 1])
    begin = index * self.seq_len
    return begin, begin + self.seq_len + self.lm

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    begin, end = self._span(check_index(index, len(self), "sequences"))
    length = self.seq_len + self.lm
    row = np.full(length, self.tokenizer.pad_id, np.int32)
    segments = np.zeros(length, np.int32)
    if self.block_padding:
      ids, docs, pads = padded_window(
        self.corpus.tokens, self.corpus.starts, self.layout, begin, end, self.tokenizer.pad_id
      )
    else:
      ids, docs, pads = self.corpus.tokens[begin:end], self.corpus.document_of(np.arange(begin, end)), None
    row[: end - begin] = ids
    segments[: end - begin] = docs - docs[0] + 1
    carries = segments > 0
    if pads is not None:
      carries[: end - begin] &= ~pads
    if not self.lm:
      return {"inputs": row, "weights": carries.astype(np.float32), "segment_ids": segments}
    inputs, targets = row[:-1], row[1:]
    # An input pad predicting a real token keeps its weight: the first token of a block-padded
    # document is predicted from the pads before it.
    real = carries[1:] & (segments[1:] == segments[:-1] if self.packing == "pack" else True)
    words = self.tokenizer.word_starts(inputs, targets) & real
    return {
      "inputs": inputs,
      "targets": targets,
      "weights": real.astype(np.float32),
      "segment_ids": segments[:-1],
      "words": words.astype(np.float32),
    }
