"""What a Pallas call's grid asks of a GPU, read off the traced call rather than taken from its declared cost.

A kernel's `CostEstimate` (lra_core/cost/pallas_costs.py) is one number of FLOPs and one of bytes, which the
roofline charges at the chip's peak as if every SM shared the work. A Triton call runs one program per grid
point, each on one SM, its loop steps one after another. A call of 32 programs on an H100's 132 SMs leaves
100 idle, and a program that walks 512 time blocks pays a dependent trip to memory 512 times: neither shows
in a declared cost. So for each `pallas_call` of a traced program this module reads

  - the grid: its programs (every grid point is one on a GPU);
  - the kernel body: its matrix products (2 FLOPs per multiply-add; float32 ones at HIGHEST precision run as
    FMAs on the CUDA cores, others on the tensor cores), its elementwise and reduction work (one operation per
    element on the CUDA cores), its exponentials and other transcendentals (the SFUs), each loop counted
    by its trip count, and its serial steps (the loops' iterations, one after another);
  - the BlockSpecs: each program reads its input blocks and writes its output blocks once.

`gpu_seconds` turns that into time: the programs run in waves of as many per SM as it holds at once
(`with_occupancy`, from the compiled kernel's threads, registers and shared memory; one when unknown); a
wave takes its programs' work on the SM (the longer of their compute and their share of the HBM
bandwidth) plus one memory latency per serial step (`MEMORY_LATENCY_S`: the loop's next block waits on the
loads of this one, while the SM's other programs compute). It is a model with one assumed
constant, checked against the kernels' measured H100 times in docs/kernels.md ("Estimates against the run").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lra_core.cost.pallas_costs import call_name, hlo_operands

# One dependent load from HBM, the order of a DRAM round trip on recent NVIDIA GPUs (about a thousand
# cycles at ~2 GHz): an assumption of the model, not a measured figure.
MEMORY_LATENCY_S = 0.5e-6
SFU_PER_SM = 16  # special-function units per SM (exp, log, ...) on Ampere and Hopper
TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "erf", "pow", "rsqrt", "sqrt", "sin", "cos"}
FREE = {
  "get",
  "swap",
  "load",
  "store",
  "masked_load",
  "masked_swap",
  "program_id",
  "num_programs",
  "broadcast_in_dim",
  "reshape",
  "squeeze",
  "expand_dims",
  "convert_element_type",
  "iota",
  "multiple_of",
  "transpose",
}


@dataclasses.dataclass(frozen=True)
class Work:
  """What one program's body does: matmul FLOPs on the tensor cores and as float32 FMAs, elementwise and
  reduction operations, transcendentals, and its serial steps (its loops' iterations; 1 with none)."""

  tensor_flops: float = 0.0
  fma_flops: float = 0.0
  vector_ops: float = 0.0
  transcendentals: float = 0.0
  steps: float = 1.0

  def __add__(self, other: Work) -> Work:
    return Work(
      self.tensor_flops + other.tensor_flops,
      self.fma_flops + other.fma_flops,
      self.vector_ops + other.vector_ops,
      self.transcendentals + other.transcendentals,
      self.steps + other.steps - 1.0,  # both bodies in sequence: their steps add
    )

  def times(self, n: float) -> Work:
    """The body of a loop run n times: n times its work and its steps."""
    return Work(
      self.tensor_flops * n, self.fma_flops * n, self.vector_ops * n, self.transcendentals * n, self.steps * n
    )

  @property
  def total(self) -> float:
    return self.tensor_flops + self.fma_flops + self.vector_ops + self.transcendentals


@dataclasses.dataclass(frozen=True)
class GridCost:
  """One Pallas call as its grid runs it: `programs` grid points, each doing `work` and moving `block_bytes`
  to and from HBM. Keyed as `KernelCost` (its name and per-device operand shapes in HLO notation)."""

  name: str
  operands: tuple[str, ...]
  grid: tuple[int, ...]
  work: Work
  block_bytes: float
  resident: int = 1  # programs an SM holds at once (`with_occupancy`; 1 until the compiled kernel is known)

  @property
  def key(self) -> str:
    return f"{self.name}({', '.join(self.operands)})"

  @property
  def programs(self) -> int:
    return math.prod(self.grid)

  @property
  def flops(self) -> float:
    """Matrix-product FLOPs of all programs (what a declared cost counts as FLOPs)."""
    return self.programs * (self.work.tensor_flops + self.work.fma_flops)

  @property
  def hbm_bytes(self) -> float:
    return self.programs * self.block_bytes


def body_work(jaxpr) -> Work:
  """The `Work` of a kernel body (a jaxpr, or a closed one), inner jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = Work()
  for eqn in jaxpr.eqns:
    total = total + _eqn_work(eqn)
  return total


def _size(var) -> float:
  return float(np.prod(getattr(var.aval, "shape", ()), dtype=np.float64))


def _eqn_work(eqn) -> Work:
  name = eqn.primitive.name
  if name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = float(np.prod([lhs.shape[d] for d in contract], dtype=np.float64))
    flops = 2.0 * _size(eqn.outvars[0]) * k
    both_f32 = all(v.aval.dtype == np.float32 for v in eqn.invars[:2])
    precision = str(eqn.params.get("precision"))
    if both_f32 and "HIGHEST" in precision:  # Triton runs it as FMAs, not on the tensor cores (TF32)
      return Work(fma_flops=flops)
    return Work(tensor_flops=flops)
  if name == "scan":
    return body_work(eqn.params["jaxpr"]).times(eqn.params["length"])
  if name == "while":  # a trip count the trace does not know: counted once
    return body_work(eqn.params["body_jaxpr"])
  if name == "cond":
    branches = [body_work(b) for b in eqn.params["branches"]]
    return max(branches, key=lambda w: w.total)
  inner = [p for p in eqn.params.values() if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
  if inner:  # jit, custom_jvp_call, closed_call, ...: their bodies
    total = Work()
    for j in inner:
      total = total + body_work(j)
    return total
  if name in FREE:
    return Work()
  if name in TRANSCENDENTAL:
    return Work(transcendentals=_size(eqn.outvars[0]))
  if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cummax"):
    return Work(vector_ops=_size(eqn.invars[0]))
  return Work(vector_ops=sum(_size(v) for v in eqn.outvars))


def grid_costs(jaxpr) -> tuple[GridCost, ...]:
  """The GridCost of every Pallas call in `jaxpr` (a traced program's), inner jaxprs (shard_map, loops,
  custom derivatives) included, each signature once."""
  found: dict[str, GridCost] = {}

  def visit(j) -> None:
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        mapping = eqn.params["grid_mapping"]
        blocks = sum(
          math.prod(b.block_aval.shape) * np.dtype(b.block_aval.dtype).itemsize for b in mapping.block_mappings
        )
        cost = GridCost(
          call_name(eqn),
          hlo_operands(eqn.invars),
          tuple(int(n) for n in mapping.grid),
          body_work(eqn.params["jaxpr"]),
          float(blocks),
        )
        found.setdefault(cost.key, cost)
        continue
      for value in eqn.params.values():
        for inner in value if isinstance(value, (tuple, list)) else (value,):
          body = getattr(inner, "jaxpr", inner)
          if hasattr(body, "eqns"):
            visit(body)

  visit(getattr(jaxpr, "jaxpr", jaxpr))
  return tuple(found.values())


def with_occupancy(cost: GridCost, gpu, *, threads: int, registers: int | None, shared_bytes: int) -> GridCost:
  """`cost` with the programs one SM of `gpu` holds at once, from its compiled kernel's threads, registers per
  thread (ptxas; None: unknown, one program) and shared memory: the fewest that the SM's threads,
  registers, shared memory and 32 blocks allow."""
  if not registers or not threads:
    return cost
  limits = (
    gpu.threads_per_sm // threads,
    gpu.registers_per_sm // (registers * threads),
    gpu.shared_per_sm // shared_bytes if shared_bytes else 32,
    32,
  )
  return dataclasses.replace(cost, resident=max(1, min(limits)))


def gpu_seconds(cost: GridCost, gpu, *, tensor_flops_per_s: float, hbm_bandwidth: float) -> float:
  """The time of one call on `gpu` (sms, fp32_lanes_per_sm, clock_ghz: lra_core.compilation.topologies.GpuArch)
  with the chip's tensor-core peak and HBM bandwidth: waves of `cost.resident` programs per SM; a program's
  work is the sum of its work on the SM's units (they wait on each other's results in these kernels) or
  its share of the bandwidth, whichever is longer; a wave takes its programs' work one after another (they
  share the SM) plus a memory latency per serial step (while one program waits, another computes)."""
  clock = gpu.clock_ghz * 1e9
  w = cost.work
  compute = (
    w.tensor_flops / (tensor_flops_per_s / gpu.sms)
    + w.fma_flops / (2 * gpu.fp32_lanes_per_sm * clock)
    + w.vector_ops / (gpu.fp32_lanes_per_sm * clock)
    + w.transcendentals / (SFU_PER_SM * clock)
  )
  memory = cost.block_bytes / (hbm_bandwidth / gpu.sms)
  r = min(cost.resident, math.ceil(cost.programs / gpu.sms))  # no more at once than there are to run
  wave = r * max(compute, memory) + w.steps * MEMORY_LATENCY_S
  return math.ceil(cost.programs / (gpu.sms * r)) * wave
