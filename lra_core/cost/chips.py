"""Accelerator chips as the cost estimates see them.

`CHIPS` holds, per JAX device kind, what one *JAX device* has: peak bf16 matmul FLOP/s, HBM
bytes and bandwidth, and interconnect bandwidth. On TPU v2 and v3 every TensorCore is a JAX
device (half a chip); v4 and v5p run both cores of a chip as one device (megacore); v5e and v6e
have one core per chip. Per-chip figures are Google Cloud's TPU documentation (system
architecture pages of each generation: cloud.google.com/tpu/docs/v2, v3, v4, v5e, v5p, v6e) and
NVIDIA's H100 / H200 datasheets (SXM, dense bf16). Interconnect: the ICI bandwidth per chip where
the documentation gives one (v5e, v5p, v6e); for v3 and v4 the pod's all-reduce bandwidth over
its chips; v2 is taken as v3's (no figure is published). Data-center network (DCN), what joins the
slices of a multi-slice job (mesh.slices): per chip, from the same pages: v5p's "DCN bandwidth per chip"
(50 Gbps); v5e and v6e give a host's NICs (2 x 100 and 4 x 200 Gbps for 8 chips) and a Pod's DCN
bandwidth (6.4 and 25.6 Tbps for 256 chips), which agree on 25 and 100 Gbps a chip. v2, v3 and v4 have
no published figure, and GPUs none here: a multi-slice estimate for them is refused.

The devices of a TPU slice or of NVIDIA GPUs that this host does not have, for compiling ahead of
time, are lra_core/compilation/topologies.py's.
"""

from __future__ import annotations

import dataclasses

import jax

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One JAX device of an accelerator."""

  name: str  # the product name, e.g. "TPU v3"
  peak_flops: float  # dense bf16 matmul FLOP/s
  hbm_bytes: int
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float  # bytes/s this device can send to its neighbours (collectives)
  devices_per_chip: int
  dcn_bandwidth: float | None = None  # bytes/s this device sends to other slices (None: not published)


def _per_device(
  name: str,
  kind: str,
  *,
  tflops: float,
  hbm_gib: float,
  hbm_gbps: float,
  ici_gbps: float,
  devices_per_chip: int = 1,
  dcn_gbit: float | None = None,  # per chip, in gigabits a second as published
) -> tuple[str, Chip]:
  n = devices_per_chip
  dcn = None if dcn_gbit is None else dcn_gbit * GB / 8 / n
  return kind, Chip(name, tflops * 1e12 / n, int(hbm_gib * GIB / n), hbm_gbps * GB / n, ici_gbps * GB / n, n, dcn)


# JAX device_kind -> Chip (per-chip figures divided among the chip's JAX devices).
CHIPS: dict[str, Chip] = dict(
  [
    _per_device("TPU v2", "TPU v2", tflops=45, hbm_gib=16, hbm_gbps=600, ici_gbps=332, devices_per_chip=2),
    _per_device("TPU v3", "TPU v3", tflops=123, hbm_gib=32, hbm_gbps=900, ici_gbps=332, devices_per_chip=2),
    _per_device("TPU v4", "TPU v4", tflops=275, hbm_gib=32, hbm_gbps=1200, ici_gbps=268),
    _per_device("TPU v5e", "TPU v5 lite", tflops=197, hbm_gib=16, hbm_gbps=819, ici_gbps=200, dcn_gbit=25),
    _per_device("TPU v5p", "TPU v5", tflops=459, hbm_gib=95, hbm_gbps=2765, ici_gbps=600, dcn_gbit=50),
    _per_device("TPU v6e", "TPU v6 lite", tflops=918, hbm_gib=32, hbm_gbps=1640, ici_gbps=448, dcn_gbit=100),
    # NVIDIA datasheets, SXM boards: dense (non-sparse) bf16 Tensor Core FLOP/s, HBM, and NVLink per
    # direction (half the bidirectional figure). The V100 has no bf16 arithmetic: XLA computes a bf16
    # program's matmuls in float32 there, so its peak is the float32 rate (its fp16 Tensor Cores: 125 TF).
    _per_device("H100", "NVIDIA H100 80GB HBM3", tflops=989, hbm_gib=80, hbm_gbps=3350, ici_gbps=450),
    _per_device("H200", "NVIDIA H200", tflops=989, hbm_gib=141, hbm_gbps=4800, ici_gbps=450),
    _per_device("A100 80GB", "NVIDIA A100-SXM4-80GB", tflops=312, hbm_gib=80, hbm_gbps=2039, ici_gbps=300),
    _per_device("A100 40GB", "NVIDIA A100-SXM4-40GB", tflops=312, hbm_gib=40, hbm_gbps=1555, ici_gbps=300),
    _per_device("V100 16GB", "Tesla V100-SXM2-16GB", tflops=15.7, hbm_gib=16, hbm_gbps=900, ici_gbps=150),
    _per_device("V100 32GB", "Tesla V100-SXM2-32GB", tflops=15.7, hbm_gib=32, hbm_gbps=900, ici_gbps=150),
  ]
)


def chip_of(device: jax.Device) -> Chip | None:
  return CHIPS.get(device.device_kind)
