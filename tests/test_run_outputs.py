"""What a run leaves behind, locally and in an object store: metrics once per step across restarts,
TensorBoard as its reader shows it, throughput and MFU, profiles, the compilation cache."""

import contextlib
import logging
import os
import pathlib
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src import lru_cache as jax_lru_cache
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

import lra_core
import outputs
from lra_core.compilation import compile_cache
from lra_core.config import log_interval
from lra_core.cost import hlo_cost, throughput
from lra_core.errors import ConfigError, StoreFailure
from lra_core.run.metrics import PROGRESS_WIDTH, MetricWriter, progress_line, read_metrics
from lra_core.runtime import fs, quiet_start
from lra_core.train import train_and_evaluate

LISTOPS = "configs/lra/listops/transformer.py:tiny"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


def listops(cache_dir, *overrides):
  return lra_core.load_config(LISTOPS, [f"data.cache_dir={cache_dir}", *overrides])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir):
  """A local run of 6 steps, logging and checkpointing every step: the reference of the restarts."""
  workdir = tmp_path_factory.mktemp("reference")
  summary = train_and_evaluate(listops(cache_dir, *RUN), workdir)
  return workdir, summary


RUN = ["train.steps=6", "train.log_every=1", "train.checkpoint_every=2", "train.test_at_end=False"]


def _write_steps(writer, steps, offset=0.0):
  for step in steps:
    writer.write(step, {"train_loss": float(step) + offset, "train_accuracy": 0.5})


@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_restart_drops_the_records_past_its_checkpoint(where, tmp_path, request):
  workdir = tmp_path if where == "local" else request.getfixturevalue("fake_gcs")("writer")
  first = MetricWriter(workdir, enabled=True)
  first.resume(0)
  _write_steps(first, range(1, 6))  # steps 1-5 logged; the last checkpoint was step 3
  first.close()
  second = MetricWriter(workdir, enabled=True)
  second.resume(3)
  _write_steps(second, range(3, 8), offset=0.25)  # step 3 again (already logged: not repeated)
  second.write(3, {"val_loss": 1.0})  # a metric step 3 did not have yet is added
  second.close()
  logged = outputs.logged_once(workdir)
  assert logged["train_loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.25), (5, 5.25), (6, 6.25), (7, 7.25)]
  assert logged["val_loss"] == [(3, 1.0)]
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3, 4, 5, 6, 7, 3]


def test_a_line_cut_short_by_a_kill_is_dropped_on_restart_and_said_to_be(tmp_path, caplog):
  first = MetricWriter(tmp_path, enabled=True)
  _write_steps(first, range(1, 4))
  first.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "val_lo')  # SIGKILL in the middle of an append
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
  second = MetricWriter(tmp_path, enabled=True)
  with caplog.at_level(logging.INFO):
    second.resume(3)
  _write_steps(second, range(4, 6))
  second.close()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
  # the cut line was step 3's: not "a record past step 3"
  assert [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()] == [
    "metrics.jsonl: dropped 1 unreadable line(s) (line 4 of 4: cut short, or not UTF-8 JSON)"
  ]


def test_damaged_bytes_in_metrics_cost_their_line_only(tmp_path, caplog):
  first = MetricWriter(tmp_path, enabled=True)
  _write_steps(first, range(1, 6))
  first.close()
  lines = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
  lines[1] = b'{"step": 2, "train_loss": \xff\xfe}\n'  # not UTF-8
  (tmp_path / "metrics.jsonl").write_bytes(b"".join(lines))
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3, 4, 5]
  second = MetricWriter(tmp_path, enabled=True)
  with caplog.at_level(logging.INFO):
    second.resume(3)
  second.close()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3]
  said = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
  assert said == [
    "metrics.jsonl: dropped 2 record(s) past step 3 (steps 4-5), logged before the restart",
    "metrics.jsonl: dropped 1 unreadable line(s) (line 2 of 5: cut short, or not UTF-8 JSON)",
  ]


def test_a_metrics_file_the_store_will_not_take_is_one_sentence(tmp_path):
  """A folder in metrics.jsonl's place (or a full disk, a store refusing writes): one sentence naming
  the file and the cause, not a traceback; the run's checkpoints are not touched."""
  (tmp_path / "metrics.jsonl").mkdir()
  writer = MetricWriter(tmp_path, enabled=True)
  with pytest.raises(StoreFailure, match=r"^reading .*metrics\.jsonl failed \(IsADirectoryError: .*\); the run stops"):
    writer.write(1, {"train_loss": 1.0})
  writer.close()


def test_a_full_disk_where_tensorboard_flushes_is_one_sentence(tmp_path, monkeypatch, caplog):
  """TensorBoard's flush finding the disk full (before metrics.jsonl does): one sentence naming its
  folder and the cause, not a traceback; at a run's exit for a signal, a warning (its status stays
  75 or 130, not the store's)."""
  from tensorboardX import SummaryWriter

  def full(self):
    raise OSError(28, "No space left on device")

  writer, other = MetricWriter(tmp_path / "a", enabled=True), MetricWriter(tmp_path / "b", enabled=True)
  writer.write(1, {"train_loss": 1.0})
  other.write(1, {"train_loss": 1.0})
  monkeypatch.setattr(SummaryWriter, "flush", full)
  monkeypatch.setattr(SummaryWriter, "close", full)
  with pytest.raises(
    StoreFailure,
    match=r"^writing .*tensorboard failed \(OSError: \[Errno 28\] No space left on device\); the run stops",
  ):
    writer.write(2, {"train_loss": 1.0})
  with caplog.at_level(logging.WARNING):
    writer.close(failing_ok=True)
  assert "No space left on device" in caplog.text
  with pytest.raises(StoreFailure, match=r"No space left on device"):
    other.close()


def test_throughput_and_mfu_are_logged(uninterrupted, cache_dir):
  workdir, summary = uninterrupted
  t = listops(cache_dir).train
  records = [r for r in read_metrics(workdir) if "train_loss" in r]
  for r in records[1:]:  # the first interval also holds the first step's dispatch
    assert r["step_time_s"] > 0 and r["tokens_per_s"] == pytest.approx(
      t.batch_size * t.seq_len / r["step_time_s"], rel=1e-6
    )
    assert 0 < r["mfu"] < 1
  assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0


def test_a_progress_line_fits_120_columns_and_counts_what_it_leaves_out():
  logged = dict(
    train_accuracy=0.0039,
    train_codebook_perplexity=8.918,
    train_codebook_unused=2.25,
    train_commit_loss=7.9,
    train_loss=6.389,
    train_perplexity=595.0,
    train_bits_per_byte=9.217,
    grad_norm=0.904,
    learning_rate=2e-4,
    objective=6.21,
    param_norm=95.43,
    tokens_per_s=1604.0,
    mfu=0.004,
    step_time_s=0.3,
  )  # what a Transformer-VQ step logs
  tail = "1,604 tokens/s | MFU 0.4% | ETA 0:00"
  line = progress_line(20, 400, logged, tail)
  assert len("00:00:00 INFO " + line) <= 120 and PROGRESS_WIDTH == 106
  assert line == "step 20/400 loss=6.389 accuracy=0.0039 bits_per_byte=9.217 +8 | " + tail
  every = progress_line(20, 400, logged, tail, width=1000)  # room for all, in PROGRESS_FIRST order first
  assert every.startswith("step 20/400 loss=6.389 accuracy=0.0039 bits_per_byte=9.217 learning_rate=0.0002 ")
  assert "+" not in every and every.count("=") == 11 and "tokens_per_s" not in every


def test_tiny_configs_log_about_ten_times_whatever_the_steps():
  tiny = lra_core.load_config("configs/lra/listops/transformer.py:tiny", [])
  assert tiny.train.log_every == 0 and log_interval(tiny.train) == 1  # 4 steps
  assert log_interval(lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["train.steps=300"]).train) == 30
  assert log_interval(lra_core.load_config("configs/lra/listops/transformer.py", []).train) == 50  # as set


def test_step_flops_count_the_matrix_products_and_the_loops_cost_analysis_misses():
  a = jnp.ones((64, 128), jnp.float32)
  b = jnp.ones((128, 32), jnp.float32)
  compiled = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, b).compile()
  flops, recompute = hlo_cost.step_flops(compiled.as_text())
  assert flops == 2 * 64 * 128 * 32 and recompute == 0
  assert compiled.cost_analysis()["flops"] >= flops  # XLA's count adds the elementwise ops

  def scanned(a, b):
    return jax.lax.scan(lambda x, _: (jnp.tanh(x @ b), None), a, None, length=10)[0]

  compiled = jax.jit(scanned).lower(a, jnp.ones((128, 128), jnp.float32)).compile()
  assert hlo_cost.step_flops(compiled.as_text())[0] == 10 * 2 * 64 * 128 * 128
  assert compiled.cost_analysis()["flops"] < 2 * 2 * 64 * 128 * 128  # the loop body counted once
  assert throughput.model_flops(compiled, 4) == 4 * 10 * 2 * 64 * 128 * 128


def test_the_cpu_peak_is_the_measured_matmul_rate():
  devices = jax.devices("cpu")
  peak, what = throughput.peak_flops(devices)
  assert peak == throughput.cpu_matmul_peak() > 1e8 and "matmul" in what
  # Measured under whatever else runs: the log says so, and how to pin it.
  assert "under load" in what and "train.peak_flops" in what
  assert throughput.peak_flops(devices[:2], per_device=1e12) == (2e12, "train.peak_flops x 2 device(s)")


def test_a_profiled_run_writes_a_trace_the_profile_plugin_reads(tmp_path, cache_dir):
  train_and_evaluate(listops(cache_dir, "train.profile_steps=1:3"), tmp_path)
  # TensorBoard's profile plugin lists runs as <logdir>/plugins/profile/<run>/<host>.xplane.pb.
  runs = list((tmp_path / "tensorboard" / "plugins" / "profile").iterdir())
  assert len(runs) == 1 and runs[0].is_dir()
  planes = list(runs[0].glob("*.xplane.pb"))
  assert len(planes) == 1 and planes[0].stat().st_size > 0
  assert list(runs[0].glob("*.trace.json.gz"))


def _readers_see(put, folder) -> set[int]:
  """The sizes of an entry a reader polling the cache saw while four writers put it at once (4 MiB each)."""
  cache = jax_lru_cache.LRUCache(str(folder), max_size=-1)
  size, seen, done = 4 << 20, set(), threading.Event()

  def read():
    while not done.is_set():
      try:
        value = cache.get("step")
      except FileNotFoundError:  # this test's own unlink, between the cache's exists() and its read
        continue
      if value is not None:
        seen.add(len(value))

  reader = threading.Thread(target=read)
  reader.start()
  for _ in range(3):
    writers = [threading.Thread(target=put, args=(cache, "step", bytes([i]) * size)) for i in range(4)]
    for w in writers:
      w.start()
    for w in writers:
      w.join()
    (pathlib.Path(folder) / "step-cache").unlink()
  done.set()
  reader.join()
  return seen


def test_the_compile_cache_writes_each_entry_whole(tmp_path):
  """Processes sharing a cache folder compile the same step at once: an entry is written under a
  temporary name and renamed, so a reader sees it whole or not at all, and no temporary is left."""
  compile_cache.write_whole()
  assert _readers_see(jax_lru_cache.LRUCache.put, tmp_path) <= {4 << 20}
  assert not list(tmp_path.iterdir())


def test_the_compile_cache_folder_follows_the_setting_and_the_workdir(monkeypatch, tmp_path):
  monkeypatch.delenv("LRA_CORE_CACHE", raising=False)
  assert compile_cache.folder_for("off", tmp_path / "runs" / "a") is None
  assert compile_cache.folder_for("auto", tmp_path / "runs" / "a") == str(tmp_path / "runs" / ".jax_compile_cache")
  assert compile_cache.folder_for("auto", "gs://bucket/runs/a") == "gs://bucket/runs/.jax_compile_cache"
  assert compile_cache.folder_for(str(tmp_path / "c"), "gs://bucket/runs/a") == str(tmp_path / "c")
  monkeypatch.setenv("LRA_CORE_CACHE", str(tmp_path / "shared"))
  assert compile_cache.folder_for("auto", "gs://bucket/runs/a") == str(tmp_path / "shared" / "jax_compile")


@contextlib.contextmanager
def persistent_cache_on():
  """JAX's persistent cache turned on with no folder set (the suite's processes keep it off: tests/conftest.py)."""
  saved = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", saved)
    jax_compilation_cache.reset_cache()


def test_a_compile_cache_this_user_may_not_add_to_is_one_warning(tmp_path, monkeypatch, caplog):
  """A shared compile cache this user reads but may not write: one warning for the folder, the run goes
  on compiling what it lacks (JAX warned with a traceback for every program)."""

  def refused(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self))

  monkeypatch.setattr(pathlib.Path, "write_bytes", refused)  # the root running this suite may write anywhere
  cache = types.SimpleNamespace(eviction_enabled=False, path=tmp_path)
  with caplog.at_level(logging.WARNING):
    for key in ("a", "b"):
      compile_cache._put_whole(cache, key, b"program")
  said = [r.getMessage() for r in caplog.records if "takes no new programs (Permission denied)" in r.getMessage()]
  assert len(said) == 1 and not list(tmp_path.iterdir())


def test_a_cache_turned_off_in_jax_config_stays_off(tmp_path):
  assert not jax.config.jax_enable_compilation_cache  # the suite's own processes keep none (tests/conftest.py)
  assert compile_cache.setup("auto", tmp_path / "runs" / "a") is None
  assert not (tmp_path / "runs" / ".jax_compile_cache").exists()
  with persistent_cache_on():
    assert compile_cache.setup(str(tmp_path / "c"), tmp_path / "runs" / "a") == str(tmp_path / "c")


@pytest.mark.slow
def test_a_second_run_loads_its_steps_from_the_persistent_cache(tmp_path):
  """Also: a command on a host without accelerators, JAX_PLATFORMS unset and the TPU and CUDA plugins
  installed (the test extra), prints none of their start-up noise (lra_core/runtime/quiet_start.py)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE") and k != "JAX_PLATFORMS"}
  env.update(LRA_CORE_CACHE=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  command = [
    sys.executable,
    "-m",
    "lra_core.train",
    f"--config={LISTOPS}",
    "--config.train.steps=2",
    f"--workdir={tmp_path / 'run'}",
  ]
  subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
  entries = list((tmp_path / "cache" / "jax_compile").iterdir())
  assert entries, "the first run wrote no compile cache entries"
  again = subprocess.run(
    [*command[:-1], f"--workdir={tmp_path / 'again'}"], env=env, check=True, capture_output=True, text=True, timeout=600
  )
  assert "persistent compilation cache: " + str(tmp_path / "cache" / "jax_compile") in again.stderr
  if not quiet_start.has_accelerator():
    for noise in ("cudart_stub", "absl::InitializeLog", "plugin configuration error", "host bounds", "worker hostname"):
      assert noise not in again.stderr, again.stderr[:3000]
  assert sorted(p.name for p in (tmp_path / "cache" / "jax_compile").iterdir()) == sorted(p.name for p in entries)


def test_an_object_store_without_its_package_is_one_sentence(monkeypatch):
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name in ("gcsfs", "tensorflow") else real(name, *a)
  )
  with pytest.raises(
    ConfigError,
    match=r"^workdir 'gs://b/run' needs the gcsfs package for gs:// paths; "
    r"install it with pip install gcsfs\.$",
  ):
    train_and_evaluate(lra_core.load_config(LISTOPS), "gs://b/run")
  with pytest.raises(ConfigError, match="scheme memory://"):
    fs.path("memory://x/run", what="workdir")


def test_sample_every_is_for_image_tasks():
  with pytest.raises(ConfigError, match="train.sample_every draws images"):
    lra_core.load_config(LISTOPS, ["train.sample_every=2"])


def test_a_multi_process_run_keeps_its_compiled_steps_apart(tmp_path, monkeypatch):
  """A run of 2 processes uses <cache>/2_processes: programs compiled for another count of processes stay
  apart (lra_core/compilation/compile_cache.py)."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with persistent_cache_on():
    folder = compile_cache.setup(str(tmp_path / "cache"), tmp_path / "run")
  assert folder == str(tmp_path / "cache" / "2_processes")
