"""The persistent compilation cache: a restarted or resumed run loads its compiled steps instead of
compiling them again (minutes for a large model on a pod).

`train.compile_cache`:
  auto   $LRA_CORE_CACHE/jax_compile when that variable is set, else `<workdir parent>/.jax_compile_cache`
         (a gs:// folder when the workdir is one, shared by the runs of a sweep)
  off    no persistent cache
  PATH   that folder (local or an object store)

A cache folder set outside the config (JAX_COMPILATION_CACHE_DIR or jax.config) is left as it is.
Only compiles that take at least JAX's `jax_persistent_cache_min_compile_time_secs` (1 s by default) are kept.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from lra_core import fs

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


def setup(setting: str, workdir) -> str | None:
  """Turns the cache on as `setting` says (unless a folder is already configured); returns the folder in use."""
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return configured
  folder = folder_for(setting, workdir)
  if folder is None:
    return None
  jax.config.update("jax_compilation_cache_dir", folder)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use a cache: decide again
  logging.info("persistent compilation cache: %s", folder)
  return folder
