"""Two processes joined by jax.distributed (localhost coordinator, 2 CPU devices each) train,
checkpoint, stop, resume and finish like one process with the same global batch.

The first half runs data-parallel across the processes with FSDP inside each (data 2 x fsdp 2);
the second half resumes that checkpoint on FSDP across both processes (fsdp 4), where no process
holds a whole parameter.

Faults, with that run as the oracle: a checkpoint that only one process cannot read (both resume
from the same older step), and an error on one process (every process exits within seconds)."""

import fcntl
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE, HOST_COLLECTIVES

import lra_core
from fixtures import c4_mlm, listops, mounts
from lra_core import cli, layout
from lra_core.bench.shardings import parameter_layout
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.errors import ConfigError
from lra_core.run import optim
from lra_core.run.metrics import read_metrics
from lra_core.run.state import make_state_spec
from lra_core.runtime import distributed, process_end
from lra_core.train import train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Data over the two processes x fsdp over each process's two devices; batch 8 -> 2 rows a device.
MESH = ["mesh.data=2", "mesh.fsdp=-1"]
# Then fsdp over all four devices of both processes.
FSDP_ACROSS = ["mesh.data=1", "mesh.fsdp=-1"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(
  overrides,
  workdir,
  *extra,
  check=True,
  spec=listops.SPEC,
  send=None,
  act=None,
  command=("-m", "lra_core.train"),
  own=((), ()),
  wrap=(),
  piped=None,
):
  """Runs `python -m lra_core.train` (or `command`) as process 0 and 1 of one run; returns their outputs
  (with check=False: [(exit status, output, seconds from start to exit)] of each). send=(i, signal, ready):
  the signal to process i once ready() is true; act=(ready, action): action() once ready() is true; the
  seconds are then counted from that moment. own[i]: arguments given to process i alone. wrap: a prefix
  of both commands (a mount namespace's nsenter). piped=(i, drained): process i writes to a 4 KiB pipe
  that is read only while drained() is true, as a launcher's stalled ssh pipe."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=str(ROOT),
    # 2 devices a process; the compiler's fast mode keeps this test cheap; collectives wait out a loaded host.
    XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE} {HOST_COLLECTIVES}",
    # A folder of their own, as a multi-process run keeps its entries apart (lra_core/compilation/compile_cache.py).
    JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache" / "two_processes"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
  )
  port = _free_port()
  args = [
    *wrap,
    sys.executable,
    *command,
    f"--config={spec}",
    f"--workdir={workdir}",
    *(f"--config.{o}" for o in overrides),
    f"--coordinator_address=localhost:{port}",
    "--num_processes=2",
    *extra,
  ]
  # Output goes to files, not pipes: a process whose pipe nobody reads while it runs blocks in its
  # write once 64 KiB are waiting, and its peer then waits in a collective until the time limit.
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  if piped is not None:
    logs[piped[0]] = _Stalling(piped[1])
  procs = [
    subprocess.Popen(
      [*args, f"--process_id={i}", *own[i]],
      env=env,
      cwd=ROOT,
      stdout=log.fileno(),
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i, log in enumerate(logs)
  ]
  start = time.monotonic()
  ended = {}
  try:
    while len(ended) < len(procs) and time.monotonic() - start < 300:
      if send is not None and send[2]():
        procs[send[0]].send_signal(send[1])
        send, start = None, time.monotonic()
      if act is not None and act[0]():
        act[1]()
        act, start = None, time.monotonic()
      ended.update(
        {i: time.monotonic() - start for i, p in enumerate(procs) if i not in ended and p.poll() is not None}
      )
      time.sleep(0.1)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  if not check:
    return [(p.returncode, out, ended.get(i)) for i, (p, out) in enumerate(zip(procs, outputs))]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return outputs


class _Stalling:
  """A process's output pipe, shrunk to 4 KiB, that is read only while drained() holds; what it read,
  and what is left in the pipe at the end, is the process's output."""

  def __init__(self, drained):
    self.read_end, self.write_end = os.pipe()
    fcntl.fcntl(self.read_end, 1031, 4096)  # F_SETPIPE_SZ
    self.text = []
    self.reader = threading.Thread(target=self._read, args=(drained,), daemon=True)
    self.reader.start()

  def _read(self, drained):
    while drained():
      chunk = os.read(self.read_end, 1024)
      if not chunk:
        return
      self.text.append(chunk)
    # Then full at once, as a stalled reader's pipe ends up (else the run logs ~40 more steps to fill it).
    while struct.unpack("i", fcntl.ioctl(self.read_end, termios.FIONREAD, b"\0" * 4))[0] < 4096:
      os.write(self.write_end, b"\n")  # blocks only once the process's own writes have filled it

  def fileno(self):
    return self.write_end

  def seek(self, _):
    os.set_blocking(self.read_end, False)
    self.reader.join(1)  # a reader left blocked in its read takes the next chunk: this output too
    try:
      while chunk := os.read(self.read_end, 1 << 16):
        self.text.append(chunk)
    except BlockingIOError:
      pass

  def read(self):
    return b"".join(self.text).decode(errors="replace")

  def close(self):
    os.close(self.read_end)
    os.close(self.write_end)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multiprocess")
  overrides = listops.build(root / "data") + MESH
  two = root / "two_processes"
  first = _launch(overrides, two, "--stop_at_step=2")
  second = _launch([*overrides, *FSDP_ACROSS], two)
  one = root / "one_process"
  # The same mesh in this process (whose 8 devices would otherwise all go to fsdp).
  config = lra_core.load_config(listops.SPEC, [*overrides, "mesh.fsdp=2"])
  summary = train_and_evaluate(config, one)
  return config, two, first, second, one, summary, overrides


@pytest.mark.slow
def test_two_processes_resume_and_match_one_process(runs):
  config, two, first, second, one, summary, _ = runs
  for out in first + second:
    assert "train step compiled in" in out and "per device" in out  # the AOT memory report
  # Each process times its own CPU for the MFU's peak (process 1 once timed process 0's device: 1e15 FLOP/s).
  peaks = [float(re.search(r"MFU: \S+ model FLOPs per step over (\S+) FLOP/s", out).group(1)) for out in first]
  assert all(1e8 < p < 1e13 for p in peaks) and max(peaks) < 10 * min(peaks), peaks
  assert all(
    "mesh {'data': 2, 'fsdp': 2, 'sequence': 1, 'tensor': 1} over 4 cpu device(s), 2 process(es)" in out
    for out in first
  )
  assert all(
    "mesh {'data': 1, 'fsdp': 4, 'sequence': 1, 'tensor': 1} over 4 cpu device(s), 2 process(es)" in out
    for out in second
  )
  assert all("stopped" in out and "at step 2" in out for out in first)
  assert all("resuming at step 2 (data position 2)" in out for out in second)
  # Process 0 alone writes the metrics and the summary.
  two_summary = json.loads((two / "summary.json").read_text())
  assert [r["step"] for r in read_metrics(two) if "train_loss" in r] == [1, 2, 3, 4]
  # The same global batches: the cross-process sums add in another order (gloo), so equal to
  # float32 rounding, not bit for bit.
  np.testing.assert_allclose(two_summary["param_checksum"], summary["param_checksum"], rtol=1e-7)
  for key in ("val_loss", "test_loss"):
    np.testing.assert_allclose(two_summary[key], summary[key], rtol=1e-5)
  # The checkpoint written jointly by the two processes restores in this single process.
  steps = Checkpointer(two, async_save=False).all_steps()
  assert steps == [2, 4]
  abstract = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0]).abstract
  restored = [Checkpointer(d, async_save=False).restore(4, abstract)[0]["params"] for d in (two, one)]
  for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_the_run_shards_parameters_over_fsdp(runs):
  config = runs[0]
  mesh = layout.make_mesh(config.mesh)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 1}
  rows = parameter_layout(lra_core.load_config(listops.SPEC, FSDP_ACROSS), num_devices=4)
  assert sum(r["per_device"] for r in rows) < 0.3 * sum(r["size"] for r in rows)  # a quarter each, norms aside
  spec = make_state_spec(config, mesh, optim.make_optimizer(config)[0])
  specs = [s.spec for s in jax.tree.leaves(spec.shardings["params"])]
  assert any("fsdp" in tuple(s) for s in specs)


@pytest.mark.parametrize(
  "flags, env, expected",
  [
    (("auto", None, None, None), {}, None),
    (("auto", "host:1234", 2, 0), {}, {"coordinator_address": "host:1234", "num_processes": 2, "process_id": 0}),
    (("auto", None, None, None), {"TPU_WORKER_HOSTNAMES": "a,b"}, {}),
    (("auto", None, None, None), {"TPU_WORKER_HOSTNAMES": "a"}, None),
    (
      ("auto", None, None, None),
      dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="16", SLURM_PROCID="3", SLURM_LOCALID="3"),
      {},
    ),
    (("on", None, None, None), {}, {}),
    (("off", None, None, None), {"TPU_WORKER_HOSTNAMES": "a,b"}, None),
  ],
)
def test_distributed_settings(flags, env, expected):
  assert distributed.settings(*flags, environ=env) == expected


@pytest.mark.parametrize(
  "flags, message",
  [
    (("auto", "host:1234", None, 0), "needs --num_processes"),
    (("auto", "host", 2, 0), "HOST:PORT"),
    (("auto", "host:1", 2, 2), "--process_id 2 is outside 0..1"),
    (("off", "host:1", 2, 0), "contradicts"),
  ],
)
def test_distributed_flag_errors(flags, message):
  with pytest.raises(ConfigError, match=message):
    distributed.settings(*flags, environ={})


@pytest.mark.slow
def test_when_one_process_cannot_read_the_newest_checkpoint_all_resume_from_the_same_older_one(runs, tmp_path):
  """Step 4's data written by process 1 (its FSDP shards, which process 0 never reads) is garbage: both
  processes take step 2, train steps 3 and 4 again and end with the run's parameters."""
  _, two, *_, overrides = runs
  workdir = tmp_path / "run"
  shutil.copytree(two, workdir)
  (workdir / "summary.json").unlink()
  files = [p for p in (workdir / "checkpoints" / "4" / "state" / "ocdbt.process_1").rglob("*") if p.is_file()]
  assert files
  for p in files:
    p.write_bytes(b"\x00garbage" * (p.stat().st_size // 8 + 1))
  outputs = _launch([*overrides, *FSDP_ACROSS], workdir)
  assert all("resuming at step 2 (data position 2)" in out for out in outputs)
  assert "checkpoint step 4 in" in outputs[0] and "process 1 of 2 could not read it" in outputs[0]
  assert (workdir / "unreadable_checkpoints" / "4" / "state").is_dir()
  # The reads orbax left running after the failure end quietly (lra_core/checkpoints/read_failures.py).
  assert not any("Traceback" in out or "Exception ignored" in out for out in outputs), outputs[1][-3000:]
  expected = json.loads((two / "summary.json").read_text())["param_checksum"]
  assert json.loads((workdir / "summary.json").read_text())["param_checksum"] == expected


@pytest.mark.slow
def test_an_error_on_one_process_ends_every_process_at_once(runs, tmp_path):
  """Process 0 alone writes the metrics; here it cannot (metrics.jsonl is a folder) while process 1 goes
  on into the first step's collectives. Both exit within seconds with the status of process 0's one
  sentence (2), process 1 with one line naming process 0 and its error."""
  *_, overrides = runs
  workdir = tmp_path / "run"
  (workdir / "metrics.jsonl").mkdir(parents=True)
  (failing, out0, t0), (other, out1, t1) = _launch(overrides, workdir, check=False)
  assert failing == cli.EXIT_USER_ERROR and "metrics.jsonl failed (IsADirectoryError" in out0, out0[-3000:]
  said = [line for line in out1.splitlines() if line.startswith("error: process 0 failed: ")]
  assert other == cli.EXIT_USER_ERROR and len(said) == 1 and "IsADirectoryError" in said[0], out1[-3000:]
  assert said[0].endswith("stopping process 1 as well.")
  assert t0 is not None and t1 is not None and max(t0, t1) - min(t0, t1) < 30, (t0, t1)


def _locked_workdir(tmp_path):
  """A workdir whose lock is held by a live process (on this host): the holder, to be killed."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  lock = dict(
    host=socket.gethostname(), pid=holder.pid, started="2026-11-28T08:00:00+00:00", id="x", heartbeat=time.time()
  )
  (workdir / "run.lock").write_text(json.dumps(lock))
  return workdir, holder


# Process 1 as it comes, or held where the backends start, its stderr in the start-up filter's pipe, until
# process 0's sentence is in the store (tests/fixtures/train_held_at_start.py): its watchdog's line and exit
# then came while the pipe held fd 2, and the line died with it (a clean-clone run: status 2, a silent log).
STARTS = {
  "as_it_comes": ("-m", "lra_core.train"),
  "held_at_start": (str(ROOT / "tests/fixtures/train_held_at_start.py"),),
}


@pytest.mark.slow
@pytest.mark.parametrize("start", STARTS)
def test_a_one_sentence_error_on_one_process_is_status_2_on_both(runs, tmp_path, start):
  """Process 0 alone takes the workdir's lock, and finds it held by a live run (bad input: one sentence,
  status 2) while process 1 goes on to the step's collectives: both exit 2, so a supervisor reading
  either sees the cause (process 1 exited 1 before, JAX's client then aborting process 0 or 1), and
  process 1 says process 0's sentence once."""
  *_, overrides = runs
  workdir, holder = _locked_workdir(tmp_path)
  try:
    (failing, out0, _), (other, out1, _) = _launch(overrides, workdir, check=False, command=STARTS[start])
  finally:
    holder.kill()
    holder.wait()
  assert failing == cli.EXIT_USER_ERROR and "is in use by the run started" in out0, out0[-3000:]
  said = [line for line in out1.splitlines() if line.startswith("error: process 0 failed: workdir ")]
  assert other == cli.EXIT_USER_ERROR and len(said) == 1, out1[-3000:]


@pytest.mark.slow
def test_a_sigterm_while_both_processes_wait_on_a_stuck_save_ends_both_with_75(tmp_path, fake_gcs):
  """Every write of step 4's array data fails (a store that keeps failing; TensorStore retries for
  minutes), so both processes wait on it as the 4-step run ends. A SIGTERM to process 1 alone ends both
  after the grace (a quarter of train.save_timeout_s: 15 s), status 75 naming the last complete
  checkpoint, not at the 60 s timeout with status 2: with several processes JAX's notifier takes the
  signal, and the key it publishes reaches every process."""
  overrides = [*listops.build(tmp_path / "data"), *MESH, "train.checkpoint_every=2", "train.save_timeout_s=60"]
  fake_gcs.store.failing = re.compile(r"/checkpoints/4/state/.*/d/")
  refused = fake_gcs.store.refused
  try:
    results = _launch(
      overrides, fake_gcs("stuck"), check=False, send=(1, signal.SIGTERM, lambda: fake_gcs.store.refused > refused + 4)
    )
  finally:
    fake_gcs.store.failing = None
  for status, out, seconds in results:
    assert status == cli.EXIT_PREEMPTED, out[-3000:]
    assert "was still being written when the run was asked to stop" in out and "the last complete one is step 2" in out
    assert seconds is not None and seconds < 45, seconds


@pytest.mark.slow
@pytest.mark.parametrize("refusal", [503, 403])
def test_a_save_failing_on_one_process_ends_both_with_one_sentence(tmp_path, fake_gcs, refusal):
  """Only process 1's writes of step 4 fail, so process 0's part completes and its commit waits in
  orbax's barrier for process 1's, whose writer then waits there too. Retried by the store's client (503,
  a store that keeps failing) or refused outright (403, as a full disk refuses a write), both processes
  end once the save has run train.save_timeout_s (10 s), status 2, each with one sentence naming the
  last complete checkpoint."""
  overrides = [*listops.build(tmp_path / "data"), *MESH, "train.checkpoint_every=2", "train.save_timeout_s=10"]
  fake_gcs.store.failing = re.compile(r"/checkpoints/4/state/ocdbt\.process_1/")
  fake_gcs.store.failing_status = refusal
  try:
    results = _launch(overrides, fake_gcs("one_failing"), check=False)
  finally:
    fake_gcs.store.failing, fake_gcs.store.failing_status = None, 503
  cause = "(train.save_timeout_s): the store is failing or too slow"
  for status, out, seconds in results:
    said = [line for line in out.splitlines() if line.startswith("error: ")]
    assert status == cli.EXIT_USER_ERROR and len(said) == 1, out[-3000:]
    assert cause in said[0] and "the last complete checkpoint is step 2" in said[0], said
  assert max(seconds for *_, seconds in results) - min(seconds for *_, seconds in results) < 20


@pytest.mark.slow
def test_a_peer_killed_without_a_word_is_one_line_naming_it(tmp_path):
  """Process 1 SIGKILLed mid-run. In a step's collective process 0 would wait until JAX's client aborts
  it (SIGABRT, a native stack, after its 100 s heartbeat timeout): the failure watchdogs' counters
  notice first (--peer_timeout_s, 8 s here). In a checkpoint save's barrier, Gloo's connection to it
  closes, which the save reported as a failed write (status 2). Either way: one line naming process 1,
  status 1."""
  workdir = tmp_path / "run"
  overrides = [*listops.build(tmp_path / "data"), *MESH, "train.steps=100000", "train.checkpoint_every=2"]
  (survivor, out, seconds), (killed, *_) = _launch(
    overrides,
    workdir,
    "--peer_timeout_s=8",
    check=False,
    send=(1, signal.SIGKILL, lambda: (workdir / "checkpoints" / "4").is_dir()),
  )
  said = [line for line in out.splitlines() if line.startswith("error: ")]
  assert killed == -signal.SIGKILL and survivor == process_end.EXIT_PEER_FAILED, out[-3000:]
  assert len(said) == 1 and said[0].startswith("error: process 1 "), out[-3000:]
  assert "it was killed or its host was lost" in said[0] and said[0].endswith("stopping process 0 as well.")
  assert seconds is not None and seconds < 40, seconds


def test_a_peer_gone_from_under_a_collective_is_named_not_reported_as_the_error_it_caused(monkeypatch):
  """The save's all-gather failing on a closed Gloo connection is a lost peer, in whatever error wraps
  it; a store's own connection reset is not."""
  monkeypatch.setattr(process_end, "coordination_client", lambda: object())  # a multi-process run's client
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  gloo = RuntimeError("UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer")
  try:
    try:
      raise gloo
    except RuntimeError as e:
      raise lra_core.errors.StoreFailure("writing checkpoint step 6 failed (...)") from e
  except lra_core.errors.StoreFailure as wrapped:
    line = process_end.lost_peer(wrapped)
  assert line.startswith("process 1 dropped out of a collective (UNKNOWN: Gloo AllGather failed")
  assert process_end.lost_peer(OSError("GCS: Connection reset by peer")) is None


@pytest.mark.slow
def test_a_sequence_split_over_two_processes_trains_like_one(tmp_path):
  """mesh.sequence 4 over both processes (2 devices each): both read the same rows, each keeps its
  half of every row's time steps, and the run ends where one process with the same mesh ends."""
  spec = "configs/lra/listops/latte.py:tiny"
  overrides = listops.build(tmp_path / "data") + ["mesh.data=1", "mesh.sequence=4", "train.steps=3"]
  outputs = _launch(overrides, tmp_path / "two", spec=spec)
  assert all("'sequence': 4" in out and "2 process(es)" in out for out in outputs)
  summary = train_and_evaluate(lra_core.load_config(spec, overrides), tmp_path / "one")
  two = json.loads((tmp_path / "two" / "summary.json").read_text())
  np.testing.assert_allclose(two["param_checksum"], summary["param_checksum"], rtol=1e-6)
  np.testing.assert_allclose(two["test_loss"], summary["test_loss"], rtol=1e-5)


@pytest.mark.slow
def test_processes_started_with_another_config_are_refused_before_the_first_step(runs, tmp_path):
  """Process 1 given another learning rate: both exit 2 before any step, each saying which key differs
  (both trained together before, to different parameters, and config.json recorded process 0's)."""
  *_, overrides = runs
  (s0, out0, _), (s1, out1, _) = _launch(overrides, tmp_path / "run", check=False, own=((), ("--config.optim.lr=0.5",)))
  for status, out in ((s0, out0), (s1, out1)):
    assert status == cli.EXIT_USER_ERROR and "config key optim.lr is " in out, out[-3000:]
    assert " step 1/" not in out and "resuming" not in out
  assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.slow
def test_a_peer_refused_for_its_config_ends_the_other_at_once_with_its_sentence(runs, tmp_path):
  """Process 1's config has a misspelt key: it still joins, so process 0 says its sentence and exits 2
  within seconds (before, it waited 300 s for process 1 to join and died of SIGABRT without a word)."""
  *_, overrides = runs
  (s0, out0, t0), (s1, out1, _) = _launch(
    overrides, tmp_path / "run", check=False, own=((), ("--config.train.no_such_key=1",))
  )
  assert s1 == cli.EXIT_USER_ERROR and "unknown config key 'train.no_such_key'" in out1, out1[-3000:]
  said = [line for line in out0.splitlines() if line.startswith("error: process 1 failed: unknown config key")]
  assert s0 == cli.EXIT_USER_ERROR and len(said) == 1 and said[0].endswith("stopping process 0 as well."), out0[-3000:]
  assert t0 < 90, t0


NO_MOUNTS = mounts.available()


@pytest.mark.slow
@pytest.mark.skipif(NO_MOUNTS is not None, reason=str(NO_MOUNTS))
def test_a_disk_filled_between_the_manifests_and_the_commit_ends_both_naming_the_cause(tmp_path):
  """The workdir on a 64 MiB tmpfs, filled as soon as both processes' manifests of step 4 exist, before
  orbax commits it: both end with one sentence naming `No space left on device`, status 2, within
  train.save_timeout_s (20 s here) of the fill. Before, both waited in orbax's barrier for 1,200 s."""
  overrides = [
    *listops.build(tmp_path / "data"),
    *MESH,
    "train.steps=10",
    "train.checkpoint_every=2",
    "train.save_timeout_s=20",
  ]
  disk = tmp_path / "disk"
  with mounts.Namespace() as ns:
    ns.tmpfs(disk, "64m")
    saving = ns.inside(disk / "run" / "checkpoints" / "4.orbax-checkpoint-tmp")
    manifests = lambda: (
      {p.parent.name for p in saving.glob("state*/ocdbt.process_*/manifest.ocdbt")}
      == {  # noqa: E731
        "ocdbt.process_0",
        "ocdbt.process_1",
      }
    )
    results = _launch(overrides, disk / "run", check=False, wrap=ns.wrap(), act=(manifests, lambda: ns.fill(disk)))
  for status, out, seconds in results:
    said = [line for line in out.splitlines() if line.startswith("error: ")]
    assert status == cli.EXIT_USER_ERROR and len(said) == 1, out[-3000:]
    assert "No space left on device" in said[0], said
    assert seconds is not None and seconds < 20 + 25, seconds


@pytest.mark.slow
@pytest.mark.skipif(NO_MOUNTS is not None, reason=str(NO_MOUNTS))
def test_checkpoints_turned_read_only_mid_run_end_both_with_one_sentence(tmp_path):
  """`checkpoints/` remounted read-only once step 4 is committed: the save of step 6 fails, and both
  processes end at their next step with one sentence naming `Read-only file system` and step 4, status
  2, within seconds (not after the 90 s floor of the save's limit). Before, process 0 logged the error
  and waited past 300 s."""
  workdir = tmp_path / "run"
  overrides = [*listops.build(tmp_path / "data"), *MESH, "train.steps=10", "train.checkpoint_every=2"]
  with mounts.Namespace() as ns:
    ready = lambda: (workdir / "checkpoints" / "4").is_dir()  # noqa: E731
    results = _launch(
      overrides, workdir, check=False, wrap=ns.wrap(), act=(ready, lambda: ns.read_only(workdir / "checkpoints"))
    )
  for status, out, seconds in results:
    said = [line for line in out.splitlines() if line.startswith("error: ")]
    assert status == cli.EXIT_USER_ERROR and len(said) == 1, out[-3000:]
    assert "Read-only file system" in said[0] and "the last complete checkpoint is step 4" in said[0], said
    assert seconds is not None and seconds < 30, seconds


@pytest.mark.slow
def test_a_log_stream_that_stops_draining_does_not_hang_process_0(tmp_path):
  """Process 0's output is a 4 KiB pipe that stops being read once step 4 is saved, as a launcher's
  stalled ssh pipe, and is then full: its next log line blocks it, process 1 waits in a step's collective, and both step
  watchdogs (5 s here) end their process with status 75. Before, process 0 stayed blocked for ever."""
  workdir = tmp_path / "run"
  overrides = [
    *listops.build(tmp_path / "data"),
    *MESH,
    "train.steps=100000",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.watchdog_min_s=5",
  ]
  saved = lambda: (workdir / "checkpoints" / "4").is_dir()  # noqa: E731
  results = _launch(overrides, workdir, check=False, piped=(0, lambda: not saved()), act=(saved, lambda: None))
  for status, out, seconds in results:
    assert status == cli.EXIT_PREEMPTED, out[-3000:]
    assert seconds is not None and seconds < 90, seconds


@pytest.mark.slow
def test_the_coordinator_killed_during_its_commit_is_one_sentence_on_the_other_process(tmp_path):
  """Process 0 SIGKILLed while step 4 is being committed: process 1's JAX client aborts it within a
  second (SIGABRT, a native stack), and its watcher turns that into one sentence naming process 0,
  status 1, within seconds (before: status -6 and no sentence)."""
  workdir = tmp_path / "run"
  overrides = [*listops.build(tmp_path / "data"), *MESH, "train.steps=100000", "train.checkpoint_every=2"]
  committing = lambda: any((workdir / "checkpoints").glob("4.orbax-checkpoint-tmp*"))  # noqa: E731
  (killed, *_), (survivor, out, seconds) = _launch(
    overrides, workdir, check=False, send=(0, signal.SIGKILL, committing)
  )
  said = [line for line in out.splitlines() if line.startswith("error: ")]
  assert killed == -signal.SIGKILL and survivor == process_end.EXIT_PEER_FAILED, (killed, survivor, out[-3000:])
  # JAX's client aborts the process (the watcher's sentence), or, where process 1 was in the save's
  # barrier, Gloo's connection to process 0 closes first (lra_core.runtime.process_end.lost_peer's).
  assert len(said) == 1 and said[0].startswith("error: process 0"), out[-3000:]
  assert "it was killed or its host was lost" in said[0] and said[0].endswith("stopping process 1 as well."), said
  assert seconds is not None and seconds < 15, seconds


def test_a_refused_process_whose_peers_never_start_says_its_sentence_before_it_waits(tmp_path):
  """Its join to report waits for peers that never come (and ends in JAX's native abort after 300 s): the
  sentence is out first, within seconds."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  args = [f"--config={listops.SPEC}", f"--workdir={tmp_path / 'run'}", "--config.train.no_such_key=1"]
  args += [f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2", "--process_id=1"]
  process = subprocess.Popen(
    [sys.executable, "-m", "lra_core.train", *args], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
  )
  try:
    start, line = time.monotonic(), ""
    while not line.startswith("error: ") and time.monotonic() - start < 60:
      line = process.stderr.readline()
    assert line.startswith("error: unknown config key 'train.no_such_key'"), line
    assert time.monotonic() - start < 30
  finally:
    process.kill()
    process.wait()


@pytest.mark.slow
def test_processes_as_slices_train_like_one_process_with_packed_documents_and_resume_over_one_slice(tmp_path):
  """mesh.slices=2 over the two processes (each one slice of 2 devices: data 2 spanning the slices x
  fsdp 2 inside each), on C4 MLM with documents packed per row, to step 2; then resumed as one slice
  (fsdp 4 over both processes): every parameter and the losses end where one process with the same
  global batch ends."""
  spec = c4_mlm.SPEC
  (tmp_path / "data").mkdir()
  common = [*c4_mlm.build(tmp_path / "data"), "train.steps=4", "train.checkpoint_every=2"]
  two = tmp_path / "two"
  first = _launch([*common, "mesh.slices=2", "mesh.data=2", "mesh.fsdp=-1"], two, "--stop_at_step=2", spec=spec)
  assert all("2 process(es), 2 slices" in out for out in first), first[0][-3000:]
  _launch([*common, *FSDP_ACROSS], two, spec=spec)
  config = lra_core.load_config(spec, [*common, "mesh.data=2", "mesh.fsdp=2"])
  summary = train_and_evaluate(config, tmp_path / "one")
  together = json.loads((two / "summary.json").read_text())
  np.testing.assert_allclose(together["test_loss"], summary["test_loss"], rtol=1e-5)
  np.testing.assert_allclose(together["param_checksum"], summary["param_checksum"], rtol=1e-7)
  abstract = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0]).abstract
  both, alone = (
    Checkpointer(run, async_save=False).restore(4, abstract)[0]["params"] for run in (two, tmp_path / "one")
  )
  for a, b in zip(jax.tree.leaves(both), jax.tree.leaves(alone)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_processes_resume_from_the_local_step_all_hold_and_without_one_host_s_from_the_workdir_s(tmp_path):
  """Local checkpoints every step, the workdir's every 4: process 0 SIGKILLed once both hold local
  steps past the workdir's newest; the restart agrees on the newest local step both hold and resumes
  there. Killed again the same way, process 1's local folder then deleted (a host replaced): no step
  is held by both, so both resume from the workdir's newest."""
  workdir, local = tmp_path / "run", tmp_path / "local"
  overrides = [
    *listops.build(tmp_path / "data"),
    *MESH,
    "train.steps=16",
    "train.checkpoint_every=4",
    "train.local_checkpoint_every=1",
    f"train.local_checkpoint_dir={local}",
  ]
  saved = lambda: max((int(p.name) for p in workdir.glob("checkpoints/*") if p.name.isdigit()), default=0)  # noqa: E731
  held = lambda i: sorted(int(p.parent.name) for p in local.glob(f"*/process_{i}/*/meta.json"))  # noqa: E731

  def killed_ahead(after: int) -> int:
    """Runs both until each holds a local step past the workdir's newest (and past `after`), SIGKILLs
    process 0 (process 1 then ends with its coordinator's loss); the newest step both hold."""
    ahead = lambda: saved() > after and all(held(i) and held(i)[-1] > saved() for i in (0, 1))  # noqa: E731
    (killed, *_), (survivor, out, _) = _launch(overrides, workdir, check=False, send=(0, signal.SIGKILL, ahead))
    assert killed == -signal.SIGKILL and survivor == process_end.EXIT_PEER_FAILED, out[-3000:]
    return max(set(held(0)) & set(held(1)))

  both = killed_ahead(0)
  (_, first, _), (_, second, _) = _launch(
    overrides, workdir, check=False, send=(0, signal.SIGKILL, lambda: saved() > both and held(0)[-1] > saved())
  )
  for out in (first, second):
    assert f"resuming at step {both} (data position {both}) from the local checkpoint" in out, out[-3000:]
  for folder in local.glob("*/process_1"):
    shutil.rmtree(folder)
  step = saved()
  outputs = _launch(overrides, workdir)
  for out in outputs:
    assert f"resuming at step {step} (data position {step})" in out and "from the local checkpoint" not in out, out
  assert "is not held by every process: the run starts from the workdir's checkpoint" in outputs[0]
