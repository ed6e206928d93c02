"""How long a checkpoint save may take, and what the store said while it failed.

A save that cannot complete (a full disk, a folder turned read-only, an object store refusing writes)
often does not fail: orbax's writer threads retry, or wait in a barrier for a process whose commit
failed, for as long as orbax's own timeout (20 minutes). The run then sits idle on every chip. So a
save in flight has a limit of its own, counted from the moment it began:

  - before this run has measured a save, `train.save_timeout_s` (default 1800 s: a first save of a
    large model to a slow store must not be cut short);
  - once a save has completed, the smaller of that and max(FLOOR_S, FACTOR x the slowest save so far):
    a store that saved in 2 s and has not finished in 90 is failing, not slow.

The loop checks the save in flight after every step (`Checkpointer.poll`), so a failing store ends
the run within the limit whatever the checkpoint interval. Where a store's error was logged while the
save was in flight (orbax logs what its threads meet, then keeps waiting), the sentence carries its
cause: `No space left on device`, `Read-only file system`. A writer thread that died of a cause no
retry mends (`FINAL`, logged as an error) ends the save at once: it cannot complete, and waiting out
the limit would idle every chip for minutes.
"""

from __future__ import annotations

import logging
import re
import time

FLOOR_S = 90.0
FACTOR = 10.0
# An operating system's or a store's cause, as the libraries word it in their log lines.
CAUSE = re.compile(
  r"\[Errno \d+\] [^\]\n'\"]+|No space left on device|Read-only file system|Disk quota exceeded|Permission denied"
)


class SaveClock:
  """The limit of the save in flight: `begin()` at each save, `done()` when one completes."""

  def __init__(self, timeout_s: float):
    self.timeout_s = timeout_s  # 0: no limit
    self.slowest: float | None = None
    self.started: float | None = None

  def begin(self) -> None:
    self.started = time.monotonic()

  def done(self) -> None:
    """The save begun last has completed (orbax's post-finalization callback, on its writer thread)."""
    if self.started is not None:
      took = time.monotonic() - self.started
      self.slowest = took if self.slowest is None else max(self.slowest, took)

  def limit_s(self) -> tuple[float, str] | None:
    """(seconds a save may take, what set them), or None for no limit."""
    if not self.timeout_s:
      return None
    if self.slowest is None:
      return self.timeout_s, "train.save_timeout_s"
    derived = max(FLOOR_S, FACTOR * self.slowest)
    if derived >= self.timeout_s:
      return self.timeout_s, "train.save_timeout_s"
    return derived, f"{FACTOR:g} x this run's slowest save, {self.slowest:.1f} s, and at least {FLOOR_S:g} s"

  def overdue(self) -> str | None:
    """Why the save in flight is past its limit (`after T s (what set them)`), or None while it is not."""
    limit = self.limit_s()
    if limit is None or self.started is None or time.monotonic() - self.started <= limit[0]:
      return None
    return f"after {limit[0]:g} s ({limit[1]})"


# Causes that waiting does not mend: the save in flight has failed once a writer thread died of one.
FINAL = re.compile(r"No space left on device|Read-only file system|Disk quota exceeded")


class StoreErrors(logging.Handler):
  """Keeps the last cause (`CAUSE`) that a log record of WARNING or above names, in its message or its
  exception, and whether an error record named a `FINAL` one: attached to the root logger while a
  Checkpointer saves; `reset()` at each save."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.cause: str | None = None
    self.final = False

  def reset(self) -> None:
    self.cause, self.final = None, False

  def emit(self, record: logging.LogRecord) -> None:
    try:
      text = record.getMessage()
    except Exception:  # noqa: BLE001  (a record whose arguments do not format: nothing to read)
      return
    if record.exc_info and record.exc_info[1] is not None:
      text += f" {record.exc_info[1]}"
    found = CAUSE.search(text)
    if found:
      self.cause = found.group(0).strip().rstrip(".:;,")
      # A warning is a retry to come; an error is a thread that gave up (orbax logs its writers' deaths so).
      self.final = self.final or (record.levelno >= logging.ERROR and FINAL.search(self.cause) is not None)
