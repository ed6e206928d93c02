"""Preemption notices: SIGTERM (and Ctrl-C, SIGINT) end a run with a checkpoint instead of losing
the steps since the last one.

Schedulers (SLURM, Kubernetes, spot / preemptible VMs) send SIGTERM some seconds before they kill
a job. In one process, a handler only raises a flag; the loop finishes the step in flight, saves,
and returns; the trainer exits with status 75 (lra_core.runtime.exit_codes.EXIT_PREEMPTED, which supervisors read
as "relaunch me"), and the same command later continues from that step. With several
processes the notice may reach only some of them, and a checkpoint needs them all: JAX's
preemption sync manager (started by `jax.distributed.initialize`) catches the signal and agrees
with every process on the step at which all of them stop, which
`multihost_utils.reached_preemption_sync_point` reports.

Ctrl-C behaves the same in one process: the step in flight finishes, a checkpoint is saved, and
the trainer exits with status 130; a second Ctrl-C aborts at once (a command leaves with status 130
there and then; called from Python, KeyboardInterrupt). The last step counts: a Ctrl-C there ends the
run saved, before its final evaluation, with 130 too.

Outside the loop a command's Ctrl-C raises KeyboardInterrupt (`ctrl_c_latched`, which lra_core.cli.run
holds), also in a command started in the background, which inherits SIGINT ignored: the loop takes it
there, so the rest of the command does too. It is also remembered (`ctrl_c_seen`): raised inside a
callback that only prints what it raises (JAX's garbage-collection hook), it would be lost, and a sweep
would start its next run; the sweep and the trainer ask before they go on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

import jax

from lra_core.runtime import process_end, quiet_start
from lra_core.runtime.exit_codes import EXIT_INTERRUPTED

_LATCH = {"held": False, "seen": False}


def _latch(signum, frame) -> None:
  del signum, frame
  _LATCH["seen"] = True
  raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_latched():
  """For a command's whole run: Ctrl-C (SIGINT) raises KeyboardInterrupt whatever the process inherited
  and is remembered for `ctrl_c_seen`. Only from the main thread (elsewhere it changes nothing)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, _latch)
  _LATCH.update(held=True, seen=False)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    _LATCH.update(held=False, seen=False)


def ctrl_c_seen() -> bool:
  """Whether this command has received a Ctrl-C (always False outside `ctrl_c_latched`)."""
  return _LATCH["held"] and _LATCH["seen"]


class PreemptionNotice:
  """`with PreemptionNotice() as notice: ... if notice.reached(step): save and leave`."""

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self.signals = signals
    self.received: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      _LATCH["seen"] = True
    if signum == signal.SIGINT and self.received == signal.SIGINT:  # the second Ctrl-C: stop now, unsaved
      if quiet_start.in_command():
        # Raised, KeyboardInterrupt can land in a callback that only prints it (JAX's garbage-collection
        # hook) and the run goes on saving: a command leaves here instead.
        print("aborted (Ctrl-C).", file=sys.stderr)
        quiet_start.leave_now(EXIT_INTERRUPTED)
      raise KeyboardInterrupt
    if self.received is None:
      what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
      again = " (Ctrl-C again to abort without it)" if signum == signal.SIGINT else ""
      logging.warning("received %s: stopping after this step with a checkpoint%s", what, again)
    self.received = signum

  def asked_to_stop(self) -> bool:
    """Whether a stop was asked for, outside the step loop's sync point (a save stuck on a failing store
    gives way to it): this process's signal, or with several processes a SIGTERM to any of them, which
    JAX's notifier publishes to all (lra_core/runtime/process_end.py)."""
    return self.received is not None or process_end.preemption_noticed()

  @property
  def interrupted(self) -> bool:
    """Whether the notice was a Ctrl-C (SIGINT) rather than a scheduler's SIGTERM."""
    return self.received == signal.SIGINT

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
