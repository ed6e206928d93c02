"""lra_core/runtime/coordinator_watch.py: a process of a multi-process run other than process 0 runs its
command as a child; the child's status and signals pass through, and its abort once joined, with the
coordinator gone, becomes one sentence and status 1. Without JAX: the child stands in for the command.
The two-process case (process 0 SIGKILLed during its commit) is in test_multiprocess.py."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from lra_core.runtime.exit_codes import EXIT_CRASH, EXIT_PREEMPTED

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMAND = """
import os, signal, sys, time
from lra_core.runtime import coordinator_watch
coordinator_watch.start(1, sys.argv[1], in_command=True)
print("child", os.getpid(), flush=True)
if sys.argv[2] == "joins and aborts":
  coordinator_watch.joined()
  os.abort()
if sys.argv[2] == "aborts before joining":
  os.abort()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
time.sleep(60)
"""


def _closed_port() -> str:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return f"localhost:{s.getsockname()[1]}"


def _start(address, mode):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.Popen(
    [sys.executable, "-c", COMMAND, address, mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _child(watcher) -> int:
  line = watcher.stdout.readline()
  assert line.startswith("child "), line
  child = int(line.split()[1])
  assert child != watcher.pid
  return child


def _gone(pid: int) -> bool:
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


@pytest.mark.skipif(sys.platform != "linux", reason="the watcher runs on Linux only")
def test_an_abort_once_joined_with_the_coordinator_gone_is_one_sentence_and_status_1():
  address = _closed_port()
  watcher = _start(address, "joins and aborts")
  _, err = watcher.communicate(timeout=60)
  said = [line for line in err.splitlines() if line.startswith("error: ")]
  assert watcher.returncode == EXIT_CRASH and said == [
    f"error: process 0, the run's coordinator at {address}, stopped answering: it was killed or its host was lost; "
    "stopping process 1 as well."
  ], err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the watcher runs on Linux only")
@pytest.mark.parametrize("mode", ["joins and aborts", "aborts before joining"])
def test_an_abort_while_the_coordinator_answers_or_before_joining_passes_through(mode):
  with socket.socket() as coordinator:
    coordinator.bind(("localhost", 0))
    coordinator.listen()
    watcher = _start(
      f"localhost:{coordinator.getsockname()[1]}" if mode == "joins and aborts" else _closed_port(), mode
    )
    _, err = watcher.communicate(timeout=60)
  assert watcher.returncode == -signal.SIGABRT and "error: " not in err, err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the watcher runs on Linux only")
def test_a_sigterm_to_the_watcher_reaches_the_command_and_a_sigkill_ends_both():
  watcher = _start(_closed_port(), "waits")
  _child(watcher)
  watcher.send_signal(signal.SIGTERM)
  assert watcher.wait(timeout=30) == EXIT_PREEMPTED  # the command's own status for it
  watcher = _start(_closed_port(), "waits")
  child = _child(watcher)
  watcher.kill()
  watcher.wait()
  assert _gone(child)
