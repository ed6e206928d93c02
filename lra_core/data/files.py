"""Locating dataset files, with errors that name the expected layout and how to get it,
tfds-style split slices such as "train[:90%]", and writing generated files whole (`atomic_text`,
with `Progress` lines for the long ones).

Data paths are `etils.epath` paths, so a data.dir may be a local folder or an object-store URL
(gs://bucket/enwik8) alike: loaders open files through epath or the helpers here, never through
the builtin open or pathlib (which turns gs://b into gs:/b).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import itertools
import os
import pathlib
import re
import secrets
import sys
from collections.abc import Iterator, Sequence
from typing import IO, TextIO

from etils import epath

from lra_core.errors import ConfigError, DataError
from lra_core.runtime import fs

_SLICE = re.compile(r"^(?P<name>[\w.-]+)(\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


def parse_split(spec: str) -> tuple[str, str | None, str | None]:
  """ "train[:90%]" -> ("train", None, "90%"); "test" -> ("test", None, None)."""
  m = _SLICE.match(spec.strip())
  if not m:
    raise ConfigError(
      f"split {spec!r} is not of the form name or name[start:stop] (counts or percentages, e.g. train[:90%])."
    )
  return m["name"], m["start"], m["stop"]


def _bound(value: str | None, n: int, default: int) -> int:
  if value is None:
    return default
  if value.endswith("%"):
    pct = int(value[:-1])
    if not -100 <= pct <= 100:
      raise ConfigError(f"split bound {value!r} is not a percentage in [-100%, 100%].")
    # Rounded like tfds: boundaries at round(n * pct / 100).
    index = int(round(n * abs(pct) / 100))
    return n - index if pct < 0 else index
  index = int(value)
  return max(0, n + index) if index < 0 else min(index, n)


def slice_range(spec: str, n: int) -> tuple[int, int]:
  """[start, stop) of `spec`'s slice over n examples (the whole range without a slice)."""
  _, start, stop = parse_split(spec)
  return _bound(start, n, 0), _bound(stop, n, n)


def expand(path: str | os.PathLike, *, what: str = "data.dir") -> epath.Path:
  """An epath for a data path: local ones with ~ expanded (relative ones stay relative), object-store
  URLs as given; a URL whose filesystem package is missing is a ConfigError naming `what`."""
  text = os.fspath(path)
  if fs.is_local(text):
    return epath.Path(os.path.expanduser(text))
  return fs.path(text, what=what)


def absolute(path: str | os.PathLike) -> str:
  """The absolute path of a local file or folder, or the URL of an object (for cache keys)."""
  text = os.fspath(path)
  return os.path.abspath(text) if fs.is_local(text) else text


def open_binary(path: str | os.PathLike) -> IO[bytes]:
  """A buffered binary stream over a local file or an object, cheap to read line by line (an object
  store's own file object copies a whole block for every line)."""
  f = epath.Path(path).open("rb")
  return f if fs.is_local(path) else io.BufferedReader(f, 1 << 20)


def open_text(path: str | os.PathLike, *, newline: str | None = None) -> IO[str]:
  """A UTF-8 text stream over a local file or an object, like open(path, encoding="utf-8")."""
  return io.TextIOWrapper(open_binary(path), encoding="utf-8", newline=newline)


def size(path: str | os.PathLike) -> int:
  """The size in bytes of a local file or an object."""
  return epath.Path(path).stat().length


def list_files(folder: str | os.PathLike) -> list[epath.Path]:
  """The files (not folders) directly inside a local folder or a gs:// one, in listing order."""
  folder = epath.Path(folder)
  if fs.is_local(folder):
    with os.scandir(folder) as entries:
      return [epath.Path(e.path) for e in entries if e.is_file()]
  return [p for p in folder.iterdir() if p.is_file()]


@contextlib.contextmanager
def atomic_text(path: str | os.PathLike, *, newline: str | None = None) -> Iterator[IO[str]]:
  """A UTF-8 text file opened for writing under a temporary name beside the local file `path`, renamed
  onto `path` when the block ends; an error or a Ctrl-C inside the block removes it instead, so `path`
  is either whole or as it was before (never a truncated file that a later run would read)."""
  target = pathlib.Path(path)
  # Same folder: a rename within one filesystem is atomic. The dot keeps the name out of globs; mode "x"
  # (not tempfile, which makes files 0600) gives the permissions a plain open gives.
  tmp = target.parent / f".{target.name}-{os.getpid()}-{secrets.token_hex(4)}.partial"
  try:
    with open(tmp, "x", newline=newline, encoding="utf-8") as f:
      yield f
    os.replace(tmp, target)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


class Progress:
  """Lines on stderr saying how far a long job of `total` items has got, one each time another
  `every` of it is done (lines, not a bar: they read the same in a log file)."""

  def __init__(self, total: int, what: str, *, every: float = 0.1, stream: TextIO | None = None):
    self.total, self.what, self.done = max(total, 1), what, 0
    self.step = max(1, int(self.total * every))
    self.stream = sys.stderr if stream is None else stream

  def advance(self, count: int = 1) -> None:
    before, self.done = self.done, self.done + count
    if self.done // self.step > before // self.step or self.done == self.total > before:
      print(f"{self.what}: {self.done:,} of {self.total:,} ({100 * self.done / self.total:.0f}%)", file=self.stream)


_READERS, _READ_AHEAD = 32, 4096  # threads, and files per batch, that `prefetch` reads objects with


def prefetch(paths: Sequence[str | os.PathLike]) -> Iterator[bytes | None]:
  """The content of each path in order, read ahead by threads when the files are objects in a bucket
  (one request per file, so reading 10^5 small images one at a time is slow); None for local files
  (the caller reads them itself) and for missing objects (opening them raises the usual error)."""
  if not paths or fs.is_local(paths[0]):
    yield from itertools.repeat(None, len(paths))
    return

  def read(path):
    try:
      return epath.Path(path).read_bytes()
    except FileNotFoundError:
      return None

  with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:
    for start in range(0, len(paths), _READ_AHEAD):
      yield from pool.map(read, paths[start : start + _READ_AHEAD])


def require_dir(data_dir: str, *, field: str = "data.dir", layout: str, prepare: str) -> epath.Path:
  """The configured folder; a one-sentence error naming the layout and how to get it otherwise."""
  if not data_dir:
    raise ConfigError(f"{field} is empty; expected a folder with {layout} ({prepare}).")
  folder = expand(data_dir, what=field)
  if not folder.is_dir():
    raise DataError(f"{field} {str(folder)!r} is not a folder; expected {layout} ({prepare}).")
  return folder


def require_files(folder: str | os.PathLike, pattern: str, *, layout: str, prepare: str) -> list[epath.Path]:
  """Sorted files matching `pattern` under `folder`, or a DataError naming what was expected."""
  folder = epath.Path(folder)
  files = sorted(p for p in folder.glob(pattern) if p.is_file())
  if not files:
    raise DataError(f"no files match {str(folder / pattern)!r}; expected {layout} ({prepare}).")
  return files


def require_file(path: str | os.PathLike, *, layout: str, prepare: str) -> epath.Path:
  path = epath.Path(path)
  if not path.is_file():
    raise DataError(f"{str(path)!r} does not exist; expected {layout} ({prepare}).")
  if size(path) == 0:
    raise DataError(f"{str(path)!r} is empty; expected {layout} ({prepare}).")
  return path


SOURCES = ("files", "tfds")


def check_release_or_tfds(data, locate, *, tfds_name: str, prepare: str) -> None:
  """`data.source` is known, and its data is there: the release files `locate(data.dir)` finds,
  or (tfds) a data.dir that is a folder, when one is given."""
  if data.source not in SOURCES:
    raise ConfigError(f"data.source {data.source!r} is not one of {SOURCES}.")
  if data.source == "files":
    locate(data.dir)
  elif data.dir and not expand(data.dir).is_dir():
    raise DataError(
      f"data.dir {data.dir!r} is not a folder; expected the tfds data_dir holding {tfds_name} ({prepare})."
    )
