"""A content-keyed on-disk cache of derived arrays (token streams, decoded pixels).

Reading a real distribution format is often slow (tokenising PG-19, decompressing ImageNet64
npz files), so a loader converts it once into a raw `.npy` array and memory-maps that on every
later start. The key holds everything the array depends on (source files with their sizes and
mtimes, tokenizer, settings), so a changed input builds a new entry; writes are atomic, so
processes that race on the same entry all end up reading one complete file. The cache is always
a local folder; the inputs may be objects in a bucket (gs://...), keyed by URL, size and mtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import pathlib
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
def recording_files() -> Iterator[dict[str, list[int]]]:
  """{path: [size, mtime]} of every file `file_fingerprint` reads inside it: the data files a run's
  sources were built from, which its checkpoints keep so that a resume notices a changed one
  (lra_core/run/data_setup.py check_data_files)."""
  found: dict[str, list[int]] = {}
  token = _RECORDING.set(found)
  try:
    yield found
  finally:
    _RECORDING.reset(token)


def file_fingerprint(paths: Sequence[str | os.PathLike]) -> list[tuple[str, int, int]]:
  """(absolute path, size, mtime_ns) of each file: enough to notice a rewritten input. An object
  in a bucket gives (URL, size, mtime in seconds), the precision its store reports. Inside
  `recording_files` each is recorded too."""
  out = []
  for p in paths:
    text = os.fspath(p)
    if fs.is_local(text):
      stat = os.stat(text)
      out.append((os.path.abspath(text), stat.st_size, stat.st_mtime_ns))
    else:
      stat = epath.Path(text).stat()
      out.append((text, int(stat.length), int(stat.mtime)))
  recording = _RECORDING.get()
  if recording is not None:
    recording.update({path: [size, mtime] for path, size, mtime in out})
  return out


def digest(key) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def staging_folder(final: pathlib.Path) -> pathlib.Path:
  """A new empty folder beside `final`, to be renamed onto it once complete, with the permissions a
  plain mkdir gives (tempfile makes it 0700: renamed into a shared $LRA_CORE_CACHE, that locked every
  other user out)."""
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
  tmp.chmod(0o777 & ~_umask())
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
    folder.parent.mkdir(parents=True, exist_ok=True)
    arrays = build()
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
  return {f.stem: np.load(f, mmap_mode="r", allow_pickle=False) for f in sorted(folder.glob("*.npy"))}
