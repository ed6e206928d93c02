"""Test setup: 8 host CPU devices (for sharding tests), the compiler's fast mode, no persistent cache in-process."""

import atexit
import gc
import os
import pathlib
import shutil
import tempfile

# The compiler's fast mode: the tests' programs are tiny, so compiling them dominates and LLVM's
# optimizations cost more than they save. XLA:CPU's older elementwise emitters compile a train step
# (hundreds of small optimizer fusions) about a third faster than its MLIR fusion emitters; the
# subprocesses the tests start inherit these settings. XLA:CPU also splits a program's LLVM module into
# parts to generate their code on parallel threads, which a host whose cores the two workers keep busy
# cannot use: one part took 15% less CPU time to compile 135 of the tests' programs (train steps and
# losses, 21.8 s against 25.8 s, five interleaved runs each, every pair lower).
FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
# Each host device of a CPU program is a thread, and a collective waits in a rendezvous for all of them:
# XLA:CPU warns on stderr when one is 20 s late and aborts the process 40 s after that, which a loaded
# 2-core host reached at the end of an 8-device run. The suite waits 5 + 5 minutes, within its own limit
# on a test (faulthandler_timeout in pyproject.toml, which writes every thread's stack);
# tests/test_host_collectives.py shows these flags are the knob.
HOST_COLLECTIVES = (
  "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300 --xla_cpu_collective_call_terminate_timeout_seconds=300"
)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE} {HOST_COLLECTIVES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Loaders cache decoded data; tests keep theirs out of the user's ~/.cache, in a folder removed when the
# process that made it ends (after the runs it started: every session once left one behind in /tmp).
if "LRA_CORE_CACHE" not in os.environ:
  os.environ["LRA_CORE_CACHE"] = tempfile.mkdtemp(prefix="lra_core_test_cache_")
  atexit.register(shutil.rmtree, os.environ["LRA_CORE_CACHE"], ignore_errors=True)

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

from lra_core.compilation import compile_cache  # noqa: E402

# The suite's own processes keep no persistent cache: a worker compiles most programs once, so a clean
# clone's run seldom reads an entry back, and writing every program cost more than it saved (a clean-clone
# run took 19 min without, 21 to 25 with). The training runs the tests start in subprocesses keep theirs
# ($LRA_CORE_CACHE/jax_compile, lra_core/compilation/compile_cache.py), where a resumed run reads its steps
# back, and so do the files that use `persistent_compile_cache` below.
jax.config.update("jax_enable_compilation_cache", False)

# A worker's heap grows to millions of objects (traced programs, the test files' data), which Python's
# cyclic collector walks again and again at its default thresholds (700, 10, 10): four model tests in one
# process spent 5.5 s of 55 in collections, 2.0 s at these. Cycles are still collected, in fewer passes.
gc.set_threshold(50_000, 20, 100)


# Under `--dist=loadfile --no-loadscope-reorder` (pyproject.toml) pytest-xdist hands out whole files in
# collection order: the longest go first (wall seconds in a full two-worker run at 94d8857, longest first), so
# that the short files fill the end and no worker is left running a long one alone.
LONGEST_FIRST = (
  "test_context_parallel.py",  # 303 s: every family's train step split over 2, 8 and 2 x 4 chips
  "test_kill_resume.py",  # 209 s: runs killed and restarted, in subprocesses
  "test_multiprocess.py",  # 184 s: two-process runs, several JAX start-ups each
  "test_hlo_cost.py",
  "test_aot.py",
  "test_library_attention.py",
  "test_transformer_vq.py",
  "test_reliability.py",
  "test_workdir_tools.py",
  "test_flash.py",
  "test_fit.py",
  "test_block_transformer.py",
  "test_remat_scan.py",
  "test_vq_pallas.py",
  "test_latte.py",
  "test_gpu_kernels.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def _proc(name: str) -> str:
  """A /proc file's text ("" where there is none: not Linux)."""
  try:
    return pathlib.Path("/proc", name).read_text()
  except OSError:
    return ""


def _mappings() -> int:
  return _proc("self/maps").count("\n")


def _resident_gib() -> float:
  kib = next((line.split()[1] for line in _proc("self/status").splitlines() if line.startswith("VmRSS:")), "0")
  return int(kib) / 2**20


def _map_limit() -> int:
  return int(_proc("sys/vm/max_map_count") or 65530)  # 65,530: the kernel's default


# A worker keeps its compiled programs from file to file until they hold this much memory.
KEEP_GIB = 2.5


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
  """A worker's compiled programs are dropped at the end of a file once they hold half the kernel's limit
  on memory mappings or the worker holds KEEP_GIB. XLA:CPU maps every executable's code into memory of
  its own (about three mappings each), and a worker that keeps every program of hundreds of files reaches
  the limit (vm.max_map_count, 65,530 by default): the next compile or load then segfaults (seen in
  clean-clone runs at 86%, in compile, serialize and deserialize alike); kept without a bound they also
  grew a worker to 6 GiB. Dropping them after every file threw away programs that the next files compile
  again: the small ones of arrays handled one operation at a time, shared by every model test."""
  yield
  before, resident = _mappings(), _resident_gib()
  watch = os.environ.get("LRA_CORE_TEST_MAPS")  # to watch it: pytest -s with LRA_CORE_TEST_MAPS=1
  if before > _map_limit() // 2 or resident > KEEP_GIB:
    jax.clear_caches()
    gc.collect()
    if watch:
      print(f"\n{before} memory mappings, {resident:.2f} GiB: dropped the programs ({_mappings()} left)", flush=True)
  elif watch:
    print(f"\n{before} memory mappings, {resident:.2f} GiB: programs kept", flush=True)


@pytest.fixture(scope="module")
def persistent_compile_cache():
  """JAX's persistent cache on for a file, in the folder the tests' training subprocesses share
  ($LRA_CORE_CACHE/jax_compile), for files that train one small config again and again in-process: each
  run jits its steps anew, so without it every resume, fallback and extension compiled them again (a full
  run at 71ad3c3: 62 s of test_reliability.py's 69 s of compiles of a second or more were repeats, 12 s of
  test_train.py's 19, 15 s of test_ema.py's 22). Only compiles of a second or more are written (JAX's
  default), so the writes stay few; a file's module fixtures come after it (pytest sets up the fixtures
  named by `usefixtures` first)."""
  compile_cache.write_whole()  # the runs in subprocesses and the other worker write the same folder
  jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["LRA_CORE_CACHE"], compile_cache.FOLDER))
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use a cache: decide again
  yield
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_compilation_cache_dir", None)
  compilation_cache.reset_cache()


@pytest.fixture
def collect_garbage():
  """A failed orbax restore leaves asyncio tasks whose exception nobody retrieved; collected at some later
  allocation, they log from inside whatever runs then, and inside `ast.parse` that breaks CPython 3.11's
  AST constructor (SystemError: AST constructor recursion depth mismatch). Tests that make restores fail
  collect them at their own end."""
  yield
  gc.collect()


@pytest.fixture(scope="session")
def fake_gcs():
  """An in-memory Google Cloud Storage server on localhost (tests/fake_gcs.py) with a bucket "lra-test":
  gs:// paths reach it through the clients a pod uses (TensorStore's gcs driver for checkpoints,
  gcsfs under etils.epath for everything else). Yields a function giving a fresh gs:// folder; its
  `store` attribute is the server's store (`store.failing`: a pattern of object names whose writes fail)."""
  import itertools

  from fake_gcs import FakeGCS

  names = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
  saved = {k: os.environ.get(k) for k in names}
  counter = itertools.count()
  server = FakeGCS()
  with server as url:
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="test")

    def folder(name="run"):
      return f"gs://lra-test/{os.getpid()}-{next(counter)}/{name}"

    folder.store = server.store
    yield folder
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
