"""LRA Image: CIFAR-10 (Krizhevsky 2009) classified from a sequence of 1024 grayscale pixels.

Where the images come from (`data.source`):

  files  `data.dir` (a local folder or a gs:// one) holds the Toronto python release
         `cifar-10-python.tar.gz`, or its extracted `cifar-10-batches-py/` folder (`data_batch_1`..
         `data_batch_5`, `test_batch`), or is that folder itself. Whichever data_batch_N exist
         are used, in order of N.
  tfds   tfds `cifar10` prepared in array_record format under `data.dir` ("" -> ~/tensorflow_datasets).

Splits are tfds slice specs (`data.train_split`, `validation_split`, `test_split`), by default
LRA's `train[:90%]`, `train[90%:]` and `test` (`image/input_pipeline.py`). tfds stores a split
in the order of md5(split name + str(example index)); the files path sorts each split the same
way, so both sources give the same examples in the same order and the slices hold the images
LRA's `tfds.load("cifar10", split="train[:90%]")` held, given all five batches (the python and
binary releases list the images in the same order).

Pixels (LRA: `tf.cast(tf.image.rgb_to_grayscale(image), tf.int32)`), in float32 at each step:

  x_c  = float32(c) * float32(1/255)                      for c in R, G, B (uint8)
  y    = (x_R * 0.2989 + x_G * 0.5870) + x_B * 0.1140
  gray = trunc(y * 255.5)                                 in 0..255

which equals TensorFlow 2.21's result (CPU) on all 2^24 RGB triples; other float32 orders or
FMA differ on up to 85 of them, float64 arithmetic on 237 (rounding at integer boundaries). `data.grayscale=False`
keeps colour instead: 3072 tokens, R, G, B per pixel in raster order (then train.seq_len=3072).
`data.image_size` S < 32 (a divisor of 32, for smoke tests) box-averages each colour channel to
S x S first (block mean, rounded half up), giving S*S tokens.

  inputs int32[1024]   mask bool[1024] (all True)   targets int32[] (0..9)   weights float32[]

Tokens are pixel values 0..255 (vocabulary 256): every position is real, so nothing is padding.
The files path decodes the pickles once into the lra_core cache (uint8[N, 1024] per split).

  python -m lra_core.data.datasets.lra.cifar10 stats --dir DIR
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import re
import sys
import tarfile
import time
from collections.abc import Sequence

import ml_collections
import numpy as np
from etils import epath

from lra_core import cli
from lra_core.data import DataInfo, cache, check_index, config_section, files, labelled_example, tfds_source
from lra_core.data.images import downsample, planar_to_hwc
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

DATASET = Dataset(name="cifar10", unit="pixel", tasks=("classify",))

ARCHIVE = "cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
TEST_BATCH = "test_batch"
SIDE = 32
PIXELS = SIDE * SIDE
VOCAB_SIZE = 256
NUM_CLASSES = 10
LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], np.float32)  # tf.image.rgb_to_grayscale
TFDS_NAME = "cifar10"
SOURCES = files.SOURCES
FILE_SPLITS = ("train", "test")

LAYOUT = (
  f"{ARCHIVE} or an extracted {FOLDER}/ with data_batch_1..5 and {TEST_BATCH} "
  "(python pickles with b'data' uint8[N,3072] and b'labels')"
)
PREPARE = (
  "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, or set data.source=tfds "
  "after `tfds build cifar10 --file_format=array_record`"
)
_BATCH = re.compile(r"^(?:\./)?(?:cifar-10-batches-py/)?(data_batch_(\d+)|test_batch)$")
# The only globals a CIFAR batch pickle refers to (numpy arrays; _codecs when written by Python 3).
_PICKLE_GLOBALS = {
  ("numpy.core.multiarray", "_reconstruct"),
  ("numpy._core.multiarray", "_reconstruct"),
  ("numpy.core.numeric", "_frombuffer"),
  ("numpy._core.numeric", "_frombuffer"),
  ("numpy", "ndarray"),
  ("numpy", "dtype"),
  ("_codecs", "encode"),
}
_CACHE_VERSION = 1

_DEFAULTS = dict(
  name=DATASET.name,
  source="files",  # files | tfds
  dir="",  # folder with cifar-10-python.tar.gz or cifar-10-batches-py/; tfds: data_dir
  grayscale=True,  # LRA; False -> 3072 RGB tokens
  image_size=32,  # S < 32: box-average to S x S first (smoke tests)
  train_split="train[:90%]",  # LRA image/input_pipeline.py
  validation_split="train[90%:]",
  test_split="test",
  cache_dir="",  # "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
)

_LOGGED: set[tuple] = set()


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def rgb_to_gray(rgb: np.ndarray) -> np.ndarray:
  """uint8[..., 3] -> uint8[...]: tf.image.rgb_to_grayscale bit for bit (see the module doc)."""
  x = rgb.astype(np.float32) * np.float32(1.0 / 255)
  y = x[..., 0] * GRAY_WEIGHTS[0] + x[..., 1] * GRAY_WEIGHTS[1]
  y = y + x[..., 2] * GRAY_WEIGHTS[2]
  return (y * np.float32(255.5)).astype(np.uint8)


def tokens(images: np.ndarray, grayscale: bool, size: int = SIDE) -> np.ndarray:
  """uint8[N, 32, 32, 3] (HWC) -> uint8[N, S*S] grayscale or uint8[N, 3*S*S] RGB, raster order."""
  images = downsample(images, size)
  n = images.shape[0]
  return rgb_to_gray(images).reshape(n, -1) if grayscale else images.reshape(n, -1)


def tfds_order(split: str, n: int) -> np.ndarray:
  """Positions of examples 0..n-1 in tfds's stored order: sorted by md5(split + str(index))."""
  salt = hashlib.md5(split.encode())
  keys = []
  for i in range(n):
    h = salt.copy()
    h.update(str(i).encode())
    keys.append(int.from_bytes(h.digest(), "big"))  # = tfds hashing.Hasher.hash_key
  return np.asarray(sorted(range(n), key=keys.__getitem__), np.int64)


# ----------------------------------------------------------------------------- reading the release


class _BatchUnpickler(pickle.Unpickler):
  """Loads CIFAR batch pickles without executing anything but numpy array reconstruction."""

  def find_class(self, module, name):
    if (module, name) not in _PICKLE_GLOBALS:
      raise pickle.UnpicklingError(f"global {module}.{name} is not part of a CIFAR batch")
    return super().find_class(module, name)


def read_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
  """One batch pickle (Python-2 protocol 2, loaded with encoding='bytes') -> (uint8[N, 32, 32, 3]
  HWC images, uint8[N] labels)."""

  def fail(what):
    return DataError(f"{where} {what}; expected {LAYOUT} ({PREPARE}).")

  try:
    batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
  except Exception as e:  # pickle raises many kinds for a corrupt stream
    raise fail(f"is not a readable CIFAR-10 batch pickle ({type(e).__name__}: {e})") from e
  if not isinstance(batch, dict):
    raise fail(f"holds a {type(batch).__name__}, not a dict")
  get = lambda key: batch.get(key.encode(), batch.get(key))  # str keys if re-pickled by Python 3
  data, labels = get("data"), get("labels")
  if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * PIXELS:
    shown = f"{data.dtype}{list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
    raise fail(f"has b'data' {shown}, not uint8[N, {3 * PIXELS}]")
  try:
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
  except (TypeError, ValueError) as e:
    raise fail(f"has b'labels' that are not a list of integers ({e})") from e
  if labels.shape != (data.shape[0],):
    raise fail(f"has {labels.size} b'labels' for {data.shape[0]} images")
  bad = np.nonzero((labels < 0) | (labels >= NUM_CLASSES))[0]
  if bad.size:
    raise fail(f"has label {labels[bad[0]]} at row {bad[0]}, outside 0..{NUM_CLASSES - 1}")
  # Rows are planar R(1024) G(1024) B(1024), each a 32x32 image in raster order.
  images = planar_to_hwc(data, SIDE)
  return images, labels.astype(np.uint8)


def locate(data_dir: str) -> epath.Path:
  """The archive under `data_dir` if there is one, else the folder holding the batch pickles."""
  root = files.require_dir(data_dir, layout=LAYOUT, prepare=PREPARE)
  if (root / ARCHIVE).is_file():
    return files.require_file(root / ARCHIVE, layout=LAYOUT, prepare=PREPARE)
  for folder in (root / FOLDER, root):
    if (folder / TEST_BATCH).is_file():
      files.require_files(folder, "data_batch_*", layout=LAYOUT, prepare=PREPARE)
      return folder
  raise DataError(
    f"data.dir {str(root)!r} holds neither {ARCHIVE} nor {FOLDER}/{TEST_BATCH}; expected {LAYOUT} ({PREPARE})."
  )


def _batch_files(location: epath.Path) -> dict[str, epath.Path]:
  return {p.name: p for p in location.iterdir() if _BATCH.match(p.name) and p.is_file()}


def _read_batches(location: epath.Path) -> dict[str, tuple[bytes, str]]:
  """name -> (raw pickle, where) for data_batch_N and test_batch."""
  if location.is_dir():
    return {name: (p.read_bytes(), f"file {str(p)!r}") for name, p in _batch_files(location).items()}
  found = {}
  try:
    with location.open("rb") as raw, tarfile.open(fileobj=raw, mode="r:gz") as archive:
      for member in archive:
        m = _BATCH.match(member.name)
        if m and member.isfile():
          found[m[1]] = (archive.extractfile(member).read(), f"member {member.name!r} of {str(location)!r}")
  except (tarfile.TarError, OSError, EOFError) as e:
    raise DataError(
      f"{str(location)!r} is not a readable gzip tar archive ({e}); expected {LAYOUT} ({PREPARE})."
    ) from e
  return found


def read_release(location: epath.Path, grayscale: bool = True, size: int = SIDE) -> dict[str, np.ndarray]:
  """`train_inputs`, `train_labels`, `test_inputs`, `test_labels` (uint8) of the python release,
  each split in tfds's stored order (see `tfds_order`)."""
  batches = _read_batches(location)
  train_names = sorted((n for n in batches if n != TEST_BATCH), key=lambda n: int(n.rsplit("_", 1)[1]))
  for missing, what in ((not train_names, "data_batch_N"), (TEST_BATCH not in batches, TEST_BATCH)):
    if missing:
      raise DataError(f"{str(location)!r} holds no {FOLDER}/{what}; expected {LAYOUT} ({PREPARE}).")
  arrays = {}
  for split, names in (("train", train_names), ("test", [TEST_BATCH])):
    parts = [read_batch(*batches[name]) for name in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    order = tfds_order(split, len(labels))
    arrays[f"{split}_inputs"] = tokens(images[order], grayscale, size)
    arrays[f"{split}_labels"] = labels[order]
  logging.info(
    "cifar10: %s has %d training batch(es) %s (%d images) and %d test images",
    location,
    len(train_names),
    train_names,
    len(arrays["train_labels"]),
    len(arrays["test_labels"]),
  )
  return arrays


def load_release(
  location: epath.Path, grayscale: bool = True, size: int = SIDE, cache_dir: str = ""
) -> dict[str, np.ndarray]:
  """`read_release`, built once into the lra_core cache and memory-mapped after."""
  inputs = [location] if location.is_file() else sorted(_batch_files(location).values())
  key = dict(
    kind="cifar10",
    version=_CACHE_VERSION,
    grayscale=bool(grayscale),
    image_size=int(size),
    input=cache.file_fingerprint(inputs),
  )
  start = time.perf_counter()
  arrays = cache.cached_arrays("cifar10", key, lambda: read_release(location, grayscale, size), root=cache_dir)
  logging.info("cifar10: %s ready in %.2f s", location, time.perf_counter() - start)
  return arrays


# ----------------------------------------------------------------------------- sources


def _example(inputs: np.ndarray, label: int) -> dict[str, np.ndarray]:
  return labelled_example(inputs, np.ones(np.shape(inputs), bool), label)


class Images:
  """Images [start, stop) of one cached split; memory maps are reopened after unpickling."""

  info = DataInfo(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, unit=DATASET.unit)

  def __init__(self, inputs: np.ndarray, labels: np.ndarray, start: int, stop: int):
    self.inputs, self.labels, self.start, self.stop = inputs, labels, start, stop

  def __len__(self) -> int:
    return self.stop - self.start

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    i = self.start + check_index(index, len(self), "images")
    return _example(self.inputs[i], self.labels[i])

  def __getstate__(self):
    state = dict(self.__dict__)
    for k in ("inputs", "labels"):
      if getattr(state[k], "filename", None):  # a memory map: pickle its file, not the data
        state[k] = ("npy", str(state[k].filename))
    return state

  def __setstate__(self, state):
    for k in ("inputs", "labels"):
      if isinstance(state[k], tuple):
        state[k] = np.load(state[k][1], mmap_mode="r")
    self.__dict__.update(state)


class TfdsImages:
  """Images of a tfds cifar10 split (slices allowed), converted on access."""

  info = Images.info

  def __init__(self, spec: str, data_dir: str, grayscale: bool, size: int = SIDE):
    self.spec, self.data_dir, self.grayscale, self.size = spec, data_dir, grayscale, size
    self._source = tfds_source.open_split(TFDS_NAME, spec, data_dir)
    self._len = len(self._source)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = check_index(index, len(self), "images")
    if self._source is None:
      self._source = tfds_source.open_split(TFDS_NAME, self.spec, self.data_dir)
    record = self._source[index]
    image, label = np.asarray(record["image"]), int(record["label"])
    if image.shape != (SIDE, SIDE, 3) or image.dtype != np.uint8 or not 0 <= label < NUM_CLASSES:
      raise DataError(
        f"tfds cifar10 {self.spec} example {index} has image {image.dtype}{list(image.shape)} "
        f"and label {label}; expected uint8[32, 32, 3] and 0..9."
      )
    return _example(tokens(image[None], self.grayscale, self.size)[0], label)

  def __getstate__(self):
    return dict(self.__dict__, _source=None)


# ----------------------------------------------------------------------------- config


def seq_len_of(data) -> int:
  """Tokens per image: S*S grayscale pixels (1024 at full size), or 3*S*S RGB values."""
  return data.image_size**2 * (1 if data.grayscale else 3)


def _split_spec(data, split: str) -> str:
  spec = data[f"{split}_split"]
  name, _, _ = files.parse_split(spec)
  if name not in FILE_SPLITS:
    raise ConfigError(
      f"data.{split}_split {spec!r} names split {name!r}; expected train or test "
      "with an optional slice such as train[90%:]."
    )
  return spec


def validate_config(config) -> None:
  """Checks T, splits, source and that the release (or the tfds folder) is there."""
  data = config.data
  size = data.image_size
  if isinstance(size, bool) or not isinstance(size, int) or size < 1 or SIDE % size:
    raise ConfigError(f"data.image_size {size!r} is not a divisor of {SIDE} (32 = full size, as LRA).")
  if config.train.seq_len != seq_len_of(data):
    kind = "grayscale pixels" if data.grayscale else "RGB values"
    raise ConfigError(
      f"train.seq_len {config.train.seq_len} does not match the {seq_len_of(data)} {kind} "
      f"of a {size}x{size} CIFAR-10 image; set train.seq_len={seq_len_of(data)}."
    )
  for split in DATASET.splits:
    _split_spec(data, split)
  files.check_release_or_tfds(data, locate, tfds_name="cifar10", prepare=PREPARE)


def make_source(config, split: str) -> Images | TfdsImages:
  """The images of `split` per `data.<split>_split` (LRA: train[:90%] / train[90%:] / test)."""
  DATASET.check_split(split)
  validate_config(config)
  data = config.data
  spec = _split_spec(data, split)
  if data.source == "tfds":
    source = TfdsImages(spec, data.dir, data.grayscale, data.image_size)
  else:
    arrays = load_release(locate(data.dir), data.grayscale, data.image_size, data.cache_dir)
    name = files.parse_split(spec)[0]
    start, stop = files.slice_range(spec, len(arrays[f"{name}_labels"]))
    source = Images(arrays[f"{name}_inputs"], arrays[f"{name}_labels"], start, stop)
  if not len(source):
    raise DataError(f"data.{split}_split {spec!r} of {data.dir!r} holds no images.")
  key = (data.source, data.dir, split, spec)
  if key not in _LOGGED:
    _LOGGED.add(key)
    logging.info(
      "cifar10 %s: %d images from %s, %dx%d %s (%d tokens)",
      split,
      len(source),
      spec,
      data.image_size,
      data.image_size,
      "grayscale" if data.grayscale else "RGB",
      seq_len_of(data),
    )
  return source


# ----------------------------------------------------------------------------- command line


def describe(source: Images) -> str:
  """Image count, per-class shares and mean token value."""
  labels = np.asarray(source.labels[source.start : source.stop])
  inputs = np.asarray(source.inputs[source.start : source.stop])
  shares = np.bincount(labels, minlength=NUM_CLASSES) / len(labels)
  return f"{len(source)} images; mean token {inputs.mean():.2f}; classes " + " ".join(
    f"{i}:{p:.3f}" for i, p in enumerate(shares)
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.doc_parser("python -m lra_core.data.datasets.lra.cifar10", __doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  stats = commands.add_parser("stats", help="print size, classes and mean pixel of the LRA splits")
  stats.add_argument("--dir", required=True, help=f"folder with {ARCHIVE} or {FOLDER}/")
  stats.add_argument("--rgb", action="store_true", help="3072 RGB tokens instead of 1024 grayscale")
  stats.add_argument("--cache_dir", default="")
  args = parser.parse_args(argv)
  try:
    data = data_config(dir=args.dir, grayscale=not args.rgb, cache_dir=args.cache_dir)
    arrays = load_release(locate(args.dir), data.grayscale, data.image_size, data.cache_dir)
    for split in DATASET.splits:
      spec = data[f"{split}_split"]
      name = files.parse_split(spec)[0]
      start, stop = files.slice_range(spec, len(arrays[f"{name}_labels"]))
      print(f"{split} ({spec}): {describe(Images(arrays[f'{name}_inputs'], arrays[f'{name}_labels'], start, stop))}")
  except (ConfigError, DataError) as e:
    sys.exit(f"error: {e}")


codec = None  # images: no text encoding to sample with


if __name__ == "__main__":
  main()
