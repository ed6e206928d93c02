"""Killed and restarted training ends exactly where an uninterrupted run ends, for every family.

For each registered model family's smoke config, the command `python -m lra_core.train` is started,
stopped with SIGTERM at a random training step (the run saves the step in flight, whichever step that
is), restarted with the same command, and run to the end. The Transformer's run is also killed with
SIGKILL at 5 random moments before that (the first during start-up, the others at random training steps
plus a random fraction of a step, so some land inside checkpoint writes): where a kill lands does not
depend on the family, what is restored does. The `param_checksum` must equal, bit for bit, that of an
uninterrupted run of the same command: the data position, root key, optimizer, model state (codebook
EMAs), carried state and LayerDrop masks all come back.
"""

import contextlib
import json
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import fixtures
import lra_core
import outputs
from lra_core import cli, registry, soak
from lra_core.runtime import fs
from lra_core.runtime.preemption import PreemptionNotice

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 9
RUN = [
  f"train.steps={STEPS}",
  "train.checkpoint_every=3",
  "train.log_every=1",
  "train.eval_batches=1",
  "train.test_at_end=False",
  "train.keep_checkpoints=2",
]

# Every registered family; the quick tier keeps the transformer's run.
FAMILIES = [
  pytest.param(f, id=f.name, marks=() if f.name == "transformer" else pytest.mark.slow) for f in registry.families()
]


# The runs are forked from a server that has imported the framework once (multiprocessing's
# forkserver), so each restart costs its own setup and tracing, not a fresh interpreter's imports.
# They inherit this process's XLA flags and use its compile cache: they run the very programs the
# uninterrupted run compiled.
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["lra_core.train", *registry.family_modules().values()])


def _train_main(argv, log, env):
  os.environ.update(env)  # the forkserver started with the environment of its first use
  fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  # The compiler's fast mode: these runs test state, not speed (read when the backend starts).
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  import jax

  jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from lra_core import cli, train

  cli.run(lambda: train.main(argv))


_FAKE_GCS_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def _start(argv, log):
  env = {k: v for k, v in os.environ.items() if k in _FAKE_GCS_ENV}
  proc = _SERVER.Process(target=_train_main, args=(argv, str(log), env))
  proc.start()
  return proc


def _logged_steps(log: pathlib.Path) -> int:
  """The newest step this attempt's progress lines ("step N/TOTAL ...") report (0 if none yet)."""
  return max((int(m) for m in re.findall(r" step (\d+)/\d+ ", log.read_text())), default=0)


def _run(argv, log) -> str:
  """Runs the command to its end (it must succeed) and returns its output."""
  log.write_text("")
  proc = _start(argv, log)
  proc.join(300)
  out = log.read_text()
  assert proc.exitcode == 0, out[-3000:]
  return out


def _interrupt(argv, log, sig, at_step, delay, timeout=120):
  """Starts the run and sends `sig` once it has logged `at_step` (None: `delay` s after start);
  returns its exit code and output."""
  log.write_text("")
  proc = _start(argv, log)
  start = time.monotonic()
  try:
    if at_step is None:
      time.sleep(delay)
    else:
      while _logged_steps(log) < at_step and proc.is_alive():
        assert time.monotonic() - start < timeout, "the run made no progress"
        time.sleep(0.002)
      time.sleep(delay)
    if proc.is_alive():
      os.kill(proc.pid, sig)
    proc.join(timeout)
  finally:
    proc.kill()
  return proc.exitcode, log.read_text()


def _resumed_steps(out: str) -> list[int]:
  return [
    int(line.split("resuming at step ")[1].split()[0]) for line in out.splitlines() if "resuming at step " in line
  ]


@pytest.mark.parametrize("family", FAMILIES)
def test_killed_and_restarted_run_matches_uninterrupted(family, tmp_path):
  smoke = family.smoke
  spec = smoke.config
  (tmp_path / "data").mkdir()
  overrides = [*fixtures.load(smoke.data).build(tmp_path / "data"), *RUN, *smoke.overrides, *smoke.light]
  lra_core.load_config(spec, overrides)  # a bad test config fails here, not in a child
  workdir, log = tmp_path / "interrupted", tmp_path / "run.log"
  argv = [f"--config={spec}", f"--workdir={workdir}", *(f"--config.{o}" for o in overrides)]
  _run([*argv[:1], f"--workdir={tmp_path / 'reference'}", *argv[2:]], log)
  reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
  rng = random.Random(family.name)
  # The Transformer: SIGKILL once during start-up and at four random steps; every family: SIGTERM.
  plan = []
  if family.name == "transformer":
    plan += [(signal.SIGKILL, None, rng.uniform(0.2, 1.5))]
    plan += [(signal.SIGKILL, rng.randint(1, STEPS - 1), rng.uniform(0, 0.05)) for _ in range(4)]
  plan += [(signal.SIGTERM, rng.randint(1, STEPS - 2), 0.0)]
  resumed_from = []
  for sig, at_step, delay in plan:
    code, out = _interrupt(argv, log, sig, at_step, delay)
    resumed_from += _resumed_steps(out)
    if code == 0 and "finished" in out:
      break  # the run got to its end before the signal arrived: nothing left to interrupt
    if sig == signal.SIGTERM:
      assert code == cli.EXIT_PREEMPTED and "preempted:" in out, out[-2000:]
    else:
      assert code == -signal.SIGKILL, out[-2000:]
  resumed_from += _resumed_steps(_run(argv, log))
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["param_checksum"] == reference["param_checksum"], (family.name, resumed_from)
  assert resumed_from and max(resumed_from) > 0, resumed_from  # the restarts really resumed mid-run
  # Every step is logged once, in metrics.jsonl and as TensorBoard shows it, with the values of
  # the uninterrupted run (steps logged after a checkpoint by a killed attempt were dropped).
  assert outputs.logged_once(workdir) == outputs.logged_once(tmp_path / "reference")


def _transformer_run(tmp_path):
  smoke = registry.family("transformer").smoke
  (tmp_path / "data").mkdir()
  overrides = [*fixtures.load(smoke.data).build(tmp_path / "data"), *RUN, *smoke.overrides, *smoke.light]
  workdir = tmp_path / "run"
  return [f"--config={smoke.config}", f"--workdir={workdir}", *(f"--config.{o}" for o in overrides)], workdir


def test_ctrl_c_saves_the_step_in_flight_exits_130_and_resumes_there(tmp_path):
  argv, workdir = _transformer_run(tmp_path)
  log = tmp_path / "run.log"
  code, out = _interrupt(argv, log, signal.SIGINT, 4, 0.0)
  said = [line for line in out.splitlines() if line.startswith("interrupted: ")]
  assert code == 130 and len(said) == 1 and "Traceback" not in out, out[-3000:]
  step = int(re.search(r"saved at step (\d+) ", said[0]).group(1))
  assert 4 <= step < STEPS and (workdir / "checkpoints" / str(step)).is_dir()
  assert _resumed_steps(_run(argv, log)) == [step]


def test_a_second_ctrl_c_aborts_at_once():
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are set from the main thread only")
  before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN under a shell's background job
  with PreemptionNotice() as notice:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs between bytecodes of the main thread
    assert notice.interrupted and notice.reached(1)
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)
  assert signal.getsignal(signal.SIGINT) is before  # restored


SECOND_CTRL_C_IN_A_CALLBACK = """
import sys; sys.argv[0] = "-m"  # a command, as `python -m lra_core.<command>` is (lra_core/runtime/quiet_start.py)
import gc, os, signal, time
from lra_core.runtime.preemption import PreemptionNotice

signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal delivers it, in the background too

def ctrl_c(*_):
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(0.5)  # the handler runs in this frame

with PreemptionNotice():
  ctrl_c()  # the first: the run goes on to the end of its step and saves
  # The second lands in a callback that only prints what it raises, as JAX's garbage-collection hook does.
  gc.callbacks.append(lambda phase, info: ctrl_c() if phase == "start" else None)
  gc.collect()
  print("saved anyway")
"""


def test_a_second_ctrl_c_in_a_command_leaves_at_once_with_130():
  """The command's side of the test above: a second Ctrl-C ends the command at once, with one line
  and exit status 130, even where it lands in a callback (raised there, the KeyboardInterrupt was
  printed as `Exception ignored in`, and the run saved anyway)."""
  done = subprocess.run(
    [sys.executable, "-c", SECOND_CTRL_C_IN_A_CALLBACK], capture_output=True, text=True, timeout=120
  )
  assert done.returncode == cli.EXIT_INTERRUPTED and "saved anyway" not in done.stdout, done.stderr[-3000:]
  assert done.stderr.strip().endswith("aborted (Ctrl-C).") and "Exception ignored" not in done.stderr, done.stderr


def test_ctrl_c_outside_the_loop_ends_with_one_line_and_130(capsys):
  def interrupted():
    raise KeyboardInterrupt

  with pytest.raises(SystemExit) as exit_:
    cli.run(interrupted)
  assert exit_.value.code == 130
  assert capsys.readouterr().err.strip().splitlines() == ["aborted (Ctrl-C)."]


@pytest.mark.slow
def test_a_run_killed_in_an_object_store_resumes_like_an_uninterrupted_one(tmp_path, fake_gcs):
  argv, _ = _transformer_run(tmp_path)
  log = tmp_path / "run.log"
  _run([argv[0], f"--workdir={tmp_path / 'reference'}", *argv[2:]], log)
  workdir = fake_gcs("killed")
  argv = [argv[0], f"--workdir={workdir}", *argv[2:]]
  resumed_from = []
  # SIGKILL once step 7 is logged: checkpoint 3 is complete (a save waits for the one before), the
  # steps logged after the newest complete checkpoint are trained and logged again.
  for at_step in (7, 8):
    code, out = _interrupt(argv, log, signal.SIGKILL, at_step, 0.0)
    resumed_from += _resumed_steps(out)
    if code == 0 and "finished" in out:
      break  # the resumed run got to its end first
    assert code == -signal.SIGKILL, out[-3000:]
  resumed_from += _resumed_steps(_run(argv, log))
  assert resumed_from and max(resumed_from) >= 3, resumed_from
  root = fs.path(workdir)
  summary = json.loads((root / "summary.json").read_text())
  expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
  assert summary["param_checksum"] == expected["param_checksum"], resumed_from
  # The outputs read back from the store: each step's metrics once, as the local run logged them; the run's
  # config; the newest train.keep_checkpoints checkpoints, the older ones deleted from the bucket.
  assert outputs.logged_once(workdir) == outputs.logged_once(tmp_path / "reference")
  assert json.loads((root / "config.json").read_text())["train"]["steps"] == STEPS
  steps = sorted(int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit())  # beside the write checks
  assert steps == [STEPS - 3, STEPS]


@pytest.mark.slow
def test_a_save_stuck_on_a_failing_store_gives_up_in_time_and_yields_to_sigterm(tmp_path, fake_gcs):
  """Every write of step 4's array data fails (503, retried by TensorStore for many minutes). The save of
  step 6 waits for step 4 at most train.save_timeout_s, then the run stops with one sentence naming the
  last complete checkpoint (2), from which the same command resumes once the store is back. A SIGTERM
  during such a wait ends the run after a grace (a quarter of the timeout here), with status 75."""
  argv, _ = _transformer_run(tmp_path)
  log = tmp_path / "run.log"
  fake_gcs.store.failing = re.compile(r"/checkpoints/4/state/.*/d/")
  try:
    workdir = fake_gcs("stuck")
    stuck = [
      argv[0],
      f"--workdir={workdir}",
      *argv[2:],
      "--config.train.save_timeout_s=8",
      "--config.train.checkpoint_every=2",
    ]
    log.write_text("")
    proc = _start(stuck, log)
    proc.join(120)
    said = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    assert proc.exitcode == cli.EXIT_USER_ERROR and len(said) == 1, log.read_text()[-3000:]
    assert said[0].endswith(
      "was still being written after 8 s (train.save_timeout_s): the store is failing or too "
      "slow; the last complete checkpoint is step 2."
    ), said
    sigterm = [
      argv[0],
      f"--workdir={fake_gcs('sigterm')}",
      *argv[2:],
      "--config.train.save_timeout_s=20",
      "--config.train.checkpoint_every=2",
    ]
    start = time.monotonic()
    code, out = _interrupt(sigterm, log, signal.SIGTERM, 6, 0.0)
    assert code == cli.EXIT_PREEMPTED and "saved at step 2 in" in out, out[-3000:]
    assert time.monotonic() - start < 60
  finally:
    fake_gcs.store.failing = None
  assert _resumed_steps(_run(stuck, log)) == [2]


def test_ctrl_c_while_the_steps_compile_ends_with_130_not_a_crash(tmp_path):
  """A Ctrl-C while the train and eval steps compile (sent once the model is built, before the train
  step's compile, which takes seconds where the tiny run after it takes one): one line and exit
  status 130, and no workdir left behind. (The interpreter's teardown under XLA's compile threads once
  crashed here, SIGSEGV, status 139: a command now leaves without it.)"""
  argv, workdir = _transformer_run(tmp_path)
  env = dict(os.environ, LRA_CORE_CACHE=str(tmp_path / "cache"))  # compiles for real: no cached steps
  # Ctrl-C as a terminal delivers it: a test run in the background inherits SIGINT ignored, which the
  # command would keep (Python installs its handler only where SIGINT is not ignored).
  restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
  command = [sys.executable, "-m", "lra_core.train", *argv]
  proc = subprocess.Popen(
    command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=restore
  )
  try:
    for line in proc.stderr:
      if " parameters" in line and "model " in line:
        sent = proc.poll() is None  # a host loaded enough to let the run end first proves nothing
        proc.send_signal(signal.SIGINT)
        break
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  if not sent:
    pytest.skip("the run ended before the Ctrl-C could be sent")
  assert proc.returncode == cli.EXIT_INTERRUPTED, err[-3000:]
  # (Should the first step have begun already, the run saves it and says so: 130 as well.)
  assert err.strip().endswith("aborted (Ctrl-C).") or "interrupted: " in out, err[-3000:]
  assert "Traceback" not in err and "Segmentation" not in err
  # Stopped before its first step, the start takes back what it made: no stub workdir is left.
  assert "interrupted: " in out or not workdir.exists(), sorted(p.name for p in workdir.iterdir())


def test_soak_labels_a_timed_kill_by_where_the_restart_was(tmp_path):
  """A kill timed within the reference's start-up can land after a resumed start's first steps (its
  compiles cached): the label says the step its log had reached, not "into start-up"."""
  log = tmp_path / "process0.log"
  log.write_text("12:00:00 INFO step 40/60 loss=1 | ETA 0:01\n")
  earlier = log.stat().st_size
  with log.open("a") as f:
    f.write("12:00:09 INFO step 44/60 loss=1 | ETA 0:01\n12:00:10 INFO step 48/60 loss=1 | ETA 0:01\n")
  assert soak.timed_kill_moment(22.1, soak.logged_step(log, earlier)) == "at step 48, timed at 22.1 s"
  assert soak.timed_kill_moment(3.04, soak.logged_step(log, log.stat().st_size)) == "in start-up, timed at 3.0 s"


def test_a_soak_stopped_by_sigterm_ends_its_run_processes(tmp_path):
  """A soak stopped (SIGTERM: a job's time limit; Ctrl-C the same) kills the two training processes it
  started: they were left training on, orphaned, their peer's soak gone."""
  workdir = tmp_path / "soak"
  proc = subprocess.Popen(
    [sys.executable, str(ROOT / "scripts" / "soak.py"), "--kills=1", "--steps=8", f"--workdir={workdir}"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    log = workdir / "logs" / "reference" / "process1.log"
    deadline = time.monotonic() + 120
    while not log.exists() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert log.exists(), "the soak started no run"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
  finally:
    proc.kill()
  time.sleep(0.5)
  running = []
  for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
      if f"--workdir={workdir}/reference".encode() in cmdline.read_bytes():
        running.append(cmdline.parent.name)
    except OSError:  # ended meanwhile
      pass
  for pid in running:  # not to leave them to the rest of the suite should the test fail
    with contextlib.suppress(OSError):
      os.kill(int(pid), signal.SIGKILL)
  assert not running, running


def _local_steps(local: pathlib.Path, process: int = 0) -> list[int]:
  return sorted(int(p.parent.name) for p in local.glob(f"*/process_{process}/*/meta.json"))


def _saved_steps(workdir: pathlib.Path) -> list[int]:
  """The workdir's complete checkpoints (an uncommitted one is a `N.orbax-checkpoint-tmp` folder)."""
  return sorted(int(p.name) for p in workdir.glob("checkpoints/*") if p.name.isdigit())


def test_a_kill_after_a_local_save_resumes_from_it_and_a_lost_local_disk_from_the_workdir(tmp_path):
  """train.local_checkpoint_every=1 beside the workdir's checkpoints: SIGKILLed mid-run, the restart
  starts from the newest local step (the workdir holding none past step 0), and after a second kill
  with the local folder gone, from the workdir's newest; both end bit-identical to the uninterrupted run."""
  argv, workdir = _transformer_run(tmp_path)
  log, local = tmp_path / "run.log", tmp_path / "local"
  _run([*argv[:1], f"--workdir={tmp_path / 'reference'}", *argv[2:]], log)
  reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
  tiered = [*argv, "--config.train.local_checkpoint_every=1", f"--config.train.local_checkpoint_dir={local}"]
  # Only local checkpoints before the end: the workdir's every 100 steps.
  code, _ = _interrupt([*tiered, "--config.train.checkpoint_every=100"], log, signal.SIGKILL, 4, 0.0)
  assert code == -signal.SIGKILL and not _saved_steps(workdir)
  newest = _local_steps(local)[-1]
  assert newest >= 3 and len(_local_steps(local)) == 2  # the newest two kept (step 4 may be cut short)
  # Killed again once the workdir holds a checkpoint and a newer local one exists.
  log.write_text("")
  proc, start = _start(tiered, log), time.monotonic()
  try:
    while not (_saved_steps(workdir) and _local_steps(local)[-1] > _saved_steps(workdir)[-1]) and proc.is_alive():
      assert time.monotonic() - start < 120, "the run made no progress"
      time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
  finally:
    proc.kill()
  out = log.read_text()
  assert f"resuming at step {newest} (data position {newest}) from the local checkpoint in {local}" in out, out[-3000:]
  assert proc.exitcode == -signal.SIGKILL, out[-3000:]
  shutil.rmtree(local)  # the host lost its disk
  persistent = _saved_steps(workdir)[-1]
  out = _run(tiered, log)
  assert _resumed_steps(out) == [persistent] and "from the local checkpoint" not in out, out[-3000:]
  assert json.loads((workdir / "summary.json").read_text())["param_checksum"] == reference["param_checksum"]
