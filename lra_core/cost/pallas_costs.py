"""What a Pallas kernel declares it costs (its `CostEstimate`), and how a compiled program's calls find it.

A Pallas kernel is an opaque custom call to the compiler, so the roofline (lra_core/cost/hlo_cost.py) counts
what the kernel declares instead of what it can see. Mosaic keeps the estimate in the TPU custom call's
backend config (`declared`). A Triton call on a GPU keeps none: its estimate comes from the traced program
(`pallas_kernel_costs`), matched to the call by kernel name and operand shapes (`kernel_key`); a Triton
kernel without one counts its operands and results as traffic and no FLOPs.
"""

from __future__ import annotations

import dataclasses
import json
import re

from lra_core.cost.hlo_text import Op, arrays

TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel compiled by Triton (XLA:GPU)
PALLAS_CALLS = (TRITON_CALL, "tpu_custom_call")  # Pallas kernels: Triton on a GPU, Mosaic on a TPU


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """What a Pallas kernel declares (its `CostEstimate`), keyed by its name and per-device operand
  shapes in HLO notation ("f32[4,2,64,16]"): how a Triton call of a GPU program, which keeps no
  estimate, finds its own (the `kernel_costs` of lra_core.cost.hlo_cost.roofline)."""

  name: str
  operands: tuple[str, ...]
  flops: float
  bytes_accessed: float
  transcendentals: float = 0.0

  @property
  def key(self) -> str:
    return f"{self.name}({', '.join(self.operands)})"


def declared(op: Op) -> tuple[float, float] | None:
  """(flops, bytes) a custom call declares in its backend config (Pallas CostEstimate), if any."""
  m = re.search(r'"cost_estimate":(\{[^}]*\})', op.attrs)
  if not m:
    return None
  try:
    estimate = json.loads(m.group(1))
  except ValueError:
    return None
  return float(estimate.get("flops", 0)), float(estimate.get("bytes_accessed", 0))


def kernel_key(op: Op, shapes: dict[str, str]) -> str:
  """A Triton call's KernelCost key: its kernel's name and its operands' shapes (layouts dropped)."""
  m = re.search(r'\bname = "([^"]*)"', op.attrs)
  operands = [
    ", ".join(f"{t}[{','.join(map(str, sizes))}]" for t, sizes in arrays(shapes.get(x, ""))) for x in op.operands
  ]
  return f"{m.group(1) if m else ''}({', '.join(operands)})"


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
          cost = KernelCost(
            call_name(eqn),
            hlo_operands(eqn.invars),
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


def call_name(eqn) -> str:
  """A pallas_call's kernel name as Pallas' Triton lowering writes it into the HLO (PTX-safe)."""
  from jax._src.interpreters import mlir

  return mlir.sanitize_name(eqn.params["jaxpr"].debug_info.func_name)


def hlo_operands(invars) -> tuple[str, ...]:
  """Operand shapes in HLO notation ("f32[4,2,64,16]"), as `kernel_key` reads them off a compiled call."""
  return tuple(
    f"{_HLO_TYPES.get(v.aval.dtype.name, v.aval.dtype.name)}[{','.join(map(str, v.aval.shape))}]" for v in invars
  )
