"""Ahead-of-time compilation with a memory estimate, before any state is allocated.

The trainer lowers and compiles its step from abstract shapes and shardings, then reads XLA's
buffer assignment for one device: the arguments (state and batch), the outputs, what the
donated state lets them share, and the temporaries. If that estimate exceeds the device's
memory, the run stops there, in the time a compile takes, with the numbers, instead of failing
to allocate minutes later (or, on a pod, after every host has loaded its data).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax

from lra_core.errors import ResourceError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of one compiled program, from XLA's buffer assignment."""
  arguments: int
  outputs: int
  aliased: int       # output buffers that reuse donated argument buffers
  temporaries: int
  code: int
  peak: int          # XLA's own peak when it reports one, else arguments + outputs - aliased + temporaries

  @classmethod
  def of(cls, compiled: jax.stages.Compiled) -> MemoryEstimate | None:
    stats = compiled.memory_analysis()
    if stats is None:
      return None
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    peak = max(int(getattr(stats, "peak_memory_in_bytes", 0) or 0), total)
    return cls(stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
               stats.temp_size_in_bytes, stats.generated_code_size_in_bytes, peak)

  def describe(self) -> str:
    return (f"{_gib(self.peak)} per device (arguments {_gib(self.arguments)}, outputs {_gib(self.outputs)}, "
            f"{_gib(self.aliased)} of them reusing donated inputs, temporaries {_gib(self.temporaries)})")


def device_memory_limit(device: jax.Device | None = None) -> tuple[int, str] | None:
  """(bytes one device may use, where the number comes from), or None if unknown.

  Accelerators report their allocator's limit. CPU devices share the host's memory, so each of
  the process's CPU devices gets an equal part of it.
  """
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind} memory"
  if device.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
    n = jax.local_device_count()
    return host // n, f"host memory / {n} CPU device(s)"
  return None


def compile_step(jitted, *abstract_args, name: str, limit_gib: float = 0.0) -> jax.stages.Compiled:
  """Lowers and compiles `jitted` for `abstract_args` and checks its memory estimate.

  limit_gib: the per-device budget; 0 takes the device's own limit (device_memory_limit).
  Raises ResourceError (one sentence with the estimate) when the estimate exceeds the budget.
  """
  t0 = time.perf_counter()
  compiled = jitted.lower(*abstract_args).compile()
  seconds = time.perf_counter() - t0
  estimate = MemoryEstimate.of(compiled)
  if estimate is None:
    logging.info("%s compiled in %.1f s (the backend gives no memory estimate)", name, seconds)
    return compiled
  limit = (int(limit_gib * GIB), "train.memory_limit_gib") if limit_gib > 0 else device_memory_limit()
  budget = f" of {_gib(limit[0])} ({limit[1]})" if limit else ""
  logging.info("%s compiled in %.1f s; memory %s%s", name, seconds, estimate.describe(), budget)
  if limit and estimate.peak > limit[0]:
    raise ResourceError(f"the {name} needs about {estimate.describe()}, more than the {_gib(limit[0])} "
                        f"available ({limit[1]}); use a smaller batch or model, more gradient "
                        "accumulation steps, or shard over more devices (mesh.fsdp / mesh.tensor).")
  return compiled


def _gib(n: int) -> str:
  return f"{n / GIB:.3f} GiB" if n >= GIB / 100 else f"{n / 2**20:.2f} MiB"
