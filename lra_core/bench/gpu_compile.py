"""Compiling for an NVIDIA GPU on a host without one, and what the compiler says of each Pallas kernel.

`compile_for_gpu` jits a function under `jax.set_mesh` of GPU devices described by
`lra_core.compilation.topologies.gpu_devices` (compile-only: no driver, no device) and compiles it with the real XLA:GPU
pipeline: Pallas lowers each kernel to Triton IR, Triton compiles it (TTIR -> TTGIR -> LLVM -> PTX, its
shared-memory allocation included), and ptxas assembles the PTX for the GPU's architecture. A kernel
whose tiles exceed the GPU's shared memory fails here, as it would on the device.

For every Pallas (Triton) kernel in the compiled program it then reports what the device would be given:
the launch grid, threads and dynamic shared memory (XLA's thunk sequence), and the registers per thread,
spill stores / loads and stack frame that `ptxas -v` reports for the kernel's own PTX (spills are local
memory traffic: cheap in a loop's prologue, dear in its body). Run time and numbers need the device.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TRITON_TARGET = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel becomes on GPU

_THUNK = re.compile(
  r"kCustomKernel .*?\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
  r"shared_memory: (\d+) bytes"
)
_NAME = re.compile(r'name = "([^"]+)"')
_WARPS = re.compile(r"num_warps = (\d+)")
_STAGES = re.compile(r"num_stages = (\d+)")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Pallas kernel of a compiled GPU program, as the compiler and ptxas describe it."""

  name: str
  grid: tuple[int, int, int]
  threads: int
  warps: int
  stages: int
  shared_bytes: int  # dynamic shared memory per block (Triton's allocation)
  registers: int | None  # per thread (ptxas -v); None when no ptxas was found
  spill_stores: int | None  # bytes per thread
  spill_loads: int | None
  stack_bytes: int | None
  ptx_bytes: int

  def describe(self) -> str:
    regs = (
      "ptxas not found"
      if self.registers is None
      else (f"{self.registers} registers, spills {self.spill_stores} B stored / {self.spill_loads} B loaded")
    )
    return (
      f"{self.name}: grid {'x'.join(map(str, self.grid))}, {self.warps} warps, "
      f"{self.shared_bytes / 1024:.0f} KiB shared, {regs}, PTX {self.ptx_bytes / 1e6:.2f} MB"
    )


def ptxas_path() -> str | None:
  """The ptxas XLA uses: the nvidia-cuda-nvcc wheel's, else one on PATH or under /usr/local/cuda."""
  try:
    import nvidia.cuda_nvcc

    path = pathlib.Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin" / "ptxas"
    if path.exists():
      return str(path)
  except ImportError:
    pass
  found = shutil.which("ptxas")
  if found:
    return found
  return "/usr/local/cuda/bin/ptxas" if os.path.exists("/usr/local/cuda/bin/ptxas") else None


def gpu_mesh(devices) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(devices), ("data",))


def traced_for_gpu(fn: Callable, args: tuple, devices):
  """fn(*args) jitted and traced under `jax.set_mesh` of the GPU `devices`, arguments replicated: the program
  the GPU compiles, with its kernels traced for the GPU (their Triton drivers and tiles)."""
  mesh = gpu_mesh(devices)
  replicated = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    return jax.jit(fn).trace(*(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args))


def compile_for_gpu(fn: Callable, args: tuple, devices, *, inspect: bool = True):
  """fn(*args) jitted under `jax.set_mesh` of the GPU `devices`, arguments replicated, lowered and compiled
  by XLA:GPU + Triton + ptxas. -> (compiled, compile seconds, [TritonKernel] of its Pallas kernels; empty
  unless `inspect`). Raises what lowering or compiling raises (e.g. RESOURCE_EXHAUSTED for shared memory)."""
  with jax.set_mesh(gpu_mesh(devices)):
    lowered = traced_for_gpu(fn, args, devices).lower()
  with tempfile.TemporaryDirectory(prefix="gpu_compile_") as dump:
    options = {"xla_dump_to": dump} if inspect else None
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    seconds = time.perf_counter() - start
    kernels = triton_kernels(compiled.as_text(), pathlib.Path(dump)) if inspect else []
  return compiled, seconds, kernels


def triton_kernels(hlo: str, dump: pathlib.Path) -> list[TritonKernel]:
  """The Pallas kernels of a compiled program (`hlo`, its text) from the compile's dump folder."""
  calls = [line for line in hlo.splitlines() if f'custom_call_target="{TRITON_TARGET}"' in line]
  thunks = {}
  for path in dump.glob("*thunk_sequence.txt"):
    for m in _THUNK.finditer(path.read_text()):
      thunks[m.group(1)] = m
  ptx = {}
  for path in dump.glob("*.ptx"):
    text = path.read_text(errors="replace")
    for name in re.findall(r"\.entry (\w+)\(", text):
      ptx[name] = path
  out = []
  for call in calls:
    name = _NAME.search(call).group(1) if _NAME.search(call) else "?"
    thunk = thunks.get(name)
    grid = tuple(int(thunk.group(i)) for i in (2, 3, 4)) if thunk else (0, 0, 0)
    threads = int(thunk.group(5)) * int(thunk.group(6)) * int(thunk.group(7)) if thunk else 0
    assembled = _ptxas(ptx[name]) if name in ptx else {}
    out.append(
      TritonKernel(
        name=name,
        grid=grid,
        threads=threads,
        warps=int(_WARPS.search(call).group(1)) if _WARPS.search(call) else 0,
        stages=int(_STAGES.search(call).group(1)) if _STAGES.search(call) else 0,
        shared_bytes=int(thunk.group(8)) if thunk else 0,
        ptx_bytes=ptx[name].stat().st_size if name in ptx else 0,
        **assembled,
      )
    )
  return out


def _ptxas(path: pathlib.Path) -> dict:
  """registers / spill_stores / spill_loads / stack_bytes of the one kernel in a PTX file, by `ptxas -v`
  for the architecture the file targets (None each when no ptxas is found)."""
  none = dict(registers=None, spill_stores=None, spill_loads=None, stack_bytes=None)
  binary = ptxas_path()
  target = re.search(r"^\.target (\w+)", path.read_text(errors="replace"), re.M)
  if binary is None or target is None:
    return none
  done = subprocess.run(
    [binary, "-v", f"-arch={target.group(1)}", str(path), "-o", os.devnull], capture_output=True, text=True, check=False
  )
  text = done.stdout + done.stderr
  spills, registers = _SPILLS.search(text), _REGISTERS.search(text)
  if spills is None or registers is None:
    return none
  return dict(
    registers=int(registers.group(1)),
    stack_bytes=int(spills.group(1)),
    spill_stores=int(spills.group(2)),
    spill_loads=int(spills.group(3)),
  )
