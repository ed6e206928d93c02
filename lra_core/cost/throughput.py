"""Throughput of a training run: step time, tokens/s and model FLOPs utilization (MFU).

MFU = model FLOPs per step / step time / peak FLOP/s of the devices the step runs on.

- Model FLOPs are the matrix products of the compiled train step (`lra_core.cost.hlo_cost.step_flops`,
  the count `lra_core.aot` estimates with, Pallas kernels at their declared costs), less what remat
  recomputes, times the number of devices. XLA's `cost_analysis()` is not used: it counts a while loop's body
  once, so scanned
  layers, update windows and micro-batches would be undercounted.
- The peak is the chip's dense bf16 matmul peak from `lra_core.cost.chips.CHIPS` (one table with
  `lra_core.aot`), times the number of devices; `train.peak_flops` overrides it per device. A CPU
  has no such table entry: its peak is measured when the run starts, the best float32 matmul rate
  (1024 x 1024 x 1024, best of 5) of the host; the host's CPU devices share it, so it is not
  multiplied by their number.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from lra_core.cost import chips, hlo_cost, pallas_costs


@functools.cache
def cpu_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
  """The host's float32 matmul FLOP/s: the best of `repeats` timed n x n x n products."""
  device = jax.local_devices(backend="cpu")[0]  # this process's own CPU (jax.devices lists process 0's first)
  a = jax.device_put(np.ones((n, n), np.float32), device)
  matmul = jax.jit(jnp.matmul)
  matmul(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best


def peak_flops(devices, per_device: float = 0.0) -> tuple[float, str] | None:
  """(peak FLOP/s of `devices` together, what the figure is), or None for an unknown accelerator."""
  n = len(devices)
  if per_device > 0:
    return per_device * n, f"train.peak_flops x {n} device(s)"
  chip = chips.chip_of(devices[0])
  if chip is not None:
    return chip.peak_flops * n, f"{chip.name} bf16 peak x {n} device(s)"
  if devices[0].platform == "cpu":
    # Measured under whatever else runs now: a loaded host measures less, and its MFU reads higher.
    return (
      cpu_matmul_peak(),
      "this host's float32 matmul rate measured now; under load it is lower and MFU higher: "
      "set train.peak_flops to fix it",
    )
  return None


def model_flops(compiled: jax.stages.Compiled, num_devices: int, traced: jax.stages.Traced | None = None) -> float:
  """Model FLOPs of one step of the SPMD program `compiled` on all its devices (remat recompute excluded).
  `traced`, the same step traced: its Pallas kernels' declared FLOPs, which a GPU program's Triton calls
  do not keep (a TPU program's Mosaic calls do)."""
  costs = pallas_costs.pallas_kernel_costs(traced.jaxpr) if traced is not None else ()
  flops, recompute = hlo_cost.step_flops(compiled.as_text(), costs)
  return (flops - recompute) * num_devices


class Throughput:
  """Step time, tokens/s and MFU over the steps between two `measure` calls."""

  def __init__(self, tokens_per_step: int, flops_per_step: float, peak: tuple[float, str] | None, step: int):
    self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
    self.peak = peak
    self.restart(step)
    if peak is not None:
      logging.info("MFU: %.4g model FLOPs per step over %.4g FLOP/s (%s)", flops_per_step, peak[0], peak[1])

  def restart(self, step: int) -> None:
    """Starts a new interval at `step` (after an evaluation, so it does not count as training)."""
    self.step, self.t = step, time.perf_counter()

  def measure(self, step: int) -> dict[str, float]:
    """{"step_time_s", "tokens_per_s", "mfu"} since the last call; the caller has synchronized
    with the device (read the step's metrics) just before."""
    now = time.perf_counter()
    steps, seconds = step - self.step, now - self.t
    self.step, self.t = step, now
    if steps <= 0 or seconds <= 0:
      return {}
    step_time = seconds / steps
    out = {"step_time_s": step_time, "tokens_per_s": self.tokens_per_step / step_time}
    if self.peak is not None and self.flops_per_step > 0:
      out["mfu"] = self.flops_per_step / step_time / self.peak[0]
    return out

  def overall(self, steps: int, seconds: float) -> dict[str, float]:
    """{"tokens_per_s", "mfu"} of `steps` steps in `seconds` (a whole run, for summary.json)."""
    seconds = max(seconds, 1e-9)
    out = {"tokens_per_s": steps * self.tokens_per_step / seconds}
    if self.peak is not None and self.flops_per_step > 0:
      out["mfu"] = steps * self.flops_per_step / seconds / self.peak[0]
    return out
