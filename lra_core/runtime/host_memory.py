"""Host memory that a step frees is kept for the next step instead of going back to the OS.

XLA on a CPU allocates each step's temporaries afresh and frees them when the step ends: 400 MiB
for a 2,048-token Transformer-VQ step at the sizes of scripts/authors_vq_bench.py, 1.5 GiB at
8,192. glibc's malloc serves blocks that large with fresh mmap()s (and returns freed heap tops
to the OS), so every step page-faults and zero-fills all of its temporaries again: 102,000 and
436,000 page faults a step, about 11% of the step, and a share that grows with the footprint.
`keep_freed_memory` tells glibc to serve every block from one heap and never hand freed memory
back (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD -1, M_ARENA_MAX 1): from the second step on a step
faults no page. The process then holds its peak memory until it exits, which a training or
benchmark process does anyway; and every thread shares one malloc arena, which makes XLA's compiles
about 20% slower (6.3 s against 7.7 s for that 2,048-token step). docs/benchmarks.md has the
measurements.

Every command applies it at start (`lra_core.cli.run`) when JAX can only run on the host's CPU
(`cpu_only`): with an accelerator the step's temporaries live in device memory, and only the
slower compiles would remain. LRA_CORE_KEEP_FREED_MEMORY=1 applies it anyway, 0 never. Nothing
changes where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import pkgutil
import sys

ENV = "LRA_CORE_KEEP_FREED_MEMORY"

# glibc's mallopt parameters (malloc.h) and the values that keep freed memory in the process.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
KEEP = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_ARENA_MAX, 1))


def _glibc() -> ctypes.CDLL | None:
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return None
  return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def cpu_only() -> bool:
  """Whether JAX in this process can only use the CPU, decided without starting JAX: JAX_PLATFORMS
  names cpu alone, or, when it is unset, no accelerator plugin (libtpu, a jax_plugins package) is
  installed."""
  platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return platforms == ["cpu"]
  if importlib.util.find_spec("libtpu") is not None:
    return False
  try:
    import jax_plugins
  except ImportError:
    return True
  return not any(pkgutil.iter_modules(jax_plugins.__path__))


def keep_freed_memory() -> bool:
  """Makes glibc keep freed memory for reuse (see the module) if LRA_CORE_KEEP_FREED_MEMORY says
  so (1), or, unset, if JAX can only use the CPU; True if it now does. Call it before JAX starts its
  backend: threads that already have their own malloc arena keep using it."""
  wanted = os.environ.get(ENV, "")
  if wanted == "0" or (wanted != "1" and not cpu_only()):
    return False
  libc = _glibc()
  if libc is None:
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in KEEP)
