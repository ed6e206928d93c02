"""A roofline estimate of one device's step time, read off the compiled (optimized) HLO of a TPU or GPU.

XLA's own `cost_analysis()` counts the body of every while loop once, so a scanned layer stack, a
scan over update windows or micro-batches, or a serial cache reduction is undercounted by its trip
count (tests/test_hlo_cost.py shows a 10-step scan counted as one step). This module walks the
optimized program instead:

- every top-level operation of a computation costs max(FLOPs / peak, bytes / HBM bandwidth),
  its bytes being its operands and results (a fusion reads and writes HBM once; what it does
  inside stays on chip);
- FLOPs are the matrix products at 2 per multiply-add: `dot` and `convolution`, also inside fusions
  (XLA:GPU's Triton GEMM fusions, `__triton_gemm` / `__triton_nested_gemm_fusion`, and cuDNN
  fusions hold their `dot`), XLA:GPU's library calls (cuBLAS `__cublas$gemm` / `__cublas$lt$matmul`,
  from the dot dimensions in their backend config and the operand shapes; cuDNN convolutions,
  forward and backward, from their window and dimension labels), plus what a Pallas kernel declares
  (its `CostEstimate`: Mosaic keeps it in the TPU custom call's backend config; a Triton call on GPU
  keeps none, so its estimate comes from the traced program, `kernel_costs`, matched by kernel name
  and operand shapes; a Triton kernel without one counts its operands and results as traffic and no
  FLOPs, and `Roofline.undeclared_kernels` counts it). A convolution counts only the window taps that
  meet input data, not those on its padding or a dilation's holes (`real_taps`): the TPU compiler
  writes head-split projections and batched matmuls as padded or dilated windows where most taps
  are empty. Its bytes are its operands and result, as for any operation. Elementwise arithmetic
  counts as no FLOPs;
- a while loop costs its trip count times its body (the count XLA records, else the bound its
  condition compares the counter with), a conditional its dearest branch;
- collectives move their bytes over the interconnect; they are assumed to overlap with compute
  (XLA schedules them asynchronously), so the estimate is max(compute-and-memory time, collective
  time), and `bound` names what dominates.

It is an estimate of what the compiled program asks of the chip, not a measurement: it does not
see stalls, imperfect overlap, or kernels' inner efficiency.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

from lra_core.chips import Chip

BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "c64": 8,
  "c128": 16,
}
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

TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel compiled by Triton (XLA:GPU)
PALLAS_CALLS = (TRITON_CALL, "tpu_custom_call")  # Pallas kernels: Triton on a GPU, Mosaic on a TPU
# The kinds of work a step's time is split into (Roofline.split): matrix products (fusions with a dot
# or convolution, library GEMMs) at the chip's peak or waiting on HBM, Pallas kernels, in-place
# updates of a buffer (a scanned stack storing its residuals, a cache), and the rest (elementwise
# work, reductions, copies, transposes); "other" is what sits in calls the walk does not open.
SPLIT = ("matmuls compute-bound", "matmuls HBM-bound", "kernels", "in-place updates", "elementwise", "other")
CUBLAS_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# cuDNN convolutions, by which of the forward convolution's arrays (input x, filter w, output y) they
# read or write (their window and dimension labels are the forward's): x is the forward's and the
# backward-filter's first operand, the backward-input's result; w the forward's and backward-input's
# second operand, the backward-filter's result; y the forward's result, the backward-input's first
# operand, the backward-filter's second.
CUDNN_CONVS = {
  "__cudnn$convForward": ("operand0", "operand1", "result"),
  "__cudnn$convBiasActivationForward": ("operand0", "operand1", "result"),
  "__cudnn$convBackwardInput": ("result", "operand1", "operand0"),
  "__cudnn$convBackwardFilter": ("operand0", "result", "operand1"),
}

_REMAT = "rematted_computation"  # in the op_name metadata of what jax.checkpoint recomputes
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  recompute_flops: float = 0.0  # of `flops`, those of the forward pass run again for the backward (remat)
  bytes: float = 0.0
  comm_bytes: float = 0.0
  compute_s: float = 0.0  # sum over operations of max(flops / peak, bytes / bandwidth)
  memory_s: float = 0.0  # of compute_s, the operations whose HBM traffic takes longer than their FLOPs
  comm_s: float = 0.0

  def add(self, other: Cost, times: float = 1.0) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """What a Pallas kernel declares (its `CostEstimate`), keyed by its name and per-device operand
  shapes in HLO notation ("f32[4,2,64,16]"): how a Triton call of a GPU program, which keeps no
  estimate, finds its own (`kernel_costs`)."""

  name: str
  operands: tuple[str, ...]
  flops: float
  bytes_accessed: float
  transcendentals: float = 0.0

  @property
  def key(self) -> str:
    return f"{self.name}({', '.join(self.operands)})"


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


@dataclasses.dataclass
class _Op:
  name: str
  opcode: str
  shape: str
  operands: list[str]
  args: str  # the text between the opcode's parentheses (a constant's value)
  attrs: str
  root: bool = False  # the computation's result


_PARENTHESIS = re.compile(r"[()]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")


def _split_balanced(text: str, start: int) -> int:
  """Index just past the parenthesised group opening at text[start]."""
  depth = 0
  for m in _PARENTHESIS.finditer(text, start):
    depth += 1 if m.group() == "(" else -1
    if depth == 0:
      return m.end()
  return len(text)


def _parse_op(line: str) -> _Op | None:
  line = line.strip()
  root = line.startswith("ROOT ")
  if root:
    line = line[5:]
  name, sep, rest = line.partition(" = ")
  if not sep:
    return None
  if rest.startswith("("):  # a tuple shape
    end = _split_balanced(rest, 0)
  else:
    end = rest.find(" ")
  shape, rest = rest[:end], rest[end:].strip()
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren]
  close = _split_balanced(rest, paren)
  operands = _OPERAND.findall(rest, paren, close)
  return _Op(name.lstrip("%"), opcode, shape, operands, rest[paren + 1 : close - 1], rest[close:], root)


def parse(text: str) -> tuple[dict[str, list[_Op]], str]:
  """HLO module text -> (computation name -> its operations, the entry computation's name)."""
  computations, entry, current = {}, "", None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(1)
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      op = _parse_op(line)
      if op is not None:
        computations[current].append(op)
  return computations, entry


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (element type, dims) of every array in a shape string, layouts stripped."""
  plain = _LAYOUT.sub("", shape)
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(plain)]


def size_bytes(shape: str) -> float:
  return sum(BYTES.get(t, 4) * math.prod(dims) for t, dims in _arrays(shape))


def _dims(shape: str) -> tuple[int, ...]:
  arrays = _arrays(shape)
  return arrays[0][1] if arrays else ()


def _matmul_flops(op: _Op, shapes: dict[str, str]) -> float:
  if op.opcode == "dot":
    out = math.prod(_dims(op.shape))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    lhs = _dims(shapes.get(op.operands[0], "")) if op.operands else ()
    contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 1
    return 2.0 * out * contracted
  lhs, rhs = (_dims(shapes.get(x, "")) for x in (list(op.operands) + ["", ""])[:2])
  return _conv_flops(op.attrs, lhs, rhs, _dims(op.shape))


def _window(attrs: str, rank: int) -> dict[str, list]:
  """A convolution's `window={...}` per spatial dimension: size, stride, pad (low, high), lhs_dilate,
  rhs_dilate (XLA leaves out the fields that are all 1s or 0s)."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in m.group(1).split()) if m else {}
  per_dim = lambda key, default: [int(v) for v in fields[key].split("x")] if key in fields else [default] * rank
  pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * rank
  return dict(
    size=per_dim("size", 1),
    stride=per_dim("stride", 1),
    pad=pads,
    lhs_dilate=per_dim("lhs_dilate", 1),
    rhs_dilate=per_dim("rhs_dilate", 1),
  )


def real_taps(
  *,
  input_size: int,
  size: int,
  outputs: int,
  stride: int = 1,
  pad_low: int = 0,
  lhs_dilate: int = 1,
  rhs_dilate: int = 1,
) -> int:
  """Window taps, summed over one spatial dimension's output positions, that land on input data: not
  on padding, and not on the holes a base (lhs) dilation puts between input elements. Tap k of output
  o reads position o * stride + k * rhs_dilate - pad_low of the dilated input, which holds data where
  that position is in [0, (input_size - 1) * lhs_dilate] and a multiple of lhs_dilate. (Window
  reversal reorders taps; it changes no count.)"""
  span = (input_size - 1) * lhs_dilate  # the last position of the dilated input
  g = math.gcd(stride, lhs_dilate)
  period = lhs_dilate // g  # outputs between two whose tap k lands on data
  inverse = pow(stride // g, -1, period) if period > 1 else 0
  total = 0
  for k in range(size):
    c = k * rhs_dilate - pad_low  # tap k's position at output 0
    lo, hi = max(0, -(c // stride)), min(outputs - 1, (span - c) // stride)
    if hi < lo or (-c) % g:
      continue
    solution = ((-c) // g * inverse) % period  # o * stride + c = 0 (mod lhs_dilate) for o = solution + n * period
    first = lo + (solution - lo) % period
    total += 0 if first > hi else (hi - first) // period + 1
  return total


def _conv_flops(attrs: str, lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]) -> float:
  """FLOPs of a convolution with operand dims `lhs`, `rhs` and result dims `out`: each output element
  is a dot over the filter's input features (per feature group) and the window taps that meet input
  data. Taps that land on padding or on a dilation's holes are not work: the TPU compiler writes
  head-split projections as windows as wide as the heads, padded so that one tap per output meets the
  input (`size=12 pad=11_11`), and batched matmuls as windows dilated by their own size."""
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
  if not m or len(m.group(2)) != len(rhs) or len(m.group(3)) != len(out):
    return 0.0
  lhs_labels, rhs_labels, out_labels = m.groups()
  spatial = lambda labels, dims: {int(c): d for c, d in zip(labels, dims) if c.isdigit()}
  window_sizes, out_sizes = spatial(rhs_labels, rhs), spatial(out_labels, out)
  in_sizes = spatial(lhs_labels, lhs) if len(lhs_labels) == len(lhs) else {}
  w = _window(attrs, len(window_sizes))
  taps = 1
  for d in sorted(window_sizes):
    if d not in in_sizes:  # the input's shape is unknown: every tap counts
      taps *= window_sizes[d] * out_sizes.get(d, 1)
      continue
    taps *= real_taps(
      input_size=in_sizes[d],
      size=window_sizes[d],
      outputs=out_sizes.get(d, 1),
      stride=w["stride"][d],
      pad_low=w["pad"][d][0],
      lhs_dilate=w["lhs_dilate"][d],
      rhs_dilate=w["rhs_dilate"][d],
    )
  features = math.prod(size for label, size in zip(rhs_labels, rhs) if label == "i")
  others = math.prod(size for label, size in zip(out_labels, out) if not label.isdigit())
  return 2.0 * others * features * taps


def _library_flops(op: _Op, shapes: dict[str, str]) -> float | None:
  """FLOPs of an XLA:GPU library call (cuBLAS GEMM, cuDNN convolution); None for any other custom call."""
  target = _target(op)
  result = _arrays(op.shape)[0][1] if _arrays(op.shape) else ()
  if target in CUBLAS_GEMMS:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.attrs)
    lhs = _dims(shapes.get(op.operands[0], "")) if op.operands else ()
    contracted = math.prod(lhs[int(i)] for i in re.findall(r"\d+", m.group(1))) if m and lhs else 0
    return 2.0 * math.prod(result) * contracted
  if target in CUDNN_CONVS:
    arrays = {"result": result}
    arrays.update({f"operand{i}": _dims(shapes.get(x, "")) for i, x in enumerate(op.operands[:2])})
    x, w, y = (arrays.get(k, ()) for k in CUDNN_CONVS[target])
    return _conv_flops(op.attrs, x, w, y) if y else 0.0
  return None


def _target(op: _Op) -> str:
  m = re.search(r'custom_call_target="([^"]*)"', op.attrs)
  return m.group(1) if m else ""


def _kernel_key(op: _Op, shapes: dict[str, str]) -> str:
  """A Triton call's KernelCost key: its kernel's name and its operands' shapes (layouts dropped)."""
  m = re.search(r'\bname = "([^"]*)"', op.attrs)
  operands = [
    ", ".join(f"{t}[{','.join(map(str, dims))}]" for t, dims in _arrays(shapes.get(x, ""))) for x in op.operands
  ]
  return f"{m.group(1) if m else ''}({', '.join(operands)})"


@functools.cache
def _called_pattern(key: str) -> re.Pattern:
  return re.compile(key + r"=\{?([^}]*?)\}?(?:,\s*[a-z_]+=|$)")


def _called(op: _Op, key: str) -> list[str]:
  m = _called_pattern(key).search(op.attrs)
  return _OPERAND.findall(m.group(1)) if m else []


def _declared(op: _Op) -> tuple[float, float] | None:
  """(flops, bytes) a custom call declares in its backend config (Pallas CostEstimate), if any."""
  m = re.search(r'"cost_estimate":(\{[^}]*\})', op.attrs)
  if not m:
    return None
  try:
    estimate = json.loads(m.group(1))
  except ValueError:
    return None
  return float(estimate.get("flops", 0)), float(estimate.get("bytes_accessed", 0))


class _Walker:
  def __init__(self, computations: dict[str, list[_Op]], chip: Chip, kernel_costs=()):
    self.computations, self.chip = computations, chip
    self.kernels = {k.key: k for k in kernel_costs}
    self.unknown_loops = 0
    self.undeclared = set()  # names of the Triton calls that found no KernelCost
    self.shapes = {name: {op.name: op.shape for op in ops} for name, ops in computations.items()}

  @functools.cache
  def inner_flops(self, computation: str) -> tuple[float, float]:
    """Matrix-product FLOPs anywhere inside a fused (or called) computation, and those of them that
    recompute the forward pass (JAX names what jax.checkpoint reruns 'rematted_computation')."""
    total = recompute = 0.0
    for op in self.computations.get(computation, ()):
      if op.opcode in ("dot", "convolution"):
        flops = _matmul_flops(op, self.shapes[computation])
        total += flops
        recompute += flops if _REMAT in op.attrs else 0.0
      for callee in _called(op, "calls"):
        inner, inner_recompute = self.inner_flops(callee)
        total, recompute = total + inner, recompute + inner_recompute
    return total, recompute

  def trip_count(self, op: _Op) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
    if m:
      return int(m.group(1))
    condition = _called(op, "condition")
    ops = self.computations.get(condition[0], []) if condition else []
    constants = {o.name: o.args for o in ops if o.opcode == "constant" and re.fullmatch(r"-?\d+", o.args)}
    for o in ops:
      bounds = [int(constants[x]) for x in o.operands if x in constants]
      if o.opcode == "compare" and bounds:
        return bounds[0] + 1 if "direction=LE" in o.attrs else bounds[0]
    return None

  def sliced_traffic(self, op: _Op, shapes: dict[str, str]) -> float:
    """HBM bytes of an operation that reads or writes only a window of a buffer: a dynamic slice reads
    its window, a dynamic update slice writes its update in place (the buffer is neither read nor
    copied), and a fusion built on them moves only those windows of the parameters they touch."""
    if op.opcode == "dynamic-slice":
      return 2 * size_bytes(op.shape)
    if op.opcode == "dynamic-update-slice":
      return 2 * size_bytes(shapes.get(op.operands[1], "")) if len(op.operands) > 1 else size_bytes(op.shape)
    callee = (_called(op, "calls") or [""])[0]
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

  def fused_roots(self, op: _Op) -> list[_Op]:
    """The operations whose results a fusion returns (a tuple root's parts)."""
    fused = self.computations.get((_called(op, "calls") or [""])[0], [])
    inner = {o.name: o for o in fused}
    root = next((o for o in fused if o.root), fused[-1] if fused else None)
    if root is not None and root.opcode == "tuple":
      return [inner[x] for x in root.operands if x in inner]
    return [root] if root is not None else []

  def category(self, op: _Op, cost: Cost) -> str:
    """What kind of work `op` is, for the step's split (SPLIT)."""
    if op.opcode == "custom-call" and _target(op) in PALLAS_CALLS:
      return "kernels"
    if cost.flops:
      return "matmuls HBM-bound" if cost.memory_s else "matmuls compute-bound"
    roots = self.fused_roots(op) if op.opcode == "fusion" else [op]
    if roots and all(r.opcode == "dynamic-update-slice" for r in roots):
      return "in-place updates"
    return "elementwise"

  @functools.cache
  def users(self, computation: str) -> dict[str, list[_Op]]:
    out: dict[str, list[_Op]] = {}
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
        nested = (_called(u, "calls") or [""])[0]
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

  def op_cost(self, op: _Op, shapes: dict[str, str]) -> Cost:
    if op.opcode in FREE or op.opcode in DONE:
      return Cost()
    if op.opcode == "while":
      n = self.trip_count(op)
      if n is None:
        self.unknown_loops += 1
        n = 1
      body = Cost()
      for name in _called(op, "body") + _called(op, "condition"):
        body.add(self.cost(name))
      scaled = Cost()
      scaled.add(body, n)
      return scaled
    if op.opcode == "conditional":
      branches = [
        self.cost(b)
        for b in _called(op, "branch_computations") + _called(op, "true_computation") + _called(op, "false_computation")
      ]
      return max(branches, key=lambda c: c.compute_s + c.comm_s, default=Cost())
    if op.opcode in ("call", "async-start"):
      total = Cost()
      for name in _called(op, "to_apply") + _called(op, "calls"):
        total.add(self.cost(name))
      return total
    operand_bytes = sum(size_bytes(shapes.get(o, "")) for o in op.operands)
    out_bytes = size_bytes(op.shape)
    if op.opcode in COLLECTIVES:
      moved = max(operand_bytes, out_bytes) * (2.0 if op.opcode.startswith("all-reduce") else 1.0)
      return Cost(comm_bytes=moved, comm_s=moved / self.chip.ici_bandwidth)
    flops, traffic = 0.0, operand_bytes + out_bytes
    if op.opcode in ("dynamic-slice", "dynamic-update-slice", "fusion"):
      traffic = self.sliced_traffic(op, shapes)
    elif op.opcode == "copy-start":  # its result is (destination, source, context): the copy reads and writes once
      traffic = 2 * operand_bytes
    elif op.opcode == "slice":  # reads and writes its window, not the whole operand
      traffic = 2 * out_bytes
    elif op.opcode == "slice-start":  # result ((operand), window, context): reads and writes the window
      arrays = _arrays(op.shape)
      window = arrays[len(op.operands)] if len(arrays) > len(op.operands) else None
      traffic = 2 * BYTES.get(window[0], 4) * math.prod(window[1]) if window else traffic
    recompute = 0.0
    if op.opcode in ("dot", "convolution"):
      flops = _matmul_flops(op, shapes)
      recompute = flops if _REMAT in op.attrs else 0.0
    elif op.opcode == "fusion":
      parts = [self.inner_flops(c) for c in _called(op, "calls")]
      flops, recompute = sum(p[0] for p in parts), sum(p[1] for p in parts)
    elif op.opcode == "custom-call":
      declared = _declared(op)
      library = _library_flops(op, shapes)
      if declared is None and _target(op) == TRITON_CALL:
        kernel = self.kernels.get(_kernel_key(op, shapes))
        if kernel is None:
          self.undeclared.add(op.name)
        else:
          declared = kernel.flops, kernel.bytes_accessed
      if declared is not None:
        flops, traffic = declared[0], declared[1] or traffic
      elif library is not None:  # the workspace a library call is given is scratch, not traffic
        flops, traffic = library, operand_bytes + size_bytes(_first_array(op.shape))
      recompute = flops if _REMAT in op.attrs else 0.0
    seconds = max(flops / self.chip.peak_flops, traffic / self.chip.hbm_bandwidth)
    memory = seconds if traffic / self.chip.hbm_bandwidth > flops / self.chip.peak_flops else 0.0
    return Cost(flops=flops, recompute_flops=recompute, bytes=traffic, compute_s=seconds, memory_s=memory)


def _first_array(shape: str) -> str:
  m = re.search(r"[a-z]+\d*(?:e\d+m\d+\w*)?\[[\d,]*\]", re.sub(r"\{[^}]*\}", "", shape))
  return m.group(0) if m else ""


def _operations(walker: _Walker, entry: str) -> list[Hotspot]:
  """Every operation of the step, each counted over all executions of its computation (loop bodies
  run trip-count times, a conditional's dearest branch once)."""
  found: list[Hotspot] = []

  def visit(computation: str, times: float, depth: int = 0) -> None:
    shapes = walker.shapes.get(computation, {})
    for op in walker.computations.get(computation, ()):
      if op.opcode == "while":
        n = walker.trip_count(op) or 1
        for body in _called(op, "body"):
          visit(body, times * n, depth + 1)
      elif op.opcode in ("call", "async-start", "conditional"):
        continue  # rare at the top of a step; their cost is in the total
      elif op.opcode not in FREE and op.opcode not in DONE and op.opcode not in COLLECTIVES:
        c = walker.op_cost(op, shapes)
        kind = op.opcode
        if op.opcode == "fusion":
          m = re.search(r"kind=(\w+)", op.attrs)
          kind = f"fusion {m.group(1) if m else ''}{' with matmul' if c.flops else ''}"
        source = re.search(r'op_name="([^"]*)"', op.attrs)
        found.append(
          Hotspot(
            op.name,
            kind,
            times,
            times * c.compute_s,
            times * c.flops,
            times * c.bytes,
            times * c.flops / walker.chip.peak_flops,
            source.group(1) if source else "",
            walker.category(op, c),
          )
        )

  visit(entry, 1.0)
  return sorted(found, key=lambda h: -h.seconds)


def _split(operations: list[Hotspot], compute_s: float) -> tuple[tuple[str, float], ...]:
  """Seconds per kind of work (SPLIT), dearest first; what the walk does not list (calls) is "other"."""
  seconds = dict.fromkeys(SPLIT, 0.0)
  for h in operations:
    seconds[h.category] += h.seconds
  seconds["other"] = max(0.0, compute_s - sum(seconds.values()))
  return tuple(sorted(((k, v) for k, v in seconds.items() if v > 0), key=lambda kv: -kv[1]))


def roofline(hlo_text: str, chip: Chip, *, top: int = 0, split: bool = False, kernel_costs=()) -> Roofline:
  """The estimate for one device of the SPMD program `hlo_text` (`compiled.as_text()`) on `chip`;
  `top` > 0 also lists that many of its dearest operations (Roofline.hotspots), `split` the step's
  time by kind of work (Roofline.split). `kernel_costs`: the KernelCost of each Pallas kernel of a GPU
  program (`pallas_kernel_costs` of its traced jaxpr)."""
  computations, entry = parse(hlo_text)
  walker = _Walker(computations, chip, kernel_costs)
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
    unknown_loops=walker.unknown_loops,
    hotspots=tuple(operations[:top]),
    undeclared_kernels=len(walker.undeclared),
    split=_split(operations, total.compute_s) if split else (),
  )


def step_flops(hlo_text: str, kernel_costs=()) -> tuple[float, float]:
  """(matrix-product FLOPs, of them recomputed by remat) of one device's program `hlo_text`, loops
  counted by their trip counts: what the trainer's MFU divides by the step time."""
  computations, entry = parse(hlo_text)
  walker = _Walker(computations, Chip("count", 1.0, 1, 1.0, 1.0, 1), kernel_costs)
  total = walker.cost(entry)
  return total.flops, total.recompute_flops


_HLO_TYPES = {
  "float32": "f32",
  "bfloat16": "bf16",
  "float16": "f16",
  "float64": "f64",
  "int32": "s32",
  "uint32": "u32",
  "int8": "s8",
  "uint8": "u8",
  "int16": "s16",
  "uint16": "u16",
  "int64": "s64",
  "uint64": "u64",
  "bool": "pred",
}


def pallas_kernel_costs(jaxpr) -> tuple[KernelCost, ...]:
  """The KernelCost of every Pallas call with a cost estimate in `jaxpr` (a traced program's, e.g.
  `jax.jit(f).trace(...).jaxpr`), inner jaxprs (loops, shard_map, remat, custom derivatives)
  included, each signature once. Under shard_map its operand shapes are per device, as in the HLO."""
  from jax.extend import core as jex_core

  found: dict[str, KernelCost] = {}

  def visit(j) -> None:
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        estimate = eqn.params.get("cost_estimate")
        if estimate is not None:
          name = eqn.params["jaxpr"].debug_info.func_name
          operands = tuple(
            f"{_HLO_TYPES.get(v.aval.dtype.name, v.aval.dtype.name)}[{','.join(map(str, v.aval.shape))}]"
            for v in eqn.invars
          )
          cost = KernelCost(
            _sanitized(name),
            operands,
            float(estimate.flops),
            float(estimate.bytes_accessed),
            float(estimate.transcendentals),
          )
          found.setdefault(cost.key, cost)
        continue
      for value in eqn.params.values():
        for inner in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(inner, jex_core.ClosedJaxpr):
            visit(inner.jaxpr)
          elif isinstance(inner, jex_core.Jaxpr):
            visit(inner)

  visit(getattr(jaxpr, "jaxpr", jaxpr))
  return tuple(found.values())


def _sanitized(name: str) -> str:
  """The kernel name as Pallas' Triton lowering writes it into the HLO (PTX-safe)."""
  from jax._src.interpreters import mlir

  return mlir.sanitize_name(name)
