"""Host memory that a step frees is kept for the next step instead of going back to the OS.

XLA on a CPU allocates each step's temporaries afresh and frees them when the step ends: 400 MiB
for a 2,048-token Transformer-VQ step at the sizes of scripts/authors_vq_bench.py, 1.5 GiB at
8,192. glibc's malloc serves blocks that large with fresh mmap()s (and returns freed heap tops
to the OS), so every step page-faults and zero-fills all of its temporaries again: 102,000 and
436,000 page faults a step, about 11% of the step, and a share that grows with the footprint.
`keep_freed_memory` tells glibc to serve every block from one heap and never hand freed memory
back (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD -1, M_ARENA_MAX 1): from the second step on a step
faults no page. The process then holds its peak memory until it exits, which a training or
benchmark process does anyway. docs/benchmarks.md has the measurement.

Every command applies it at start (`lra_core.cli.run`); LRA_CORE_KEEP_FREED_MEMORY=0 leaves the
allocator as it is. Nothing changes where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
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


def keep_freed_memory() -> bool:
  """Makes glibc keep freed memory for reuse (see the module); True if it now does. Call it before
  JAX starts its backend: threads that already have their own malloc arena keep using it."""
  if os.environ.get(ENV, "1") == "0":
    return False
  libc = _glibc()
  if libc is None:
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in KEEP)
