"""A Hugging Face `tokenizer.json` (the `tokenizers` package: the `hf` extra) as a `data.tokenizer`.

A model folder's tokenizer.json holds the whole pipeline (normaliser, pre-tokeniser, model, the
post-processor that adds special tokens), so its ids are the ones Hugging Face's fast tokenizer gives
with its defaults (`add_special_tokens`: Gemma's <bos>, nothing for GPT-NeoX). Which token ends a
document is not in tokenizer.json: the folder's tokenizer_config.json (or special_tokens_map.json)
names it as `eos_token`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from lra_core.errors import ConfigError, DataError

# a piece that begins a whitespace-separated word: byte-level BPE's space mark, SentencePiece's
WORD_MARKS = ("\u0120", "\u2581")


class HFTokenizer:
  """tokenizer.json at `path`, with the eos and pad tokens its folder's configs name."""

  def __init__(self, path: str):
    try:
      import tokenizers
    except ImportError as e:
      raise ConfigError(
        f"data.tokenizer {path!r} is a Hugging Face tokenizer.json: install the hf extra (pip install -e \".[hf]\")."
      ) from e
    if not os.path.isfile(path):
      raise DataError(f"Hugging Face tokenizer {path!r} does not exist.")
    try:
      self.tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises its own Exception subclass for a damaged file
      raise DataError(f"Hugging Face tokenizer {path!r} cannot be read ({str(e).splitlines()[0]}).") from e
    self.path = path
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    special = _special_tokens(os.path.dirname(path))
    self.eos_id = self._id(special.get("eos_token"), "eos_token")
    pad = special.get("pad_token")
    self.pad_id = self._id(pad, "pad_token") if pad else self.eos_id
    vocab = self.tok.get_vocab(with_added_tokens=True)
    self._word_table = np.zeros(self.vocab_size, bool)
    for piece, i in vocab.items():
      self._word_table[i] = piece.startswith(WORD_MARKS)

  def _id(self, token: str | None, what: str) -> int:
    i = None if token is None else self.tok.token_to_id(token)
    if i is None:
      raise DataError(
        f"Hugging Face tokenizer {self.path!r}: its folder's tokenizer_config.json names no {what} in the "
        f"vocabulary ({token!r}); documents need one to be concatenated."
      )
    return i

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tok.encode(text).ids, np.int32)

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self.tok.encode_batch(list(texts))]

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size and i != self.pad_id])

  def word_starts(self, previous: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Pieces that begin with a word mark begin a word; the context is not needed."""
    del previous
    return self._word_table[ids]

  def fingerprint(self) -> str:
    with open(self.path, "rb") as f:
      return "hf:" + hashlib.sha256(f.read()).hexdigest()[:16] + f":eos{self.eos_id}"


def _special_tokens(folder: str) -> dict[str, str]:
  """{"eos_token": ..., "pad_token": ...} as the folder's tokenizer_config.json, or else its
  special_tokens_map.json, names them (a token may be written as {"content": ...})."""
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      try:
        config = json.loads(open(path, encoding="utf-8").read())
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} cannot be read as JSON ({e}).") from e
      out = {}
      for key in ("eos_token", "pad_token"):
        value = config.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
      if out.get("eos_token"):
        return out
  return {}
