"""LRA Pathfinder and Path-X: is there a dashed path between the two dots of an image?

Files (the LRA release, `lra_release/pathfinder<res>/`), read from `data.dir` (local or gs://):

  <dir>/curv_baseline/            easy          (contour length 6)
  <dir>/curv_contour_length_9/    intermediate
  <dir>/curv_contour_length_14/   hard          (LRA's Pathfinder at 32x32, Path-X at 128x128)
    imgs/<batch>/sample_<k>.png   8-bit greyscale, res x res
    metadata/<batch>.npy          TEXT despite the name: one line per image, split on ' ',
                                  e.g. `imgs/0 sample_0.png 0 0 1.0 6 2 2 0.5 1 1`;
                                  image = <difficulty>/f[0]/f[1], label = int(f[3])

What follows LRA (`lra_benchmarks/data/pathfinder.py`, `image/input_pipeline.py`,
`get_pathfinder_base_datasets`):
  * one difficulty folder is one tfds split (easy / intermediate / hard) built from every
    `metadata/*.npy`; LRA's key of an example is `f[0]_f[1]_<line number in its file>`;
  * tfds writes a split sorted by md5(split name + key) (tensorflow_datasets/core/hashing.py;
    the tests check this order against tfds's own writer); that is the order here, so
    `train` = `<difficulty>[:80%]`, `validation` = `[80%:90%]`, `test` = `[90%:]` hold the same
    images as in LRA, with tfds's percent rounding (round(n * pct / 100));
  * images whose PNG file is empty are dropped after slicing, like LRA's `filter`;
  * pixels are the PNG's uint8 values as int32 tokens 0..255, not normalised (LRA normalises
    only for its CNNs), flattened in raster order to T = res * res; vocabulary 256, 2 classes.
Differences: every non-empty metadata line counts (LRA drops a file's last line when the file
lacks a final newline); PNGs other than 8-bit greyscale are refused, as are labels not 0/1.

Example fields: inputs int32[T], mask bool[T] (all True), targets int32[] (0/1), weights
float32[] (1). The PNGs are decoded once (Pillow) into uint8[N, T] in the cache, keyed by the
metadata files' paths, sizes and mtimes, and memory-mapped afterwards.

`generate` draws Pathfinder-STYLE images with this module's own renderer into the same
layout: two target contours of dashes, shorter distractors, label 1 when the two dots end the
same contour. They are not the official images (drewlinsley/pathfinder's snakes2.py).

  python -m lra_core.data.datasets.lra.pathfinder stats DIR [--difficulty=hard] [--resolution=32]
  python -m lra_core.data.datasets.lra.pathfinder generate --out=DIR [--resolution=32 --contour_length=14
      --num=1000 --seed=0]   # Pathfinder-STYLE images in the same layout (not the official ones)
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import sys
import time
from collections.abc import Sequence

import ml_collections
import numpy as np
from etils import epath

from lra_core import cli
from lra_core.data import DataInfo, cache, check_index, config_section, files, labelled_example
from lra_core.data.datasets.lra.pathfinder_generator import generate
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

DATASET = Dataset(name="pathfinder", unit="pixel", tasks=("classify",))

DIFFICULTIES = {
  "easy": "curv_baseline",
  "intermediate": "curv_contour_length_9",
  "hard": "curv_contour_length_14",
}
SPLIT_SLICES = {"train": "[:80%]", "validation": "[80%:90%]", "test": "[90%:]"}
VOCAB_SIZE = 256
NUM_CLASSES = 2
METADATA_GLOB = "metadata/*.npy"
# Bumped whenever the cached arrays would change for the same files: part of the cache key.
_CACHE_VERSION = 1

_DEFAULTS = dict(
  name=DATASET.name,
  dir="",  # the resolution folder, e.g. lra_release/pathfinder32/
  difficulty="hard",  # easy | intermediate | hard
  resolution=32,  # 32 = Pathfinder, 128 = Path-X (64, 256 and any other size also load)
  cache_dir="",  # decoded pixels; "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
)


def data_config(**overrides) -> ml_collections.ConfigDict:
  """The `config.data` section for Pathfinder; defaults are LRA's Pathfinder (32x32, hard)."""
  return config_section(_DEFAULTS, overrides)


def layout(folder: str | os.PathLike, difficulty: str, resolution: int) -> str:
  sub = DIFFICULTIES.get(difficulty, difficulty)
  return (
    f"{folder}/{sub}/metadata/*.npy text files and imgs/<batch>/*.png, the lra_release pathfinder{resolution} layout"
  )


PREPARE = (
  "download lra_release.gz from github.com/google-research/long-range-arena, or write "
  "Pathfinder-style images with `python -m lra_core.data.datasets.lra.pathfinder generate`"
)

# ----------------------------------------------------------------------------- metadata


@dataclasses.dataclass(frozen=True)
class Row:
  """One metadata line: the image it names, its label and LRA's tfds key."""

  image: str  # path relative to the difficulty folder, "imgs/0/sample_0.png"
  label: int
  key: str  # "imgs/0_sample_0.png_1"
  where: str  # "<metadata file> line <k>", for errors


def read_metadata(path: str | os.PathLike) -> list[Row]:
  """Parses one metadata text file, raising DataError at the first line that does not parse."""
  path = epath.Path(path)
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(
      f"metadata file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
      "expected lines like 'imgs/0 sample_0.png 0 1 ...' (the LRA release writes text "
      "despite the .npy name)."
    ) from None
  rows = []
  for lineno, line in enumerate(text.split("\n"), start=1):
    line = line.rstrip("\r")
    if not line:
      continue
    fields = line.split(" ")
    where = f"{path} line {lineno}"
    if len(fields) < 4 or not fields[0] or not fields[1]:
      raise DataError(
        f"{where}: {line[:80]!r} has {len(fields)} space-separated fields; expected "
        "at least 4 (image folder, image file, index, label)."
      )
    if fields[3] not in ("0", "1"):
      raise DataError(f"{where}: label {fields[3]!r} (field 4) is not 0 or 1.")
    rows.append(
      Row(image=f"{fields[0]}/{fields[1]}", label=int(fields[3]), key=f"{fields[0]}_{fields[1]}_{lineno}", where=where)
    )
  return rows


def tfds_order(keys: Sequence[str], split_name: str) -> np.ndarray:
  """Permutation putting `keys` in the order tfds writes them: md5(split_name + key) ascending."""
  salted = hashlib.md5(split_name.encode("utf-8"))
  hashes = []
  for key in keys:
    md5 = salted.copy()
    md5.update(key.replace("\\", "/").encode("utf-8"))
    hashes.append(md5.digest())  # big-endian bytes sort like tfds's int(hexdigest, 16)
  return np.asarray(sorted(range(len(keys)), key=hashes.__getitem__), np.int64)


# ----------------------------------------------------------------------------- images


def decode_png(path: str | os.PathLike, resolution: int, data: bytes | None = None) -> np.ndarray | None:
  """uint8[res*res] raster-order pixels of an 8-bit greyscale PNG; None for an empty file.
  `data` is the file's content when it was read already (`files.prefetch`)."""
  from PIL import Image  # imported here to keep imports light

  path = str(path)
  try:
    with io.BytesIO(data) if data is not None else epath.Path(path).open("rb") as f:
      if not f.read(1):
        return None
      f.seek(0)
      with Image.open(f, formats=("PNG",)) as image:
        size, mode = image.size, image.mode
        pixels = image.tobytes() if size == (resolution, resolution) and mode == "L" else b""
  except FileNotFoundError:
    raise DataError(
      f"image {path!r} does not exist; expected every image a metadata line names under imgs/<batch>/ ({PREPARE})."
    ) from None
  except (OSError, SyntaxError, ValueError) as e:
    raise DataError(f"image {path!r} is not a readable PNG ({e}).") from None
  if size != (resolution, resolution):
    raise DataError(
      f"image {path!r} is {size[0]}x{size[1]} pixels; expected {resolution}x{resolution} "
      f"(data.resolution {resolution})."
    )
  if mode != "L":
    raise DataError(f"image {path!r} has PNG mode {mode!r}; expected 8-bit greyscale (mode 'L').")
  return np.frombuffer(pixels, np.uint8)


def difficulty_folder(data_dir: str, difficulty: str, resolution: int) -> epath.Path:
  """`<dir>/<difficulty folder>`, checked to exist with metadata files and an imgs/ folder."""
  if difficulty not in DIFFICULTIES:
    raise ConfigError(f"data.difficulty {difficulty!r} is not one of {list(DIFFICULTIES)}.")
  spec = dict(layout=layout(data_dir or "<dir>", difficulty, resolution), prepare=PREPARE)
  folder = files.require_dir(data_dir, **spec) / DIFFICULTIES[difficulty]
  if not folder.is_dir():
    raise DataError(f"{str(folder)!r} is not a folder; expected {spec['layout']} ({PREPARE}).")
  if not (folder / "imgs").is_dir():
    raise DataError(f"{str(folder / 'imgs')!r} is not a folder; expected {spec['layout']} ({PREPARE}).")
  files.require_files(folder, METADATA_GLOB, **spec)
  return folder


def decode_difficulty(folder: epath.Path, difficulty: str, resolution: int) -> dict[str, np.ndarray]:
  """Every image of one difficulty folder, in tfds order.

  Returns pixels uint8[N, res*res], labels uint8[N] and empty bool[N] (empty PNG files, which
  LRA filters out after slicing; their pixels are zero).
  """
  metadata = files.require_files(
    folder, METADATA_GLOB, layout=layout(folder.parent, difficulty, resolution), prepare=PREPARE
  )
  rows = [row for path in metadata for row in read_metadata(path)]
  if not rows:
    raise DataError(
      f"the metadata files {str(folder / METADATA_GLOB)!r} list no images; expected "
      f"{layout(folder.parent, difficulty, resolution)} ({PREPARE})."
    )
  order = tfds_order([row.key for row in rows], difficulty)
  pixels = np.zeros((len(rows), resolution * resolution), np.uint8)
  labels = np.empty(len(rows), np.uint8)
  empty = np.zeros(len(rows), bool)
  start = time.perf_counter()
  base = str(folder)
  paths = [os.path.join(base, rows[j].image) for j in order]
  for i, (j, path, data) in enumerate(zip(order, paths, files.prefetch(paths))):
    row = rows[j]
    try:
      image = decode_png(path, resolution, data)
    except DataError as e:
      raise DataError(f"{row.where}: {e}") from None
    labels[i] = row.label
    if image is None:
      empty[i] = True
    else:
      pixels[i] = image
    if (i + 1) % 20000 == 0:
      logging.info("Pathfinder %s: decoded %d of %d images.", folder, i + 1, len(rows))
  seconds = time.perf_counter() - start
  logging.info(
    "Pathfinder %s: decoded %d images (%d empty) in %.1f s, %.0f images/s.",
    folder,
    len(rows),
    int(empty.sum()),
    seconds,
    len(rows) / max(seconds, 1e-9),
  )
  return {"pixels": pixels, "labels": labels, "empty": empty}


def load_difficulty(data_dir: str, difficulty: str, resolution: int, cache_dir: str = "") -> dict[str, np.ndarray]:
  """`decode_difficulty`, decoded once into the cache and memory-mapped from then on."""
  folder = difficulty_folder(data_dir, difficulty, resolution)
  metadata = files.require_files(
    folder, METADATA_GLOB, layout=layout(data_dir, difficulty, resolution), prepare=PREPARE
  )
  key = dict(
    version=_CACHE_VERSION,
    folder=files.absolute(folder),
    difficulty=difficulty,
    resolution=resolution,
    metadata=cache.file_fingerprint(metadata),
  )
  return cache.cached_arrays(
    f"pathfinder{resolution}-{difficulty}",
    key,
    lambda: decode_difficulty(folder, difficulty, resolution),
    root=cache_dir,
  )


def split_indices(empty: np.ndarray, split: str, difficulty: str) -> np.ndarray:
  """Rows of `split` in tfds order: LRA's percent slice of the difficulty, then non-empty only."""
  start, stop = files.slice_range(difficulty + SPLIT_SLICES[split], len(empty))
  return start + np.flatnonzero(~np.asarray(empty[start:stop]))


# ----------------------------------------------------------------------------- source


class Source:
  """One split of one difficulty for `classify`: whole images of T = res * res pixels.

  Pickling keeps only the cache file names; a worker maps the arrays itself.
  """

  info = DataInfo(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, unit=DATASET.unit)

  def __init__(self, arrays: dict[str, np.ndarray], split: str, difficulty: str):
    DATASET.check_split(split)
    self.split, self.difficulty = split, difficulty
    self._files = {name: getattr(a, "filename", None) for name, a in arrays.items()}
    self._arrays = arrays
    self._indices = split_indices(arrays["empty"], split, difficulty)
    self.seq_len = int(arrays["pixels"].shape[1])

  @property
  def arrays(self) -> dict[str, np.ndarray]:
    if self._arrays is None:
      self._arrays = {name: np.load(f, mmap_mode="r", allow_pickle=False) for name, f in self._files.items()}
    return self._arrays

  @property
  def indices(self) -> np.ndarray:
    """Rows of the cached arrays that this split holds, in order."""
    if self._indices is None:
      self._indices = split_indices(self.arrays["empty"], self.split, self.difficulty)
    return self._indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """-> inputs int32[T] (pixels 0..255), mask bool[T], targets int32[] (0/1), weights float32[]."""
    row = self.indices[check_index(index, len(self.indices))]
    arrays = self.arrays
    return labelled_example(arrays["pixels"][row], np.ones(self.seq_len, bool), arrays["labels"][row])

  def __getstate__(self):
    state = dict(self.__dict__)
    if all(self._files.values()):  # memory-mapped: the receiver reopens the files
      state["_arrays"] = state["_indices"] = None
    return state


# ----------------------------------------------------------------------------- config


def _resolution(data) -> int:
  resolution = data.resolution
  if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or resolution < 1:
    raise ConfigError(f"data.resolution {resolution!r} must be a positive integer (32 = Pathfinder, 128 = Path-X).")
  return int(resolution)


def validate_config(config) -> None:
  """Cheap checks: difficulty, resolution, seq_len = resolution^2 and the folder layout."""
  data = config.data
  resolution = _resolution(data)
  if data.difficulty not in DIFFICULTIES:
    raise ConfigError(f"data.difficulty {data.difficulty!r} is not one of {list(DIFFICULTIES)}.")
  if "train" in config and config.train.seq_len != resolution * resolution:
    raise ConfigError(
      f"train.seq_len {config.train.seq_len} is not data.resolution {resolution} squared "
      f"({resolution * resolution}); a Pathfinder example is a whole image in raster order."
    )
  difficulty_folder(data.dir, data.difficulty, resolution)


def make_source(config, split: str) -> Source:
  """The `split` ("train", "validation", "test") of the configured difficulty and resolution."""
  DATASET.check_split(split)
  validate_config(config)
  data = config.data
  arrays = load_difficulty(data.dir, data.difficulty, _resolution(data), data.cache_dir)
  return Source(arrays, split, data.difficulty)


# ----------------------------------------------------------------------------- command line


def describe(arrays: dict[str, np.ndarray], difficulty: str) -> str:
  """Per split: examples, label balance and mean pixel value."""
  lines = []
  for split in DATASET.splits:
    rows = split_indices(arrays["empty"], split, difficulty)
    labels = np.asarray(arrays["labels"])[rows]
    pixels = np.asarray(arrays["pixels"])[rows]
    positive = labels.mean() if len(rows) else float("nan")
    lines.append(
      f"  {split}: {len(rows)} examples, label 1 fraction {positive:.3f} "
      f"({int(labels.sum())}/{len(rows)}), mean pixel {pixels.mean() if len(rows) else 0:.2f}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.doc_parser("python -m lra_core.data.datasets.lra.pathfinder", __doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  stats = commands.add_parser("stats", help="decode (or map from the cache) and describe the splits")
  stats.add_argument("dir")
  stats.add_argument("--difficulty", default="hard", choices=list(DIFFICULTIES))
  stats.add_argument("--resolution", type=int, default=32)
  stats.add_argument("--cache_dir", default="")
  gen = commands.add_parser("generate", help="write Pathfinder-style images in the release layout")
  gen.add_argument("--out", required=True, help="the resolution folder, e.g. data/pathfinder32")
  gen.add_argument("--resolution", type=int, default=32)
  gen.add_argument("--contour_length", type=int, default=14, help="6 easy, 9 intermediate, 14 hard")
  gen.add_argument("--num", type=int, default=1000)
  gen.add_argument("--batch_size", type=int, default=1000, help="images per imgs/<batch>/ folder")
  gen.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  try:
    start = time.perf_counter()
    if args.command == "generate":
      folder = generate(
        args.out,
        resolution=args.resolution,
        contour_length=args.contour_length,
        num=args.num,
        batch_size=args.batch_size,
        seed=args.seed,
      )
      print(
        f"wrote {args.num} Pathfinder-style {args.resolution}x{args.resolution} images to {folder} "
        f"in {time.perf_counter() - start:.1f} s"
      )
      return
    arrays = load_difficulty(args.dir, args.difficulty, args.resolution, args.cache_dir)
    print(
      f"{args.dir} {args.difficulty} ({DIFFICULTIES[args.difficulty]}), {args.resolution}x"
      f"{args.resolution}: {len(arrays['labels'])} images, {int(np.sum(arrays['empty']))} empty, "
      f"loaded in {time.perf_counter() - start:.2f} s"
    )
    print(describe(arrays, args.difficulty))
  except (ConfigError, DataError) as e:
    sys.exit(f"error: {e}")


codec = None  # images: no text encoding to sample with


if __name__ == "__main__":
  main()
