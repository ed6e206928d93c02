r"""Tokenizers for text corpora (PG-19, C4) and the SentencePiece training command.

`data.tokenizer` names one:
  "bytes"          UTF-8 bytes, id = byte + 2 (pad 0, eos 1), vocabulary 258;
  "<path>.model"   a SentencePiece model, e.g. one trained by this module (BPE 32k for PG-19,
                   as Transformer-VQ) or a user's own (T5's C4 vocabulary, Gemma's); it must define
                   eos. A model that defines bos (Gemma's, Llama's) starts each document with it, as
                   Hugging Face's tokenizers for those models do. It may be an object in a bucket
                   (gs://...), loaded from its bytes.
  "<path>.json"    a Hugging Face tokenizer.json (lra_core/data/hf_tokenizer.py: GPT-NeoX's BPE,
                   Gemma's), its eos named by the folder's tokenizer_config.json; a local file.

Train one (pad 0, eos 1, unk 2, no bos, as T5 and Transformer-VQ number them), then inspect it:

  python -m lra_core.data.tokenizer --train --input=/data/pg19/train \
      --model_prefix=/data/pg19/spm_bpe32k --vocab_size=32000
  python -m lra_core.data.tokenizer --model=/data/pg19/spm_bpe32k.model --encode="some text"

`--input` takes folders (every *.txt below them), .txt files and C4 .json(.gz) shards (their
"text" fields), comma-separated; they and `--model_prefix` may be gs:// paths.

Every tokenizer also says which tokens begin a whitespace-separated word (`word_starts`), so an
evaluation can report word-level perplexity (Rae et al. 2020: total loss / number of words).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from etils import epath

from lra_core import cli
from lra_core.data import files
from lra_core.data.hf_tokenizer import HFTokenizer
from lra_core.errors import ConfigError, DataError, UserError
from lra_core.runtime import fs

WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")


@functools.cache
def _byte_separators() -> np.ndarray:
  """True for ids of whitespace bytes and for pad/eos, which separate documents like whitespace."""
  table = np.zeros(ByteTokenizer.vocab_size, bool)
  table[[b + ByteTokenizer.offset for b in WHITESPACE]] = True
  table[[ByteTokenizer.pad_id, ByteTokenizer.eos_id]] = True
  return table


class ByteTokenizer:
  """UTF-8 bytes shifted by 2: pad 0, eos 1, byte b -> b + 2."""

  offset = 2
  pad_id, eos_id = 0, 1
  vocab_size = 256 + offset

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

  def decode(self, ids) -> str:
    ids = np.asarray(ids, np.int64).reshape(-1)
    ids = ids[ids >= self.offset] - self.offset
    if ids.size and ids.max() > 255:
      raise DataError(f"id {int(ids.max()) + self.offset} is outside the byte vocabulary [0, {self.vocab_size}).")
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def word_starts(self, previous: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether token ids[t] (preceded by previous[t]) is the first byte of a word."""
    table = _byte_separators()
    return ~table[ids] & table[previous]

  def fingerprint(self) -> str:
    return "bytes+2"


class SentencePieceTokenizer:
  """A SentencePiece model file; it must define an eos piece."""

  def __init__(self, path: str):
    import sentencepiece as spm

    path = os.path.expanduser(path)
    file = files.expand(path, what="data.tokenizer")
    if not file.is_file():
      raise DataError(
        f"SentencePiece model {path!r} does not exist; train one with "
        f"`python -m lra_core.data.tokenizer --train --input=... --model_prefix=...`."
      )
    # SentencePiece reads only local files: a model in a bucket is loaded from its bytes.
    self._proto = None if fs.is_local(path) else file.read_bytes()
    try:
      if self._proto is None:
        self.sp = spm.SentencePieceProcessor(model_file=path)
      else:
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
    except (OSError, RuntimeError) as e:
      raise DataError(f"SentencePiece model {path!r} cannot be read ({e}).") from e
    self.path = path
    self.vocab_size = self.sp.get_piece_size()
    self.eos_id = self.sp.eos_id()
    self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else 0
    self.bos = [self.sp.bos_id()] if self.sp.bos_id() >= 0 else []  # ours and T5's define none
    if self.eos_id < 0:
      raise DataError(f"SentencePiece model {path!r} has no eos piece; documents need one to be concatenated.")
    pieces = [self.sp.id_to_piece(i) for i in range(self.vocab_size)]
    self._word_table = np.array([p.startswith("\u2581") for p in pieces], bool)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.bos + self.sp.encode(text), np.int32)

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(self.bos + ids, np.int32) for ids in self.sp.encode(list(texts), num_threads=os.cpu_count())]

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self.sp.decode([i for i in ids if 0 <= i < self.vocab_size and i != self.pad_id])

  def word_starts(self, previous: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Pieces that begin with the word-boundary mark begin a word; the context is not needed."""
    del previous
    return self._word_table[ids]

  def fingerprint(self) -> str:
    kind = "spm+bos:" if self.bos else "spm:"  # documents encoded before bos was prepended are not reused
    if self._proto is not None:
      return kind + hashlib.sha256(self._proto).hexdigest()[:16]
    with open(self.path, "rb") as f:
      return kind + hashlib.sha256(f.read()).hexdigest()[:16]


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HFTokenizer


@functools.lru_cache(maxsize=8)
def _load(spec: str, mtime_ns: int) -> Tokenizer:
  del mtime_ns
  return HFTokenizer(spec) if spec.endswith(".json") else SentencePieceTokenizer(spec)


def make_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer `data.tokenizer` names: "bytes", a SentencePiece .model path or a tokenizer.json."""
  if spec == "bytes":
    return ByteTokenizer()
  if not spec:
    raise ConfigError(
      "data.tokenizer is empty; expected 'bytes', the path of a SentencePiece .model file or a tokenizer.json."
    )
  path = os.path.expanduser(spec)
  if path.endswith(".json") and not fs.is_local(path):
    raise ConfigError(f"data.tokenizer {spec!r}: a Hugging Face tokenizer.json is read from a local path only.")
  if fs.is_local(path):
    return _load(path, os.stat(path).st_mtime_ns if os.path.exists(path) else 0)
  file = files.expand(path, what="data.tokenizer")
  return _load(path, file.stat().mtime if file.is_file() else 0)


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], *, batch: int = 64) -> Iterator[np.ndarray]:
  """Token ids of each text (no eos), encoding `batch` texts per call where the tokenizer can."""
  if not hasattr(tokenizer, "encode_many"):
    yield from (tokenizer.encode(t) for t in texts)
    return
  pending = []
  for text in texts:
    pending.append(text)
    if len(pending) == batch:
      yield from tokenizer.encode_many(pending)
      pending = []
  if pending:
    yield from tokenizer.encode_many(pending)


# --------------------------------------------------------------------------- training


def iter_text_files(inputs: Sequence[str]) -> Iterator[epath.Path]:
  """Files named by --input (local or gs://): folders expand to every *.txt, *.json.gz and *.json
  below them."""
  for item in inputs:
    path = files.expand(item, what="--input")
    if path.is_dir():
      found = sorted(p for p in _files_below(path) if _kind(p))
      if not found:
        raise DataError(f"folder {str(path)!r} holds no .txt or .json(.gz) files.")
      yield from found
    elif path.is_file():
      if not _kind(path):
        raise DataError(f"{str(path)!r} is neither a .txt nor a .json(.gz)/.jsonl(.gz) file.")
      yield path
    else:
      raise DataError(f"--input {item!r} does not exist.")


def _files_below(folder: epath.Path) -> Iterator[epath.Path]:
  if fs.is_local(folder):
    yield from (epath.Path(p) for p in pathlib.Path(folder).rglob("*") if p.is_file())
    return
  for path in folder.iterdir():
    if path.is_dir():
      yield from _files_below(path)
    elif path.is_file():
      yield path


def _kind(path: epath.Path) -> str:
  name = path.name.lower()
  if name.endswith(".txt"):
    return "txt"
  if name.endswith((".json", ".json.gz", ".jsonl", ".jsonl.gz")):
    return "json"
  return ""


def iter_lines(paths: Iterable[str | os.PathLike]) -> Iterator[str]:
  """Non-empty lines of text files, and lines of the "text" field of JSON-lines files."""
  for path in map(epath.Path, paths):
    if _kind(path) == "txt":
      with io.TextIOWrapper(files.open_binary(path), encoding="utf-8", errors="replace") as f:
        yield from (line.rstrip("\n") for line in f if line.strip())
      continue
    with files.open_binary(path) as raw:
      stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
      with io.TextIOWrapper(stream, encoding="utf-8") as f:
        yield from _json_lines(f, path)


def _json_lines(f, path: epath.Path) -> Iterator[str]:
  """The non-empty lines of the "text" field of each JSON line of `f` (the file `path`)."""
  for line_no, line in enumerate(f, start=1):
    if not line.strip():
      continue
    try:
      text = json.loads(line)["text"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise DataError(f"line {line_no} of {str(path)!r} is not a JSON object with a 'text' field.") from e
    yield from (part for part in text.split("\n") if part.strip())


def train(
  inputs: Sequence[str],
  model_prefix: str,
  *,
  vocab_size: int = 32000,
  model_type: str = "bpe",
  input_sentence_size: int = 10_000_000,
  character_coverage: float = 1.0,
  seed: int = 0,
) -> str:
  """Trains a SentencePiece model on the lines of `inputs`; returns the .model path. A gs://
  model_prefix is trained in a local temporary folder and copied up."""
  import sentencepiece as spm

  found = list(iter_text_files(inputs))
  target = files.expand(model_prefix, what="--model_prefix")
  with tempfile.TemporaryDirectory(prefix="spm-") as spool:
    # SentencePiece writes only local files.
    out = pathlib.Path(os.fspath(target)) if fs.is_local(target) else pathlib.Path(spool) / target.name
    out.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)  # which lines are sampled, when there are more than enough
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter_lines(found),
      model_prefix=str(out),
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      input_sentence_size=input_sentence_size,
      shuffle_input_sentence=True,
      pad_id=0,
      eos_id=1,
      unk_id=2,
      bos_id=-1,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
    )
    if not fs.is_local(target):
      for suffix in (".model", ".vocab"):
        (target.parent / (target.name + suffix)).write_bytes(out.with_name(out.name + suffix).read_bytes())
  return str(target) + ".model"


def main(argv: Sequence[str] | None = None) -> int:
  parser = cli.doc_parser("python -m lra_core.data.tokenizer", __doc__)
  parser.add_argument("--train", action="store_true", help="train a SentencePiece model")
  parser.add_argument("--input", default="", help="comma-separated folders / .txt / .json(.gz) files")
  parser.add_argument("--model_prefix", default="", help="output: <prefix>.model and <prefix>.vocab")
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument("--model_type", default="bpe", choices=["bpe", "unigram", "char", "word"])
  parser.add_argument(
    "--input_sentence_size", type=int, default=10_000_000, help="lines sampled for training (0 = all)"
  )
  parser.add_argument("--character_coverage", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--model", default="", help="a .model file to inspect with --encode")
  parser.add_argument("--encode", default=None, help="text to encode with --model")
  args = parser.parse_args(argv)
  try:
    if args.train:
      if not args.input or not args.model_prefix:
        raise ConfigError("--train needs --input and --model_prefix.")
      start = time.time()
      path = train(
        args.input.split(","),
        args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        input_sentence_size=args.input_sentence_size,
        character_coverage=args.character_coverage,
        seed=args.seed,
      )
      tok = SentencePieceTokenizer(path)
      print(f"wrote {path}: {args.model_type} vocabulary {tok.vocab_size} in {time.time() - start:.1f} s")
    elif args.encode is not None:
      tok = make_tokenizer(args.model or "bytes")
      ids = tok.encode(args.encode)
      print(" ".join(map(str, ids.tolist())))
      print(f"{len(ids)} tokens; decodes to {tok.decode(ids)!r}")
    else:
      parser.error("give --train, or --encode with --model.")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except RuntimeError as e:  # SentencePiece reports bad settings (e.g. vocab too large) this way
    print(f"error: SentencePiece training failed: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
