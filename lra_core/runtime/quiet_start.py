"""What a command does before JAX starts: no accelerator plugin noise on a host without accelerators.

An install with the `tpu`, `gpu-compile` or `test` extra brings libtpu and the CUDA plugin. On a host
with neither a TPU nor an NVIDIA GPU, JAX then prints about 30 lines at start-up: the CUDA plugin's
C++ logs "Could not find cuda drivers" when JAX imports it, its version check raises and JAX prints
the chained tracebacks, and libtpu warns that it finds no TPU. None of it says anything about the run.

A command (`python -m lra_core.<command>`, an `lra-*` script, `scripts/*.py`) therefore
  - sets JAX_PLATFORMS=cpu when it is unset and the host has no accelerator device (no /dev/nvidia*,
    /dev/accel*, numbered /dev/vfio groups or /dev/kfd): JAX would choose the CPU anyway, and the
    plugins are then registered but never started; an accelerator host is left alone;
  - drops the CUDA plugin's "Could not find cuda drivers" lines (and absl's notice before them) from
    what `import jax` and the start of JAX's backends (`start_backends`) write to stderr; every other
    line written then reaches stderr unchanged.
A library user's `import lra_core` changes nothing. `JAX_PLATFORMS` set by the user always wins.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import pathlib
import re
import select
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

from lra_core.runtime import host_memory

# Lines the CUDA plugin's extension logs when it loads on a host without a CUDA driver.
NOISE = re.compile(
  rb"(.*cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\."
  rb"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR)\r?\n?"
)
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def is_command(argv0: str) -> bool:
  """Whether this process runs one of the project's commands (what sys.argv[0] is while the
  `lra_core` package is imported)."""
  if argv0 == "-m":  # python -m lra_core.<command>: the package is imported before the module runs
    return True
  path = pathlib.Path(argv0)
  if path.name.startswith("lra-"):
    return True
  # Resolved: `python plot.py` run inside scripts/ names no folder (only a .py path: "-c" run there is no script).
  script = path.resolve() if path.suffix == ".py" else path
  return script.parent.name == "scripts" and (script.parent.parent / "lra_core").is_dir()


def has_accelerator() -> bool:
  """Whether the host has a TPU or GPU device node (without starting JAX)."""
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


_COMMAND = False  # whether `prepare` found this process to be a command


def prepare() -> contextlib.AbstractContextManager:
  """For a command: chooses the CPU where nothing else is there, and returns the context to import
  JAX in (its plugin noise dropped); for anything else, a context that does nothing."""
  global _COMMAND
  if not is_command(sys.argv[0] if sys.argv else ""):
    return contextlib.nullcontext()
  _COMMAND = True
  if "JAX_PLATFORMS" not in os.environ and not host_memory.cpu_only() and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
  return noise_dropped()


def in_command() -> bool:
  """Whether this process runs one of the project's commands (`prepare` decided it at import)."""
  return _COMMAND


WRITE_WAIT_S = 10.0  # how long a leaving process waits for a write to its output streams


def within(seconds: float, write: Callable[[], object]) -> bool:
  """Calls `write` (what a leaving process says or flushes) and waits at most `seconds` for it; True if
  it finished. A stream nobody drains (a launcher's stalled ssh pipe) blocks a write for ever, and so
  does a log call while another thread's write holds the handler's lock: the process must still leave
  with its status, its line lost where nobody reads it anyway. Where stdout and stderr take writes now
  it runs here, in this thread (which may be all the interpreter lets run: a main thread in native code
  hands it over only between its calls); else in a daemon thread, waited for."""
  if _taking_writes((1, 2)):  # a log call blocked in its write holds its handler's lock: never here
    with contextlib.suppress(OSError, ValueError):
      write()
    return True
  done = threading.Event()

  def call() -> None:
    try:
      write()
    except (OSError, ValueError):  # a closed stream: nothing to say it on
      pass
    finally:
      done.set()

  # Named as its caller: the write is that thread's, in a stack dump too.
  threading.Thread(target=call, name=threading.current_thread().name, daemon=True).start()
  return done.wait(seconds)


def _taking_writes(fds) -> bool:
  """Whether each of `fds` would take a write now (a pipe with room, a file, a terminal)."""
  try:
    return len(select.select([], list(fds), [], 0)[1]) == len(fds)
  except (OSError, ValueError):  # closed, or not selectable: a write fails at once rather than waits
    return True


def leave_now(status: int):
  """Ends the process at once with `status`, without the interpreter's teardown (after a Ctrl-C, XLA's
  compile threads may still be running, and tearing the interpreter down under them has crashed it,
  SIGSEGV, exit status 139, after the command had said it was aborting; a multi-process run leaves
  without JAX's shutdown barrier). What was written to stderr reaches it first, also from inside
  `noise_dropped`: a line said by another thread while the main thread starts the backends would
  otherwise die in the filter's file with the process; a stream that takes nothing does not hold it."""

  def flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for active in reversed(_FILTERS):
      active.end()

  within(WRITE_WAIT_S, flush)
  os._exit(status)


def start_backends() -> None:
  """For a command: starts JAX's backends (which imports and starts the plugins: the CUDA plugin logs
  once more) with the plugin noise dropped. Called where a command first needs a device, after
  `jax.distributed.initialize` (which must come before any backend starts)."""
  if _COMMAND:
    import jax

    with noise_dropped():
      jax.devices()


class _Filter:
  """Fd 2 into an unlinked temporary file; `end` (once, from any thread) puts the real stderr back and
  writes every line the file holds but NOISE to it, in order.

  A file, not a pipe: a write into it never waits for a reader, so no thread has to drain it while JAX
  imports, and `end` finds in it every byte written before, whichever thread ends the filter and
  whatever the others are doing (a pipe's drain thread, held off the interpreter while the main
  thread started the backends, once lost the end of a leaving watchdog's line)."""

  def __init__(self, saved: int, spill: io.RawIOBase):
    self.saved, self.spill = saved, spill
    self.ended = False
    self.lock = threading.Lock()  # `end` runs once: the main thread leaving the context, or a leaving thread

  def start(self) -> None:
    """Fd 2 into the file, once the filter is where `leave_now` finds it: a line another thread writes
    from this moment on is in the file a leaving thread's `end` writes out."""
    with self.lock:
      if not self.ended:
        os.dup2(self.spill.fileno(), 2)

  def end(self) -> None:
    with self.lock:
      if self.ended:
        return
      self.ended = True
      sys.stderr.flush()
      os.dup2(self.saved, 2)
      os.close(self.saved)
      written = b""
      while chunk := os.pread(self.spill.fileno(), 1 << 20, len(written)):
        written += chunk
      self.spill.close()
      kept = b"".join(line for line in written.splitlines(keepends=True) if not NOISE.fullmatch(line))
      while kept:
        kept = kept[os.write(2, kept) :]


_FILTERS: list[_Filter] = []  # the filters in effect, innermost last (leave_now ends them)


@contextlib.contextmanager
def noise_dropped() -> Iterator[None]:
  """While inside, what is written to file descriptor 2 goes to a temporary file; on leaving (or at
  `leave_now`, from any thread), every line but NOISE is written to the real stderr, in order."""
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (AttributeError, OSError, ValueError):  # no real stderr (an embedding host): nothing to filter
    yield
    return
  try:
    spill = tempfile.TemporaryFile(buffering=0)
  except OSError:  # no writable temporary folder: the noise passes
    os.close(saved)
    yield
    return
  active = _Filter(saved, spill)
  _FILTERS.append(active)  # before fd 2 moves: a thread leaving in between would lose what it wrote
  active.start()
  try:
    yield
  finally:
    active.end()
    _FILTERS.remove(active)
