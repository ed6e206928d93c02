"""The step watchdog (lra_core/runtime/watchdog.py): a run whose steps stop ends with every thread's stack in its
log and exit status 75 (the supervisors rerun it), within its limit; a run that keeps stepping does not."""

import fcntl
import logging
import subprocess
import sys
import threading
import time

import fixtures.listops
from lra_core import cli
from lra_core.runtime.watchdog import StepWatchdog


def test_the_limit_is_the_floor_or_a_multiple_of_the_median_step():
  dog = StepWatchdog(factor=10.0, floor_s=0.5, status=75)
  assert dog.limit_s() == 0.5
  dog._times.extend([0.01, 0.2, 0.1])  # recent steps: median 0.1 s
  assert dog.limit_s() == 1.0


def test_a_blocked_main_thread_is_reported_with_its_stack_and_ended(capfd):
  left = []
  ended = threading.Event()

  def leave(status, message):
    left.append((status, message))
    ended.set()

  def stuck_in_a_collective():
    ended.wait(10)

  with StepWatchdog(factor=5.0, floor_s=0.3, status=cli.EXIT_PREEMPTED, leave=leave, poll_s=0.05) as dog:
    for _ in range(5):  # a healthy run: no report
      time.sleep(0.02)
      dog.beat()
    assert not left
    start = time.monotonic()
    stuck_in_a_collective()
  assert 0.3 <= time.monotonic() - start < 3
  assert [status for status, _ in left] == [75]
  assert left[0][1].startswith("watchdog: no training step finished for ")
  assert "stuck_in_a_collective" in capfd.readouterr().err  # the main thread's stack, where it waits


STUCK_RUN = """
import sys; sys.argv[0] = "-m"  # a command, as `python -m lra_core.train` is (lra_core/runtime/quiet_start.py)
import time
from lra_core import cli, train
from lra_core.run import data_setup

check = data_setup.check_batch
def check_then_hang(batch, config, index):  # the data reader hangs before step 4's batch
  if index == 3:
    time.sleep(600)
  return check(batch, config, index)

data_setup.check_batch = check_then_hang
cli.run(lambda: train.main(sys.argv[1:]))
"""


def test_a_run_whose_steps_stop_exits_75_with_every_thread_s_stack(tmp_path):
  data = fixtures.listops.build(tmp_path / "data")
  overrides = [*data, "train.steps=50", "train.watchdog_min_s=3", "train.watchdog_factor=5", "train.test_at_end=False"]
  argv = [f"--config={fixtures.listops.SPEC}", f"--workdir={tmp_path / 'run'}", *(f"--config.{o}" for o in overrides)]
  start = time.monotonic()
  done = subprocess.run([sys.executable, "-c", STUCK_RUN, *argv], capture_output=True, text=True, timeout=300)
  assert done.returncode == cli.EXIT_PREEMPTED, done.stderr[-3000:]
  assert "watchdog: no training step finished for " in done.stderr
  assert "check_then_hang" in done.stderr and "Current thread" in done.stderr  # the stacks, the stuck one too
  assert time.monotonic() - start < 200


def test_a_log_handler_whose_file_was_closed_does_not_keep_the_watchdog_from_acting(capfd, tmp_path):
  """A handler left on the root logger with its file closed (by whatever opened it) raises on flush; the
  watchdog still dumps the stacks and ends the run (before, its thread died there and the run hung)."""
  file = open(tmp_path / "run.log", "w")
  handler = logging.StreamHandler(file)
  logging.getLogger().addHandler(handler)
  file.close()
  try:
    test_a_blocked_main_thread_is_reported_with_its_stack_and_ended(capfd)
  finally:
    logging.getLogger().removeHandler(handler)


STREAM_NOBODY_READS = """
import logging, sys, threading, time
from lra_core import cli
from lra_core.runtime import quiet_start
from lra_core.runtime.watchdog import StepWatchdog

quiet_start.WRITE_WAIT_S = 2.0
cli.setup_logging()
with StepWatchdog(factor=5.0, floor_s=1.0, status=cli.EXIT_PREEMPTED, poll_s=0.1):
  while True:  # the main thread logs until the stream takes no more: blocked in a write, the handler's lock held
    logging.info("a step " + "x" * 200)
"""


def test_a_log_stream_nobody_reads_does_not_hang_the_watchdog():
  """Stderr a pipe whose reader stalled (a launcher's ssh pipe): the main thread blocks in a log write,
  and the watchdog, whose stack dump and log line would block on the same stream (its line on the same
  handler's lock), still ends the process with 75 (it hung for ever before)."""
  proc = subprocess.Popen([sys.executable, "-c", STREAM_NOBODY_READS], stderr=subprocess.PIPE, stdout=subprocess.PIPE)
  try:
    fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # fills at once; nobody reads it
    status = proc.wait(timeout=60)
  finally:
    proc.kill()
    proc.wait()
  assert status == cli.EXIT_PREEMPTED
