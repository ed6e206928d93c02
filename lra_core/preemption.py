"""Preemption notices: SIGTERM ends a run with a checkpoint instead of losing the steps since the
last one.

Schedulers (SLURM, Kubernetes, spot / preemptible VMs) send SIGTERM some seconds before they kill
a job. In one process, a handler only raises a flag; the loop finishes the step in flight, saves,
and returns (exit status 0), and the same command later continues from that step. With several
processes the notice may reach only some of them, and a checkpoint needs them all: JAX's
preemption sync manager (started by `jax.distributed.initialize`) catches the signal and agrees
with every process on the step at which all of them stop, which
`multihost_utils.reached_preemption_sync_point` reports.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax


class PreemptionNotice:
  """`with PreemptionNotice() as notice: ... if notice.reached(step): save and leave`."""

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
    self.signals = signals
    self.received: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is None:
      logging.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)
    self.received = signum

  def __enter__(self) -> PreemptionNotice:
    # Several processes: JAX's sync manager owns the signal. Signal handlers can only be set from
    # the main thread (a run started from another thread keeps the default: SIGTERM ends it, and
    # it resumes from its last checkpoint).
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()

  def reached(self, step: int) -> bool:
    """True at the step where this run should save and stop (every process gets the same answer)."""
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None
