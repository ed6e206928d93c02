"""A step watchdog: a run whose steps stop (a main thread blocked in a collective, a lost device, a
deadlocked reader) ends with every thread's stack in its log and a status its supervisor restarts.

A hung process prints nothing and its heartbeats (the run lock's, the coordination service's) go on,
so nothing else notices: the job sits until someone looks. The training loop calls `beat()` after
every step; a daemon thread checks that the last beat is younger than the limit

  max(train.watchdog_min_s, train.watchdog_factor x the median of the recent steps' times),

where the floor covers what runs between two steps at any size (an evaluation, a checkpoint save, a
compile of the eval step) and the factor a step that is merely slower than usual. Past it, the thread
writes every thread's Python stack to stderr (faulthandler: it needs no lock the stuck thread may
hold), tells the other processes (lra_core.runtime.process_end.report_failure) and ends the process with
status 75, the one the launchers' supervisors and the SLURM script rerun: the run resumes from its
last checkpoint. `train.watchdog_factor=0` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable

from lra_core.runtime import process_end, quiet_start

RECENT = 50  # steps whose median sets the limit


def _leave(status: int, message: str) -> None:
  if process_end.claim_end(None, status):  # else a peer's failure ends this process already, its line said
    process_end.report_failure(message, status)
  process_end.leave(status)


def _stderr():
  """Where faulthandler can write: stderr's file descriptor (a stream replaced by a capture has none)."""
  try:
    return sys.stderr.fileno()
  except (AttributeError, ValueError, OSError):
    return sys.__stderr__.fileno()


class StepWatchdog:
  """`with StepWatchdog(factor, floor_s, status) as dog: ... dog.beat()` after each step."""

  def __init__(
    self,
    factor: float,
    floor_s: float,
    status: int,
    *,
    leave: Callable[[int, str], None] = _leave,
    poll_s: float = 5.0,
  ):
    self.factor, self.floor_s, self.status = factor, floor_s, status
    self.leave, self.poll_s = leave, poll_s
    self._times: collections.deque[float] = collections.deque(maxlen=RECENT)
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def limit_s(self) -> float:
    """How long the run may go without a beat now."""
    typical = statistics.median(self._times) if self._times else 0.0
    return max(self.floor_s, self.factor * typical)

  def beat(self) -> None:
    now = time.monotonic()
    self._times.append(now - self._last)
    self._last = now

  def restart(self) -> None:
    """The clock starts again without counting the wait as a step (after an evaluation, a save)."""
    self._last = time.monotonic()

  def _watch(self) -> None:
    while not self._stop.wait(min(self.poll_s, self.floor_s / 4)):
      quiet, limit = time.monotonic() - self._last, self.limit_s()
      if quiet <= limit:
        continue
      message = (
        f"no training step finished for {quiet:.0f} s (the limit: {limit:.0f} s, the larger of "
        f"train.watchdog_min_s and train.watchdog_factor x the median step); every thread's stack follows, "
        f"and the run exits with status {self.status} to be restarted from its last checkpoint"
      )
      # Nothing on the way may keep the watchdog from acting: a log handler whose file was closed (by
      # whatever opened it) raises on flush, and a stream nobody drains blocks every write (the stuck
      # thread may be blocked in one, holding the handler's lock): what it says gets a bounded time.
      quiet_start.within(quiet_start.WRITE_WAIT_S, lambda: self._say(message))
      self.leave(self.status, f"watchdog: {message}")
      return

  @staticmethod
  def _say(message: str) -> None:
    logging.error("watchdog: %s", message)
    for handler in logging.getLogger().handlers:
      with contextlib.suppress(ValueError, OSError):
        handler.flush()
    faulthandler.dump_traceback(file=_stderr(), all_threads=True)

  def __enter__(self) -> StepWatchdog:
    if self.factor > 0:
      self.restart()
      self._thread = threading.Thread(target=self._watch, name="lra_core-step-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None
