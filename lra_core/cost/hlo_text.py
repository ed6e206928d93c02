"""The text of a compiled (optimized) HLO module, as `compiled.as_text()` prints it, read into operations.

A module is a set of computations, one of them the entry; each operation is one line,
`[ROOT ]%name = <shape> <opcode>(<operands>), <attributes>`. Shapes are arrays (`bf16[4,8]{1,0:T(8,128)}`)
or tuples of them; layouts and tilings (the braces) change no size. Attributes name the computations
an operation calls (`calls=`, `body=`, `condition=`, `to_apply=`, branches) and a custom call's target
and backend config. lra_core/cost/hlo_cost.py walks what this module reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

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

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_START = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s")  # "  %name = shape opcode(...)"
_ARRAY = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_PARENTHESIS = re.compile(r"[()]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")


@dataclasses.dataclass
class Op:
  """One operation of a computation."""

  name: str
  opcode: str
  shape: str
  operands: list[str]
  args: str  # the text between the opcode's parentheses (a constant's value)
  attrs: str
  root: bool = False  # the computation's result


def _split_balanced(text: str, start: int) -> int:
  """Index just past the parenthesised group opening at text[start]."""
  depth = 0
  for m in _PARENTHESIS.finditer(text, start):
    depth += 1 if m.group() == "(" else -1
    if depth == 0:
      return m.end()
  return len(text)


def parse_op(line: str) -> Op | None:
  """The operation on one line of a computation; None for a line that holds none."""
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
  return Op(name.lstrip("%"), opcode, shape, operands, rest[paren + 1 : close - 1], rest[close:], root)


def parse(text: str) -> tuple[dict[str, list[Op]], str]:
  """HLO module text -> (computation name -> its operations, the entry computation's name)."""
  computations, entry, current, held = {}, "", None, ""

  def add(op_text: str) -> None:
    op = parse_op(op_text) if op_text else None
    if op is not None:
      computations[current].append(op)

  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(1)
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.strip() == "}":
      add(held)
      current, held = None, ""
    elif held and not _OP_START.match(line):
      # an operation whose attributes run over several lines (a TPU kernel's kernel_metadata, before its
      # op_name): the rest of the one before
      held = f"{held} {line.strip()}"
    else:
      add(held)
      held = line
  return computations, entry


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (element type, dims) of every array in a shape string, layouts stripped."""
  plain = _LAYOUT.sub("", shape)
  return [(t, tuple(int(d) for d in sizes.split(",") if d)) for t, sizes in _ARRAY.findall(plain)]


def size_bytes(shape: str) -> float:
  return sum(BYTES.get(t, 4) * math.prod(sizes) for t, sizes in arrays(shape))


def dims(shape: str) -> tuple[int, ...]:
  """The dims of the shape's first array (() for none)."""
  found = arrays(shape)
  return found[0][1] if found else ()


def first_array(shape: str) -> str:
  """The shape's first array, layout dropped ("f32[4,8]"): a library call's result without its workspace."""
  m = re.search(r"[a-z]+\d*(?:e\d+m\d+\w*)?\[[\d,]*\]", re.sub(r"\{[^}]*\}", "", shape))
  return m.group(0) if m else ""


def target(op: Op) -> str:
  """A custom call's target ("__cublas$gemm", "tpu_custom_call", ...); "" for any other operation."""
  m = re.search(r'custom_call_target="([^"]*)"', op.attrs)
  return m.group(1) if m else ""


def op_name(op: Op) -> str:
  """The JAX operation an op came from (its `metadata={op_name=...}`: the traced name stack); "" if none."""
  m = re.search(r'op_name="([^"]*)"', op.attrs)
  return m.group(1) if m else ""


@functools.cache
def _called_pattern(key: str) -> re.Pattern:
  return re.compile(key + r"=\{?([^}]*?)\}?(?:,\s*[a-z_]+=|$)")


def called(op: Op, key: str) -> list[str]:
  """The computations `op` names in its attribute `key` (calls, body, condition, to_apply, branches)."""
  m = _called_pattern(key).search(op.attrs)
  return _OPERAND.findall(m.group(1)) if m else []


# -- which devices a collective connects ----------------------------------------------------------------

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def device_groups(op: Op) -> list[list[int]] | None:
  """The groups of devices a collective exchanges within (ids: positions in the program's device
  assignment, the mesh's devices in order), from its replica_groups, in any of the three forms XLA
  prints (explicit lists, an iota `[G,S]<=[dims]T(perm)`, or `mesh[axes] {reduced axes}`), or its
  source_target_pairs (a collective-permute: each pair a group); [] for one group of every device
  (empty replica_groups); None when it names none."""
  m = _EXPLICIT.search(op.attrs)
  if m:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = _IOTA.search(op.attrs)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(a) for a in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = _MESH.search(op.attrs)
  if m:
    axes = re.findall(r"'([^']*)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    over = [names.index(a) for a in re.findall(r"'([^']*)'", m.group(2))]
    kept = [i for i in range(len(names)) if i not in over]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(kept + over)
    return ids.reshape(-1, math.prod(sizes[i] for i in over)).tolist()
  m = _PAIRS.search(op.attrs)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  return None
