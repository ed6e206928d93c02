"""`train.profile_steps=a:b`: a jax.profiler trace of steps a..b-1 for TensorBoard's profile plugin.

The trace lands in `<workdir>/tensorboard/plugins/profile/<time>/<host>.xplane.pb` (with a
`.trace.json.gz`), where `tensorboard --logdir=<workdir>/tensorboard` shows it under Profile. The
profiler writes local files only, so for an object-store workdir it traces into a local folder and
copies the files up when the trace stops. Every step inside the window is a StepTraceAnnotation,
which the plugin's step-time view groups by.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil
import tempfile

import jax

from lra_core.runtime import fs


class StepProfiler:
  def __init__(self, window: tuple[int, int] | None, tensorboard_dir, *, enabled: bool | None = None):
    self.window = window
    self.target = tensorboard_dir
    self.enabled = window is not None and (jax.process_index() == 0 if enabled is None else enabled)
    self.local: pathlib.Path | None = None
    self.active = False

  def step(self, step: int):
    """A context around the dispatch of `step` (0-based): starts the trace at the window's start."""
    if not self.enabled or not self.window[0] <= step < self.window[1]:
      return contextlib.nullcontext()
    if not self.active:
      local = fs.local_or_none(self.target)
      self.local = local if local is not None else pathlib.Path(tempfile.mkdtemp(prefix="lra_core_profile_"))
      jax.profiler.start_trace(str(self.local))
      self.active = True
      logging.info("profiling steps %d..%d", *self.window)
    return jax.profiler.StepTraceAnnotation("train", step_num=step)

  def after(self, step: int, state) -> None:
    """Stops the trace once `step` is the window's last step (waiting for it to finish on the device)."""
    if self.active and step + 1 >= self.window[1]:
      self.stop(state)

  def stop(self, state=None) -> None:
    if not self.active:
      return
    if state is not None:
      jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self.active = False
    if fs.local_or_none(self.target) is None:
      fs.upload_tree(self.local, self.target)
      shutil.rmtree(self.local, ignore_errors=True)
    logging.info("wrote the profile of steps %d..%d under %s/plugins/profile", *self.window, self.target)
