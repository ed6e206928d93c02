"""One run per workdir (lra_core/runtime/run_lock.py), and workdirs the trainer cannot write: refused with one
sentence before anything is written or compiled."""

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest

import fixtures.listops
import lra_core
from lra_core import cli
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.errors import ConfigError
from lra_core.runtime import run_lock
from lra_core.train import train_and_evaluate

FAST = ["train.steps=2", "train.test_at_end=False", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  data = fixtures.listops.build(tmp_path_factory.mktemp("listops"))
  return lra_core.load_config(fixtures.listops.SPEC, [*data, *FAST])


@pytest.fixture
def other_process():
  """A live process that is not this one (stands in for a run holding the lock)."""
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  yield proc
  proc.kill()
  proc.wait()


def _lock(workdir, **record):
  workdir.mkdir(parents=True, exist_ok=True)
  base = {"host": socket.gethostname(), "started": "2026-11-27T08:00:00+00:00", "id": "x", "heartbeat": time.time()}
  (workdir / run_lock.NAME).write_text(json.dumps({**base, **record}))


def test_a_second_run_on_a_live_workdir_is_refused_with_one_sentence(config, other_process, tmp_path):
  workdir = tmp_path / "run"
  _lock(workdir, pid=other_process.pid)
  with pytest.raises(run_lock.WorkdirInUse) as refused:
    train_and_evaluate(config, workdir)
  message = str(refused.value)
  assert f"pid {other_process.pid}" in message and socket.gethostname() in message and "2026-11-27T08:00" in message
  assert "\n" not in message and message.endswith(".")
  assert sorted(p.name for p in workdir.iterdir()) == [run_lock.NAME]  # nothing written, the lock kept
  assert json.loads((workdir / run_lock.NAME).read_text())["pid"] == other_process.pid


def test_the_lock_of_a_killed_run_is_taken_over_and_given_back_at_the_end(config, tmp_path, caplog, monkeypatch):
  """The holder was SIGKILLed (its pid is gone on this host); another host's lock without a heartbeat
  for STALE_S is taken over too, and a finished run leaves no lock."""
  killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  killed.kill()
  killed.wait()
  workdir = tmp_path / "run"
  _lock(workdir, pid=killed.pid)
  assert "step" in train_and_evaluate(config, workdir)
  assert "taking over the lock" in caplog.text and f"(pid {killed.pid}), which is gone" in caplog.text
  assert not (workdir / run_lock.NAME).exists()
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)  # how long a stale-looking lock is watched, too
  _lock(workdir, host="another-host", pid=1, heartbeat=time.time() - run_lock.STALE_S - 1)
  with run_lock.RunLock(workdir):
    assert json.loads((workdir / run_lock.NAME).read_text())["pid"] == os.getpid()
  _lock(workdir, host="another-host", pid=1, heartbeat=time.time() - run_lock.STALE_S - 1)
  with run_lock.RunLock(workdir):  # the holder renews its heartbeat (a rename: never half-written)
    first = json.loads((workdir / run_lock.NAME).read_text())["heartbeat"]
    time.sleep(0.3)
    assert json.loads((workdir / run_lock.NAME).read_text())["heartbeat"] > first
  (workdir / run_lock.NAME).write_text("")  # a lock being created this instant: not taken over
  with pytest.raises(run_lock.WorkdirInUse):
    run_lock.RunLock(workdir).acquire()
  old = time.time() - 60
  os.utime(workdir / run_lock.NAME, (old, old))  # left empty by a run killed while creating it: taken over
  with run_lock.RunLock(workdir):
    pass
  _lock(workdir, host="another-host", pid=1)  # its heartbeat is fresh: that run may be alive
  with pytest.raises(run_lock.WorkdirInUse, match="on host another-host"):
    run_lock.RunLock(workdir).acquire()


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="POSIX permissions; root writes anyway")
def test_a_read_only_workdir_is_one_sentence(config, tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  workdir.chmod(stat.S_IRUSR | stat.S_IXUSR)
  try:
    with pytest.raises(ConfigError, match=r"workdir .* cannot be written \(Permission denied\); give a writable"):
      train_and_evaluate(config, workdir)
  finally:
    workdir.chmod(stat.S_IRWXU)


@pytest.mark.parametrize(
  "code, said", [(errno.EROFS, "Read-only file system"), (errno.ENOSPC, "No space left on device")]
)
def test_a_read_only_or_full_file_system_is_one_sentence(config, tmp_path, monkeypatch, code, said):
  """The lock is the run's first write: the file system's refusal (simulated here, since this suite may
  run as root on a writable disk) becomes one sentence with the system's reason."""

  def refuse(path, *args, **kwargs):
    raise OSError(code, os.strerror(code), path)

  monkeypatch.setattr(run_lock.os, "open", refuse)
  with pytest.raises(ConfigError, match=rf"workdir .* cannot be written \({said}\); give a writable folder"):
    train_and_evaluate(config, tmp_path / "run")


def test_a_workdir_that_is_a_file_is_one_sentence_and_exit_status_2(config, tmp_path, capsys):
  workdir = tmp_path / "run"
  workdir.write_text("my notes")
  with pytest.raises(SystemExit) as exit_:
    cli.run(lambda: train_and_evaluate(config, workdir))
  assert exit_.value.code == cli.EXIT_USER_ERROR
  assert capsys.readouterr().err.strip().splitlines() == [
    f"error: workdir {workdir} is a file, not a folder; give a folder (it is created if missing)."
  ]
  assert workdir.read_text() == "my notes"


def test_a_workdir_whose_path_reads_as_another_pattern_is_refused_before_anything_is_written(config, tmp_path):
  """The checkpoint library finds a step's files by a glob under the step's path: `lr[1e-3]` saved
  checkpoints that no resume could read. Refused at start; characters a pattern matches as themselves
  (`*`, `?`, a lone bracket) save and read back."""
  workdir = tmp_path / "lr[1e-3]" / "run"
  with pytest.raises(ConfigError, match=r"cannot hold checkpoints: .* 'lr\[1e-3\]' holds a \[\.\.\.\] set"):
    train_and_evaluate(config, workdir)
  assert not (tmp_path / "lr[1e-3]").exists()
  odd = tmp_path / "lr[x*?" / "run"
  saver = Checkpointer(odd, async_save=False)
  saver.save(1, {"w": jnp.arange(3.0)}, {})
  saver.close()
  state, _ = Checkpointer(odd).restore(1, None)
  assert state["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_live_run_on_a_host_whose_clock_is_behind_keeps_its_lock(tmp_path, monkeypatch):
  """Seen from a host whose clock is 400 s ahead, a live run's heartbeats look 400 s old: the lock is
  watched, found renewed, and refused; once its heartbeats stop, it is taken over."""
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  workdir = tmp_path / "run"
  skew = 400.0
  _lock(workdir, host="another-host", pid=1, heartbeat=time.time() - skew)
  stop = threading.Event()

  def live_holder():  # its own clock: every beat 400 s behind this host's
    while not stop.wait(run_lock.HEARTBEAT_S):
      _lock(workdir, host="another-host", pid=1, heartbeat=time.time() - skew)

  beating = threading.Thread(target=live_holder, daemon=True)
  beating.start()
  try:
    with pytest.raises(run_lock.WorkdirInUse, match="on host another-host"):
      run_lock.RunLock(workdir).acquire()
  finally:
    stop.set()
    beating.join()
  with run_lock.RunLock(workdir):  # killed: the same record, no more beats
    assert json.loads((workdir / run_lock.NAME).read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("how", ["a file in its place", "a read-only file system"])
def test_checkpoints_that_cannot_be_written_are_one_sentence_before_the_first_step(config, tmp_path, monkeypatch, how):
  """Found at the first save, it cost a whole checkpoint interval of training."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  if how == "a file in its place":
    (workdir / "checkpoints").write_text("")
  else:
    from etils import epath

    write = epath.Path.write_text

    def refuse(self, *args, **kwargs):  # under checkpoints/ only: the run's other files are elsewhere
      if self.parent.name != "checkpoints":
        return write(self, *args, **kwargs)
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(self))

    monkeypatch.setattr(epath.Path, "write_text", refuse)
  started = []
  monkeypatch.setattr("lra_core.train._compile_train_step", lambda *a: started.append(1))
  with pytest.raises(
    ConfigError, match=r"^checkpoints cannot be written to .*run/checkpoints \(.+\); make it a writable"
  ):
    train_and_evaluate(config, workdir)
  assert not started


def test_a_bucket_s_checkpoints_folder_stays_once_checked_so_no_peer_lists_it_vanishing(fake_gcs, monkeypatch):
  """A store's folder exists only while an object is in it: a write check that removed its probe made
  `checkpoints/` appear and vanish under a peer's exists()-then-listing (orbax's), whose listing then
  failed with a FileNotFoundError. Each process index's probe stays; a restart rewrites it."""
  from lra_core.checkpoints import checkpointer
  from lra_core.runtime import fs

  workdir = fs.path(fake_gcs())
  for index in (0, 1, 0):
    monkeypatch.setattr("jax.process_index", lambda: index)
    checkpointer.check_writable(workdir)
    assert (workdir / "checkpoints").is_dir()
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [".write_check.0", ".write_check.1"]
  assert Checkpointer(workdir).all_steps() == []


def test_two_runs_racing_for_a_bucket_s_lock_cannot_both_win(fake_gcs, monkeypatch):
  """On gs:// the lock is the store's conditional create: a second run that saw no lock (the first's
  write not yet there when it looked) still fails to create one, where writing and reading back let it
  overwrite the first's and start too."""
  from lra_core.runtime import fs

  workdir = fs.path(fake_gcs())
  with run_lock.RunLock(workdir) as first:
    second = run_lock.RunLock(workdir)
    monkeypatch.setattr(second, "_read", lambda: None)  # it looked before the first had written
    assert second._create() is False
    assert json.loads((workdir / run_lock.NAME).read_text())["id"] == first.record["id"]
  assert not (workdir / run_lock.NAME).exists()
