"""What `python -m lra_core.aot` reports for one config on one topology, and its step-time estimate.

A `Report` holds memory per device and whether it fits, and a roofline estimate of the train step
(lra_core/cost/hlo_cost.py): FLOPs per device, step time, tokens/s and MFU against the chip's bf16 peak
(lra_core/cost/chips.py). It prints as a table and round-trips through JSON; the estimate is computed from
the compiled train step's HLO text (`estimate_from_hlo`), which can be kept in a file (`write_hlo`) and
costed again later without a compile.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import os
import pathlib

from lra_core.compilation.step_compile import size
from lra_core.cost import chips, hlo_cost
from lra_core.cost.pallas_costs import TRITON_CALL, KernelCost


@dataclasses.dataclass(frozen=True)
class Report:
  """What `python -m lra_core.aot` prints (and writes with --json): one config on one topology."""

  topology: str
  num_devices: int
  device_kind: str
  mesh: dict
  hbm_gib: float
  arguments_gib: float
  temporaries_gib: float
  peak_gib: float
  eval_peak_gib: float
  fits: bool
  flops_per_device: float
  est_step_seconds: float
  est_tokens_per_s: float
  est_mfu: float
  est_hfu: float
  recompute_flops: float
  memory_bound_share: float  # of the estimated step, the share spent in operations bound by HBM bandwidth
  bound: str
  compile_seconds: float
  remat: str
  scan_layers: bool
  num_params: int
  mosaic_kernels: int  # Pallas kernels compiled by Mosaic in the train step (0: none, interpreted, or a GPU)
  refusal: str = ""  # the TPU compiler's out-of-memory message, when it refused the step
  hotspots: tuple = ()  # the train step's dearest operations (hlo_cost.Hotspot), when asked for
  tokens_per_step: int = 0  # global tokens per train step (what tokens/s counts)
  platform: str = "tpu"  # "tpu" or "gpu"
  usable_gib: float = math.nan  # what `fits` compares the peaks with: HBM, or on a GPU HBM x memory_fraction
  memory_fraction: float = 1.0  # GPU: XLA_PYTHON_CLIENT_MEM_FRACTION, the share of HBM JAX preallocates
  pallas_kernels: int = 0  # Pallas kernels compiled for the device in the train step: Mosaic (TPU) or Triton (GPU)
  kernel_costs: tuple = ()  # GPU: the Pallas kernels' declared costs (pallas_costs.KernelCost), which the HLO lacks
  undeclared_kernels: int = 0  # Triton calls the estimate found no cost for (counted as traffic only)
  gemm_fallback: str = ""  # GPU: why a step's matmuls were compiled as cuBLAS calls rather than Triton fusions
  time_split: tuple = ()  # ((kind of work, seconds), ...) of the estimated step (hlo_cost.SPLIT), dearest first
  comm_seconds: float = 0.0  # the step's collectives at the chip's interconnect bandwidth (overlapped with compute)
  comm_bytes: float = 0.0
  sequence_comm_seconds: float = 0.0  # of those, the sequence axis's (mesh.sequence: kernels/context_parallel.py)
  sequence_comm_bytes: float = 0.0
  slices: int = 1  # TPU slices joined over the data-center network (mesh.slices)
  slice_axis: str = "data"  # the mesh axis that spans them
  dcn_comm_seconds: float = 0.0  # of the collectives, those between slices, at the chip's DCN bandwidth
  dcn_comm_bytes: float = 0.0

  JSON_FIELDS = (
    "topology",
    "num_devices",
    "device_kind",
    "hbm_gib",
    "peak_gib",
    "fits",
    "flops_per_device",
    "est_step_seconds",
    "est_tokens_per_s",
    "est_mfu",
  )
  # est_mfu counts the model's FLOPs: the program's less what remat recomputes (recompute_flops);
  # est_hfu counts every FLOP the chip runs.

  def to_json(self) -> dict:
    """The issue-stable fields first, then the rest; numbers the compile could not give are null."""
    out = {k: getattr(self, k) for k in self.JSON_FIELDS}
    out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in out})
    out["hotspots"] = [dataclasses.asdict(h) | {"bound": h.bound} for h in self.hotspots]
    out["kernel_costs"] = [dataclasses.asdict(k) | {"operands": list(k.operands)} for k in self.kernel_costs]
    out["time_split"] = [[kind, seconds] for kind, seconds in self.time_split]
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}

  @classmethod
  def from_json(cls, fields: dict) -> Report:
    """The report `to_json` wrote (nulls back to NaN; fields a newer report added take their defaults)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: math.nan if v is None else v for k, v in fields.items() if k in known}
    values["hotspots"] = tuple(
      hlo_cost.Hotspot(**{k: v for k, v in h.items() if k != "bound"}) for h in fields.get("hotspots", ())
    )
    values["kernel_costs"] = tuple(
      KernelCost(**(k | {"operands": tuple(k["operands"])})) for k in fields.get("kernel_costs", ())
    )
    values["time_split"] = tuple((kind, seconds) for kind, seconds in fields.get("time_split", ()))
    return cls(**values)

  def split_text(self) -> str:
    """'elementwise 45%, matmuls HBM-bound 28%, ...': the step by kind of work (hlo_cost.SPLIT), over 0.5%."""
    total = sum(seconds for _, seconds in self.time_split)
    return ", ".join(f"{kind} {100 * s / total:.0f}%" for kind, s in self.time_split if s >= 0.005 * total) or "-"

  @property
  def kernel_compiler(self) -> str:
    return "Triton" if self.platform == "gpu" else "Mosaic"

  @property
  def peak_name(self) -> str:
    """What the MFU divides by: the chip's bf16 peak (the V100 has no bf16: its float32 rate)."""
    return "float32 peak (it has no bf16)" if "V100" in self.device_kind else "bf16 peak"

  @property
  def topology_text(self) -> str:
    """'v5e:2x2', or for several slices '2 slices of v5e:2x2 over the data-center network'."""
    if self.slices == 1:
      return self.topology
    return f"{self.slices} slices of {self.topology} over the data-center network"

  def mesh_warning(self) -> str:
    """One line when the config's mesh leaves some of the topology's devices out, else ''."""
    used = math.prod(self.mesh.values())
    if used >= self.num_devices:
      return ""
    return (
      f"warning: the config's mesh {self.mesh} uses {used} of the topology's {self.num_devices} devices, so "
      f"every number below is for a run on {used}; set --config.mesh.data=-1 (or another axis) to use them all."
    )

  def memory_row(self) -> str:
    if self.platform != "gpu":
      return size(self.hbm_gib)
    if not math.isclose(self.usable_gib, self.hbm_gib * self.memory_fraction, rel_tol=1e-6):
      return f"{size(self.hbm_gib)}, of which this check allows {size(self.usable_gib)} (train.memory_limit_gib)"
    return (
      f"{size(self.hbm_gib)}, of which a JAX process may use {size(self.usable_gib)} "
      f"(XLA_PYTHON_CLIENT_MEM_FRACTION={self.memory_fraction:g}: JAX preallocates that share)"
    )

  def comm_text(self) -> str:
    """The collectives' time (and the sequence axis's part), as a share of the estimated step."""
    share = lambda seconds: f"{100 * seconds / max(self.est_step_seconds, 1e-12):.0f}%"
    if not self.comm_bytes:
      return "none"
    text = (
      f"{duration(self.comm_seconds)} moving {size(self.comm_bytes / 2**30)} per device "
      f"({share(self.comm_seconds)} of the estimated step, overlapped with compute)"
    )
    if self.mesh.get("sequence", 1) > 1:
      text += (
        f"; the sequence axis {duration(self.sequence_comm_seconds)}, {size(self.sequence_comm_bytes / 2**30)} "
        f"({share(self.sequence_comm_seconds)})"
      )
    if self.slices > 1:
      text += (
        f"; between the {self.slices} slices (DCN, the {self.slice_axis} axis) {duration(self.dcn_comm_seconds)}, "
        f"{size(self.dcn_comm_bytes / 2**30)} ({share(self.dcn_comm_seconds)})"
      )
    return text

  def table(self) -> str:
    compiler = "GPU" if self.platform == "gpu" else "TPU"
    if self.refusal:  # the compiler refused the step for memory
      train = (
        f"needs {size(self.peak_gib)} of temporaries (the {compiler} compiler's out-of-memory refusal)"
        if not math.isnan(self.peak_gib)
        else f"refused by the {compiler} compiler: {self.refusal}"
      )
      estimate = [("estimated step time", "- (not compiled)")]
    else:
      train = (
        f"arguments {size(self.arguments_gib)}, temporaries {size(self.temporaries_gib)}, peak {size(self.peak_gib)}"
      )
      estimate = [
        ("FLOPs per device per step", f"{self.flops_per_device:.4g}"),
        ("estimated step time", f"{duration(self.est_step_seconds)} ({self.bound}-bound)"),
        ("estimated tokens/s", f"{self.est_tokens_per_s:,.0f}"),
        (
          "estimated MFU",
          f"{100 * self.est_mfu:.1f}% of {self.device_kind} {self.peak_name} "
          f"({100 * self.est_hfu:.1f}% counting remat's recomputation)",
        ),
        ("memory-bound share", f"{100 * self.memory_bound_share:.0f}% of the estimated step"),
        ("where the step goes", self.split_text()),
        ("collectives", self.comm_text()),
      ]
    rows = [
      ("topology", f"{self.topology_text} ({self.num_devices} x {self.device_kind}, mesh {self.mesh})"),
      ("HBM per device", self.memory_row()),
      ("train step per device", train),
      ("eval step per device", f"peak {size(self.eval_peak_gib)}" if not math.isnan(self.eval_peak_gib) else "-"),
      ("fits", "yes" if self.fits else "NO"),
      ("parameters", f"{self.num_params:,} (remat {self.remat}, scan_layers {self.scan_layers})"),
      (f"Pallas kernels ({self.kernel_compiler}) in train step", f"{self.pallas_kernels}"),
      *([("matrix products", self.gemm_fallback)] if self.gemm_fallback else []),
      *estimate,
      ("compile time on this host", f"{self.compile_seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if self.hotspots:
      total = self.est_step_seconds
      lines.append(f"dearest operations of the train step (share of the {duration(total)} estimate):")
      for h in self.hotspots:
        lines.append(
          f"  {100 * h.seconds / total:5.1f}%  {h.bound:7s}  x{h.executions:<6,.0f} {h.kind:24s} "
          f"{h.source[-90:] or h.name}"
        )
    return "\n".join(lines)


def estimate_from_hlo(report: Report, hlo: str, *, hotspots: int = 0) -> Report:
  """`report` with its estimate (step time, tokens/s, MFU, HFU, what bounds it) computed from the
  compiled train step's HLO text for the report's chip (and, on a GPU, its Pallas kernels' costs)."""
  chip = chips.CHIPS[report.device_kind]
  mesh = tuple(report.mesh.items())  # in the mesh's axis order, as its devices are laid out
  roof = hlo_cost.roofline(
    hlo,
    chip,
    top=hotspots,
    split=True,
    kernel_costs=report.kernel_costs,
    mesh=mesh,
    slices=(report.slice_axis, report.slices),
  )
  if roof.unknown_loops:
    logging.warning(
      "%d loop(s) of the train step have no readable trip count and count once in the estimate", roof.unknown_loops
    )
  if roof.undeclared_kernels:
    logging.warning(
      "%d Triton kernel(s) of the train step declare no cost: their traffic counts, their FLOPs do not",
      roof.undeclared_kernels,
    )
  seconds = max(roof.seconds, 1e-12)
  mosaic = hlo.count('custom_call_target="tpu_custom_call"')
  triton = hlo.count(f'custom_call_target="{TRITON_CALL}"')
  return dataclasses.replace(
    report,
    flops_per_device=roof.flops,
    est_step_seconds=roof.seconds,
    est_tokens_per_s=report.tokens_per_step / seconds,
    est_mfu=(roof.flops - roof.recompute_flops) / (seconds * chip.peak_flops),
    est_hfu=roof.flops / (seconds * chip.peak_flops),
    recompute_flops=roof.recompute_flops,
    memory_bound_share=roof.memory_bound_s / seconds,
    bound=roof.bound,
    mosaic_kernels=mosaic,
    pallas_kernels=triton if report.platform == "gpu" else mosaic,
    undeclared_kernels=roof.undeclared_kernels,
    hotspots=roof.hotspots,
    time_split=roof.split,
    comm_seconds=roof.comm_s,
    comm_bytes=roof.comm_bytes,
    sequence_comm_seconds=roof.sequence_comm_s,
    sequence_comm_bytes=roof.sequence_comm_bytes,
    dcn_comm_seconds=roof.dcn_comm_s,
    dcn_comm_bytes=roof.dcn_comm_bytes,
  )


def write_hlo(text: str, path: str | os.PathLike) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  data = text.encode()
  path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def read_hlo(path: str | os.PathLike) -> str:
  path = pathlib.Path(path)
  data = path.read_bytes()
  return (gzip.decompress(data) if path.suffix == ".gz" else data).decode()


def duration(seconds: float) -> str:
  """'12.5 ms' from 0.1 ms up, '35.0 µs' below."""
  return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:,.1f} µs"
