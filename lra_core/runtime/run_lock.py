"""One run per workdir: a lock file, `<workdir>/run.lock`, held while a run trains there.

Two runs writing one workdir corrupt it quietly (one run's weights with both runs' metrics, or one
run deleting the other's checkpoint in progress). So the trainer's process 0 takes the lock before
it writes anything, and a second run stops with one sentence naming the first (host, pid, start
time). The lock holds JSON: the host, the pid, the start time and a heartbeat that a daemon thread
renews every HEARTBEAT_S seconds. It is given back when the run ends in any way Python sees
(finished, preempted, an error).

A lock left behind by a run that was killed (SIGKILL, a lost VM) is taken over:
  - on the same host, when its pid is no longer alive (at once);
  - from another host, when its heartbeat is older than STALE_S by this host's clock and the record is
    not renewed while this host watches it for two heartbeats (the holder cannot be asked, and the two
    hosts' clocks may differ by minutes: what counts is that its heartbeat has stopped).

Locally the lock is created atomically (O_EXCL); on gs:// too, by the store's conditional create
(`ifGenerationMatch=0`: fs.create_exclusive). Other object stores have no such create through epath:
there the lock is written, then read back after a moment, and the run that reads its own id back holds
it; two runs started within that moment may both see their own write.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid

from lra_core.errors import ConfigError, UserError
from lra_core.runtime import fs

NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
_SETTLE_S = 1.0  # object stores: how long to wait before reading a lock back


class WorkdirInUse(UserError, RuntimeError):
  """Another live run holds the workdir's lock."""


def _now() -> float:
  return time.time()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


class RunLock:
  """`with RunLock(workdir): train`; raises WorkdirInUse if another live run holds it."""

  def __init__(self, workdir: fs.Path):
    self.path = workdir / NAME
    self.local = fs.is_local(os.fspath(workdir))
    self.record = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "id": uuid.uuid4().hex,
    }
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._made_workdir = False  # whether acquire created the workdir (release removes it if left empty)

  # -- the record -------------------------------------------------------------------------------

  def _text(self) -> str:
    return json.dumps({**self.record, "heartbeat": _now()})

  def _read(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
      return {}  # half-written or damaged: treated as stale

  def _stale(self, other: dict) -> bool:
    if not other or "pid" not in other:  # damaged, or being created this instant (local: by its mtime)
      if self.local:
        try:
          return _now() - os.stat(os.fspath(self.path)).st_mtime > _SETTLE_S
        except FileNotFoundError:
          return True
      return True
    if other.get("host") == self.record["host"]:
      return not _alive(int(other["pid"]))
    age = _now() - float(other.get("heartbeat", 0.0))
    if age <= STALE_S:
      return False
    # Old by this host's clock, which the other host's need not match (a clock 270 s ahead made a live
    # run's lock look stale): stale only if the record also stops changing for two heartbeats.
    logging.info(
      "workdir lock of host %s: its heartbeat is %.0f s old by this host's clock; watching it for %.0f s",
      other.get("host", "?"),
      age,
      2 * HEARTBEAT_S + _SETTLE_S,
    )
    return not self._beating(other)

  def _beating(self, seen: dict) -> bool:
    """Whether the lock's record, last read as `seen`, is rewritten within two heartbeats."""
    deadline = time.monotonic() + 2 * HEARTBEAT_S + _SETTLE_S
    while time.monotonic() < deadline:
      time.sleep(min(1.0, HEARTBEAT_S / 4))
      now = self._read()
      if now != seen:
        return now is not None  # renewed: alive; given back: not held
    return False

  def _refusal(self, other: dict) -> WorkdirInUse:
    return WorkdirInUse(
      f"workdir {self.path.parent} is in use by the run started {other.get('started', '?')} on host "
      f"{other.get('host', '?')} (pid {other.get('pid', '?')}); wait for it to end, stop it, or use another "
      f"workdir (a lock whose run was killed is taken over: at once on the same host, after "
      f"{STALE_S:.0f} s without a heartbeat from another)."
    )

  # -- acquiring --------------------------------------------------------------------------------

  def _create(self) -> bool:
    """Writes the lock if there is none; True if this run now holds it."""
    if self.local:
      try:
        fd = os.open(os.fspath(self.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      except FileExistsError:
        return False
      with os.fdopen(fd, "w") as f:
        f.write(self._text())
      return True
    created = fs.create_exclusive(self.path, self._text())
    if created is not None:
      return created
    if self._read() is not None:
      return False
    self.path.write_text(self._text())
    time.sleep(_SETTLE_S)
    return (self._read() or {}).get("id") == self.record["id"]

  def acquire(self) -> None:
    """Takes the lock (the run's first write to the workdir: a workdir that is a file, read-only or
    full is refused here with one sentence) or raises WorkdirInUse."""
    workdir = self.path.parent
    if workdir.exists() and not workdir.is_dir():
      raise ConfigError(f"workdir {workdir} is a file, not a folder; give a folder (it is created if missing).")
    self._made_workdir = not workdir.exists()
    for _ in range(3):
      try:
        workdir.mkdir(parents=True, exist_ok=True)
        created = self._create()
      except OSError as e:
        raise ConfigError(
          f"workdir {workdir} cannot be written ({e.strerror or type(e).__name__}); give a writable folder "
          "with free space."
        ) from e
      if created:
        break
      other = self._read()
      if other is None:
        continue  # given back meanwhile: try again
      if not self._stale(other):
        raise self._refusal(other)
      logging.warning(
        "taking over the lock of workdir %s from the run started %s on host %s (pid %s), which is gone",
        self.path.parent,
        other.get("started", "?"),
        other.get("host", "?"),
        other.get("pid", "?"),
      )
      self.path.unlink(missing_ok=True)
    else:
      raise self._refusal(self._read() or {})
    self._thread = threading.Thread(target=self._beat, name="lra_core-run-lock", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        held = (self._read() or {}).get("id") == self.record["id"]
        if held:
          self._renew()
        else:
          logging.error("workdir %s: another run has taken the lock over; this run's outputs may mix", self.path.parent)
          return
      except OSError as e:  # a store that failed for a moment: the next beat tries again
        logging.warning("could not renew the workdir lock %s: %s", self.path, e)

  def _renew(self) -> None:
    """Rewrites the record with a new heartbeat; locally through a rename, so no reader sees it half-written."""
    if not self.local:
      self.path.write_text(self._text())  # an object is replaced whole
      return
    tmp = f"{os.fspath(self.path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(self._text())
    os.replace(tmp, os.fspath(self.path))

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None
    try:
      if (self._read() or {}).get("id") == self.record["id"]:
        self.path.unlink(missing_ok=True)
      # A run refused before writing anything (its data missing, say) leaves no empty workdir behind.
      if self._made_workdir and self.local and not any(self.path.parent.iterdir()):
        self.path.parent.rmdir()
    except OSError as e:  # a read-only or vanished workdir: nothing to give back
      logging.warning("could not remove the workdir lock %s: %s", self.path, e)

  def __enter__(self) -> RunLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
