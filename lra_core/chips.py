"""Accelerator chips as the cost estimates see them, and TPU slices without a TPU.

`CHIPS` holds, per JAX device kind, what one *JAX device* has: peak bf16 matmul FLOP/s, HBM
bytes and bandwidth, and interconnect bandwidth. On TPU v2 and v3 every TensorCore is a JAX
device (half a chip); v4 and v5p run both cores of a chip as one device (megacore); v5e and v6e
have one core per chip. Per-chip figures are Google Cloud's TPU documentation (system
architecture pages of each generation: cloud.google.com/tpu/docs/v2, v3, v4, v5e, v5p, v6e) and
NVIDIA's H100 / H200 datasheets (SXM, dense bf16). Interconnect: the ICI bandwidth per chip where
the documentation gives one (v5e, v5p, v6e); for v3 and v4 the pod's all-reduce bandwidth over
its chips; v2 is taken as v3's (no figure is published).

`tpu_devices("v3:2x2")` gives the devices of a TPU slice on any host with libtpu installed
(`pip install "lra_core[tpu]"`): `jax.jit(...).lower(...).compile()` over a mesh of them runs the
real TPU compiler, which is how `python -m lra_core.aot` checks paper configs on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from lra_core.errors import ConfigError

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One JAX device of an accelerator."""
  name: str                # the product name, e.g. "TPU v3"
  peak_flops: float        # dense bf16 matmul FLOP/s
  hbm_bytes: int
  hbm_bandwidth: float     # bytes/s
  ici_bandwidth: float     # bytes/s this device can send to its neighbours (collectives)
  devices_per_chip: int


def _per_device(name: str, kind: str, *, tflops: float, hbm_gib: float, hbm_gbps: float, ici_gbps: float,
                devices_per_chip: int = 1) -> tuple[str, Chip]:
  n = devices_per_chip
  return kind, Chip(name, tflops * 1e12 / n, int(hbm_gib * GIB / n), hbm_gbps * GB / n, ici_gbps * GB / n, n)


# JAX device_kind -> Chip (per-chip figures divided among the chip's JAX devices).
CHIPS: dict[str, Chip] = dict([
    _per_device("TPU v2", "TPU v2", tflops=45, hbm_gib=16, hbm_gbps=600, ici_gbps=332, devices_per_chip=2),
    _per_device("TPU v3", "TPU v3", tflops=123, hbm_gib=32, hbm_gbps=900, ici_gbps=332, devices_per_chip=2),
    _per_device("TPU v4", "TPU v4", tflops=275, hbm_gib=32, hbm_gbps=1200, ici_gbps=268),
    _per_device("TPU v5e", "TPU v5 lite", tflops=197, hbm_gib=16, hbm_gbps=819, ici_gbps=200),
    _per_device("TPU v5p", "TPU v5", tflops=459, hbm_gib=95, hbm_gbps=2765, ici_gbps=600),
    _per_device("TPU v6e", "TPU v6 lite", tflops=918, hbm_gib=32, hbm_gbps=1640, ici_gbps=448),
    _per_device("H100", "NVIDIA H100 80GB HBM3", tflops=989, hbm_gib=80, hbm_gbps=3350, ici_gbps=450),
    _per_device("H200", "NVIDIA H200", tflops=989, hbm_gib=141, hbm_gbps=4800, ici_gbps=450),
])

# Topology names: generation -> (the TPU compiler's chip config, chips per host, the slice shapes
# Cloud TPU offers, in chips). A slice name is "<generation>:<shape>", e.g. "v3:4x4" (32 cores).
GENERATIONS = {
    "v2": ("default", (2, 2, 1), ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "v3": ("default", (2, 2, 1), ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32")),
    "v4": ("megacore", (2, 2, 1), ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                                   "8x8x16")),
    "v5e": ("default", (2, 2, 1), ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "v5p": ("default", (2, 2, 1), ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8")),
    "v6e": ("default", (2, 2, 1), ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
}


def known_topologies() -> list[str]:
  return [f"{g}:{shape}" for g, (_, _, shapes) in GENERATIONS.items() for shape in shapes]


def chip_of(device: jax.Device) -> Chip | None:
  return CHIPS.get(device.device_kind)


def tpu_devices(topology: str) -> list[jax.Device]:
  """The devices of the TPU slice `topology` ("v3:2x2", "v5p:2x2x4", ...), for compiling on any host.

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
    from jax.experimental import topologies
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name=chip_config,
                                        chips_per_host_bounds=per_host, num_slices=1)
  except (ImportError, RuntimeError, jax.errors.JaxRuntimeError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not libtpu_installed():
      raise ConfigError(f"compiling for TPU topology {topology!r} needs libtpu; install it with "
                        "pip install -e \".[tpu]\".") from e
    raise ConfigError(f"the TPU compiler could not describe topology {topology!r}: {first}") from e
  return list(desc.devices)


def libtpu_installed() -> bool:
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None
