"""FLOPs of the matrix products of a compiled (optimized) HLO program, at 2 per multiply-add.

- `dot` and `convolution`, also inside fusions (XLA:GPU's Triton GEMM fusions, `__triton_gemm` /
  `__triton_nested_gemm_fusion`, and cuDNN fusions hold their `dot`);
- XLA:GPU's library calls: cuBLAS `__cublas$gemm` / `__cublas$lt$matmul`, from the dot dimensions in
  their backend config and the operand shapes; cuDNN convolutions, forward and backward, from their
  window and dimension labels.

A convolution counts only the window taps that meet input data, not those on its padding or a
dilation's holes (`real_taps`): the TPU compiler writes head-split projections and batched matmuls as
padded or dilated windows where most taps are empty. Elementwise arithmetic counts as no FLOPs.
What a Pallas kernel computes is what it declares (lra_core/cost/pallas_costs.py).
"""

from __future__ import annotations

import math
import re

from lra_core.cost.hlo_text import Op, arrays, dims, target

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


def matmul_flops(op: Op, shapes: dict[str, str]) -> float:
  """FLOPs of a `dot` or `convolution`; `shapes` maps its computation's value names to their shapes."""
  if op.opcode == "dot":
    out = math.prod(dims(op.shape))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    lhs = dims(shapes.get(op.operands[0], "")) if op.operands else ()
    contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 1
    return 2.0 * out * contracted
  lhs, rhs = (dims(shapes.get(x, "")) for x in (list(op.operands) + ["", ""])[:2])
  return _conv_flops(op.attrs, lhs, rhs, dims(op.shape))


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
  spatial = lambda labels, sizes: {int(c): d for c, d in zip(labels, sizes) if c.isdigit()}
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


def library_flops(op: Op, shapes: dict[str, str]) -> float | None:
  """FLOPs of an XLA:GPU library call (cuBLAS GEMM, cuDNN convolution); None for any other custom call."""
  call = target(op)
  result = arrays(op.shape)[0][1] if arrays(op.shape) else ()
  if call in CUBLAS_GEMMS:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.attrs)
    lhs = dims(shapes.get(op.operands[0], "")) if op.operands else ()
    contracted = math.prod(lhs[int(i)] for i in re.findall(r"\d+", m.group(1))) if m and lhs else 0
    return 2.0 * math.prod(result) * contracted
  if call in CUDNN_CONVS:
    operands = {"result": result}
    operands.update({f"operand{i}": dims(shapes.get(x, "")) for i, x in enumerate(op.operands[:2])})
    x, w, y = (operands.get(k, ()) for k in CUDNN_CONVS[call])
    return _conv_flops(op.attrs, x, w, y) if y else 0.0
  return None
