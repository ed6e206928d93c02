"""ImageNet64 loader: release npz decoding, splits, orders, downsampling, tfds path, errors."""

import io
import os
import pickle

import einops
import numpy as np
import pytest

import lra_core
from fixtures import imagenet64 as fx
from lra_core.data.datasets import imagenet64
from lra_core.errors import ConfigError, DataError

TINY = fx.SPEC
DIFFUSION = "configs/imagenet64/fit_denoiser.py:tiny"
FULL = ["data.image_size=64", "train.seq_len=12288"]


def _config(root, *extra, spec=TINY):
  return lra_core.load_config(spec, fx.build(root) + list(extra))


def _fixture_images():
  """What the fixture wrote, per split, as HWC images and 0-based labels."""
  train = np.concatenate([fx.images(8, 0), fx.images(4, 8)])
  train_labels = np.array([1, 1000, 5, 17, 230, 999, 64, 2, 3, 4, 5, 6]) - 1
  val = fx.images(8, 100)
  val_labels = np.arange(10, 90, 10) - 1
  return {"train": (train, train_labels), "validation": (val, val_labels), "test": (val, val_labels)}


def _oracle_downsample(images, size):
  """Box average by float mean, rounded half up."""
  f = images.shape[1] // size
  mean = images.reshape(len(images), size, f, size, f, 3).astype(np.float64).mean(axis=(2, 4))
  return np.floor(mean + 0.5).astype(np.uint8)


def test_full_size_examples_are_raster_hwc_pixels_after_start(tmp_path):
  config = _config(tmp_path, *FULL)
  expected = _fixture_images()
  for split in ("train", "validation", "test"):
    src = lra_core.data.make_source(config, split)
    images, _ = expected[split]
    assert len(src) == len(images)
    assert src.info.vocab_size == 257 and src.info.unit == "dim"
    for k in (0, len(src) - 1):
      ex = src[k]
      assert {n: (v.dtype, v.shape) for n, v in ex.items()} == {
        "inputs": (np.int32, (12288,)),
        "targets": (np.int32, (12288,)),
        "weights": (np.float32, (12288,)),
      }
      # Independent of the loader's transpose: the planar row's pixel (y, x) has R at y*64+x,
      # G at 4096+y*64+x, B at 8192+y*64+x, and token 3*(y*64+x)+c must be that value.
      row = fx.planar_rows(images[k : k + 1])[0]
      pix = np.arange(4096)
      oracle = np.stack([row[pix], row[4096 + pix], row[8192 + pix]], axis=1).reshape(-1)
      np.testing.assert_array_equal(ex["targets"], oracle)
      assert ex["inputs"][0] == imagenet64.START
      np.testing.assert_array_equal(ex["inputs"][1:], ex["targets"][:-1])
      assert ex["weights"].min() == 1.0


def test_train_files_are_read_in_numeric_order(tmp_path):
  for n, offset in ((1, 0), (2, 10), (10, 20)):
    fx.write_npz(tmp_path / f"train_data_batch_{n}.npz", fx.images(1, offset), [n])
  fx.write_npz(tmp_path / "val_data.npz", fx.images(1, 50), [7])
  paths = imagenet64.npz_files(str(tmp_path))
  assert [os.path.basename(p) for p in paths["train"]] == [f"train_data_batch_{n}.npz" for n in (1, 2, 10)]
  assert paths["validation"] == paths["test"] == [str(tmp_path / "val_data.npz")]
  images = imagenet64.NpzImages(paths["train"], str(tmp_path / "cache"))
  assert [images[i][1] for i in range(3)] == [0, 1, 9]  # labels 1, 2, 10, 0-based


def test_tiny_downsamples_by_box_average(tmp_path):
  config = _config(tmp_path)
  assert config.train.seq_len == 192 and config.data.image_size == 8
  images, _ = _fixture_images()["validation"]
  small = _oracle_downsample(images, 8)
  src = lra_core.data.make_source(config, "validation")
  got = np.stack([src[k]["targets"] for k in range(len(src))])
  np.testing.assert_array_equal(got, small.reshape(len(small), -1))
  np.testing.assert_array_equal(imagenet64.to_image(got, 8), small)


def test_flip_adds_mirror_images_to_the_train_split_only(tmp_path):
  config = _config(tmp_path, "data.flip=True", spec=DIFFUSION)
  train = lra_core.data.make_source(config, "train")
  images, labels = _fixture_images()["train"]
  small = _oracle_downsample(images, 8)
  n = len(small)
  assert len(train) == 2 * n
  for k in (0, 5, n - 1):
    assert train[k]["targets"] == labels[k] == train[n + k]["targets"]
    np.testing.assert_array_equal(train[k]["inputs"], small[k].reshape(-1))
    np.testing.assert_array_equal(train[n + k]["inputs"], small[k][:, ::-1].reshape(-1))  # columns reversed
    np.testing.assert_array_equal(train[n + k]["inputs"], train[n + k]["inputs"])  # a function of the index
  for split in ("validation", "test"):
    assert len(lra_core.data.make_source(config, split)) == 8
  plain = lra_core.data.make_source(_config(tmp_path, "data.flip=False", spec=DIFFUSION), "train")
  assert len(plain) == n


@pytest.mark.parametrize(
  "shape,size,patch,channels", [((), 8, 4, 3), ((5,), 64, 8, 3), ((2, 3), 16, 2, 1), ((4,), 8, 8, 3), ((1,), 6, 3, 2)]
)
def test_patchify_matches_einops_and_inverts(shape, size, patch, channels):
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, shape + (size * size * channels,))
  g = size // patch
  oracle = einops.rearrange(x, "... (gh ph gw pw c) -> ... (gh gw ph pw c)", gh=g, ph=patch, gw=g, pw=patch)
  got = imagenet64.patchify(x, size, patch, channels)
  np.testing.assert_array_equal(got, oracle)
  np.testing.assert_array_equal(imagenet64.unpatchify(got, size, patch, channels), x)


def test_patch_order_groups_patches(tmp_path):
  config = _config(tmp_path, "data.order=patches", "data.patch_size=4")
  images, _ = _fixture_images()["train"]
  small = _oracle_downsample(images, 8)
  src = lra_core.data.make_source(config, "train")
  ex = src[3]
  # Group 1 is the top-right 4x4 patch: rows 0..3, columns 4..7, 48 tokens.
  np.testing.assert_array_equal(ex["targets"][48:96], small[3, 0:4, 4:8].reshape(-1))
  np.testing.assert_array_equal(imagenet64.to_image(ex["targets"], 8, "patches", 4), small[3])
  assert ex["inputs"][0] == imagenet64.START and (ex["inputs"][1:] == ex["targets"][:-1]).all()


def test_classify_task_gives_zero_based_labels(tmp_path):
  config = _config(tmp_path, "task=classify", "model.num_classes=1000")
  expected = _fixture_images()
  for split in ("train", "validation"):
    src = lra_core.data.make_source(config, split)
    assert src.info.num_classes == 1000
    labels = [int(src[k]["targets"]) for k in range(len(src))]
    assert labels == list(expected[split][1])
    ex = src[0]
    assert ex["inputs"].shape == (192,) and ex["mask"].dtype == bool and ex["mask"].all()
    assert ex["targets"].dtype == np.int32 and ex["weights"].shape == ()
    assert 0 <= ex["inputs"].min() and ex["inputs"].max() <= 255


def test_decoded_files_are_cached_and_memory_mapped(tmp_path, monkeypatch):
  config = _config(tmp_path)
  first = lra_core.data.make_source(config, "validation")[5]
  assert len(list((tmp_path / "cache").glob("imagenet64-*/pixels.npy"))) == 1

  def no_decoding(path):
    raise AssertionError(f"{path} was decoded again")

  monkeypatch.setattr(imagenet64, "read_npz", no_decoding)
  src = lra_core.data.make_source(config, "validation")
  assert isinstance(src.images.parts[0]["pixels"], np.memmap)
  np.testing.assert_array_equal(src[5]["targets"], first["targets"])
  # Pickling keeps paths only; the copy maps the cache again.
  blob = pickle.dumps(src)
  assert len(blob) < 4000
  np.testing.assert_array_equal(pickle.loads(blob)[5]["targets"], first["targets"])
  # A rewritten file is a new cache entry.
  monkeypatch.undo()
  fx.write_npz(tmp_path / "val_data.npz", fx.images(9, 200), [1] * 9)
  assert len(lra_core.data.make_source(config, "validation")) == 9


def _build_tfds(root, num_train=10, num_val=8):
  """tfds `imagenet_resized/64x64` with the real builder's name, versions and features."""
  import tensorflow_datasets as tfds
  from PIL import Image

  def png(image):
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()  # encoded here: tfds would need TensorFlow to encode arrays

  class ImagenetResized(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("0.1.1")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="64x64", version=tfds.core.Version("0.1.0"))]

    def _info(self):
      names = tfds.core.tfds_path("image_classification/imagenet_resized_labels.txt")
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {"image": tfds.features.Image(shape=(64, 64, 3)), "label": tfds.features.ClassLabel(names_file=names)}
        ),
        supervised_keys=("image", "label"),
      )

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(num_train, 0), "validation": self._generate_examples(num_val, 100)}

    def _generate_examples(self, count, offset):
      for k, image in enumerate(fx.images(count, offset)):
        yield k, {"image": png(image), "label": (offset + 3 * k) % 1000}

  ImagenetResized(config="64x64", data_dir=str(root), file_format="array_record").download_and_prepare()


def test_tfds_source_reads_imagenet_resized(tmp_path):
  _build_tfds(tmp_path / "tfds")
  config = lra_core.load_config(TINY, [f"data.dir={tmp_path / 'tfds'}", "data.source=tfds", *FULL])
  imagenet64.validate_config(config)
  train = lra_core.data.make_source(config, "train")
  test = lra_core.data.make_source(config, "test")
  assert (len(train), len(test)) == (10, 8)
  # tfds orders records by a hash of their keys: match them by content.
  by_content = {fx.images(1, 100 + k)[0].tobytes(): k for k in range(8)}
  seen = set()
  for i in range(len(test)):
    tokens, label = test.tokens(i)
    k = by_content[tokens.astype(np.uint8).tobytes()]
    assert label == (100 + 3 * k) % 1000
    seen.add(k)
  assert seen == set(range(8))
  assert pickle.loads(pickle.dumps(train))[0]["targets"].shape == (12288,)


@pytest.mark.parametrize(
  "overrides,error,message",
  [
    (["train.seq_len=100"], ConfigError, "train.seq_len 100 is not the 192 tokens of a 8x8 RGB image"),
    (["data.image_size=24", "train.seq_len=1728"], ConfigError, "data.image_size 24 is not a divisor of 64"),
    (["data.order=patches", "data.patch_size=3"], ConfigError, "data.patch_size 3 does not divide"),
    (["data.order=zigzag"], ConfigError, "data.order 'zigzag' is not one of"),
    (["task=lm"], ConfigError, "task 'lm' cannot use the imagenet64 dataset"),
    (
      ["data.dir="],
      ConfigError,
      "data.dir is empty; expected a folder with <dir>/train_data_batch_<N>.npz and "
      "<dir>/val_data.npz, the Imagenet64_*_npz release",
    ),
  ],
)
def test_config_errors(tmp_path, overrides, error, message):
  config = _config(tmp_path, *overrides)
  with pytest.raises(error) as info:
    lra_core.data.validate_config(config)  # the dataset's record checks the task, its module the rest
  assert message in str(info.value)


def _error(tmp_path) -> str:
  config = lra_core.load_config(TINY, [f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}"])
  with pytest.raises(DataError) as info:
    imagenet64.validate_config(config)
    lra_core.data.make_source(config, "train")
    lra_core.data.make_source(config, "validation")
  return str(info.value)


def test_missing_files_name_the_release_layout(tmp_path):
  layout = f"{tmp_path}/train_data_batch_<N>.npz and {tmp_path}/val_data.npz, the Imagenet64_*_npz release"
  msg = _error(tmp_path)
  assert "train_data_batch_*.npz" in msg and layout in msg and "Imagenet64_val_npz.zip" in msg
  fx.write_npz(tmp_path / "train_data_batch_1.npz", fx.images(2), [1, 2])
  msg = _error(tmp_path)
  assert f"{tmp_path / 'val_data.npz'}' does not exist" in msg and layout in msg
  msg = _error(tmp_path / "nowhere")
  assert f"is not a folder; expected {tmp_path}/nowhere/train_data_batch_<N>.npz" in msg


@pytest.mark.parametrize(
  "write,message",
  [
    (lambda p: np.savez(p, data=fx.planar_rows(fx.images(2))), "has no 'labels' array"),
    (lambda p: np.savez(p, labels=np.array([1, 2])), "has no 'data' array"),
    (
      lambda p: np.savez(p, data=np.zeros((2, 3072), np.uint8), labels=np.array([1, 2])),
      "has `data` uint8[2, 3072]; expected uint8[N, 12288]",
    ),
    (
      lambda p: np.savez(p, data=fx.planar_rows(fx.images(2)), labels=np.array([0, 1])),
      "has labels in [0, 1]; expected 1-based labels 1..1000",
    ),
    (lambda p: np.savez(p, data=fx.planar_rows(fx.images(2)), labels=np.array([1, 1001])), "has labels in [1, 1001]"),
    (
      lambda p: np.savez(p, data=fx.planar_rows(fx.images(2)), labels=np.array([1])),
      "has `labels` int64[1] for 2 images",
    ),
    (lambda p: p.write_bytes(b"not a zip"), "is not a readable npz file"),
  ],
)
def test_malformed_files_are_named(tmp_path, write, message):
  fx.write_npz(tmp_path / "val_data.npz", fx.images(2), [1, 2])
  bad = tmp_path / "train_data_batch_1.npz"
  write(bad)
  msg = _error(tmp_path)
  assert repr(str(bad)) in msg and message in msg


def test_to_image_checks_values_and_length():
  with pytest.raises(DataError, match="token 256 is not a pixel intensity"):
    imagenet64.to_image(np.full(192, 256), 8)
  with pytest.raises(DataError, match="sequence length 100 is not"):
    imagenet64.to_image(np.zeros(100, np.int32), 8)
