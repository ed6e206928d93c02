"""A content-keyed on-disk cache of derived arrays (token streams, decoded pixels).

Reading a real distribution format is often slow (tokenising PG-19, decompressing ImageNet64
npz files), so a loader converts it once into a raw `.npy` array and memory-maps that on every
later start. The key holds everything the array depends on (source files with their sizes,
mtimes and content samples, tokenizer, settings), so a changed input builds a new entry; writes are atomic, so
processes that race on the same entry all end up reading one complete file. The cache is always
a local folder; the inputs may be objects in a bucket (gs://...), keyed by URL, size and mtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import pathlib
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from etils import epath

from lra_core.errors import ConfigError
from lra_core.runtime import fs


def cache_root(configured: str = "") -> pathlib.Path:
  """`configured`, else $LRA_CORE_CACHE, else ~/.cache/lra_core; always a local folder."""
  root = configured or os.environ.get("LRA_CORE_CACHE", "") or "~/.cache/lra_core"
  if not fs.is_local(root):
    raise ConfigError(
      f"data.cache_dir {root!r} is not a local folder; the cache holds memory-mapped arrays, "
      f"so set it (or $LRA_CORE_CACHE) to a local path such as ~/.cache/lra_core."
    )
  return pathlib.Path(root).expanduser()


_RECORDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("data files read", default=None)


@contextlib.contextmanager
def recording_files() -> Iterator[dict[str, list]]:
  """{path: [size, mtime, content sample]} of every file `file_fingerprint` reads inside it: the data files a run's
  sources were built from, which its checkpoints keep so that a resume notices a changed one
  (lra_core/run/data_setup.py check_data_files)."""
  found: dict[str, list] = {}
  token = _RECORDING.set(found)
  try:
    yield found
  finally:
    _RECORDING.reset(token)


SAMPLE_BYTES = 4096  # read at a file's start, middle and end for its content sample


def file_fingerprint(paths: Sequence[str | os.PathLike]) -> list[tuple[str, int, int, str]]:
  """(absolute path, size, mtime_ns, content sample) of each file: enough to notice a rewritten input,
  also one rewritten in place with its size and mtime kept (`touch -r`, a copy that keeps times): the
  sample is a digest of SAMPLE_BYTES at the file's start, middle and end (three reads, whatever its
  size). An object in a bucket gives (URL, size, mtime in seconds, ""): its store gives every rewrite a
  new time, and a read per object would cost a request each. Inside `recording_files` each is recorded."""
  out = []
  for p in paths:
    text = os.fspath(p)
    if fs.is_local(text):
      stat = os.stat(text)
      out.append((os.path.abspath(text), stat.st_size, stat.st_mtime_ns, _sample(text, stat.st_size)))
    else:
      stat = epath.Path(text).stat()
      out.append((text, int(stat.length), int(stat.mtime), ""))
  recording = _RECORDING.get()
  if recording is not None:
    recording.update({path: [size, mtime, sample] for path, size, mtime, sample in out})
  return out


def _sample(path: str, size: int) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
      h.update(os.pread(f.fileno(), SAMPLE_BYTES, offset))
  return h.hexdigest()[:16]


def digest(key) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def staging_folder(final: pathlib.Path) -> pathlib.Path:
  """A new empty folder beside `final`, to be renamed onto it once complete, with the permissions a
  plain mkdir gives (tempfile makes it 0700: renamed into a shared $LRA_CORE_CACHE, that locked every
  other user out), and where the folder it goes into is group-writable (a cache shared by a group),
  group-writable too, its group kept for what is made inside (setgid): another user of the group can
  add to it and replace it."""
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
  mode = 0o777 & ~_umask()
  if final.parent.stat().st_mode & stat.S_IWGRP:
    mode |= stat.S_IRWXG | stat.S_ISGID
  tmp.chmod(mode)
  return tmp


def _umask() -> int:
  mask = os.umask(0o022)  # reading it means setting it: put it straight back
  os.umask(mask)
  return mask


def unreadable(folder: pathlib.Path, e: OSError) -> ConfigError:
  """The one sentence for a cache entry this user may not read (another user's, not shared)."""
  return ConfigError(
    f"the data cache {folder} cannot be read ({e.strerror}); it belongs to another user: ask them to make it "
    "readable (chmod -R g+rX), or set data.cache_dir (or $LRA_CORE_CACHE) to a folder of your own."
  )


def cached_arrays(
  name: str, key, build: Callable[[], dict[str, np.ndarray]], *, root: str = ""
) -> dict[str, np.ndarray]:
  """The arrays `build()` returns, stored under <root>/<name>-<digest(key)>/ and memory-mapped.

  `build` runs only when the entry is missing; every array comes back read-only.
  """
  folder = cache_root(root) / f"{name}-{digest(key)}"
  done = folder / "key.json"
  try:
    return _cached_arrays(folder, done, key, build)
  except PermissionError as e:
    raise unreadable(folder, e) from e


def _cached_arrays(folder: pathlib.Path, done: pathlib.Path, key, build) -> dict[str, np.ndarray]:
  if not done.is_file():
    arrays = build()
    try:
      _store(folder, done, key, arrays)
    except PermissionError as e:  # a cache this user reads but may not add to (another user's, shared)
      _warn_unwritable(folder.parent, e)
      return {field: _read_only(value) for field, value in arrays.items()}
  return {f.stem: np.load(f, mmap_mode="r", allow_pickle=False) for f in sorted(folder.glob("*.npy"))}


_WARNED: set[str] = set()


def _warn_unwritable(root: pathlib.Path, e: OSError) -> None:
  if str(root) not in _WARNED:
    _WARNED.add(str(root))
    logging.warning("%s What it lacks is built in memory at every start.", unwritable(root, e))


def unwritable(root: pathlib.Path, e: OSError) -> ConfigError:
  """The one sentence for a cache folder this user reads but may not add to (another user's, shared)."""
  return ConfigError(
    f"the data cache {root} takes no new entries ({e.strerror or type(e).__name__}): ask its owner to make it "
    "group-writable (chmod -R g+ws), or set data.cache_dir (or $LRA_CORE_CACHE) to a folder of your own."
  )


def _read_only(value) -> np.ndarray:
  out = np.asarray(value).view()
  out.flags.writeable = False
  return out


def _store(folder: pathlib.Path, done: pathlib.Path, key, arrays: dict) -> None:
  """`arrays` written as the entry `folder`, whole or not at all."""
  folder.parent.mkdir(parents=True, exist_ok=True)
  tmp = staging_folder(folder)
  try:
    for field, value in arrays.items():
      np.save(tmp / f"{field}.npy", np.ascontiguousarray(value), allow_pickle=False)
    (tmp / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str) + "\n")
    try:
      os.rename(tmp, folder)  # atomic; fails if another process got there first
    except OSError:
      if not done.is_file():
        raise
  finally:
    if tmp.exists():
      for f in tmp.iterdir():
        f.unlink()
      tmp.rmdir()
