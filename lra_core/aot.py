"""Ahead-of-time compilation: memory, fit and a step-time estimate, before any state exists.

The trainer lowers and compiles its step from abstract shapes and shardings, then reads XLA's
buffer assignment for one device: the arguments (state and batch), the outputs, what the
donated state lets them share, and the temporaries. If that estimate exceeds the device's
memory, the run stops there, in the time a compile takes, with the numbers, instead of failing
to allocate minutes later (or, on a pod, after every host has loaded its data).

The same path compiles a config for accelerators that are not there, on any host: a TPU slice
(libtpu's compiler) or NVIDIA GPUs (XLA:GPU, Triton and ptxas of the CUDA plugin, no driver needed):

  python -m lra_core.aot --config=configs/enwik8/transformer_vq.py --topology=v3:2x2 \
      --config.train.batch_size=8 --config.train.seq_len=8192 --config.mesh.data=8 [--json=FILE]
  python -m lra_core.aot --config=configs/c4/latte.py:latte --topology=a100x4 --config.mesh.data=4

--topology is a TPU slice, <generation>:<chips> (v3:2x2, v5p:2x2x1, ...), or GPUs, <gpu>[x<count>]
with <gpu> one of lra_core.chips.GPUS (h100, h200, a100, a100-40g, v100, v100-32g; h100x16 is two
hosts of 8). It builds the trainer's own train step (state spec, shardings, donation, micro-batches,
kernels) and eval step for the config's batch shapes, with no data files, and prints memory per
device, whether it fits, and a roofline estimate of the step (lra_core/hlo_cost.py): FLOPs per
device, step time, tokens/s and MFU against the chip's bf16 peak (lra_core/chips.py). A TPU step
fits its chip's HBM; a GPU step fits the part of the GPU's memory JAX preallocates,
XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set) of it, read from this process's environment.
Exit status: 0 fits, 3 compiles but does not fit, 2 a config or topology error (one sentence).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import os
import pathlib
import re
import sys
import time

import jax

from lra_core import chips, cli, data_setup, hlo_cost, layout, optim, sharding
from lra_core.data import pipeline
from lra_core.errors import ConfigError, ResourceError
from lra_core.state import StateSpec, make_state_spec
from lra_core.steps import make_eval_step, make_train_step
from lra_core.tasks import Task, make_task

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of one compiled program, from XLA's buffer assignment."""

  arguments: int
  outputs: int
  aliased: int  # output buffers that reuse donated argument buffers
  temporaries: int
  code: int
  peak: int  # XLA's own peak when it reports one, else arguments + outputs - aliased + temporaries

  @classmethod
  def of(cls, compiled: jax.stages.Compiled) -> MemoryEstimate | None:
    stats = compiled.memory_analysis()
    if stats is None:
      return None
    total = (
      stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )
    peak = max(int(getattr(stats, "peak_memory_in_bytes", 0) or 0), total)
    return cls(
      stats.argument_size_in_bytes,
      stats.output_size_in_bytes,
      stats.alias_size_in_bytes,
      stats.temp_size_in_bytes,
      stats.generated_code_size_in_bytes,
      peak,
    )

  def describe(self) -> str:
    return (
      f"{size(self.peak / GIB)} per device (arguments {size(self.arguments / GIB)}, outputs "
      f"{size(self.outputs / GIB)}, {size(self.aliased / GIB)} of them reusing donated inputs, temporaries "
      f"{size(self.temporaries / GIB)})"
    )


def device_memory_limit(device: jax.Device | None = None) -> tuple[int, str] | None:
  """(bytes one device may use, where the number comes from), or None if unknown.

  Accelerators report their allocator's limit. CPU devices share the host's memory, so each of
  the process's CPU devices gets an equal part of it.
  """
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  except (jax.errors.JaxRuntimeError, RuntimeError, NotImplementedError):
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind} memory"
  chip = chips.chip_of(device)
  if chip is not None and device.platform == "gpu":  # a compile-only GPU: what JAX would preallocate
    fraction = gpu_memory_fraction()
    return int(chip.hbm_bytes * fraction), f"{chip.name} memory x XLA_PYTHON_CLIENT_MEM_FRACTION {fraction:g}"
  if chip is not None:  # a device without a runtime (a TPU topology's): its HBM
    return chip.hbm_bytes, f"{chip.name} HBM"
  if device.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
    n = jax.local_device_count()
    return host // n, f"host memory / {n} CPU device(s)"
  return None


DEFAULT_GPU_MEMORY_FRACTION = 0.75  # JAX's preallocation when XLA_PYTHON_CLIENT_MEM_FRACTION is unset


def gpu_memory_fraction() -> float:
  """The share of a GPU's memory a JAX process may use: JAX's allocator takes
  XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 unless set) and no more."""
  text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
  if not text:
    return DEFAULT_GPU_MEMORY_FRACTION
  try:
    fraction = float(text)
  except ValueError:
    fraction = math.nan
  if not 0 < fraction <= 1:
    raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a fraction in (0, 1].")
  return fraction


def target_devices(topology: str) -> list[jax.Device]:
  """The devices of a TPU slice ("v3:2x2") or of NVIDIA GPUs ("h100", "a100x4"), compile-only.
  Raises ConfigError (one sentence) for a name that is neither."""
  if chips.is_gpu_topology(topology):
    return chips.gpu_devices(topology)
  if ":" in topology:
    return chips.tpu_devices(topology)
  raise ConfigError(
    f"topology {topology!r} is neither a TPU slice, <generation>:<chips> (e.g. v3:2x2, v5p:2x2x1), "
    f"nor GPUs, <gpu> or <gpu>x<count> with <gpu> one of {', '.join(chips.GPUS)} (e.g. h100, "
    "a100x4, h100x16)."
  )


def jit_train_step(config, spec, task, tx, schedule):
  """The trainer's train step, jitted as the trainer runs it: the state donated, its shardings kept."""
  return jax.jit(
    make_train_step(config, spec, task, tx, schedule), donate_argnums=0, out_shardings=(spec.shardings, None)
  )


def compile_step(
  jitted, *abstract_args, name: str, limit_gib: float = 0.0, device: jax.Device | None = None
) -> jax.stages.Compiled:
  """Lowers and compiles `jitted` for `abstract_args` and checks its memory estimate.

  limit_gib: the per-device budget; 0 takes the device's own limit (device_memory_limit of
  `device`, by default the first local one).
  Raises ResourceError (one sentence with the estimate) when the estimate exceeds the budget.
  """
  compiled, seconds = timed_compile(jitted, *abstract_args)
  estimate = MemoryEstimate.of(compiled)
  if estimate is None:
    logging.info("%s compiled in %.1f s (the backend gives no memory estimate)", name, seconds)
    return compiled
  limit = memory_limit(limit_gib, device)
  budget = f" of {size(limit[0] / GIB)} ({limit[1]})" if limit else ""
  logging.info("%s compiled in %.1f s; memory %s%s", name, seconds, estimate.describe(), budget)
  if limit and estimate.peak > limit[0]:
    raise ResourceError(
      f"the {name} needs about {estimate.describe()}, more than the {size(limit[0] / GIB)} "
      f"available ({limit[1]}); use a smaller batch or model, more gradient "
      "accumulation steps, model.remat, or shard over more devices (mesh.fsdp / mesh.tensor)."
    )
  return compiled


def timed_compile(jitted, *abstract_args) -> tuple[jax.stages.Compiled, float]:
  t0 = time.perf_counter()
  compiled = jitted.lower(*abstract_args).compile()
  return compiled, time.perf_counter() - t0


def memory_limit(limit_gib: float, device: jax.Device | None = None) -> tuple[int, str] | None:
  return (int(limit_gib * GIB), "train.memory_limit_gib") if limit_gib > 0 else device_memory_limit(device)


# ----------------------------------------------------------------------------- a config for a TPU slice or GPUs


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
  kernel_costs: tuple = ()  # GPU: the Pallas kernels' declared costs (hlo_cost.KernelCost), which the HLO lacks
  undeclared_kernels: int = 0  # Triton calls the estimate found no cost for (counted as traffic only)
  gemm_fallback: str = ""  # GPU: why a step's matmuls were compiled as cuBLAS calls rather than Triton fusions
  time_split: tuple = ()  # ((kind of work, seconds), ...) of the estimated step (hlo_cost.SPLIT), dearest first

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
      hlo_cost.KernelCost(**(k | {"operands": tuple(k["operands"])})) for k in fields.get("kernel_costs", ())
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
      ]
    rows = [
      ("topology", f"{self.topology} ({self.num_devices} x {self.device_kind}, mesh {self.mesh})"),
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


def compile_config(
  config,
  topology: str,
  *,
  devices: list[jax.Device] | None = None,
  hotspots: int = 0,
  hlo_path: str | os.PathLike | None = None,
) -> Report:
  """Compiles `config`'s train and eval steps for the TPU slice or GPUs `topology` (their devices by
  `target_devices` unless given) and measures them. Raises ConfigError for a bad topology or a
  mesh the devices cannot hold; a step that compiles but does not fit comes back with fits=False.
  `hlo_path` also keeps the compiled train step's HLO text there (gzip if it ends in .gz), from
  which `estimate_from_hlo` recomputes the estimate without compiling again."""
  devices = target_devices(topology) if devices is None else devices
  chip = chips.chip_of(devices[0])
  if chip is None:
    raise ConfigError(f"device kind {devices[0].device_kind!r} has no entry in lra_core.chips.CHIPS.")
  platform = "gpu" if devices[0].platform == "gpu" else "tpu"
  t = config.train
  mesh, task, spec, traced = trace_train_step(config, devices)
  rules = config.sharding.rules
  with jax.set_mesh(mesh), sharding.activate(mesh, rules):
    train, train_s, train_fallback = _compile_for_target(traced, platform=platform)
    evaluate, eval_s, eval_fallback = _compile_for_target(
      *_eval_step_args(config, spec, task, mesh, rules), platform=platform
    )
  limit, _ = memory_limit(t.memory_limit_gib, devices[0])
  tokens = t.batch_size * t.seq_len // pipeline.num_windows(config)
  # A GPU program's Triton calls keep no cost estimate: the traced program's Pallas calls give theirs.
  kernel_costs = hlo_cost.pallas_kernel_costs(traced.jaxpr) if platform == "gpu" else ()
  common = dict(
    topology=topology,
    num_devices=len(devices),
    device_kind=devices[0].device_kind,
    mesh={k: v for k, v in mesh.shape.items()},
    hbm_gib=chip.hbm_bytes / GIB,
    compile_seconds=train_s + eval_s,
    remat=str(config.model.remat),
    scan_layers=bool(config.model.scan_layers),
    num_params=spec.num_params,
    tokens_per_step=tokens,
    platform=platform,
    usable_gib=limit / GIB,
    memory_fraction=gpu_memory_fraction() if platform == "gpu" else 1.0,
    kernel_costs=kernel_costs,
    gemm_fallback=train_fallback or eval_fallback,
    # The estimate's fields, until estimate_from_hlo reads them off the compiled step.
    flops_per_device=math.nan,
    est_step_seconds=math.nan,
    est_tokens_per_s=math.nan,
    est_mfu=math.nan,
    est_hfu=math.nan,
    recompute_flops=math.nan,
    memory_bound_share=math.nan,
    bound="-",
    mosaic_kernels=0,
  )
  if isinstance(train, OutOfMemory):
    eval_peak = evaluate.required if isinstance(evaluate, OutOfMemory) else MemoryEstimate.of(evaluate).peak
    logging.info("the train step does not fit: %s", train.message)
    return Report(
      **common,
      arguments_gib=math.nan,
      temporaries_gib=train.required / GIB,
      peak_gib=train.required / GIB,
      eval_peak_gib=eval_peak / GIB,
      fits=False,
      refusal=train.message,
    )
  memory = MemoryEstimate.of(train)
  eval_peak = evaluate.required if isinstance(evaluate, OutOfMemory) else MemoryEstimate.of(evaluate).peak
  hlo = train.as_text()
  if hlo_path is not None:
    write_hlo(hlo, hlo_path)
  report = Report(
    **common,
    arguments_gib=memory.arguments / GIB,
    temporaries_gib=memory.temporaries / GIB,
    peak_gib=memory.peak / GIB,
    eval_peak_gib=eval_peak / GIB,
    fits=max(memory.peak, eval_peak) <= limit,
  )
  return estimate_from_hlo(report, hlo, hotspots=hotspots)


def trace_train_step(config, devices: list[jax.Device]) -> tuple[sharding.Mesh, Task, StateSpec, jax.stages.Traced]:
  """(mesh, task, state spec, traced train step) of `config` over `devices`, from shapes alone (no data,
  nothing allocated). Compile the step inside `with jax.set_mesh(mesh), sharding.activate(mesh, rules)`,
  where the Pallas kernels lower for the mesh's devices: `traced.lower().compile()`."""
  mesh = layout.make_mesh(config.mesh, devices)
  rules = config.sharding.rules
  info = data_setup.config_data_info(config)
  data_setup.check_compatible(config, info, mesh)
  task = make_task(config, info)
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  with jax.set_mesh(mesh), sharding.activate(mesh, rules):
    batch = layout.config_batch(config, mesh, rules)
    return mesh, task, spec, jit_train_step(config, spec, task, tx, schedule).trace(spec.abstract, batch)


def estimate_from_hlo(report: Report, hlo: str, *, hotspots: int = 0) -> Report:
  """`report` with its estimate (step time, tokens/s, MFU, HFU, what bounds it) computed from the
  compiled train step's HLO text for the report's chip (and, on a GPU, its Pallas kernels' costs)."""
  chip = chips.CHIPS[report.device_kind]
  roof = hlo_cost.roofline(hlo, chip, top=hotspots, split=True, kernel_costs=report.kernel_costs)
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
  triton = hlo.count(f'custom_call_target="{hlo_cost.TRITON_CALL}"')
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


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """A compile the TPU compiler refused because its buffers exceed the chip's memory."""

  required: float  # bytes the compiler said it needs (NaN if its message names none)
  message: str


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_TRITON_TOO_OLD = re.compile(r"Triton support is only enabled for .*compute capability")
_NO_TRITON_TILING = "Couldn't find output tile sizes"
CUBLAS_ONLY_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
GEMM_FALLBACK = (
  "cuBLAS GEMMs (xla_gpu_enable_triton_gemm=false): XLA:GPU's Triton GEMM emitter found no "
  "tiling for a matmul of the step"
)


def _compile_for_target(step, *abstract_args, platform: str = "tpu"):
  """(compiled, seconds, fallback): timed_compile of a jitted step (or an already traced one, with no
  arguments), except that the compiler's out-of-memory refusal comes back as OutOfMemory (the devices
  cannot hold the step: an answer, not an error). On a GPU, Triton's refusal of a compute capability
  below 8.0 is a ConfigError, and a step whose matmul XLA's Triton GEMM emitter finds no tiling for
  compiles again with cuBLAS GEMMs (`fallback` says so; "" when none was needed)."""
  t0 = time.perf_counter()
  fallback = ""
  try:
    lowered = step.lower() if isinstance(step, jax.stages.Traced) else step.lower(*abstract_args)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # Without a device XLA cannot autotune, and its default Triton tiling fails for some matmul shapes
      # (e.g. 82,080 rows); on a GPU its autotuner chooses between Triton and cuBLAS per matmul.
      if platform != "gpu" or _NO_TRITON_TILING not in str(e):
        raise
      logging.warning(
        "XLA:GPU found no Triton tiling for a matmul (%s); compiling with cuBLAS GEMMs",
        str(e).strip().splitlines()[0][:200],
      )
      compiled = lowered.compile(compiler_options=dict(CUBLAS_ONLY_OPTIONS))
      fallback = GEMM_FALLBACK
    return compiled, time.perf_counter() - t0, fallback
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if platform == "gpu" and _TRITON_TOO_OLD.search(text):
      raise ConfigError(
        "Pallas kernels compile to Triton, which needs compute capability 8.0 or newer and this GPU "
        "has less (a V100 has 7.0); use model.impl=xla."
      ) from e
    if "RESOURCE_EXHAUSTED" not in text:
      raise
    first = text.strip().splitlines()[0]
    m = re.search(r"required for [\w ]+\(([\d.]+)([KMGTP]?)\)", first) or re.search(r"\(([\d.]+)([KMGTP]?)\)", first)
    # XLA:GPU plans any size of program: its RESOURCE_EXHAUSTED is a kernel's shared memory, not HBM.
    required = float(m.group(1)) * _UNITS[m.group(2)] if m and platform != "gpu" else math.nan
    return OutOfMemory(required, first), time.perf_counter() - t0, fallback


def _eval_step_args(config, spec, task, mesh, rules) -> tuple:
  """The evaluator's jitted step and its abstract arguments at the eval batch size."""
  batch_size = config.train.eval_batch_size or config.train.batch_size
  batch = layout.config_batch(config, mesh, rules, batch_size=batch_size)
  carry = None
  if spec.has_carry:
    carry = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(
        (batch_size,) + a.shape[1:],
        a.dtype,
        sharding=sharding.NamedSharding(mesh, layout.batch_spec(rules, mesh, (batch_size,) + a.shape[1:])),
      ),
      spec.abstract["carry"],
    )
  step = jax.jit(make_eval_step(config, spec, task))
  return step, spec.abstract["params"], spec.abstract["model_state"], batch, carry


def size(gib: float) -> str:
  """'1.25 GiB' from 0.1 GiB up, else '3.4 MiB' or '12.0 KiB': small models' numbers do not read 0.00."""
  if not abs(gib) < 0.1 or gib == 0:  # NaN too
    return f"{gib:,.2f} GiB"
  mib = gib * 2**10
  return f"{mib:,.1f} MiB" if abs(mib) >= 0.1 else f"{mib * 2**10:,.1f} KiB"


def duration(seconds: float) -> str:
  """'12.5 ms' from 0.1 ms up, '35.0 µs' below."""
  return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:,.1f} µs"


# ----------------------------------------------------------------------------- command line

EXIT_FITS, EXIT_USER_ERROR, EXIT_DOES_NOT_FIT = 0, cli.EXIT_USER_ERROR, 3
EXAMPLE = (
  "python -m lra_core.aot --config configs/enwik8/transformer_vq.py --topology v5e:2x2 \\\n"
  "      --config.mesh.data=4 --config.train.batch_size 8 --json runs/vq_v5e.json"
)


def main(argv=None) -> int:
  def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
      "--topology",
      required=True,
      help="a TPU slice, <generation>:<chips>, e.g. v3:2x2 (8 cores), v4:2x2x2, v5e:4x4, v5p:2x2x4; "
      "or NVIDIA GPUs, <gpu>[x<count>] with <gpu> one of "
      + ", ".join(chips.GPUS)
      + ", e.g. h100, a100x4, a100-40gx8, h100x16 (two hosts of 8)",
    )
    parser.add_argument("--json", default="", help="also write the report's fields to this JSON file")
    parser.add_argument(
      "--hotspots",
      type=int,
      default=0,
      help="also list this many of the train step's dearest operations (what bounds the estimate)",
    )
    parser.add_argument(
      "--hlo", default="", help="also write the compiled train step's HLO text to this file (gzip if it ends in .gz)"
    )

  args = cli.parse(
    argv,
    extra=flags,
    workdir=False,
    prog="python -m lra_core.aot",
    example=EXAMPLE,
    description="Compiles a config's train and eval steps for a TPU slice (libtpu) or NVIDIA GPUs "
    "(the CUDA plugin) on this host and reports memory, fit and an estimated step time.",
  )
  report = compile_config(
    args.config, args.extra.topology, hotspots=args.extra.hotspots, hlo_path=args.extra.hlo or None
  )
  if report.mesh_warning():
    print(report.mesh_warning(), file=sys.stderr)
  print(f"{args.spec} on {args.extra.topology}:")
  print(report.table())
  if args.extra.json:
    path = pathlib.Path(args.extra.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
  return EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
  status = []
  cli.run(lambda: status.append(main()))
  sys.exit(status[0] if status else EXIT_USER_ERROR)
