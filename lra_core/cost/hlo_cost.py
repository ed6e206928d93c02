"""A roofline estimate of one device's step time, read off the compiled (optimized) HLO of a TPU or GPU.

XLA's own `cost_analysis()` counts the body of every while loop once, so a scanned layer stack, a
scan over update windows or micro-batches, or a serial cache reduction is undercounted by its trip
count (tests/test_hlo_cost.py shows a 10-step scan counted as one step). This module walks the
optimized program instead (lra_core/cost/hlo_text.py reads it):

- every top-level operation of a computation costs max(FLOPs / peak, bytes / HBM bandwidth),
  its bytes being its operands and results (a fusion reads and writes HBM once; what it does
  inside stays on chip);
- FLOPs are the matrix products at 2 per multiply-add, also inside fusions and in XLA:GPU's library
  calls (lra_core/cost/hlo_flops.py), plus what a Pallas kernel declares (lra_core/cost/pallas_costs.py), or
  for jax's library flash kernels, which declare nothing, what the scope around their call states
  (kernels/softmax/library.py); a Triton kernel with neither counts its traffic and no FLOPs, and
  `Roofline.undeclared_kernels` counts it. A convolution's bytes are its operands and result, as for
  any operation. Elementwise arithmetic counts as no FLOPs;
- a while loop costs its trip count times its body (the count XLA records, else the bound its
  condition compares the counter with), a conditional its dearest branch;
- collectives move their bytes over the interconnect; they are assumed to overlap with compute
  (XLA schedules them asynchronously), so the estimate is max(compute-and-memory time, collective
  time), and `bound` names what dominates; those whose device groups span the `sequence` mesh axis
  (a sequence split over chips: kernels/context_parallel.py) are also counted on their own;

It is an estimate of what the compiled program asks of the chip, not a measurement: it does not
see stalls, imperfect overlap, or kernels' inner efficiency.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from lra_core.cost import pallas_grid
from lra_core.cost.chips import Chip
from lra_core.cost.hlo_flops import library_flops, matmul_flops
from lra_core.cost.hlo_text import (
  BYTES,
  Op,
  arrays,
  called,
  device_groups,
  first_array,
  op_name,
  parse,
  size_bytes,
  target,
)
from lra_core.cost.pallas_costs import PALLAS_CALLS, TRITON_CALL, declared, kernel_key
from lra_core.kernels.softmax import library as library_attention

FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
  "iota",
  "opt-barrier",
  "add-dependency",
  "domain",
}
DONE = {
  "all-gather-done",
  "all-reduce-done",
  "collective-permute-done",
  "async-done",
  "send-done",
  "recv-done",
  "copy-done",
  "slice-done",
}
COLLECTIVES = {
  "all-gather",
  "all-gather-start",
  "all-reduce",
  "all-reduce-start",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-permute-start",
  "ragged-all-to-all",
  "collective-broadcast",
}

# The kinds of work a step's time is split into (Roofline.split): matrix products (fusions with a dot
# or convolution, library GEMMs) at the chip's peak or waiting on HBM, Pallas kernels, in-place
# updates of a buffer (a scanned stack storing its residuals, a cache), and the rest (elementwise
# work, reductions, copies, transposes); "other" is what sits in calls the walk does not open.
SPLIT = ("matmuls compute-bound", "matmuls HBM-bound", "kernels", "in-place updates", "elementwise", "other")

_REMAT = "rematted_computation"  # in the op_name metadata of what jax.checkpoint recomputes
_MEGASCALE = "_xla_megascale_transfer_type"  # a send / recv between TPU slices (over the data-center network)


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  recompute_flops: float = 0.0  # of `flops`, those of the forward pass run again for the backward (remat)
  bytes: float = 0.0
  comm_bytes: float = 0.0
  compute_s: float = 0.0  # sum over operations of max(flops / peak, bytes / bandwidth)
  memory_s: float = 0.0  # of compute_s, the operations whose HBM traffic takes longer than their FLOPs
  comm_s: float = 0.0
  sequence_comm_bytes: float = 0.0  # of comm_bytes, those of the sequence axis (kernels/context_parallel.py)
  sequence_comm_s: float = 0.0
  dcn_comm_bytes: float = 0.0  # of comm_bytes, those between slices (over the data-center network)
  dcn_comm_s: float = 0.0

  def add(self, other: Cost, times: float = 1.0) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


@dataclasses.dataclass(frozen=True)
class Roofline:
  """One device's estimated step: `seconds` and its parts."""

  flops: float
  recompute_flops: float  # of `flops`, the forward pass recomputed for the backward pass (remat)
  hbm_bytes: float
  comm_bytes: float
  compute_s: float  # operations, each at the slower of its FLOPs and its HBM traffic
  memory_bound_s: float  # of compute_s, the operations bound by HBM traffic
  flop_s: float  # the FLOPs alone at peak
  comm_s: float
  unknown_loops: int  # while loops whose trip count could not be read (counted once)
  sequence_comm_bytes: float = 0.0  # of comm_bytes, the collectives across the sequence axis
  sequence_comm_s: float = 0.0
  dcn_comm_bytes: float = 0.0  # of comm_bytes, the collectives between slices, at the chip's DCN bandwidth
  dcn_comm_s: float = 0.0
  hotspots: tuple = ()  # the dearest operations: Hotspot records, dearest first
  undeclared_kernels: int = 0  # Triton (Pallas) calls with no KernelCost: their traffic counted, no FLOPs
  split: tuple = ()  # (kind of operation, seconds) over the whole step, dearest first: see SPLIT

  @property
  def seconds(self) -> float:
    return max(self.compute_s, self.comm_s)

  @property
  def bound(self) -> str:
    if self.comm_s > self.compute_s:
      return "interconnect"
    return "compute" if self.flop_s >= 0.5 * self.compute_s else "memory bandwidth"


@dataclasses.dataclass(frozen=True)
class Hotspot:
  """One operation of the program with what it costs over the whole step (times its executions)."""

  name: str
  kind: str  # opcode, or for a fusion the kind XLA gave it (kLoop, kOutput, ...) and its matmuls
  executions: float
  seconds: float
  flops: float
  bytes: float
  flop_seconds: float  # its FLOPs alone at peak: near `seconds` when compute-bound
  source: str = ""  # the JAX operation it came from (metadata op_name), if recorded
  category: str = ""  # one of SPLIT: what kind of work it is

  @property
  def bound(self) -> str:
    return "compute" if self.flop_seconds >= 0.5 * self.seconds else "memory"


class _Walker:
  def __init__(
    self, computations: dict[str, list[Op]], chip: Chip, kernel_costs=(), mesh=(), grid_costs=(), gpu=None, slices=None
  ):
    self.computations, self.chip = computations, chip
    self.grids, self.gpu = {g.key: g for g in grid_costs}, gpu
    # Each device's place along the sequence axis (mesh: ((axis, size), ...), the devices in order)
    self.along_sequence = self.slice_of = None
    names, sizes = [a for a, _ in mesh], [n for _, n in mesh]
    if dict(mesh).get("sequence", 1) > 1:
      self.along_sequence = np.unravel_index(np.arange(math.prod(sizes)), sizes)[names.index("sequence")]
    self.slice_count = 1 if slices is None else slices[1]
    if slices is not None and slices[1] > 1:  # (axis, count): that axis spans the slices, outermost
      axis, count = slices
      along = np.unravel_index(np.arange(math.prod(sizes)), sizes)[names.index(axis)]
      self.slice_of = along // (dict(mesh)[axis] // count)
    self.kernels = {k.key: k for k in kernel_costs}
    self.unknown_loops = 0
    self.undeclared = set()  # names of the Triton calls that found no KernelCost
    self.shapes = {name: {op.name: op.shape for op in ops} for name, ops in computations.items()}
    self.defined = {op.name: op for ops in computations.values() for op in ops}  # names are the module's

  def dcn_transfer(self, op: Op, shapes: dict[str, str]) -> Cost:
    """A multi-slice TPU program's exchange between slices: XLA keeps each collective inside a slice and
    adds, for the part between slices, a host-transfer send and recv pair that the runtime carries over
    the data-center network. The send counts it (the recv is its other half): a ring over the S slices
    sends 2(S-1)/S of an all-reduced buffer, (S-1)/S of a reduce-scattered one, S-1 shards of an
    all-gathered one."""
    if op.opcode == "recv":
      return Cost()
    data = size_bytes(shapes.get(op.operands[0], "")) if op.operands else 0
    kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', op.attrs)
    s = max(self.slice_count, 2)
    share = {"ALL_REDUCE": 2 * (s - 1) / s, "REDUCE_SCATTER": (s - 1) / s, "ALL_GATHER": s - 1}
    moved = data * share.get(kind.group(1) if kind else "", 1.0)
    seconds = moved / (self.chip.dcn_bandwidth or self.chip.ici_bandwidth)
    return Cost(comm_bytes=moved, comm_s=seconds, dcn_comm_bytes=moved, dcn_comm_s=seconds)

  def spans_sequence(self, op: Op) -> bool:
    """Whether a collective exchanges between devices at different places of the sequence axis."""
    return _spans(op, self.along_sequence)

  def spans_slices(self, op: Op) -> bool:
    """Whether a collective exchanges between devices of different slices (over the data-center network)."""
    return _spans(op, self.slice_of)

  @functools.cache
  def inner_flops(self, computation: str) -> tuple[float, float]:
    """Matrix-product FLOPs anywhere inside a fused (or called) computation, and those of them that
    recompute the forward pass (JAX names what jax.checkpoint reruns 'rematted_computation')."""
    total = recompute = 0.0
    for op in self.computations.get(computation, ()):
      if op.opcode in ("dot", "convolution"):
        flops = matmul_flops(op, self.shapes[computation])
        total += flops
        recompute += flops if _REMAT in op.attrs else 0.0
      for callee in called(op, "calls"):
        inner, inner_recompute = self.inner_flops(callee)
        total, recompute = total + inner, recompute + inner_recompute
    return total, recompute

  def trip_count(self, op: Op) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
    if m:
      return int(m.group(1))
    condition = called(op, "condition")
    ops = self.computations.get(condition[0], []) if condition else []
    constants = {o.name: o.args for o in ops if o.opcode == "constant" and re.fullmatch(r"-?\d+", o.args)}
    for o in ops:
      bounds = [int(constants[x]) for x in o.operands if x in constants]
      if o.opcode == "compare" and bounds:
        end = bounds[0] + 1 if "direction=LE" in o.attrs else bounds[0]
        return end - self.loop_start(op, [x for x in o.operands if x not in constants], ops)
    return None

  def loop_start(self, op: Op, counters: list[str], condition: list[Op]) -> int:
    """The first value of a while loop's counter where the loop's initial tuple gives it as a constant,
    else 0: XLA peels a scan's first iteration into the code before the loop, which then starts at 1."""
    in_condition = {o.name: o for o in condition}
    counter = in_condition.get(counters[0]) if counters else None
    index = (
      re.search(r"index=(\d+)", counter.attrs)
      if counter is not None and counter.opcode == "get-tuple-element"
      else None
    )
    init = self.defined.get(op.operands[0]) if op.operands else None
    if index is None or init is None or init.opcode != "tuple" or int(index.group(1)) >= len(init.operands):
      return 0
    value = self.defined.get(init.operands[int(index.group(1))])
    while value is not None and value.opcode in ("copy", "bitcast", "convert") and value.operands:
      value = self.defined.get(value.operands[0])
    if value is None or value.opcode != "constant" or not re.fullmatch(r"-?\d+", value.args):
      return 0
    return int(value.args)

  def sliced_traffic(self, op: Op, shapes: dict[str, str]) -> float:
    """HBM bytes of an operation that reads or writes only a window of a buffer: a dynamic slice reads
    its window, a dynamic update slice writes its update in place (the buffer is neither read nor
    copied), and a fusion built on them moves only those windows of the parameters they touch."""
    if op.opcode == "dynamic-slice":
      return 2 * size_bytes(op.shape)
    if op.opcode == "dynamic-update-slice":
      return 2 * size_bytes(shapes.get(op.operands[1], "")) if len(op.operands) > 1 else size_bytes(op.shape)
    callee = (called(op, "calls") or [""])[0]
    fused = self.computations.get(callee, [])
    inner = {o.name: o for o in fused}
    traffic = 0.0
    for i, name in enumerate(op.operands):
      traffic += self.parameter_read(callee, i, size_bytes(shapes.get(name, "")))
    for r in self.fused_roots(op):
      if r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
        traffic += size_bytes(inner[r.operands[1]].shape) if r.operands[1] in inner else size_bytes(r.shape)
      else:
        traffic += size_bytes(r.shape)
    return traffic

  def fused_roots(self, op: Op) -> list[Op]:
    """The operations whose results a fusion returns (a tuple root's parts)."""
    fused = self.computations.get((called(op, "calls") or [""])[0], [])
    inner = {o.name: o for o in fused}
    root = next((o for o in fused if o.root), fused[-1] if fused else None)
    if root is not None and root.opcode == "tuple":
      return [inner[x] for x in root.operands if x in inner]
    return [root] if root is not None else []

  def category(self, op: Op, cost: Cost) -> str:
    """What kind of work `op` is, for the step's split (SPLIT)."""
    if op.opcode == "custom-call" and target(op) in PALLAS_CALLS:
      return "kernels"
    if cost.flops:
      return "matmuls HBM-bound" if cost.memory_s else "matmuls compute-bound"
    roots = self.fused_roots(op) if op.opcode == "fusion" else [op]
    if roots and all(r.opcode == "dynamic-update-slice" for r in roots):
      return "in-place updates"
    return "elementwise"

  @functools.cache
  def users(self, computation: str) -> dict[str, list[Op]]:
    out: dict[str, list[Op]] = {}
    for o in self.computations.get(computation, ()):
      for x in o.operands:
        out.setdefault(x, []).append(o)
    return out

  def parameter_read(self, computation: str, index: int, full: float) -> float:
    """Bytes a fused computation reads of its parameter `index` (`full` bytes in all): only the windows
    its (dynamic) slices take, nothing of a buffer it updates in place, looking through nested fusions
    (a scanned layer's stacked weights or residuals are sliced one layer at a time)."""
    param = next(
      (o for o in self.computations.get(computation, ()) if o.opcode == "parameter" and o.args.strip() == str(index)),
      None,
    )
    return full if param is None else self.value_read(computation, param.name, full)

  def value_read(self, computation: str, name: str, full: float) -> float:
    """Bytes read of the value `name` (`full` bytes) by its users in `computation`, as parameter_read."""
    uses = self.users(computation).get(name, [])
    if not uses:
      return full
    read = 0.0
    for u in uses:
      if u.opcode in ("dynamic-slice", "slice") and u.operands[0] == name:
        read += size_bytes(u.shape)
      elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
        continue  # updated in place: only the update is written (counted with the output)
      elif u.opcode == "bitcast":  # the same bytes in another shape (XLA:GPU's layout changes): what its users read
        read += self.value_read(computation, u.name, full)
      elif u.opcode == "fusion":
        nested = (called(u, "calls") or [""])[0]
        read += sum(self.parameter_read(nested, k, full) for k, x in enumerate(u.operands) if x == name)
      else:
        return full
    return min(full, read)

  @functools.cache
  def cost(self, computation: str) -> Cost:
    total = Cost()
    shapes = self.shapes.get(computation, {})
    for op in self.computations.get(computation, ()):
      total.add(self.op_cost(op, shapes))
    return total

  def dearest_branch(self, op: Op) -> str | None:
    """The branch computation of a conditional that takes the longest: the one the estimate counts
    (which runs is decided at run time)."""
    names = called(op, "branch_computations") + called(op, "true_computation") + called(op, "false_computation")
    return max(names, key=lambda name: self.cost(name).compute_s + self.cost(name).comm_s, default=None)

  def op_cost(self, op: Op, shapes: dict[str, str]) -> Cost:
    if op.opcode in FREE or op.opcode in DONE:
      return Cost()
    if op.opcode == "while":
      n = self.trip_count(op)
      if n is None:
        self.unknown_loops += 1
        n = 1
      body = Cost()
      for name in called(op, "body") + called(op, "condition"):
        body.add(self.cost(name))
      scaled = Cost()
      scaled.add(body, n)
      return scaled
    if op.opcode == "conditional":
      branch = self.dearest_branch(op)
      return Cost() if branch is None else self.cost(branch)
    if op.opcode in ("call", "async-start"):
      total = Cost()
      for name in called(op, "to_apply") + called(op, "calls"):
        total.add(self.cost(name))
      return total
    operand_bytes = sum(size_bytes(shapes.get(o, "")) for o in op.operands)
    out_bytes = size_bytes(op.shape)
    if op.opcode in ("send", "recv") and _MEGASCALE in op.attrs:
      return self.dcn_transfer(op, shapes)
    if op.opcode in COLLECTIVES:
      if op.opcode in ("all-gather-start", "collective-permute-start"):
        # the result is a tuple (operands, results, sync flags): what is received is the results alone
        n = len(op.operands)
        out_bytes = sum(BYTES.get(t, 4) * math.prod(d) for t, d in arrays(op.shape)[n : 2 * n])
      moved = max(operand_bytes, out_bytes) * (2.0 if op.opcode.startswith("all-reduce") else 1.0)
      seconds = moved / self.chip.ici_bandwidth
      cost = Cost(comm_bytes=moved, comm_s=seconds)
      if self.spans_slices(op) and self.chip.dcn_bandwidth:
        # All of it at DCN speed: an upper bound, where XLA may reduce inside each slice over ICI first.
        cost.comm_s = cost.dcn_comm_s = moved / self.chip.dcn_bandwidth
        cost.dcn_comm_bytes = moved
      if self.spans_sequence(op):  # between the chips of one split sequence (and maybe other axes)
        cost.sequence_comm_bytes, cost.sequence_comm_s = moved, cost.comm_s
      return cost
    flops, traffic = 0.0, operand_bytes + out_bytes
    if op.opcode in ("dynamic-slice", "dynamic-update-slice", "fusion"):
      traffic = self.sliced_traffic(op, shapes)
    elif op.opcode == "copy-start":  # its result is (destination, source, context): the copy reads and writes once
      traffic = 2 * operand_bytes
    elif op.opcode == "slice":  # reads and writes its window, not the whole operand
      traffic = 2 * out_bytes
    elif op.opcode == "slice-start":  # result ((operand), window, context): reads and writes the window
      parts = arrays(op.shape)
      window = parts[len(op.operands)] if len(parts) > len(op.operands) else None
      traffic = 2 * BYTES.get(window[0], 4) * math.prod(window[1]) if window else traffic
    recompute = 0.0
    if op.opcode in ("dot", "convolution"):
      flops = matmul_flops(op, shapes)
      recompute = flops if _REMAT in op.attrs else 0.0
    elif op.opcode == "fusion":
      parts = [self.inner_flops(c) for c in called(op, "calls")]
      flops, recompute = sum(p[0] for p in parts), sum(p[1] for p in parts)
    elif op.opcode == "custom-call":
      estimate = declared(op)
      library = library_flops(op, shapes)
      if estimate is None and target(op) in PALLAS_CALLS:  # a library flash kernel states its FLOPs in a scope
        stated = library_attention.kernel_flops(op_name(op))
        estimate = None if stated is None else (stated, 0.0)
      if estimate is None and target(op) == TRITON_CALL:
        kernel = self.kernels.get(kernel_key(op, shapes))
        if kernel is None:
          self.undeclared.add(op.name)
        else:
          estimate = kernel.flops, kernel.bytes_accessed
      if estimate is not None:
        flops, traffic = estimate[0], estimate[1] or traffic
      elif library is not None:  # the workspace a library call is given is scratch, not traffic
        flops, traffic = library, operand_bytes + size_bytes(first_array(op.shape))
      recompute = flops if _REMAT in op.attrs else 0.0
      grid = self.grids.get(kernel_key(op, shapes)) if target(op) == TRITON_CALL and self.gpu else None
      if grid is not None:  # charged by what its grid runs (lra_core/cost/pallas_grid.py), not its declared cost
        seconds = pallas_grid.gpu_seconds(
          grid, self.gpu, tensor_flops_per_s=self.chip.peak_flops, hbm_bandwidth=self.chip.hbm_bandwidth
        )
        flops = flops or grid.flops
        memory = seconds if grid.hbm_bytes / self.chip.hbm_bandwidth > flops / self.chip.peak_flops else 0.0
        return Cost(flops=flops, recompute_flops=recompute, bytes=grid.hbm_bytes, compute_s=seconds, memory_s=memory)
    seconds = max(flops / self.chip.peak_flops, traffic / self.chip.hbm_bandwidth)
    memory = seconds if traffic / self.chip.hbm_bandwidth > flops / self.chip.peak_flops else 0.0
    return Cost(flops=flops, recompute_flops=recompute, bytes=traffic, compute_s=seconds, memory_s=memory)


def _operations(walker: _Walker, entry: str) -> list[Hotspot]:
  """Every operation of the step, each counted over all executions of its computation (loop bodies
  run trip-count times, a conditional's dearest branch once)."""
  found: list[Hotspot] = []

  def visit(computation: str, times: float, depth: int = 0) -> None:
    shapes = walker.shapes.get(computation, {})
    for op in walker.computations.get(computation, ()):
      if op.opcode == "while":
        n = walker.trip_count(op) or 1
        for body in called(op, "body"):
          visit(body, times * n, depth + 1)
      elif op.opcode in ("call", "async-start"):
        for name in called(op, "to_apply") + called(op, "calls"):
          visit(name, times, depth + 1)
      elif op.opcode == "conditional":  # e.g. ring attention's skip of a key piece no query reads
        branch = walker.dearest_branch(op)
        if branch is not None:
          visit(branch, times, depth + 1)
      elif op.opcode not in FREE and op.opcode not in DONE and op.opcode not in COLLECTIVES:
        c = walker.op_cost(op, shapes)
        kind = op.opcode
        if op.opcode == "fusion":
          m = re.search(r"kind=(\w+)", op.attrs)
          kind = f"fusion {m.group(1) if m else ''}{' with matmul' if c.flops else ''}"
        found.append(
          Hotspot(
            op.name,
            kind,
            times,
            times * c.compute_s,
            times * c.flops,
            times * c.bytes,
            times * c.flops / walker.chip.peak_flops,
            op_name(op),
            walker.category(op, c),
          )
        )

  visit(entry, 1.0)
  return sorted(found, key=lambda h: -h.seconds)


def _split(operations: list[Hotspot], compute_s: float) -> tuple[tuple[str, float], ...]:
  """Seconds per kind of work (SPLIT), dearest first; what the walk does not list is "other"."""
  seconds = dict.fromkeys(SPLIT, 0.0)
  for h in operations:
    seconds[h.category] += h.seconds
  seconds["other"] = max(0.0, compute_s - sum(seconds.values()))
  return tuple(sorted(((k, v) for k, v in seconds.items() if v > 0), key=lambda kv: -kv[1]))


def roofline(
  hlo_text: str,
  chip: Chip,
  *,
  top: int = 0,
  split: bool = False,
  kernel_costs=(),
  mesh=(),
  grid_costs=(),
  gpu=None,
  slices=None,
) -> Roofline:
  """The estimate for one device of the SPMD program `hlo_text` (`compiled.as_text()`) on `chip`;
  `top` > 0 also lists that many of its dearest operations (Roofline.hotspots), `split` the step's
  time by kind of work (Roofline.split). `kernel_costs`: the KernelCost of each Pallas kernel of a GPU
  program (lra_core.cost.pallas_costs.pallas_kernel_costs of its traced jaxpr). `mesh`: ((axis, size), ...)
  of the program's mesh, its devices in order: the collectives across the `sequence` axis are also
  counted on their own (Roofline.sequence_comm_*). `grid_costs` (lra_core.cost.pallas_grid.grid_costs of
  the traced jaxpr) with `gpu` (its GpuArch: SMs, lanes, clock): each Triton call is timed by its grid
  (`pallas_grid.gpu_seconds`) rather than at the chip's peak. `slices`: (the mesh axis that spans them,
  how many) of a multi-slice mesh: the collectives between slices go at the chip's DCN bandwidth and are
  counted on their own (Roofline.dcn_comm_*)."""
  computations, entry = parse(hlo_text)
  walker = _Walker(computations, chip, kernel_costs, mesh, grid_costs, gpu, slices)
  total = walker.cost(entry)
  operations = _operations(walker, entry) if top or split else []
  return Roofline(
    flops=total.flops,
    recompute_flops=total.recompute_flops,
    hbm_bytes=total.bytes,
    comm_bytes=total.comm_bytes,
    memory_bound_s=total.memory_s,
    compute_s=total.compute_s,
    flop_s=total.flops / chip.peak_flops,
    comm_s=total.comm_s,
    sequence_comm_bytes=total.sequence_comm_bytes,
    sequence_comm_s=total.sequence_comm_s,
    dcn_comm_bytes=total.dcn_comm_bytes,
    dcn_comm_s=total.dcn_comm_s,
    unknown_loops=walker.unknown_loops,
    hotspots=tuple(operations[:top]),
    undeclared_kernels=len(walker.undeclared),
    split=_split(operations, total.compute_s) if split else (),
  )


def _spans(op: Op, place) -> bool:
  """Whether collective `op` exchanges between devices at different `place`s (an array over the devices
  in order; None: never)."""
  if place is None:
    return False
  groups = device_groups(op)
  if groups is None:
    return False
  if not groups:  # one group of every device
    return True
  n = len(place)
  return any(len({int(place[i]) for i in g if i < n}) > 1 for g in groups)


def step_flops(hlo_text: str, kernel_costs=()) -> tuple[float, float]:
  """(matrix-product FLOPs, of them recomputed by remat) of one device's program `hlo_text`, loops
  counted by their trip counts: what the trainer's MFU divides by the step time."""
  computations, entry = parse(hlo_text)
  walker = _Walker(computations, Chip("count", 1.0, 1, 1.0, 1.0, 1), kernel_costs)
  total = walker.cost(entry)
  return total.flops, total.recompute_flops
