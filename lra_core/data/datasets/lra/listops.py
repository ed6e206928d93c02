"""ListOps (Long Range Arena): a seeded generator, the TSV loader and the dataset source.

An expression is a tree of operators over digits, e.g. `[MAX 2 9 [MIN 4 7 ] 0 ]` = 9; the
task is to classify its value (10 classes) from up to 2000 tokens. Files use the official
format (`basic_{train,val,test}.tsv`, header `Source<TAB>Target`, CRLF), where the source
writes every node as nested binary pairs, `( ( ( [MAX 2 ) 9 ) ] )`. The loader applies the
LRA preprocessing (`]` -> `X`, drop `(` `)`, split on whitespace) with a fixed sorted
vocabulary instead of LRA's set order, which changed with PYTHONHASHSEED.

  python -m lra_core.data.datasets.lra.listops generate --out DIR [--num_train N ... --seed S]
  python -m lra_core.data.datasets.lra.listops stats DIR/basic_val.tsv [...]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import random
import shutil
import time
from typing import Iterator, Sequence

import ml_collections
import numpy as np
from etils import epath

from lra_core import cli
from lra_core.data import DataInfo, cache, check_index, config_section, files, labelled_example
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

DATASET = Dataset(name="listops", unit="token", tasks=("classify",))

log = logging.getLogger(__name__)

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")  # order matters: random.choice draws from it
VALUE_P = 0.25  # a node below max_depth is a digit with probability 1 - VALUE_P

# Fixed: id 0 is padding, then the 15 model tokens in Python sort order ("X" < "[").
VOCAB = ("<pad>",) + tuple(sorted([str(d) for d in range(10)] + list(OPERATORS) + ["X"]))
VOCAB_SIZE = len(VOCAB)
NUM_CLASSES = 10
_TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB) if i}
_LABELS = frozenset(str(i) for i in range(NUM_CLASSES))
_DIGITS = range(10)

SPLIT_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
HEADER = ("Source", "Target")
GENERATOR_FIELDS = ("seed", "num_train", "num_val", "num_test", "max_depth", "max_args", "min_length", "max_length")
# Bumped whenever generated files would change for the same settings: part of the cache key.
_GENERATOR_VERSION = 1
# Attempts in a row without a new expression before settings are declared (nearly) impossible.
_PATIENCE = 1_000_000

# ----------------------------------------------------------------------------- generator


def _apply(op: str, values: list[int]) -> int:
  if op == "[MIN":
    return min(values)
  if op == "[MAX":
    return max(values)
  if op == "[SM":
    return sum(values) % 10
  values = sorted(values)
  mid = len(values) // 2
  # Same as int(np.median(values)): the mean of the middle pair, truncated.
  return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) // 2


def random_tree(rng: random.Random, max_depth: int, max_args: int) -> tuple[list[str], int, int]:
  """Draws one expression, consuming `rng` exactly like the official `generate_tree(1, ...)`.

  Returns (raw tokens of the official string form, length in model tokens, value). The walk
  keeps its own stack, so any max_depth is safe.
  """
  tokens: list[str] = []
  open_nodes: list[list] = []  # [depth, children still to draw, op slot in tokens, child values]
  depth, length = 1, 0
  while True:
    if (rng.random() if depth < max_depth else 1.0) > VALUE_P:
      value = rng.choice(_DIGITS)
      tokens.append(str(value))
      length += 1
      while open_nodes:  # hand the finished subtree to its parent, closing parents as they fill
        node = open_nodes[-1]
        node[3].append(value)
        tokens.append(")")
        node[1] -= 1
        if node[1]:
          break
        op = rng.choice(OPERATORS)  # drawn after the children, as the official generator does
        tokens[node[2]] = op
        tokens += ("]", ")")
        value = _apply(op, node[3])
        open_nodes.pop()
      else:
        return tokens, length, value
      depth = open_nodes[-1][0] + 1
    else:
      num_args = rng.randint(2, max_args)
      # ((...((op c0) c1)...) cn) ]) opens num_args + 1 pairs before the operator.
      tokens += ["("] * (num_args + 1)
      open_nodes.append([depth, num_args, len(tokens), []])
      tokens.append("")
      length += 2
      depth += 1


def check_generator_settings(
  *,
  num_train: int,
  num_val: int,
  num_test: int,
  max_depth: int,
  max_args: int,
  min_length: int,
  max_length: int,
  seed: int = 0,
) -> None:
  """Raises ConfigError for settings that cannot produce the requested examples."""
  del seed
  for name, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
    if value < 1:
      raise ConfigError(f"data.{name} {value} must be a positive number of examples.")
  if max_depth < 1:
    raise ConfigError(f"data.max_depth {max_depth} must be at least 1.")
  if max_args < 2:
    raise ConfigError(f"data.max_args {max_args} must be at least 2 (an operator takes 2 or more).")
  if min_length + 1 >= max_length:
    raise ConfigError(
      f"data.min_length {min_length} must be below data.max_length {max_length}"
      " - 1 (lengths are kept strictly between them)."
    )
  longest = 1
  for _ in range(max_depth - 1):
    longest = min(2 + max_args * longest, max_length)  # capped: only the comparison matters
  if longest <= min_length:
    raise ConfigError(
      f"data.min_length {min_length} is not below the longest expression "
      f"{longest} that max_depth {max_depth} and max_args {max_args} allow."
    )


def sample_expressions(
  num: int, *, seed: int = 0, max_depth: int = 10, max_args: int = 10, min_length: int = 500, max_length: int = 2000
) -> Iterator[tuple[str, int]]:
  """Yields `num` distinct (source string, label) pairs with min_length < length < max_length."""
  rng = random.Random(seed)
  seen: set[bytes] = set()
  misses = 0
  while len(seen) < num:
    tokens, length, value = random_tree(rng, max_depth, max_args)
    if min_length < length < max_length:
      source = " ".join(tokens)
      # A digest instead of the string keeps memory small for 100k expressions of ~7 KB.
      key = hashlib.blake2b(source.encode(), digest_size=16).digest()
      if key not in seen:
        seen.add(key)
        misses = 0
        yield source, value
        continue
    misses += 1
    if misses >= _PATIENCE:
      raise ConfigError(
        f"only {len(seen)} distinct expressions found of the {num} requested "
        f"after {_PATIENCE} tries; widen data.min_length/max_length or raise "
        "data.max_depth/max_args."
      )


def generate_files(
  out_dir: str | os.PathLike,
  *,
  num_train: int = 96000,
  num_val: int = 2000,
  num_test: int = 2000,
  max_depth: int = 10,
  max_args: int = 10,
  min_length: int = 500,
  max_length: int = 2000,
  seed: int = 0,
  progress: bool = False,
) -> None:
  """Writes basic_{train,val,test}.tsv: the first num_train expressions drawn go to train, etc. Each
  file appears only once whole (files.atomic_text); `progress` prints how far it has got on stderr."""
  settings = dict(
    num_train=num_train,
    num_val=num_val,
    num_test=num_test,
    max_depth=max_depth,
    max_args=max_args,
    min_length=min_length,
    max_length=max_length,
    seed=seed,
  )
  check_generator_settings(**settings)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  examples = sample_expressions(
    num_train + num_val + num_test,
    seed=seed,
    max_depth=max_depth,
    max_args=max_args,
    min_length=min_length,
    max_length=max_length,
  )
  for split, count in (("train", num_train), ("validation", num_val), ("test", num_test)):
    shown = files.Progress(count, f"writing {out / SPLIT_FILES[split]}") if progress else None
    with files.atomic_text(out / SPLIT_FILES[split], newline="") as f:
      writer = csv.writer(f, delimiter="\t")  # default "\r\n" line ends, as in the official files
      writer.writerow(HEADER)
      for _ in range(count):
        writer.writerow(next(examples))
        if shown is not None:
          shown.advance()


BYTES_PER_TOKEN = 5.5  # of the TSV files, source and target: measured over 320 expressions of 500-2000 tokens


def expected_bytes(count: int, min_length: int, max_length: int) -> float:
  """About how many bytes `generate_files` writes for `count` expressions (the defaults: 0.7 GB)."""
  return count * (min_length + max_length) / 2 * BYTES_PER_TOKEN


# ----------------------------------------------------------------------------- loader


def _model_tokens(source: str) -> list[str]:
  return source.replace("]", "X").replace("(", "").replace(")", "").split()


def encode(text: str) -> list[int]:
  """Source string (official form, parentheses optional) -> token ids, with no padding."""
  try:
    return [_TOKEN_ID[tok] for tok in _model_tokens(text)]
  except KeyError as e:
    raise DataError(f"token {e.args[0]!r} is not in the ListOps vocabulary {VOCAB[1:]}.") from None


def decode(ids: Sequence[int] | np.ndarray) -> str:
  """Token ids -> space-separated model tokens (`]` shown as X), padding dropped."""
  return " ".join(VOCAB[i] for i in np.asarray(ids).reshape(-1).tolist() if i)


@dataclasses.dataclass(frozen=True)
class Examples:
  """One TSV file: example i is tokens[offsets[i]:offsets[i + 1]] with label labels[i]."""

  tokens: np.ndarray  # uint8[sum of lengths]
  offsets: np.ndarray  # int64[N + 1]
  labels: np.ndarray  # uint8[N]

  def __len__(self) -> int:
    return len(self.labels)

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)


def load_tsv(path: str | os.PathLike) -> Examples:
  """Reads one ListOps TSV in the official format (a local file or gs://...), raising DataError at
  the first bad line."""
  path = files.expand(path, what="ListOps file")
  if not path.is_file():
    raise DataError(f"ListOps file {path} does not exist.")
  chunks, lengths, labels = [], [], []
  try:
    with files.open_text(path, newline="") as f:
      header = f.readline().rstrip("\r\n")
      if not header:
        raise DataError(f"ListOps file {path} is empty; expected a header line 'Source<TAB>Target'.")
      if tuple(header.split("\t")) != HEADER:
        raise DataError(f"{path} line 1: header {header!r} is not 'Source<TAB>Target'.")
      for lineno, line in enumerate(f, start=2):
        line = line.rstrip("\r\n")
        if not line:
          continue
        fields = line.split("\t")
        if len(fields) != 2:
          raise DataError(f"{path} line {lineno}: found {len(fields)} tab-separated fields, expected 2.")
        source, target = fields
        if target.strip() not in _LABELS:
          raise DataError(f"{path} line {lineno}: label {target!r} is not an integer in 0..9.")
        tokens = _model_tokens(source)
        if not tokens:
          raise DataError(f"{path} line {lineno}: the expression has no tokens.")
        try:
          ids = np.fromiter(map(_TOKEN_ID.__getitem__, tokens), np.uint8, len(tokens))
        except KeyError as e:
          raise DataError(
            f"{path} line {lineno}: token {e.args[0]!r} is not in the ListOps vocabulary {VOCAB[1:]}."
          ) from None
        chunks.append(ids)
        lengths.append(len(ids))
        labels.append(int(target))
  except UnicodeDecodeError as e:  # random bytes, or a binary file under the TSV's name
    raise DataError(
      f"ListOps file {path} is not UTF-8 text (byte {e.start} of a read block); expected a TSV."
    ) from None
  if not labels:
    raise DataError(f"ListOps file {path} has a header but no examples.")
  offsets = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  return Examples(np.concatenate(chunks), offsets, np.asarray(labels, np.uint8))


class Source:
  """ListOps examples for `classify`, padded with 0 (and truncated, as LRA does) to seq_len T."""

  info = DataInfo(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, unit=DATASET.unit, vocab=VOCAB)

  def __init__(self, path: str | os.PathLike, seq_len: int):
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
      raise ConfigError(f"train.seq_len {seq_len!r} must be a positive integer.")
    self.path = files.expand(path, what="ListOps file")
    self.seq_len = int(seq_len)
    cache.file_fingerprint([path])  # a run's data files, kept with its checkpoints (cache.recording_files)
    self.examples = load_tsv(path)
    truncated = int(np.sum(self.examples.lengths > seq_len))
    if truncated:
      log.warning(
        "%s: %d of %d ListOps examples are longer than seq_len %d and are truncated.",
        self.path,
        truncated,
        len(self.examples),
        seq_len,
      )

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """-> inputs int32[T], mask bool[T] (True = real token), targets int32[], weights float32[]."""
    index = check_index(index, len(self.examples))
    start, stop = self.examples.offsets[index : index + 2]
    stop = min(stop, start + self.seq_len)
    inputs = np.zeros(self.seq_len, np.int32)
    inputs[: stop - start] = self.examples.tokens[start:stop]
    return labelled_example(inputs, inputs != 0, self.examples.labels[index])


# ----------------------------------------------------------------------------- config


_DEFAULTS = dict(
  name=DATASET.name,
  dir="",  # folder holding basic_{train,val,test}.tsv (local or gs://)
  generate=False,  # with dir "": generate the set below once into cache_dir and use it
  cache_dir="",  # "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
  seed=0,
  num_train=96000,
  num_val=2000,
  num_test=2000,
  max_depth=10,
  max_args=10,
  min_length=500,
  max_length=2000,
)


def data_config(**overrides) -> ml_collections.ConfigDict:
  """The `config.data` section for ListOps; defaults are the official generator's flags."""
  return config_section(_DEFAULTS, overrides)


def _generator_settings(data) -> dict[str, int]:
  return {k: data.get(k, _DEFAULTS[k]) for k in GENERATOR_FIELDS}


def cache_folder(data) -> pathlib.Path:
  """Where `data.generate` puts the set: one subfolder per generator setting."""
  key = json.dumps(dict(_generator_settings(data), version=_GENERATOR_VERSION), sort_keys=True)
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  return cache.cache_root(data.cache_dir) / f"listops-{digest}"


def _has_files(folder: pathlib.Path) -> bool:
  return all((folder / name).is_file() for name in SPLIT_FILES.values())


def ensure_generated(data) -> pathlib.Path:
  """Generates the set described by `data` into its cache folder unless it is there already."""
  final = cache_folder(data)
  try:
    if _has_files(final):
      return final
  except PermissionError as e:
    raise cache.unreadable(final, e) from e
  settings = _generator_settings(data)
  start = time.time()
  try:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.staging_folder(final)
  except PermissionError as e:  # a shared cache this user may read but not add to
    raise cache.unwritable(final.parent, e) from e
  try:
    generate_files(tmp, **settings)
    (tmp / "generator.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    try:
      os.rename(tmp, final)  # atomic; fails if another process already put its copy there
    except OSError:
      if not _has_files(final):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  log.info(
    "Generated ListOps %d/%d/%d examples into %s in %.0f s.",
    settings["num_train"],
    settings["num_val"],
    settings["num_test"],
    final,
    time.time() - start,
  )
  return final


def _folder(data) -> epath.Path:
  if data.get("dir", ""):
    return files.expand(data.dir)
  if data.get("generate", False):
    return ensure_generated(data)
  raise DataError(
    "data.dir is empty and data.generate is False; set data.dir to a folder with "
    "basic_{train,val,test}.tsv or data.generate=True."
  )


def validate_config(config) -> None:
  """Raises ConfigError/DataError for a ListOps config that cannot work, before any work."""
  data = config.data
  check_generator_settings(**_generator_settings(data))
  if data.get("dir", ""):
    folder = files.expand(data.dir)
    missing = [name for name in SPLIT_FILES.values() if not (folder / name).is_file()]
    if missing:
      raise DataError(f"data.dir {str(folder)!r} lacks the ListOps file(s) {missing}.")
  elif not data.get("generate", False):
    _folder(data)  # raises the "set data.dir or data.generate=True" error


def make_source(config, split: str) -> Source:
  """The ListOps `split` ("train", "validation", "test") per config.data and train.seq_len."""
  DATASET.check_split(split)
  validate_config(config)
  return Source(_folder(config.data) / SPLIT_FILES[split], config.train.seq_len)


# ----------------------------------------------------------------------------- command line


def describe(examples: Examples) -> str:
  """Example count, token lengths (min / mean / median / max) and the label fractions."""
  lengths = examples.lengths
  fractions = np.bincount(examples.labels, minlength=NUM_CLASSES) / len(examples)
  return (
    f"{len(examples)} examples; length min {lengths.min()} / mean {lengths.mean():.1f} / "
    f"median {np.median(lengths):g} / max {lengths.max()}; labels "
    + " ".join(f"{i}:{p:.3f}" for i, p in enumerate(fractions))
  )


GENERATOR_HELP = dict(
  seed="seed of the expression draw",
  num_train="examples in basic_train.tsv",
  num_val="examples in basic_val.tsv",
  num_test="examples in basic_test.tsv",
  max_depth="deepest operator nesting",
  max_args="most arguments of one operator",
  min_length="expressions are longer than this many tokens",
  max_length="expressions are shorter than this many tokens",
)


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.doc_parser("python -m lra_core.data.datasets.lra.listops", __doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  gen = commands.add_parser("generate", help="write basic_{train,val,test}.tsv into --out")
  gen.add_argument("--out", required=True, help="folder to write the three files into")
  for name in GENERATOR_FIELDS:
    shown = f"{GENERATOR_HELP[name]} (default: %(default)s)"
    gen.add_argument(f"--{name}", type=int, default=_DEFAULTS[name], help=shown)
  stats = commands.add_parser("stats", help="print size, token lengths and labels of TSV files")
  stats.add_argument("files", nargs="+")
  args = parser.parse_args(argv)
  # A UserError is one line and status 2, a Ctrl-C one line and status 130, as for every command.
  cli.run(lambda: _command(args))


def _command(args: argparse.Namespace) -> None:
  if args.command == "generate":
    total = args.num_train + args.num_val + args.num_test
    size = expected_bytes(total, args.min_length, args.max_length)
    print(
      f"writing {total:,} expressions of {args.min_length}-{args.max_length} tokens to {args.out}: "
      f"about {size / 1e6:,.0f} MB",
      flush=True,
    )
    start = time.time()
    generate_files(args.out, progress=True, **{name: getattr(args, name) for name in GENERATOR_FIELDS})
    took = time.time() - start
    print(f"wrote {args.num_train}/{args.num_val}/{args.num_test} examples to {args.out} in {took:.1f} s")
  else:
    for path in args.files:
      print(f"{path}: {describe(load_tsv(path))}")


def codec(config):
  """(encode, decode) of this dataset's fixed vocabulary, for sampling (any config)."""
  return encode, decode


if __name__ == "__main__":
  main()
