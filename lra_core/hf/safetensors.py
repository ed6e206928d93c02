"""The safetensors format, read and written with numpy (no torch, no extra package).

A file is an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype", "shape",
"data_offsets": [begin, end]}}, and an optional "__metadata__" of strings), then the tensors' bytes,
offsets counted from the end of the header. Hugging Face model folders keep their weights so, in one
`model.safetensors` or in shards named by `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

from lra_core.errors import CheckpointError

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


def read(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of one .safetensors file, memory-mapped and read-only (stored little-endian, read on
  the little-endian hosts JAX runs on)."""
  path = pathlib.Path(path)
  with path.open("rb") as f:
    raw = f.read(8)
    size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 0 < size <= _MAX_HEADER:
      raise CheckpointError(f"{path} is not a safetensors file (its first 8 bytes give no header length).")
    try:
      header = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON: {e}).") from e
  if not isinstance(header, dict):
    raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object).")
  body = path.stat().st_size - 8 - size
  header.pop("__metadata__", None)
  mapped = np.memmap(path, np.uint8, mode="r", offset=8 + size, shape=(body,)) if body else np.zeros(0, np.uint8)
  tensors = {}
  for name, entry in header.items():
    entry = entry if isinstance(entry, dict) else {}
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
      raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of {sorted(DTYPES)}.")
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    if not (_whole_numbers(offsets) and len(offsets) == 2 and _whole_numbers(shape)):
      raise CheckpointError(f"{path}: tensor {name!r} gives no whole-number shape and two data_offsets.")
    (begin, end), shape = offsets, tuple(shape)
    if not 0 <= begin <= end <= body or end - begin != int(np.prod(shape)) * dtype.itemsize:
      raise CheckpointError(
        f"{path}: tensor {name!r} ({entry['dtype']} {list(shape)}) does not fit bytes {begin}..{end} of the "
        f"file's {body}: the file is cut short or damaged."
      )
    tensors[name] = mapped[begin:end].view(dtype).reshape(shape)
  return tensors


def read_index(path: str | os.PathLike) -> list[str]:
  """The shard files (sorted, each once) a `model.safetensors.index.json` names in its weight_map."""
  path = pathlib.Path(path)
  try:
    index = json.loads(path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} cannot be read as JSON ({e}).") from e
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise CheckpointError(f"{path} has no weight_map of tensor names to shard files.")
  return sorted(set(weight_map.values()))


def _whole_numbers(value) -> bool:
  """Whether `value` is a list of non-negative whole numbers (JSON's, not booleans)."""
  return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Writes `tensors` (names in sorted order, each C-contiguous little-endian) to one file, atomically."""
  header, offset = {}, 0
  arrays = {}
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])  # native order: the little-endian hosts JAX runs on
    if array.dtype not in _NAMES:
      raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors does not hold.")
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape)}
    header[name]["data_offsets"] = [offset, offset + array.nbytes]
    offset += array.nbytes
    arrays[name] = array
  if metadata:
    header["__metadata__"] = dict(metadata)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned, as the reference writer keeps them
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.tmp")
  with tmp.open("wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for array in arrays.values():
      f.write(array.tobytes())
  os.replace(tmp, path)
