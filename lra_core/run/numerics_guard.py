"""The numerics guard of the training loop, on the host: a non-finite objective, gradient norm or
parameter norm stops the run at once with the step, the metric and the last good checkpoint
(train.nan_check), or with train.skip_nonfinite the step's update was dropped on the device and the
guard counts it, a finished run that skipped more than train.max_skipped_fraction failing. It also adds
up the steps' metrics for the next log.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from lra_core.errors import TrainingDiverged


class NumericsGuard:
  """The numerics guard on the host: stops at the first non-finite objective / gradient norm /
  parameter norm (naming the step, the metric and the last good checkpoint), or with
  train.skip_nonfinite counts the steps whose update the train step skipped."""

  def __init__(self, t, ckpt, skipped: int):
    self.nan_check, self.skip, self.max_skipped = t.nan_check, t.skip_nonfinite, t.max_skipped_fraction
    self.ckpt, self.skipped, self.last_saved = ckpt, skipped, 0

  def check_skipped_share(self, steps: int) -> None:
    """A finished run that skipped more than train.max_skipped_fraction of its steps fails (exit status 2)
    instead of reporting barely trained parameters as a result."""
    if self.skip and self.skipped > self.max_skipped * steps:
      raise TrainingDiverged(
        f"{self.skipped} of {steps} steps were skipped for non-finite values, more than "
        f"train.max_skipped_fraction={self.max_skipped:g} of them; lower the learning rate or check the data "
        f"(the checkpoints in {self.ckpt.directory} are kept)."
      )

  def check_and_accumulate(self, step: int, metrics: dict, sums: dict) -> None:
    host = jax.device_get(metrics)
    if self.skip and float(host.pop("skipped", 0.0)):
      self.skipped += 1
      logging.warning(
        "step %d: non-finite objective, gradients or parameters; update skipped (%d so far)", step, self.skipped
      )
      return
    host.pop("skipped", None)
    if self.nan_check:
      for name in ("objective", "grad_norm", "param_norm"):
        value = float(host[name])
        if not np.isfinite(value):
          where = (
            f"the last good checkpoint is step {self.last_saved} in {self.ckpt.directory}"
            if self.last_saved
            else "no checkpoint was written yet"
          )
          raise TrainingDiverged(f"non-finite {name} ({value}) at step {step}; {where}.")
    for name, value in host.items():
      value = np.asarray(value, np.float64)
      if value.shape == (2,):  # (sum, weight) pairs add up
        s, w = sums.get(name, (0.0, 0.0))
        sums[name] = (s + value[0], w + value[1])
      else:  # scalars: keep the latest
        sums[name] = (float(value), None)
