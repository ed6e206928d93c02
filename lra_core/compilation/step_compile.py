"""The train step compiled ahead of time, from abstract shapes, with its per-device memory checked first.

The trainer lowers and compiles its step from abstract shapes and shardings, then reads XLA's
buffer assignment for one device: the arguments (state and batch), the outputs, what the
donated state lets them share, and the temporaries. If that estimate exceeds the device's
memory, the run stops there, in the time a compile takes, with the numbers, instead of failing
to allocate minutes later (or, on a pod, after every host has loaded its data). A GPU's memory is
the part JAX preallocates, XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set) of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import jax

from lra_core.cost import chips
from lra_core.errors import ConfigError, ResourceError
from lra_core.run.steps import make_train_step

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of one compiled program, from XLA's buffer assignment."""

  arguments: int
  outputs: int
  aliased: int  # output buffers that reuse donated argument buffers
  temporaries: int
  code: int
  peak: int  # XLA's own peak when it reports one, else arguments + outputs - aliased + temporaries

  @classmethod
  def of(cls, compiled: jax.stages.Compiled) -> MemoryEstimate | None:
    stats = compiled.memory_analysis()
    if stats is None:
      return None
    total = (
      stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )
    peak = max(int(getattr(stats, "peak_memory_in_bytes", 0) or 0), total)
    return cls(
      stats.argument_size_in_bytes,
      stats.output_size_in_bytes,
      stats.alias_size_in_bytes,
      stats.temp_size_in_bytes,
      stats.generated_code_size_in_bytes,
      peak,
    )

  def describe(self) -> str:
    return (
      f"{size(self.peak / GIB)} per device (arguments {size(self.arguments / GIB)}, outputs "
      f"{size(self.outputs / GIB)}, {size(self.aliased / GIB)} of them reusing donated inputs, temporaries "
      f"{size(self.temporaries / GIB)})"
    )


def device_memory_limit(device: jax.Device | None = None) -> tuple[int, str] | None:
  """(bytes one device may use, where the number comes from), or None if unknown.

  Accelerators report their allocator's limit. CPU devices share the host's memory, so each of
  the process's CPU devices gets an equal part of it.
  """
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  except (jax.errors.JaxRuntimeError, RuntimeError, NotImplementedError):
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind} memory"
  chip = chips.chip_of(device)
  if chip is not None and device.platform == "gpu":  # a compile-only GPU: what JAX would preallocate
    fraction = gpu_memory_fraction()
    return int(chip.hbm_bytes * fraction), f"{chip.name} memory x XLA_PYTHON_CLIENT_MEM_FRACTION {fraction:g}"
  if chip is not None:  # a device without a runtime (a TPU topology's): its HBM
    return chip.hbm_bytes, f"{chip.name} HBM"
  if device.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
    n = jax.local_device_count()
    return host // n, f"host memory / {n} CPU device(s)"
  return None


DEFAULT_GPU_MEMORY_FRACTION = 0.75  # JAX's preallocation when XLA_PYTHON_CLIENT_MEM_FRACTION is unset


def gpu_memory_fraction() -> float:
  """The share of a GPU's memory a JAX process may use: JAX's allocator takes
  XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 unless set) and no more."""
  text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
  if not text:
    return DEFAULT_GPU_MEMORY_FRACTION
  try:
    fraction = float(text)
  except ValueError:
    fraction = math.nan
  if not 0 < fraction <= 1:
    raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a fraction in (0, 1].")
  return fraction


def jit_train_step(config, spec, task, tx, schedule):
  """The trainer's train step, jitted as the trainer runs it: the state donated, its shardings kept."""
  return jax.jit(
    make_train_step(config, spec, task, tx, schedule), donate_argnums=0, out_shardings=(spec.shardings, None)
  )


def compile_step(
  jitted, *abstract_args, name: str, limit_gib: float = 0.0, device: jax.Device | None = None
) -> jax.stages.Compiled:
  """Lowers and compiles `jitted` for `abstract_args` and checks its memory estimate.

  limit_gib: the per-device budget; 0 takes the device's own limit (device_memory_limit of
  `device`, by default the first local one).
  Raises ResourceError (one sentence with the estimate) when the estimate exceeds the budget.
  """
  compiled, seconds = timed_compile(jitted, *abstract_args)
  estimate = MemoryEstimate.of(compiled)
  if estimate is None:
    logging.info("%s compiled in %.1f s (the backend gives no memory estimate)", name, seconds)
    return compiled
  limit = memory_limit(limit_gib, device)
  budget = f" of {size(limit[0] / GIB)} ({limit[1]})" if limit else ""
  logging.info("%s compiled in %.1f s; memory %s%s", name, seconds, estimate.describe(), budget)
  if limit and estimate.peak > limit[0]:
    raise ResourceError(
      f"the {name} needs about {estimate.describe()}, more than the {size(limit[0] / GIB)} "
      f"available ({limit[1]}); use a smaller batch or model, more gradient "
      "accumulation steps, model.remat, or shard over more devices (mesh.fsdp / mesh.tensor)."
    )
  return compiled


def timed_compile(jitted, *abstract_args) -> tuple[jax.stages.Compiled, float]:
  """(compiled, seconds the lowering and compile took)."""
  t0 = time.perf_counter()
  compiled = jitted.lower(*abstract_args).compile()
  return compiled, time.perf_counter() - t0


def memory_limit(limit_gib: float, device: jax.Device | None = None) -> tuple[int, str] | None:
  """(bytes, where the number comes from): `limit_gib` (train.memory_limit_gib) if set, else the device's."""
  return (int(limit_gib * GIB), "train.memory_limit_gib") if limit_gib > 0 else device_memory_limit(device)


def size(gib: float) -> str:
  """'1.25 GiB' from 0.1 GiB up, else '3.4 MiB' or '12.0 KiB': small models' numbers do not read 0.00."""
  if not abs(gib) < 0.1 or gib == 0:  # NaN too
    return f"{gib:,.2f} GiB"
  mib = gib * 2**10
  return f"{mib:,.1f} MiB" if abs(mib) >= 0.1 else f"{mib * 2**10:,.1f} KiB"
