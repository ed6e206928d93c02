"""What ends the other processes of a multi-process run when process 0, the coordinator, is lost.

Process 0 hosts JAX's coordination service. When it dies (SIGKILL, a lost host), the JAX client of
every other process aborts it within a second: SIGABRT from a native fatal log line ("Terminating
process because the JAX distributed service detected fatal errors ..."), before any Python code of the
process can say a word, so the failure watchdog (process_end) has no time to name the cause and a
supervisor reads a native stack. JAX 0.10's client takes no callback in its place (the hook it has
fails to convert the status and aborts all the same).

So a process that joins as process 1 or above through --coordinator_address runs its command in a
child process, started before anything joins, and waits for it (`start`). The child's status passes
through unchanged (its death by a signal too), except one: aborted after joining while the coordinator
no longer answers, which becomes one sentence naming process 0, status 1 (EXIT_PEER_FAILED), as a peer
killed without a word is named everywhere else.

Signals reach the child as they would have reached the command: a SIGTERM, SIGHUP or SIGINT sent to this
process is passed on, and a Ctrl-C at a terminal, which reaches both (one process group), is left to
the child. The child dies with this process (PR_SET_PDEATHSIG), so a SIGKILL to it ends both, as before.
Linux only; elsewhere the command runs as one process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

from lra_core.runtime.exit_codes import EXIT_CRASH

ENV = "LRA_CORE_WATCHED"  # in the child: the fd it reports its joining to
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent: a terminal's Ctrl-C reaching the group
ANSWER_WAIT_S = 3.0  # how long the coordinator may take to accept a connection before it counts as gone
_PR_SET_PDEATHSIG = 1
_report_fd: int | None = None  # in the child: where `joined` tells the watcher


def start(process_id: int | None, coordinator_address: str | None, in_command: bool) -> None:
  """In a command joining a run as process `process_id` >= 1 through `coordinator_address`: runs the
  command again as a child and exits with its status (never returns). In that child: keeps where to
  report its joining, and returns. Anywhere else (process 0, one process, a test calling the parser, not
  Linux): returns at once."""
  if ENV in os.environ:
    _as_child(os.environ[ENV])
    return
  if not (in_command and process_id and coordinator_address and sys.platform == "linux"):
    return
  read_end, write_end = os.pipe()
  waited = {*PASSED_ON, signal.SIGCHLD}
  signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # from here on they queue for sigtimedwait
  watcher = os.getpid()

  def in_child() -> None:  # between fork and exec: it dies with the watcher from its first instruction on
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != watcher:  # the watcher died before the line above took effect
      os._exit(EXIT_CRASH)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)  # the command's own signals

  child = subprocess.Popen(
    [sys.executable, *sys.orig_argv[1:]],
    env={**os.environ, ENV: str(write_end)},
    pass_fds=(write_end,),
    preexec_fn=in_child,
  )
  os.close(write_end)
  status = _wait(child, waited)
  if status == -signal.SIGABRT and _joined(read_end) and not _answers(coordinator_address):
    os.write(
      2,
      f"error: process 0, the run's coordinator at {coordinator_address}, stopped answering: it was killed or its "
      f"host was lost; stopping process {process_id} as well.\n".encode(),
    )
    os._exit(EXIT_CRASH)
  if status < 0:  # killed by a signal: so is this process, for the supervisor reading its status
    signal.signal(-status, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {-status})
    os.kill(os.getpid(), -status)
  os._exit(status)  # no atexit work of this process's imports: the child did the command's


def joined() -> None:
  """Tells the watcher (if any) that this process has joined its run."""
  global _report_fd
  if _report_fd is not None:
    try:
      os.write(_report_fd, b"joined\n")
      os.close(_report_fd)
    except OSError:
      pass  # the watcher is gone; this process dies with it
    _report_fd = None


def _as_child(fd: str) -> None:
  global _report_fd
  del os.environ[ENV]  # the command's own subprocesses are no watched children
  _report_fd = int(fd)


def _wait(child: subprocess.Popen, waited: set) -> int:
  """Passes signals on to the child until it ends; its status (-N: killed by signal N)."""
  while child.poll() is None:
    info = signal.sigtimedwait(waited, 1.0)
    if info is None or info.si_signo == signal.SIGCHLD:
      continue
    if info.si_signo == signal.SIGINT and info.si_code == SI_KERNEL:
      continue  # a terminal's Ctrl-C: the child, in the same process group, has it already
    try:
      child.send_signal(info.si_signo)
    except ProcessLookupError:
      pass
  return child.returncode


def _joined(read_end: int) -> bool:
  os.set_blocking(read_end, False)
  try:
    return b"joined" in os.read(read_end, 64)
  except (BlockingIOError, OSError):
    return False


def _answers(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=ANSWER_WAIT_S):
      return True
  except OSError:
    return False
