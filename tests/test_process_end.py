"""How a process of a multi-process run ends: one line, naming the cause, and that cause's status, at
every interleaving of the watchdog (a peer's failure) and the main thread (its own failure).

The process here is process 1 of 2 over a fake coordination store; `quiet_start.leave_now`, the one place
a command exits early, records its first call as the process's exit (status, and what stderr held then:
`os._exit` ends every other thread there) instead of exiting. Each case stops one thread at one step of
its way out (before it claims the end, holding the claim with its line unsaid, acknowledging, leaving)
and runs the other thread to its end before letting the first go on. One case runs as a real process:
a line said while the main thread's stderr passes through the start-up filter reaches stderr."""

import fcntl
import json
import logging
import random
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

from lra_core import cli
from lra_core.errors import ConfigError
from lra_core.runtime import process_end, quiet_start

PEER_STATUS = 75  # the failing peer's status (stuck): unlike every status of this process's own causes
PEER_LINE = "process 0 failed: watchdog: no training step finished for 900 s."
# This process's own way to end, each with its line's start (None: a crash, its traceback) and status.
ACTIONS = {
  "bad_input": ("error: workdir x is in use", cli.EXIT_USER_ERROR),
  "crash": (None, cli.EXIT_CRASH),
  "lost_peer": ("error: process 0 dropped out of a collective", process_end.EXIT_PEER_FAILED),
  "ctrl_c": ("aborted (Ctrl-C).", cli.EXIT_INTERRUPTED),
}
# The steps of a thread's way out, in order; at "claim" it has not claimed the end yet.
STEPS = ("claim", "print", "acknowledge", "leave")


class _Exited(BaseException):
  """The thread that called leave_now: in a real process nothing runs after it."""


class _Store:
  """The coordination service's key-value store, as the watchdog and report_failure use it."""

  def __init__(self):
    self.values, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    with self.lock:
      if key in self.values:
        return self.values[key]
    raise RuntimeError("DEADLINE_EXCEEDED")  # at once: nobody else acknowledges here

  def key_value_dir_get(self, prefix):
    with self.lock:
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix + "/")]


class _Process:
  """Process 1 of 2: its stderr, its first exit, and a gate that holds one thread at one step."""

  def __init__(self, monkeypatch, capsys):
    self.store, self.capsys, self.exits = _Store(), capsys, []
    self.lock = threading.Lock()
    self.hold: tuple[str, str] | None = None  # (thread name, step)
    self.reached, self.go = threading.Event(), threading.Event()
    self.jitter = None  # a random pause at every step (the stress loop), instead of a hold
    monkeypatch.setattr(process_end, "coordination_client", lambda: self.store)
    monkeypatch.setattr(process_end, "_claim", None)
    monkeypatch.setattr(process_end, "FAILURE_GRACE_S", 0.2)
    monkeypatch.setattr(process_end, "CLAIMANT_WAIT_S", 0.3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(quiet_start, "leave_now", self._leave_now)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # a real process exits next; pytest's handlers stay
    claim_end, acknowledge = process_end.claim_end, process_end._acknowledge

    def claim(*args):
      self.step("claim")
      return claim_end(*args)

    def said(*args, **kwargs):  # inside the claim: its lock held, the line not out yet
      self.step("print")
      print(*args, **kwargs)

    def acknowledged(*args):
      self.step("acknowledge")
      return acknowledge(*args)

    monkeypatch.setattr(process_end, "claim_end", claim)
    monkeypatch.setattr(process_end, "print", said, raising=False)
    monkeypatch.setattr(process_end, "_acknowledge", acknowledged)
    self.watchdog = process_end._Watchdog(self.store, 1, 2)
    monkeypatch.setattr(process_end, "_watchdog", self.watchdog)

  def step(self, name):
    if self.jitter is not None:
      time.sleep(self.jitter.uniform(0, 0.003))
    elif self.hold == (threading.current_thread().name, name):
      self.hold = None
      self.reached.set()
      assert self.go.wait(10)

  def _leave_now(self, status):
    self.step("leave")
    with self.lock:
      if not self.exits:
        self.exits.append((status, self.capsys.readouterr().err, threading.current_thread().name))
    raise _Exited

  def thread(self, name, target, *, first=None):
    def run():
      try:
        if first is not None:
          first()
        target()
      except (_Exited, SystemExit):
        pass

    return threading.Thread(target=run, name=name, daemon=True)

  def peer_fails(self, first=None):
    """Process 0's report in the store, and this process's watchdog, which reads it (after `first`)."""
    try:
      self.store.key_value_set(process_end.FAILURE_KEY, json.dumps(dict(process=0, status=PEER_STATUS, line=PEER_LINE)))
    except RuntimeError:  # this process reported first: the peer's watchdog reads that (the real store's order)
      pass
    return self.thread("watchdog", self.watchdog._watch, first=first)


def _own_failure(action):
  """This process's main thread failing on its own (as lra_core.cli.run handles it)."""

  def bad_input():
    cli._failed(ConfigError("workdir x is in use by the run started 2026-11-28."))

  def crash():
    cli._failed(RuntimeError("a bug"))

  def lost_peer():
    process_end.stop_for_lost_peer("process 0 dropped out of a collective (Gloo: Connection closed by peer)")

  def ctrl_c():
    def interrupted():
      raise KeyboardInterrupt

    cli.run(interrupted)

  return dict(bad_input=bad_input, crash=crash, lost_peer=lost_peer, ctrl_c=ctrl_c)[action]


def _check(process, claimant, action):
  """The process left once, with the claimant's status, having said the claimant's line and no other."""
  assert process.exits, "nobody left"
  status, err, _ = process.exits[0]
  lines = [line for line in err.splitlines() if line.startswith(("error:", "aborted"))]
  if claimant == "watchdog":
    assert status == PEER_STATUS, (status, err)
    assert lines == [f"error: {PEER_LINE[:-1]}; stopping process 1 as well."], err
  else:
    start, own_status = ACTIONS[action]
    assert status == own_status, (status, err)
    if start is None:
      assert lines == [] and "RuntimeError: a bug" in err, err
    else:
      assert len(lines) == 1 and lines[0].startswith(start), err


def _run(process, first, other, started=False):
  """Starts `first` (held at its step), then runs `other` to its end (or to where it waits for the
  held thread, its answer fixed by then), then lets `first` go on."""
  if not started:
    first.start()
    assert process.reached.wait(10)
  other.start()
  other.join(1.0)  # a thread waiting on the held one's claim stays waiting: its outcome is fixed
  process.go.set()
  first.join(10)
  other.join(10)
  assert not first.is_alive() and not other.is_alive()


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("action", ACTIONS)
def test_the_watchdog_held_at_each_step_while_the_main_thread_fails(monkeypatch, capsys, step, action):
  """The watchdog has read a peer's failure and stops at `step`; the main thread then fails by itself.
  Held before its claim, the main thread's own cause ends the process; held after it, the peer's."""
  process = _Process(monkeypatch, capsys)
  process.hold = ("watchdog", step)
  watchdog = process.peer_fails()
  _run(process, watchdog, process.thread("main", _own_failure(action)))
  _check(process, "main" if step == "claim" else "watchdog", action)


# The steps each of the main thread's own failures passes: a crash says no line of its own, and a lost
# peer's end acknowledges nothing.
OWN_STEPS = [
  (step, action)
  for action in ACTIONS
  for step in STEPS
  if (step, action) not in (("print", "crash"), ("acknowledge", "lost_peer"))
]


@pytest.mark.parametrize("step, action", OWN_STEPS)
def test_the_main_thread_held_at_each_step_of_its_own_failure_as_a_peer_s_arrives(monkeypatch, capsys, step, action):
  """The main thread fails by itself and stops at `step`; the peer's report then arrives. Held before
  its claim, the peer's cause ends the process; held after it, its own."""
  process = _Process(monkeypatch, capsys)
  process.hold = ("main", step)
  main = process.thread("main", _own_failure(action))
  main.start()
  assert process.reached.wait(10)
  watchdog = process.peer_fails()
  _run(process, main, watchdog, started=True)
  _check(process, "watchdog" if step == "claim" else "main", action)


@pytest.mark.slow
@pytest.mark.parametrize("action", ACTIONS)
def test_both_threads_at_once_with_random_pauses_at_every_step(monkeypatch, capsys, action):
  """300 runs of both ways out at once, each step after a random pause of up to 3 ms: whichever claims
  first, the process says exactly its line and leaves with its status."""
  seen = set()
  for seed in range(300):
    with monkeypatch.context() as m:
      process = _Process(m, capsys)
      process.jitter = random.Random(seed)
      m.setattr(process_end, "CLAIMANT_WAIT_S", 0.02)
      # Both leave a barrier together, each after its own random delay of up to 10 ms: longer than either
      # way takes to its claim, so that each thread claims first in many of the runs.
      together = threading.Barrier(2)
      delays = [process.jitter.uniform(0, 0.01) for _ in range(2)]
      starts = [lambda d=d: (together.wait(10), time.sleep(d)) for d in delays]
      watchdog = process.peer_fails(first=starts[0])
      main = process.thread("main", _own_failure(action), first=starts[1])
      watchdog.start()
      main.start()
      watchdog.join(10)
      main.join(10)
      assert not watchdog.is_alive() and not main.is_alive()
      claimant = "main" if process_end._claim[1] is main else "watchdog"
      seen.add(claimant)
      _check(process, claimant, action)
  assert seen == {"main", "watchdog"}, seen  # both orders happened


@pytest.mark.parametrize("main_thread", ["waiting", "holding the interpreter"])
def test_a_line_said_while_the_main_thread_starts_the_backends_reaches_stderr(main_thread):
  """Fd 2 goes to the start-up filter's file while the backends start (lra_core/runtime/quiet_start.py); a process 1
  slow there, its watchdog saying process 0's failure and exiting, lost the line (a clean-clone run:
  status 2, nothing said), or its end when the main thread held the interpreter (starting a backend
  in native code; here a long multiplication) while the filter was a pipe whose drain thread had to
  run before the exit. A real process: os._exit ends it."""
  hold = "for _ in range(2): big * big" if main_thread != "waiting" else "time.sleep(30)"
  script = textwrap.dedent(f"""
    import sys, threading, time
    from lra_core.runtime import process_end
    from lra_core.runtime import quiet_start
    big = 3 ** 4_000_000
    with quiet_start.noise_dropped():
      print("the backends start", file=sys.stderr, flush=True)
      said = threading.Event()
      def watchdog():
        process_end.claim_end("error: {PEER_LINE}", 2)
        said.set()
        process_end.leave(2, process=1)
      threading.Thread(target=watchdog).start()
      said.wait()
      {hold}
    print("not reached", file=sys.stderr)
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == 2, done.stderr
  assert done.stderr.endswith(f"the backends start\nerror: {PEER_LINE}\n"), done.stderr


def test_a_line_said_as_the_start_up_filter_begins_reaches_stderr():
  """The watchdog saying a peer's failure and leaving at the moment the main thread enters the filter:
  fd 2 moved to the filter's file before the filter was listed for `leave_now`, and a line written in
  between died with the process (process 1 of a run whose process 0 failed at once: status 2, nothing
  said, under load). A real process: os._exit ends it."""
  script = textwrap.dedent(f"""
    import sys
    from lra_core.runtime import process_end, quiet_start

    class Listed(list):
      def append(self, item):  # the watchdog runs here: says its line, leaves
        process_end.claim_end("error: {PEER_LINE}", 2)
        process_end.leave(2, process=1)

    quiet_start._FILTERS = Listed()
    with quiet_start.noise_dropped():
      print("not reached", file=sys.stderr)
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and done.stderr.endswith(f"error: {PEER_LINE}\n"), done.stderr


@pytest.mark.parametrize(
  "line",
  [
    "process 0 failed: workdir x is in use (use another workdir).",
    "process 0 failed: workdir x is in use (use another workdir).\n",
    "process 0 failed: workdir x is in use (use another workdir). ",
    "process 0 failed: workdir x is in use (use another workdir)",
  ],
)
def test_a_forwarded_sentence_ends_in_one_full_stop(line):
  """A peer's sentence said by this process: its own end dropped (it read `...another workdir).; stopping
  process 1 as well.` where the sentence ended in a full stop and a space)."""
  assert process_end.forwarded(line, 1) == (
    "error: process 0 failed: workdir x is in use (use another workdir); stopping process 1 as well."
  )


PEER_FAILS_WHILE_NOBODY_READS = f"""
import logging, threading, time
from lra_core import cli
from lra_core.runtime import process_end, quiet_start

quiet_start.WRITE_WAIT_S = 2.0
cli.setup_logging()

def watchdog():  # a peer's failure arrives while the main thread is blocked in a log write
  time.sleep(2)
  process_end.claim_end("error: {PEER_LINE}", {PEER_STATUS})
  process_end.leave({PEER_STATUS}, process=1)

threading.Thread(target=watchdog, daemon=True).start()
while True:
  logging.info("a step " + "x" * 200)
"""


def test_a_peer_s_failure_ends_a_process_whose_log_stream_nobody_reads():
  """Stderr a pipe whose reader stalled: the watchdog's line cannot be written, and the process still
  exits with the peer's status (it hung for ever in that write before)."""
  proc = subprocess.Popen(
    [sys.executable, "-c", PEER_FAILS_WHILE_NOBODY_READS], stderr=subprocess.PIPE, stdout=subprocess.PIPE
  )
  try:
    fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    status = proc.wait(timeout=60)
  finally:
    proc.kill()
    proc.wait()
  assert status == PEER_STATUS
