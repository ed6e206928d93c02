"""The persistent compilation cache: a restarted or resumed run loads its compiled steps instead of
compiling them again (minutes for a large model on a pod).

`train.compile_cache`:
  auto   $LRA_CORE_CACHE/jax_compile when that variable is set, else `<workdir parent>/.jax_compile_cache`
         (a gs:// folder when the workdir is one, shared by the runs of a sweep)
  off    no persistent cache
  PATH   that folder (local or an object store)

A cache folder set outside the config (JAX_COMPILATION_CACHE_DIR or jax.config) is left as it is, and
a cache turned off there (JAX_ENABLE_COMPILATION_CACHE=false) stays off. A multi-process run keeps its
entries in a subfolder `<N>_processes` of the folder (`setup`).
Only compiles that take at least JAX's `jax_persistent_cache_min_compile_time_secs` (1 s by default) are kept.

Entries are written whole (`write_whole`): the processes of a run and the runs of a sweep share the
folder and compile the same steps at the same moment, and JAX writes an entry in place, so another
process could read a half-written executable, or two writers interleave into one.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
from jax._src import lru_cache as jax_lru_cache
from jax.experimental.compilation_cache import compilation_cache

from lra_core.runtime import fs

FOLDER = "jax_compile"


def folder_for(setting: str, workdir) -> str | None:
  """The cache folder `train.compile_cache` asks for with `workdir`, or None for "off"."""
  if setting == "off":
    return None
  if setting != "auto":
    return os.fspath(fs.path(setting, what="train.compile_cache"))
  if os.environ.get("LRA_CORE_CACHE"):
    return os.fspath(fs.path(os.environ["LRA_CORE_CACHE"]) / FOLDER)
  return os.fspath(fs.path(workdir, what="workdir").parent / ".jax_compile_cache")


_JAX_PUT = jax_lru_cache.LRUCache.put
_SUFFIX = getattr(jax_lru_cache, "_CACHE_SUFFIX", "-cache")  # how JAX names an entry's file


def _put_whole(self, key: str, value: bytes) -> None:
  """JAX's LRUCache.put, the entry written under a temporary name and renamed onto its own (atomic in a
  local folder; an object store's objects appear whole anyway). With a size cap JAX's own put runs: it
  holds a file lock around its write."""
  if self.eviction_enabled or not key:
    return _JAX_PUT(self, key, value)
  final = self.path / f"{key}{_SUFFIX}"
  if final.exists():
    return
  tmp = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
  try:
    tmp.write_bytes(value)
  except PermissionError as e:  # a shared cache this user reads but may not add to: said once, not per program
    if str(self.path) not in _UNWRITABLE:
      _UNWRITABLE.add(str(self.path))
      logging.warning(
        "the compile cache %s takes no new programs (%s): this run compiles what it lacks; ask its owner to make "
        "it group-writable (chmod -R g+ws), or set train.compile_cache to a folder of your own",
        self.path,
        e.strerror or type(e).__name__,
      )
    return
  tmp.replace(final)  # a racing writer of the same key put the same program: either copy stands


_UNWRITABLE: set[str] = set()


def write_whole() -> None:
  """Makes the persistent cache write each entry whole (the module docstring); idempotent."""
  jax_lru_cache.LRUCache.put = _put_whole


def setup(setting: str, workdir) -> str | None:
  """Turns the cache on as `setting` says (unless a folder is already configured); returns the folder in use."""
  write_whole()
  if not jax.config.jax_enable_compilation_cache:  # turned off in JAX's own config (JAX_ENABLE_COMPILATION_CACHE)
    return None
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return configured
  folder = folder_for(setting, workdir)
  if folder is None:
    return None
  if jax.process_count() > 1:
    # A multi-process client's executables carry its cross-process collectives: each process count keeps
    # its entries apart, so that no run reads back a program compiled for another count of processes.
    folder = os.fspath(fs.path(folder) / f"{jax.process_count()}_processes")
  jax.config.update("jax_compilation_cache_dir", folder)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use a cache: decide again
  logging.info("persistent compilation cache: %s", folder)
  return folder
