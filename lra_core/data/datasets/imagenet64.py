"""Downsampled ImageNet 64x64 (Chrabaszcz et al. 2017) as pixel sequences.

Two ways in, picked by `data.source`:

  npz   the `Imagenet64_*_npz` release unzipped into `data.dir` (a local folder or a gs:// one):
          train       <dir>/train_data_batch_<N>.npz (all of them, N in numeric order)
          validation  <dir>/val_data.npz
          test        <dir>/val_data.npz as well: the test labels were never published and
                      papers (Transformer-VQ, FIT) report on the validation set.
        Each file holds `data` uint8[N, 12288], a row being channel-planar R(4096) G(4096)
        B(4096) with each channel a 64x64 image in row-major order, and `labels` int[N],
        1-based (1..1000, the devkit's map_clsloc numbering). A file is decoded once into
        raster-order uint8[N, 12288] (see `cache.cached_arrays`) and memory-mapped afterwards.
  tfds  tfds `imagenet_resized/64x64` (version 0.1.0, built by tfds 4.x) prepared in array_record
        format under `data.dir` (empty: ~/tensorflow_datasets): `image` uint8[64,64,3] and
        0-based `label`; train = "train", validation = test = "validation".

An image becomes T = 3*S*S tokens, the intensities 0..255, flattened HWC: pixels in raster
order, R,G,B per pixel (the layout Transformer-VQ trains on). `data.image_size` S < 64 (a
divisor of 64) box-averages the image first (mean of each (64/S)x(64/S) block, rounded half
up): S=8 gives 192 tokens, for tiny configs and quick runs; it is not a published setting.
`data.flip=True` adds left-right mirror images to the train split (validation and test stay
as they are): train example i < N is image i, example N + i is image i flipped, so the split
doubles, every epoch of the shuffled stream holds each image once as it is and once mirrored,
and which flip an example gets is a function of its index (a resumed run reads the same
batches). pix2seq flips ImageNet training images at random with probability 1/2.
`data.order="patches"` regroups the tokens into p x p patches (p = `data.patch_size`), patches
in raster order, pixels within a patch in raster order, R,G,B per pixel, so each group of
p*p*3 contiguous tokens is one patch (FIT's ImageNet64 AR layout: 8x8 patches, 192 tokens per
group); see `patchify` / `unpatchify`.

Example fields by `task`:

  image_ar  inputs int32[T] = [START] + targets[:-1], START = 256 (vocabulary 257)
            targets int32[T] (0..255), weights float32[T] (ones); bits per dim reported
  classify  inputs int32[T] (0..255), mask bool[T] (all True), targets int32[] (label - 1,
            0..999), weights float32[]
  diffusion the classify fields; inputs are the raster pixels of the image to denoise (order
            "raster": the denoiser cuts its own patches) and targets its class
"""

from __future__ import annotations

import logging
import os
import re

import ml_collections
import numpy as np
from etils import epath

from lra_core import task_kinds
from lra_core.data import DataInfo, cache, check_index, config_section, files, labelled_example, tfds_source
from lra_core.data.images import downsample, flip_left_right, planar_to_hwc
from lra_core.dataset_record import Dataset
from lra_core.errors import ConfigError, DataError

# One target is one colour value of one pixel: image_ar reports bits per dim, as the papers do.
DATASET = Dataset(name="imagenet64", unit="dim", tasks=("image_ar", "classify", "diffusion"))

SIZE = 64  # height and width of the release's images
CHANNELS = 3
ROW_LEN = CHANNELS * SIZE * SIZE  # 12288 bytes per image
NUM_CLASSES = 1000
START = 256  # image_ar: the token before the first pixel
SOURCES = ("npz", "tfds")
ORDERS = ("raster", "patches")
TFDS_NAME = "imagenet_resized/64x64"
TFDS_SPLITS = {"train": "train", "validation": "validation", "test": "validation"}
TRAIN_GLOB = "train_data_batch_*.npz"
VAL_FILE = "val_data.npz"
_TRAIN_FILE = re.compile(r"^train_data_batch_(\d+)\.npz$")
_CACHE_VERSION = 1  # bump when the cached arrays change meaning
PREPARE = (
  "download Imagenet64_train_part1_npz.zip, Imagenet64_train_part2_npz.zip and "
  "Imagenet64_val_npz.zip (Downsampled ImageNet 64x64, https://image-net.org/download-images) "
  "and unzip them into that folder"
)

_DEFAULTS = dict(
  name=DATASET.name,
  source="npz",  # npz | tfds
  dir="",  # npz: the folder of the .npz files; tfds: its data_dir ("" -> default)
  image_size=64,  # S: box-average down to S x S (a divisor of 64) -> 3*S*S tokens
  order="raster",  # raster | patches (p x p patch groups of p*p*3 tokens)
  patch_size=8,  # p, for order "patches"
  cache_dir="",  # decoded npz arrays; "" -> $LRA_CORE_CACHE or ~/.cache/lra_core
  flip=False,  # train split: add the left-right mirror of every image (2N examples)
)

# Layouts already logged, so opening the three splits logs once.
_LOGGED: set[tuple] = set()


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Returns the `data` config section, with `overrides` applied to its known fields."""
  return config_section(_DEFAULTS, overrides)


def layout(folder: str = "<dir>") -> str:
  return f"{folder}/train_data_batch_<N>.npz and {folder}/val_data.npz, the Imagenet64_*_npz release"


# ------------------------------------------------------------------------------- Pixel math


def num_tokens(image_size: int, channels: int = CHANNELS) -> int:
  return channels * image_size * image_size


def planar_to_raster(rows: np.ndarray, size: int = SIZE) -> np.ndarray:
  """[N, C*H*W] channel-planar rows (the npz layout) -> [N, H*W*C] raster order, R,G,B per pixel."""
  n = rows.shape[0]
  return planar_to_hwc(rows, size).reshape(n, -1)


def _check_patch_shape(length: int, image_size: int, patch_size: int, channels: int) -> None:
  if length != num_tokens(image_size, channels):
    raise DataError(
      f"sequence length {length} is not image_size**2 * channels = "
      f"{image_size}**2 * {channels} = {num_tokens(image_size, channels)}."
    )
  if patch_size < 1 or image_size % patch_size:
    raise ConfigError(f"patch_size {patch_size} does not divide image_size {image_size}.")


def patchify(pixels: np.ndarray, image_size: int, patch_size: int, channels: int = CHANNELS) -> np.ndarray:
  """[..., H*W*C] raster order -> [..., H*W*C] grouped by p x p patches.

  Patches come in raster order; inside a patch, pixels in raster order with C values each, so
  group g is [..., g*p*p*C:(g+1)*p*p*C].
  """
  pixels = np.asarray(pixels)
  _check_patch_shape(pixels.shape[-1], image_size, patch_size, channels)
  lead, g, p = pixels.shape[:-1], image_size // patch_size, patch_size
  x = pixels.reshape(*lead, g, p, g, p, channels)
  k = len(lead)
  x = x.transpose(*range(k), k, k + 2, k + 1, k + 3, k + 4)  # [..., gh, gw, ph, pw, C]
  return x.reshape(*lead, -1)


def unpatchify(groups: np.ndarray, image_size: int, patch_size: int, channels: int = CHANNELS) -> np.ndarray:
  """Inverse of `patchify`: [..., H*W*C] grouped by patches -> raster order."""
  groups = np.asarray(groups)
  _check_patch_shape(groups.shape[-1], image_size, patch_size, channels)
  lead, g, p = groups.shape[:-1], image_size // patch_size, patch_size
  x = groups.reshape(*lead, g, g, p, p, channels)
  k = len(lead)
  x = x.transpose(*range(k), k, k + 2, k + 1, k + 3, k + 4)  # [..., gh, ph, gw, pw, C]
  return x.reshape(*lead, -1)


def to_tokens(images: np.ndarray, order: str = "raster", patch_size: int = 8) -> np.ndarray:
  """uint8 [..., S, S, C] images -> [..., S*S*C] tokens in `order` (same dtype)."""
  images = np.asarray(images)
  *lead, s, _, c = images.shape
  flat = images.reshape(*lead, -1)
  return patchify(flat, s, patch_size, c) if order == "patches" else flat


def to_image(
  tokens, image_size: int = SIZE, order: str = "raster", patch_size: int = 8, channels: int = CHANNELS
) -> np.ndarray:
  """Tokens [..., T] (targets or sampled pixels, 0..255) -> uint8 [..., S, S, C] images."""
  if order not in ORDERS:
    raise ConfigError(f"order {order!r} is not one of {ORDERS}.")
  tokens = np.asarray(tokens)
  if tokens.size and (tokens.min() < 0 or tokens.max() > 255):
    bad = tokens[(tokens < 0) | (tokens > 255)].reshape(-1)[0]
    raise DataError(f"token {int(bad)} is not a pixel intensity in [0, 255].")
  if order == "patches":
    tokens = unpatchify(tokens, image_size, patch_size, channels)
  elif tokens.shape[-1] != num_tokens(image_size, channels):
    raise DataError(
      f"sequence length {tokens.shape[-1]} is not image_size**2 * channels = {num_tokens(image_size, channels)}."
    )
  return tokens.astype(np.uint8).reshape(*tokens.shape[:-1], image_size, image_size, channels)


# ------------------------------------------------------------------------------- Files


def npz_files(data_dir: str) -> dict[str, list[str]]:
  """{"train": [train_data_batch_1.npz, ...] in numeric order, "validation"/"test": [val_data.npz]}."""
  named = str(files.expand(data_dir)) if data_dir else "<dir>"
  folder = files.require_dir(data_dir, layout=layout(named), prepare=PREPARE)
  where = layout(str(folder))
  found = files.require_files(folder, TRAIN_GLOB, layout=where, prepare=PREPARE)
  numbered = []
  for path in found:
    m = _TRAIN_FILE.match(path.name)
    if not m:
      raise DataError(f"{str(path)!r} is not named train_data_batch_<N>.npz with a number N; expected {where}.")
    numbered.append((int(m[1]), str(path)))
  val = files.require_file(folder / VAL_FILE, layout=where, prepare=PREPARE)
  train = [p for _, p in sorted(numbered)]
  return {"train": train, "validation": [str(val)], "test": [str(val)]}


def read_npz(path: str) -> dict[str, np.ndarray]:
  """Decodes one release file: {"pixels": uint8[N, 12288] raster HWC, "labels": int16[N] 0-based}."""
  logging.info("imagenet64: decoding %s into the cache (once per file version)", path)
  folder = os.path.dirname(files.absolute(path))
  where = f"expected {layout(folder)} with `data` uint8[N, {ROW_LEN}] and `labels` 1..{NUM_CLASSES}"
  try:
    # Through a file object, so an object in a bucket reads like a local file.
    with epath.Path(path).open("rb") as f, np.load(f, allow_pickle=False) as npz:
      missing = [k for k in ("data", "labels") if k not in npz.files]
      if missing:
        raise DataError(
          f"{path!r} has no {' or '.join(repr(k) for k in missing)} array "
          f"(it holds {sorted(npz.files)}); {where} ({PREPARE})."
        )
      data, labels = npz["data"], np.asarray(npz["labels"]).reshape(-1)
  except DataError:
    raise
  except (OSError, ValueError, EOFError) as e:  # not a zip, truncated, or pickled objects
    raise DataError(f"{path!r} is not a readable npz file ({e}); {where} ({PREPARE}).") from e
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != ROW_LEN:
    raise DataError(
      f"{path!r} has `data` {data.dtype}{list(data.shape)}; expected uint8[N, {ROW_LEN}] channel-planar 64x64 RGB rows."
    )
  if labels.shape[0] != data.shape[0] or not np.issubdtype(labels.dtype, np.integer):
    raise DataError(
      f"{path!r} has `labels` {labels.dtype}{list(labels.shape)} for {data.shape[0]} "
      f"images; expected one integer label per row."
    )
  if labels.size and (labels.min() < 1 or labels.max() > NUM_CLASSES):
    raise DataError(
      f"{path!r} has labels in [{labels.min()}, {labels.max()}]; expected 1-based labels 1..{NUM_CLASSES}."
    )
  pixels = np.empty_like(data)
  for start in range(0, data.shape[0], 8192):  # chunks: no second full-size temporary
    pixels[start : start + 8192] = planar_to_raster(data[start : start + 8192])
  return {"pixels": pixels, "labels": (labels - 1).astype(np.int16)}


def cached_npz(path: str, cache_dir: str = "") -> dict[str, np.ndarray]:
  """`read_npz(path)`, decoded once and memory-mapped from the cache afterwards."""
  key = {"format": _CACHE_VERSION, "file": cache.file_fingerprint([path])}
  return cache.cached_arrays("imagenet64", key, lambda: read_npz(path), root=cache_dir)


class NpzImages:
  """Random access to the images of some release files, through their decoded cache entries.

  Pickling keeps only the paths: a worker process memory-maps the cache itself.
  """

  def __init__(self, paths: list[str], cache_dir: str = ""):
    self.paths, self.cache_dir = list(paths), cache_dir
    self._parts: list[dict[str, np.ndarray]] | None = None
    self._ends = np.cumsum([len(p["labels"]) for p in self.parts])

  @property
  def parts(self) -> list[dict[str, np.ndarray]]:
    if self._parts is None:
      self._parts = [cached_npz(p, self.cache_dir) for p in self.paths]
    return self._parts

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
    """-> (uint8[64, 64, 3], 0-based label)."""
    k = int(np.searchsorted(self._ends, index, side="right"))
    row = index - (int(self._ends[k - 1]) if k else 0)
    part = self.parts[k]
    return np.asarray(part["pixels"][row]).reshape(SIZE, SIZE, CHANNELS), int(part["labels"][row])

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_parts"] = None
    return state


class TfdsImages:
  """Random access to tfds `imagenet_resized/64x64`; pickling keeps only the name and split."""

  def __init__(self, split: str, data_dir: str):
    self.split, self.data_dir = split, data_dir
    self._source = None
    self._len = len(self.source)

  @property
  def source(self):
    if self._source is None:
      self._source = tfds_source.open_split(TFDS_NAME, self.split, self.data_dir)
    return self._source

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
    record = self.source[int(index)]
    image = np.asarray(record["image"])
    if image.shape != (SIZE, SIZE, CHANNELS) or image.dtype != np.uint8:
      raise DataError(
        f"tfds {TFDS_NAME} {self.split} record {index} has image {image.dtype}"
        f"{list(image.shape)}; expected uint8[64, 64, 3]."
      )
    return image, int(record["label"])

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_source"] = None
    return state


# ------------------------------------------------------------------------------- Source


class PixelSequences:
  """Images (from `NpzImages` or `TfdsImages`) as fixed-length token examples for `task`; with
  `flip`, examples N..2N-1 are the left-right mirrors of images 0..N-1."""

  def __init__(self, images, *, task: str, image_size: int, order: str, patch_size: int, flip: bool = False):
    self.images, self.task, self.flip = images, task, flip
    self.image_size, self.order, self.patch_size = image_size, order, patch_size
    self.seq_len = num_tokens(image_size)
    self.labelled = task_kinds.kind(task).labelled  # whole images with their class, else pixels to predict
    self.info = (
      DataInfo(vocab_size=256, num_classes=NUM_CLASSES, unit=DATASET.unit)
      if self.labelled
      else DataInfo(vocab_size=START + 1, unit=DATASET.unit)
    )

  def __len__(self) -> int:
    return len(self.images) * (2 if self.flip else 1)

  def tokens(self, index: int) -> tuple[np.ndarray, int]:
    """(int32[T] pixel tokens in the configured order, 0-based label) of example `index`."""
    mirrored, index = divmod(check_index(index, len(self), "images"), len(self.images))
    image, label = self.images[index]
    image = downsample(image, self.image_size)
    if mirrored:
      image = flip_left_right(image)
    return to_tokens(image, self.order, self.patch_size).astype(np.int32), label

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    tokens, label = self.tokens(index)
    if self.labelled:
      return labelled_example(tokens, np.ones(self.seq_len, bool), label)
    return {
      "inputs": np.concatenate([np.full(1, START, np.int32), tokens[:-1]]),
      "targets": tokens,
      "weights": np.ones(self.seq_len, np.float32),
    }


def _check_settings(config) -> None:
  d = config.data
  if d.source not in SOURCES:
    raise ConfigError(f"data.source {d.source!r} is not one of {SOURCES}.")
  if d.order not in ORDERS:
    raise ConfigError(f"data.order {d.order!r} is not one of {ORDERS}.")
  if config.task == "diffusion" and d.order != "raster":
    raise ConfigError(
      f"task 'diffusion' reads images in data.order 'raster', not {d.order!r} (the denoiser makes its own patches)."
    )
  size = d.image_size
  if not isinstance(size, int) or size < 1 or SIZE % size:
    raise ConfigError(f"data.image_size {size!r} is not a divisor of {SIZE} (e.g. 8, 16, 32, 64).")
  if d.order == "patches" and (not isinstance(d.patch_size, int) or d.patch_size < 1 or size % d.patch_size):
    raise ConfigError(f"data.patch_size {d.patch_size!r} does not divide data.image_size {size}.")
  if config.train.seq_len != num_tokens(size):
    raise ConfigError(
      f"train.seq_len {config.train.seq_len} is not the {num_tokens(size)} tokens of a "
      f"{size}x{size} RGB image (3 * data.image_size**2); set train.seq_len="
      f"{num_tokens(size)}."
    )


def validate_config(config) -> None:
  """Checks sizes, order and that the files (or the prepared tfds dataset) are there."""
  _check_settings(config)
  if config.data.source == "npz":
    npz_files(config.data.dir)
  else:
    TfdsImages("validation", config.data.dir)


def make_source(config, split: str) -> PixelSequences:
  """The `split` images as token sequences of `3 * data.image_size**2` tokens."""
  DATASET.check_split(split)
  _check_settings(config)
  d = config.data
  if d.source == "npz":
    paths = npz_files(d.dir)[split]
    images = NpzImages(paths, d.cache_dir)
    where = ", ".join(p.rsplit("/", 1)[-1] for p in paths)
  else:
    images = TfdsImages(TFDS_SPLITS[split], d.dir)
    where = f"tfds {TFDS_NAME} {TFDS_SPLITS[split]}"
  flip = bool(d.get("flip", False)) and split == "train"
  key = (d.source, d.dir, split, flip)
  if key not in _LOGGED:
    _LOGGED.add(key)
    note = " (the validation images: ImageNet64 has no public test labels)" if split == "test" else ""
    note += " and their left-right mirrors (data.flip)" if flip else ""
    logging.info(
      "imagenet64 %s: %d images from %s%s; %d tokens each (%dx%d, %s order)",
      split,
      len(images),
      where,
      note,
      num_tokens(d.image_size),
      d.image_size,
      d.image_size,
      d.order,
    )
  return PixelSequences(
    images,
    task=config.task,
    image_size=d.image_size,
    order=d.order,
    patch_size=d.patch_size,
    flip=flip,
  )


codec = None  # images: no text encoding to sample with
