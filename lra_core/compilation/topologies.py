"""Devices of accelerators that are not attached, for compiling ahead of time on a CPU host.

`tpu_devices("v3:2x2")` gives the devices of a TPU slice on any host with libtpu installed
(`pip install "lra_core[tpu]"`): `jax.jit(...).lower(...).compile()` over a mesh of them runs the
real TPU compiler, which is how `python -m lra_core.aot` checks paper configs on a CPU machine.
`gpu_devices("h100x8")` does the same for NVIDIA GPUs with the CUDA plugin and ptxas installed
(`pip install "lra_core[gpu-compile]"`, no GPU or driver needed): XLA:GPU, Triton and ptxas compile
for the GPU that `GPUS` describes (its XLA target config, `target_config`). What a chip can do, as the
cost estimates read it, is lra_core/cost/chips.py's `CHIPS`.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from lra_core.cost.chips import CHIPS
from lra_core.errors import ConfigError, brief

# ----------------------------------------------------------------------------- TPU slices without a TPU

# Topology names: generation -> (the TPU compiler's chip config, chips per host, the slice shapes
# Cloud TPU offers, in chips). A slice name is "<generation>:<shape>", e.g. "v3:4x4" (32 cores).
GENERATIONS = {
  "v2": ("default", (2, 2, 1), ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16")),
  "v3": ("default", (2, 2, 1), ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32")),
  "v4": ("megacore", (2, 2, 1), ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16")),
  "v5e": ("default", (2, 2, 1), ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
  "v5p": ("default", (2, 2, 1), ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8")),
  "v6e": ("default", (2, 2, 1), ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
}


def known_topologies() -> list[str]:
  return [f"{g}:{shape}" for g, (_, _, shapes) in GENERATIONS.items() for shape in shapes]


def tpu_devices(topology: str, slices: int = 1) -> list[jax.Device]:
  """The devices of the TPU slice `topology` ("v3:2x2", "v5p:2x2x4", ...), or of `slices` such slices
  joined over the data-center network (each device's `slice_index` says which), for compiling on any host.

  Raises ConfigError (one sentence) for an unknown name, listing the known ones, or when libtpu is
  not installed.
  """
  generation, _, shape = topology.partition(":")
  if generation not in GENERATIONS or shape not in GENERATIONS[generation][2]:
    raise ConfigError(f"topology {topology!r} is not known; expected one of {', '.join(known_topologies())}.")
  chip_config, per_host, _ = GENERATIONS[generation]
  dims = tuple(int(d) for d in re.findall(r"\d+", shape))
  per_host = tuple(min(p, d) for p, d in zip(per_host, dims + (1,) * (3 - len(dims))))
  # libtpu reads these at start-up and warns (harmlessly) when a CPU host has neither; compiling
  # needs no exclusive hold on a TPU, so several processes (test workers) may load it at once.
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v4-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    from jax.experimental import topologies as jax_topologies

    desc = jax_topologies.get_topology_desc(
      platform="tpu",
      topology_name=topology,
      chip_config_name=chip_config,
      chips_per_host_bounds=per_host,
      num_slices=slices,
    )
  except (ImportError, RuntimeError, jax.errors.JaxRuntimeError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not libtpu_installed():
      raise ConfigError(
        f"compiling for TPU topology {topology!r} needs libtpu; install it with pip install -e \".[tpu]\"."
      ) from e
    raise ConfigError(f"the TPU compiler could not describe topology {topology!r}: {first}") from e
  return list(desc.devices)


def libtpu_installed() -> bool:
  import importlib.util

  return importlib.util.find_spec("libtpu") is not None


# ----------------------------------------------------------------------------- GPUs without a GPU


@dataclasses.dataclass(frozen=True)
class GpuArch:
  """What XLA:GPU, Triton and ptxas need to know of an NVIDIA GPU to compile for it without one: the
  fields of XLA's `GpuTargetConfigProto` (`target_config`). Sources: the CUDA C++ Programming Guide's
  "Technical Specifications per Compute Capability" (shared memory per SM and per block, registers,
  threads) and NVIDIA's architecture whitepapers and tuning guides (SMs, L2, boost clock) of each
  product; memory and bandwidth as in `CHIPS`."""

  kind: str  # the device kind JAX reports (the key into CHIPS)
  compute_capability: tuple[int, int]
  sms: int
  fp32_lanes_per_sm: int
  shared_per_sm: int  # bytes
  shared_per_block: int  # bytes one block may opt in to (what Triton may allocate)
  l2_bytes: int
  clock_ghz: float  # boost clock
  threads_per_sm: int = 2048
  registers_per_sm: int = 65536  # 32-bit registers, also the most one block may use (at most 255 a thread)

  def target_config(self) -> str:
    """XLA's `GpuTargetConfigProto` text for this GPU: what `jax.experimental.topologies` needs to
    compile for it on a host without one (a real GPU's exact text: `device_target_config`)."""
    chip = CHIPS[self.kind]
    major, minor = self.compute_capability
    return "\n".join(
      [
        "gpu_device_info {",
        f'  name: "{self.kind}"',
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        f"  core_count: {self.sms}",
        f"  fpus_per_core: {self.fp32_lanes_per_sm}",
        "  threads_per_warp: 32",
        "  threads_per_block_limit: 1024",
        f"  threads_per_core_limit: {self.threads_per_sm}",
        "  thread_dim_limit_x: 1024",
        "  thread_dim_limit_y: 1024",
        "  thread_dim_limit_z: 64",
        "  block_dim_limit_x: 2147483647",
        "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        "  shared_memory_per_block: 49152",
        f"  shared_memory_per_block_optin: {self.shared_per_block}",
        f"  shared_memory_per_core: {self.shared_per_sm}",
        f"  registers_per_core_limit: {self.registers_per_sm}",
        f"  registers_per_block_limit: {self.registers_per_sm}",
        f"  memory_bandwidth: {int(chip.hbm_bandwidth * chip.devices_per_chip)}",
        f"  l2_cache_size: {self.l2_bytes}",
        f"  clock_rate_ghz: {self.clock_ghz}",
        f"  device_memory_size: {chip.hbm_bytes * chip.devices_per_chip}",
        "}",
        'platform_name: "CUDA"',
        f'device_description_str: "{self.kind}"',
        "",
      ]
    )


KIB, MIB = 2**10, 2**20
_HOPPER = dict(
  compute_capability=(9, 0),
  sms=132,
  fp32_lanes_per_sm=128,
  shared_per_sm=228 * KIB,
  shared_per_block=227 * KIB,
  l2_bytes=50 * MIB,
  clock_ghz=1.98,
)
_AMPERE = dict(
  compute_capability=(8, 0),
  sms=108,
  fp32_lanes_per_sm=64,
  shared_per_sm=164 * KIB,
  shared_per_block=163 * KIB,
  l2_bytes=40 * MIB,
  clock_ghz=1.41,
)
_VOLTA = dict(
  compute_capability=(7, 0),
  sms=80,
  fp32_lanes_per_sm=64,
  shared_per_sm=96 * KIB,
  shared_per_block=96 * KIB,
  l2_bytes=6 * MIB,
  clock_ghz=1.53,
)

# GPU target names for `gpu_devices`: "<name>" is one GPU, "<name>x<N>" N GPUs (8 to a host).
GPUS: dict[str, GpuArch] = {
  "h100": GpuArch("NVIDIA H100 80GB HBM3", **_HOPPER),
  "h200": GpuArch("NVIDIA H200", **_HOPPER),
  "a100": GpuArch("NVIDIA A100-SXM4-80GB", **_AMPERE),
  "a100-40g": GpuArch("NVIDIA A100-SXM4-40GB", **_AMPERE),
  "v100": GpuArch("Tesla V100-SXM2-16GB", **_VOLTA),
  "v100-32g": GpuArch("Tesla V100-SXM2-32GB", **_VOLTA),
}
GPUS_PER_HOST = 8
_GPU_TOPOLOGY = re.compile(r"^([a-z0-9\-]+?)(?:x(\d+))?$")
GPU_EXTRA = "gpu-compile"


def known_gpu_topologies() -> list[str]:
  return [f"{name}{suffix}" for name in GPUS for suffix in ("", "x2", "x4", "x8", "x16")]


def is_gpu_topology(topology: str) -> bool:
  """Whether `topology` names GPUs ("h100", "a100x4") rather than a TPU slice ("v3:2x2")."""
  m = _GPU_TOPOLOGY.match(topology)
  return ":" not in topology and m is not None and m.group(1) in GPUS


def parse_gpu_topology(topology: str) -> tuple[GpuArch, int]:
  """ "h100x8" -> (the H100's GpuArch, 8). Raises ConfigError (one sentence) for an unknown name or a count
  that is neither at most one host's 8 GPUs nor whole hosts of 8."""
  m = _GPU_TOPOLOGY.match(topology)
  if ":" in topology or m is None or m.group(1) not in GPUS:
    raise ConfigError(
      f"GPU target {topology!r} is not known; expected <gpu> or <gpu>x<count> with <gpu> one of "
      f"{', '.join(GPUS)} (e.g. h100, a100x4, h100x16)."
    )
  count = int(m.group(2) or 1)
  if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
    raise ConfigError(
      f"GPU target {topology!r} has {count} GPUs; expected 1 to {GPUS_PER_HOST} on one host or "
      f"a multiple of {GPUS_PER_HOST} (whole hosts)."
    )
  return GPUS[m.group(1)], count


def cuda_plugin_installed() -> bool:
  import importlib.util

  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
  except ModuleNotFoundError:  # no jax_plugins package at all: no plugin of any kind is installed
    return False


def gpu_devices(topology: str) -> list[jax.Device]:
  """The devices of `topology` ("h100", "a100x4", "h100x16" = two hosts of 8), for compiling on any host
  with the CUDA plugin installed (`pip install "lra_core[gpu-compile]"`): XLA compiles for them as for the
  GPU (no driver, no device), from `GpuArch.target_config`. Raises ConfigError (one sentence) for an
  unknown name, a missing plugin, or a process whose CUDA plugin did not register."""
  arch, count = parse_gpu_topology(topology)
  if not cuda_plugin_installed():
    raise ConfigError(
      f"compiling for GPU target {topology!r} needs the CUDA plugin and ptxas; install them with "
      f"pip install -e \".[{GPU_EXTRA}]\"."
    )
  _skip_cuda_runtime_check()
  hosts, per_host = (1, count) if count <= GPUS_PER_HOST else (count // GPUS_PER_HOST, GPUS_PER_HOST)
  try:
    from jax.experimental import topologies as jax_topologies

    desc = jax_topologies.get_topology_desc(
      platform="cuda", target_config=arch.target_config(), topology=f"1x{hosts}x{per_host}"
    )
  except (ImportError, RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
    raise ConfigError(
      f"the GPU compiler could not describe {topology!r} ({brief(e) or type(e).__name__}); on a host without a GPU "
      "run with JAX_PLATFORMS=cpu so that the CUDA plugin loads without a driver."
    ) from e
  return list(desc.devices)


def _skip_cuda_runtime_check() -> None:
  """On a host without a CUDA driver, the CUDA plugin registers only when JAX is not asked to run on it
  (its start-up check of the CUDA runtime would fail): before JAX starts its backends, ask for the CPU
  (nothing can run on a GPU here anyway). A host with a driver is left as it is."""
  import ctypes

  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized() or jax.config.jax_platforms:
    return
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    jax.config.update("jax_platforms", "cpu")


def device_target_config(device: jax.Device | None = None) -> str:
  """The exact `GpuTargetConfigProto` text of a real GPU (run on a machine that has one), to compare
  with or replace `GpuArch.target_config`."""
  from jax._src.lib import xla_client

  device = device or jax.devices()[0]
  return str(xla_client.get_topology_for_devices([device]).target_config)
