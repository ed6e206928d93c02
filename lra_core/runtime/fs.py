"""Paths for workdirs, data folders and `train.init_from`: a local folder or an object store alike.

`fs.path("gs://bucket/run")` and `fs.path("runs/x")` both give an `etils.epath.Path`, so the same
code reads and writes JSON, metrics and checkpoints on a laptop and on a pod writing to a bucket.
Orbax and TensorStore write checkpoints to gs:// and s3:// natively; everything else (config.json,
metrics.jsonl, TensorBoard events, profiles) goes through epath, which reaches object stores with
the fsspec package of the scheme (or TensorFlow's gfile for gs:// when TensorFlow is installed).

Object stores have no append and no rename of folders, so writers that append locally
(metrics.jsonl, TensorBoard) rewrite whole objects there (lra_core.run.metrics); tools that only
write local files (the profiler) write to a local spool that `upload_tree` copies up.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

from etils import epath

from lra_core.errors import ConfigError

# Object-store schemes epath knows -> the packages that give it a filesystem (any one suffices)
# and the pip requirement to name when none is installed.
SCHEMES = {
  "gs": (("gcsfs", "tensorflow"), "gcsfs"),
  "s3": (("s3fs", "tensorflow"), "s3fs"),
  "az": (("adlfs",), "adlfs"),
  "hf": (("huggingface_hub",), "huggingface_hub"),
}

Path = epath.Path


def scheme(path: str | os.PathLike) -> str:
  """ "gs" for "gs://b/x", "" for a local path."""
  text = os.fspath(path)
  head, sep, _ = text.partition("://")
  return head if sep and head.isidentifier() else ""


def is_local(path: str | os.PathLike) -> bool:
  return not scheme(path)


def path(p: str | os.PathLike, *, what: str = "path") -> epath.Path:
  """An epath for `p`: local paths are expanded (~) and made absolute; object-store URLs need
  their filesystem package, else ConfigError with one sentence naming it. `what` names the setting
  in that sentence (e.g. "workdir")."""
  text = os.fspath(p)
  kind = scheme(text)
  if not kind:
    return epath.Path(pathlib.Path(text).expanduser().absolute())
  if kind not in SCHEMES:
    raise ConfigError(
      f"{what} {text!r} uses the scheme {kind}://, which lra_core cannot reach; use a local "
      f"path or one of {', '.join(s + '://' for s in SCHEMES)}."
    )
  modules, requirement = SCHEMES[kind]
  if not any(importlib.util.find_spec(m) is not None for m in modules):
    raise ConfigError(
      f"{what} {text!r} needs the {requirement} package for {kind}:// paths; install it with pip install {requirement}."
    )
  return epath.Path(text)


def create_exclusive(p: epath.Path, text: str) -> bool | None:
  """Writes `text` to `p` only where no object is there yet, in one request: True if written, False if
  one was there. On gs:// that is the store's own condition (`ifGenerationMatch=0`, through gcsfs), so
  two writers racing cannot both win; None where this store gives no such write (the caller falls back)."""
  if scheme(p) != "gs" or importlib.util.find_spec("gcsfs") is None:
    return None
  import fsspec

  try:
    fsspec.filesystem("gs").pipe_file(os.fspath(p), text.encode(), mode="create")
  except FileExistsError:  # gcsfs's name for the store's 412 Precondition Failed
    return False
  return True


def local_or_none(p: epath.Path) -> pathlib.Path | None:
  """The plain pathlib.Path of a local epath (for tools that only write local files), else None."""
  text = os.fspath(p)
  return None if scheme(text) else pathlib.Path(text)


def upload_tree(local: pathlib.Path, remote: epath.Path) -> None:
  """Copies the files under `local` to the same relative paths under `remote` (overwriting)."""
  for f in sorted(local.rglob("*")):
    if f.is_file():
      target = remote / f.relative_to(local).as_posix()
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(f.read_bytes())
