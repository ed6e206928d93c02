"""How the processes of a multi-process run end together: one process failing, or a peer failing or
disappearing, ends every process with one line and one status, promptly.

Left alone, an exception on one process leaves the others blocked in their next collective, and the
failing one waits in JAX's shutdown barrier for them: several minutes of idle chips before anything exits.
Instead, a process that fails writes one line naming itself and its error into the coordination service's
key-value store (`report_failure`, called by `lra_core.cli.run`), and every process runs a watchdog thread
(`start_watchdog`, started by `lra_core.runtime.distributed.initialize`) that waits on that key: when it
appears, the process prints the line and exits at once with the failing process's status (2 for bad input,
75 preempted or stuck, 130 a Ctrl-C, 1 a crash: a supervisor sees the cause whichever process it reads),
from wherever its main thread is blocked; a lost coordinator is status 1 (EXIT_PEER_FAILED). The
failing process waits until the others have seen the line (the store lives in process 0, so
process 0 must outlive their read), at most FAILURE_GRACE_S, and exits without the barrier; processes
failing at the same moment (a store they all wait on) do not wait for each other, and process 0 leaves
last. Within a process, its own failure and a peer's report arriving together, the first to claim the end
(`claim_end`) says the one line and sets the exit status; the other thread says nothing.
A process that dies without a word (SIGKILL, a lost host) leaves the others blocked in a collective;
JAX's coordination service notices after its heartbeat timeout (100 s) and aborts every process
(SIGABRT, a fatal log line and a native stack). Before that, the watchdogs notice: each renews a
counter in the store every second, and a process whose peer's counter has not moved for
--peer_timeout_s (PEER_TIMEOUT_S, 60 s) prints one line naming it and exits with status 1
(EXIT_PEER_FAILED); a peer gone from under a collective is named the same way (`lost_peer`).
A SIGTERM to any process, which JAX's preemption notifier publishes in the same store, reaches every
process through `preemption_noticed` (lra_core/runtime/preemption.py stops the run with a checkpoint).
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import threading
import time
import traceback

import jax

from lra_core.errors import brief
from lra_core.runtime import quiet_start
from lra_core.runtime.exit_codes import EXIT_CRASH

PEER_TIMEOUT_S = 60.0  # --peer_timeout_s's default: below JAX's heartbeat timeout (100 s)
FAILURE_KEY = "lra_core/failure"
ALIVE_KEY = "lra_core/alive"  # /<process>: a counter each watchdog renews every _POLL_MS; "done" at a clean exit
FAILURE_GRACE_S = 20.0  # how long a failing process waits for the others to read its line
# Process 0 hosts the coordination service, and a process whose JAX client loses it before its own exit
# is aborted by that client (SIGABRT) instead of exiting with its status: every other process leaves as
# soon as it may, and process 0 this much later.
EXIT_MARGIN_S = 1.0
EXIT_PEER_FAILED = EXIT_CRASH  # the status of a process stopped by a lost peer or coordinator
_POLL_MS = 1000


def coordination_client():
  """The coordination service's client of this process (None outside a multi-process run)."""
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state.client


# What JAX's preemption notifier (started by jax.distributed.initialize, which takes SIGTERM from
# Python's handlers) writes into the coordination service's key-value store when any process gets
# SIGTERM: every process reads it at once. The sync point (multihost_utils.reached_preemption_sync_point)
# needs every process at the same step, which a save stuck in one of them never reaches.
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


def preemption_noticed() -> bool:
  """Whether some process of this multi-process run has received SIGTERM (False in one process)."""
  client = coordination_client()
  if client is None or jax.process_count() < 2:
    return False
  try:
    client.key_value_try_get(PREEMPTION_NOTICE_KEY)
  except Exception:  # noqa: BLE001  (NOT_FOUND: no notice yet; a lost coordinator is the failure watchdog's)
    return False
  return True


class _Watchdog:
  """Waits on FAILURE_KEY in a daemon thread; ends this process when another one reports a failure."""

  def __init__(self, client, process: int, count: int, peer_timeout_s: float = PEER_TIMEOUT_S):
    self.client, self.process, self.peer_timeout_s = client, process, peer_timeout_s
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._watch, name="lra_core-failure-watchdog", daemon=True)
    self._beats = 0
    start = time.monotonic()
    # Each peer's last counter seen and when it last moved (from this watchdog's start: a peer that
    # never writes one is silent from then).
    self._heard = {p: (None, start) for p in range(count) if p != process}

  def _beat_and_listen(self) -> None:
    """Renews this process's counter; ends the process if a peer's has not moved for peer_timeout_s."""
    self._beats += 1
    self.client.key_value_set(f"{ALIVE_KEY}/{self.process}", str(self._beats), allow_overwrite=True)
    now = time.monotonic()
    values = dict(self.client.key_value_dir_get(ALIVE_KEY))
    for peer, (seen, since) in list(self._heard.items()):
      value = values.get(f"{ALIVE_KEY}/{peer}")
      if value == "done":  # ended cleanly: waiting in JAX's shutdown barrier, not lost
        del self._heard[peer]
      elif value != seen:
        self._heard[peer] = (value, now)
      elif now - since > self.peer_timeout_s:
        line = (
          f"process {peer} has not answered for {now - since:.0f} s (--peer_timeout_s): it was killed or its host "
          "was lost; the run resumes from its last checkpoint when restarted"
        )
        self._stop_process(line, acknowledge=False)

  def _watch(self) -> None:
    while not self.stopped.is_set():
      try:
        self._beat_and_listen()
        line = self.client.blocking_key_value_get(FAILURE_KEY, _POLL_MS)
      except Exception as e:  # noqa: BLE001  (the store's errors are one type with a status text)
        if self.stopped.is_set() or "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
          continue
        line = f"process {self.process} lost the run's coordinator ({brief(e)})"
        self._stop_process(line, acknowledge=False)
        return
      report = json.loads(line)
      if report["process"] == self.process:
        return  # this process's own report: it exits by itself
      self._stop_process(report["line"], acknowledge=True, status=report["status"])
      return

  def _stop_process(self, line: str, *, acknowledge: bool, status: int = EXIT_PEER_FAILED) -> None:
    """Says why and exits with `status`: the failing process's own (a supervisor reading any process
    sees the cause: 2 bad input, 75 preempted or stuck, 130 Ctrl-C, 1 a crash). Nothing, if this process
    is ending already (its own failure, said by the main thread)."""
    said = forwarded(line, self.process)
    if self.stopped.is_set() or not claim_end(said, status):
      return
    if acknowledge:
      _acknowledge(self.client, self.process)
    leave(status, self.process)  # from this thread: the main thread may be blocked in a collective


_watchdog: _Watchdog | None = None

# How this process ends: the first of its own failure (the main thread), a peer's report, a silent peer
# or a lost coordinator (the watchdog) to claim the end says its line and sets the exit status, under one
# lock; whichever thread comes later says nothing and leaves with that status. Without it a process could
# say one cause and exit with another's status, or say two lines, or (a thread leaving between another's
# mark and its line) none.
_ENDING = threading.Lock()
_claim: tuple[int, threading.Thread] | None = None  # (exit status, the claiming thread)
CLAIMANT_WAIT_S = 5.0  # how long a later thread lets the claiming one finish (acknowledge, then exit)


def claim_end(line: str | None, status: int) -> bool:
  """Makes `status` the exit status of this multi-process run's process and prints `line` on stderr,
  unless another thread has claimed its end: then False, and that thread's line is out (a caller
  waiting on the claim returns once it is). In one process: prints and returns True."""
  global _claim
  with _ENDING:
    if _claim is not None:
      return False
    if coordination_client() is not None:  # a repeated in-process command (a test, a notebook) is never ended by one
      _claim = (status, threading.current_thread())
    if line is not None:
      quiet_start.within(quiet_start.WRITE_WAIT_S, lambda: print(line, file=sys.stderr, flush=True))
    return True


# What the collectives' transport says when the process at the other end is gone (CPU: Gloo over TCP).
_TRANSPORTS = ("Gloo",)
_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(e: BaseException) -> str | None:
  """The line for an error (or one it wraps) that is a peer gone from under a collective, None for any
  other: a process killed mid-save shows up first as a failed all-gather of the save's barrier."""
  # The client first: the process count starts the backends, which a bad config never got to.
  if coordination_client() is None or jax.process_count() < 2:
    return None
  seen, hops = e, 0
  while seen is not None and hops < 8:
    text = str(seen)
    if any(t in text for t in _TRANSPORTS) and any(g in text for g in _GONE):
      peer = _silent_peer()
      return (
        f"process {peer} dropped out of a collective ({brief(seen)}): it was killed or its host was lost; the run "
        "resumes from its last checkpoint when restarted"
      )
    seen, hops = seen.__cause__ or seen.__context__, hops + 1
  return None


def _silent_peer() -> str:
  """The peer whose watchdog counter moved longest ago (the other one of two)."""
  me, count = jax.process_index(), jax.process_count()
  if count == 2:
    return str(1 - me)
  if _watchdog is None or not _watchdog._heard:
    return "?"
  return str(min(_watchdog._heard, key=lambda p: _watchdog._heard[p][1]))


def forwarded(line: str, process: int) -> str:
  """The line process `process` says for a peer's failure `line` (a sentence: its own end dropped, so
  that the whole ends in one full stop)."""
  return f"error: {line.strip().rstrip('.;').rstrip()}; stopping process {process} as well."


def stop_for_lost_peer(line: str) -> None:
  """Ends this process for a peer that is gone: its line once, status EXIT_PEER_FAILED (or the status of
  an end another thread claimed first, its line said)."""
  claim_end(forwarded(line, jax.process_index()), EXIT_PEER_FAILED)
  leave(EXIT_PEER_FAILED)


def start_watchdog(peer_timeout_s: float = PEER_TIMEOUT_S) -> None:
  """Starts the failure watchdog of a multi-process run (once; stopped at exit, before JAX's shutdown)."""
  global _watchdog
  client = coordination_client()
  if _watchdog is not None or client is None or jax.process_count() < 2:
    return
  _watchdog = _Watchdog(client, jax.process_index(), jax.process_count(), peer_timeout_s)
  _watchdog.thread.start()
  atexit.register(stop_watchdog)  # runs before jax's own exit handler (registered at import): LIFO


def stop_watchdog() -> None:
  """A clean exit: the run's processes meet in JAX's shutdown barrier, not in the failure key."""
  global _watchdog
  if _watchdog is not None:
    _watchdog.stopped.set()
    _watchdog.thread.join(timeout=2 * _POLL_MS / 1000)
    try:  # the others stop counting this process's silence
      _watchdog.client.key_value_set(f"{ALIVE_KEY}/{_watchdog.process}", "done", allow_overwrite=True)
    except Exception:  # noqa: BLE001  (the coordinator gone already: nobody is counting)
      pass
    _watchdog = None


def report_failure(message: str, status: int, traceback_of: BaseException | None = None) -> None:
  """Ends a multi-process run after an error on this process: `message` (one line) and `status` go to
  every other process, which stop with the same status; this one waits until they have read it (at most
  FAILURE_GRACE_S) and exits with `status` without JAX's shutdown barrier, after printing the
  traceback of `traceback_of` if given. Returns at once in a single-process run (the caller exits
  as usual)."""
  client = coordination_client()
  if client is None or jax.process_count() < 2:
    return
  if traceback_of is not None:
    quiet_start.within(quiet_start.WRITE_WAIT_S, lambda: traceback.print_exception(traceback_of))
  me, count = jax.process_index(), jax.process_count()
  if _watchdog is not None:
    _watchdog.stopped.set()
  try:
    client.key_value_set(
      FAILURE_KEY, json.dumps(dict(process=me, status=status, line=f"process {me} failed: {message}"))
    )
  except Exception:  # noqa: BLE001  (another process reported first: its line stands, this one still ends)
    pass
  # This process knows the run is ending: another one failing at the same moment (a store both wait on)
  # need not wait FAILURE_GRACE_S for an acknowledgement from a watchdog this one has stopped.
  _acknowledge(client, me)
  deadline = time.monotonic() + FAILURE_GRACE_S
  for other in range(count):
    remaining_ms = int(1000 * (deadline - time.monotonic()))
    if other == me or remaining_ms <= 0:
      continue
    try:
      client.blocking_key_value_get(f"{FAILURE_KEY}/seen/{other}", remaining_ms)
    except Exception:  # noqa: BLE001  (it stopped without a word, or the grace ran out)
      pass
  quiet_start.within(quiet_start.WRITE_WAIT_S, logging.shutdown)
  leave(status, me)


def _acknowledge(client, process: int) -> None:
  try:
    client.key_value_set(f"{FAILURE_KEY}/seen/{process}", "1")
  except Exception:  # noqa: BLE001  (said already; or the failing process stops waiting after FAILURE_GRACE_S)
    pass


def leave(status: int, process: int | None = None) -> None:
  """Exits now with `status` (or the status of the end claimed by `claim_end`), without JAX's shutdown
  barrier (or the interpreter's teardown, which waits for stuck threads); in a multi-process run process
  0, which hosts the coordination service, EXIT_MARGIN_S later, so that no other process outlives it."""
  with _ENDING:
    claim = _claim
  if claim is not None and claim[1] is not threading.current_thread():
    # Another thread claimed the end: it acknowledges a peer's report, then exits (which ends this one).
    time.sleep(CLAIMANT_WAIT_S)
  if claim is not None:
    status = claim[0]
  if coordination_client() is not None:
    process = jax.process_index() if process is None else process
    if process == 0 and jax.process_count() > 1:
      quiet_start.within(quiet_start.WRITE_WAIT_S, lambda: (sys.stdout.flush(), sys.stderr.flush()))
      time.sleep(EXIT_MARGIN_S)
  quiet_start.leave_now(status)
