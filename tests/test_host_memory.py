"""lra_core.runtime.host_memory: a block the process frees is served again without page faults, every command
asks for that at start where JAX can only use the CPU, and the switch overrides that."""

import os
import subprocess
import sys
import textwrap
import types

import pytest

from lra_core import cli
from lra_core.runtime import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's (Linux)")

# Touches a freshly malloc'ed 256 MiB block, frees it, and prints the page faults that touching a
# second such block costs (65,536 if it is new memory from the OS, none if the freed one is reused).
SECOND_BLOCK_FAULTS = textwrap.dedent(
  """
  import ctypes, resource, sys
  from lra_core.runtime import host_memory
  print(host_memory.keep_freed_memory())
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  size = 256 << 20
  def touch():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
  touch()
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  touch()
  print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  """
)


def _second_block_faults(**env) -> tuple[str, int]:
  out = subprocess.run(
    [sys.executable, "-c", SECOND_BLOCK_FAULTS],
    env=dict(os.environ, PYTHONPATH=ROOT, **env),
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  return out[0], int(out[1])


@glibc_only
def test_a_freed_block_is_reused_without_page_faults_unless_switched_off():
  kept, faults = _second_block_faults(JAX_PLATFORMS="cpu")
  assert kept == "True" and faults < 1000, faults
  kept, faults = _second_block_faults(JAX_PLATFORMS="cpu", **{host_memory.ENV: "0"})
  assert kept == "False" and faults > 30000, faults  # glibc's default: fresh pages for every block
  kept, faults = _second_block_faults(JAX_PLATFORMS="tpu")  # an accelerator: left alone unless asked
  assert kept == "False" and faults > 30000, faults
  kept, faults = _second_block_faults(JAX_PLATFORMS="tpu", **{host_memory.ENV: "1"})
  assert kept == "True" and faults < 1000, faults


@pytest.mark.parametrize(
  "platforms, want", [("cpu", True), (" cpu ", True), ("tpu", False), ("cuda,cpu", False), ("cpu,tpu", False)]
)
def test_jax_platforms_decides_whether_jax_is_cpu_only(monkeypatch, platforms, want):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  assert host_memory.cpu_only() is want


def test_without_jax_platforms_an_installed_accelerator_plugin_means_not_cpu_only(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: None)
  monkeypatch.setitem(sys.modules, "jax_plugins", None)  # import fails: no plugin package
  assert host_memory.cpu_only()
  plugins = types.ModuleType("jax_plugins")
  plugins.__path__ = [str(tmp_path)]
  monkeypatch.setitem(sys.modules, "jax_plugins", plugins)
  assert host_memory.cpu_only()  # the namespace package, empty
  (tmp_path / "xla_cuda12").mkdir()
  (tmp_path / "xla_cuda12" / "__init__.py").write_text("")
  assert not host_memory.cpu_only()
  monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: object() if name == "libtpu" else None)
  assert not host_memory.cpu_only()


def test_every_command_keeps_freed_memory_from_its_start(monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("kept"))
  cli.run(lambda: calls.append("main"))
  assert calls == ["kept", "main"]
