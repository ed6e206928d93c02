"""LRA Text (IMDB) and Image (CIFAR-10) sources on releases written in their real formats.

Oracles: the reviews and pixels the fixtures wrote, decoded here independently (plain pickle,
numpy reshapes, tfds's own md5 ordering); TensorFlow's rgb_to_grayscale values recorded on the
RGB triples where the float32 evaluation order matters; and tfds array_record datasets built by
tfds itself from the same data, which both loaders must reproduce.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import tarfile

import ml_collections
import numpy as np
import pytest

from fixtures import cifar10 as cifar_fixture
from fixtures import imdb as imdb_fixture
from lra_core import data as data_lib
from lra_core.data.datasets.lra import cifar10, imdb
from lra_core.errors import ConfigError, DataError


def _config(data, seq_len: int) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(dict(task="classify", data=data, train=dict(seq_len=seq_len)))
  config.lock()
  return config


def _all(source) -> list[dict[str, np.ndarray]]:
  return [source[i] for i in range(len(source))]


def _same(a: list[dict], b: list[dict]) -> bool:
  return len(a) == len(b) and all(
    x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
  )


# ---------------------------------------------------------------- IMDB


@pytest.fixture
def imdb_release(tmp_path):
  data = imdb_fixture.reviews()
  imdb_fixture.write_archive(tmp_path / imdb.ARCHIVE, data)
  return tmp_path, data


def _imdb_config(folder, seq_len=40, **overrides):
  overrides.setdefault("cache_dir", str(folder / "cache"))
  return _config(imdb.data_config(dir=str(folder), **overrides), seq_len)


def _expected_reviews(data, split, seq_len):
  rows = sorted(
    (label, i, text)
    for (s, name), reviews in data.items()
    if s == split
    for label, i, text in [(("neg", "pos").index(name), i, t) for i, _, t in reviews]
  )
  out = []
  for label, _, text in rows:
    raw = np.frombuffer(text.strip()[:seq_len], np.uint8).astype(np.int32) + 1
    inputs = np.pad(raw, (0, seq_len - raw.size))
    out.append(dict(inputs=inputs, mask=inputs > 0, targets=np.int32(label), weights=np.float32(1)))
  return out


def test_imdb_archive_reviews_bytes_labels_and_lra_splits(imdb_release):
  folder, data = imdb_release
  config = _imdb_config(folder, seq_len=40)
  imdb.validate_config(config)
  train = imdb.make_source(config, "train")
  assert len(train) == 12 and train.info.vocab_size == 257 and train.info.num_classes == 2
  assert _same(_all(train), _expected_reviews(data, "train", 40))
  # IMDB has no validation split: LRA validates on the test reviews.
  expected_test = _expected_reviews(data, "test", 40)
  assert _same(_all(imdb.make_source(config, "validation")), expected_test)
  assert _same(_all(imdb.make_source(config, "test")), expected_test)
  ex = train[-1]
  assert ex["inputs"].dtype == np.int32 and ex["mask"].dtype == bool and ex["targets"].shape == ()
  assert ex["weights"].dtype == np.float32 and 0 <= ex["inputs"].min() and ex["inputs"].max() <= 256
  # The expected order is (label, numeric id): review 9 before review 10 in each folder.
  assert list(np.asarray(train.labels)) == [0] * 6 + [1] * 6


def test_imdb_whitespace_stripped_and_truncation(imdb_release):
  folder, data = imdb_release
  source = imdb.make_source(_imdb_config(folder, seq_len=4000), "train")
  texts = [imdb.decode(source[i]["inputs"]) for i in range(len(source))]
  stripped = data["train", "pos"][0][2].strip().decode("utf-8")
  assert stripped in texts and not any(t != t.strip() for t in texts)
  assert all(source[i]["mask"].sum() == len(texts[i].encode("utf-8")) for i in range(len(source)))
  cut = imdb.make_source(_imdb_config(folder, seq_len=7), "train")
  assert all(cut[i]["mask"].all() for i in range(len(cut)))  # every review is longer than 7 bytes


def test_imdb_encode_decode():
  text = "Zürich, 日本語 <br />"
  ids = imdb.encode(text)
  assert ids.dtype == np.int32 and list(ids) == [b + 1 for b in text.encode("utf-8")]
  assert imdb.decode(np.pad(ids, (0, 5))) == text
  assert imdb.decode(ids[:2]) == "Z\ufffd"  # cut inside a two-byte character
  with pytest.raises(DataError, match="257"):
    imdb.decode([300])


def test_imdb_folder_and_archive_agree(imdb_release, tmp_path_factory):
  folder, _ = imdb_release
  extracted = tmp_path_factory.mktemp("extracted")
  with tarfile.open(folder / imdb.ARCHIVE) as archive:
    archive.extractall(extracted, filter="data")
  want = _all(imdb.make_source(_imdb_config(folder), "train"))
  for where in (extracted, extracted / "aclImdb"):
    assert _same(_all(imdb.make_source(_imdb_config(where, cache_dir=str(folder / "c2")), "train")), want)


def test_imdb_cache_is_reused_and_keyed_by_the_archive(imdb_release, monkeypatch):
  folder, _ = imdb_release
  first = _all(imdb.make_source(_imdb_config(folder), "test"))
  monkeypatch.setattr(imdb, "read_reviews", lambda location: pytest.fail("cache not used"))
  source = imdb.make_source(_imdb_config(folder), "test")
  assert _same(_all(source), first)
  blob = pickle.dumps(source)
  assert len(blob) < 2000 and _same(_all(pickle.loads(blob)), first)  # paths, not arrays
  monkeypatch.undo()
  imdb_fixture.write_archive(folder / imdb.ARCHIVE, imdb_fixture.reviews(seed=1))
  assert not _same(_all(imdb.make_source(_imdb_config(folder), "test")), first)


def _tfds_imdb(data_dir, data):
  import tensorflow_datasets as tfds

  class ImdbReviews(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="plain_text")]

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {"text": tfds.features.Text(), "label": tfds.features.ClassLabel(names=["neg", "pos"])}
        ),
        supervised_keys=("text", "label"),
      )

    def _split_generators(self, dl_manager):
      return {s: self._generate_examples(s) for s in ("train", "test")}

    def _generate_examples(self, split):
      for (s, label), rows in data.items():
        for i, r, text in rows:
          if s == split:  # as the real builder: key = archive path, text = read().strip()
            yield f"aclImdb/{s}/{label}/{i}_{r}.txt", {"text": text.strip(), "label": label}

  ImdbReviews(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_imdb_tfds_source_matches_files(imdb_release, tmp_path_factory):
  folder, data = imdb_release
  tfds_dir = tmp_path_factory.mktemp("tfds")
  _tfds_imdb(tfds_dir, data)
  key = lambda ex: (int(ex["targets"]), ex["inputs"].tobytes())
  for split in ("train", "validation", "test"):
    files_examples = _all(imdb.make_source(_imdb_config(folder), split))
    tfds_source = imdb.make_source(_imdb_config(tfds_dir, source="tfds"), split)
    assert _same(sorted(_all(tfds_source), key=key), sorted(files_examples, key=key))
    assert len(pickle.dumps(tfds_source)) < 2000


@pytest.mark.parametrize(
  "case, message",
  [
    ("no_dir", "is not a folder"),
    ("empty_dir", "holds neither aclImdb_v1.tar.gz"),
    ("not_gzip", "is not a readable gzip tar archive"),
    ("no_reviews", "holds no aclImdb/train/neg/\\*.txt reviews"),
    ("bad_name", "is not named <id>_<rating>.txt"),
  ],
)
def test_imdb_errors_name_file_and_layout(tmp_path, case, message):
  folder = tmp_path / "imdb"
  if case != "no_dir":
    folder.mkdir()
  if case == "not_gzip":
    (folder / imdb.ARCHIVE).write_bytes(b"<html>404 Not Found</html>")
  if case == "no_reviews":
    imdb_fixture.write_archive(folder / imdb.ARCHIVE, {})
  if case == "bad_name":
    data = imdb_fixture.reviews()
    data["test", "pos"].append(("x", 7, b"misnamed"))
    imdb_fixture.write_archive(folder / imdb.ARCHIVE, data)
  with pytest.raises(DataError, match=message) as info:
    imdb.make_source(_imdb_config(folder), "train")
  text = str(info.value)
  assert str(folder) in text and "aclImdb/{train,test}/{neg,pos}/<id>_<rating>.txt" in text
  assert "ai.stanford.edu" in text and "tfds build imdb_reviews" in text


def test_imdb_bad_config(tmp_path):
  with pytest.raises(ConfigError, match="data.dir is empty"):
    imdb.validate_config(_config(imdb.data_config(), 8))
  with pytest.raises(ConfigError, match="data.source 'hf'"):
    imdb.validate_config(_config(imdb.data_config(dir=str(tmp_path), source="hf"), 8))
  with pytest.raises(ConfigError, match="train.seq_len 0"):
    imdb.validate_config(_config(imdb.data_config(dir=str(tmp_path)), 0))
  with pytest.raises(ConfigError, match="not a field of the imdb dataset"):
    imdb.data_config(path="x")


# ---------------------------------------------------------------- CIFAR-10

# tf.image.rgb_to_grayscale (TensorFlow 2.21, CPU) on RGB triples where the float32 order of
# operations or float64 arithmetic changes the result: (R, G, B, gray).
TF_GRAY = [
  (5, 49, 41, 34),
  (50, 205, 39, 140),
  (91, 117, 157, 113),
  (126, 175, 73, 148),
  (152, 103, 253, 135),
  (188, 110, 0, 120),
  (213, 100, 91, 133),
  (238, 182, 111, 190),
  (0, 122, 186, 93),
  (48, 144, 192, 121),
  (83, 69, 180, 86),
  (119, 198, 113, 165),
  (182, 112, 128, 135),
  (211, 39, 244, 114),
  (236, 254, 192, 242),
  (0, 0, 0, 0),
  (255, 255, 255, 255),
  (255, 0, 0, 76),
  (0, 255, 0, 149),
  (0, 0, 255, 29),
]


def test_grayscale_equals_tensorflow():
  rgb = np.array([t[:3] for t in TF_GRAY], np.uint8)
  want = np.array([t[3] for t in TF_GRAY], np.uint8)
  assert np.array_equal(cifar10.rgb_to_gray(rgb), want)
  # The triples are sensitive: a float64 evaluation of the same formula misses some of them.
  naive = ((rgb.astype(np.float64) / 255) @ [0.2989, 0.5870, 0.1140] * 255.5).astype(np.uint8)
  assert not np.array_equal(naive, want)


def _tfds_key_order(split: str, n: int) -> list[int]:
  md5 = lambda i: int(hashlib.md5(split.encode() + str(i).encode()).hexdigest(), 16)
  return sorted(range(n), key=md5)


def _decode_batches(batches: dict[str, bytes], names) -> tuple[np.ndarray, np.ndarray]:
  """HWC images and labels straight from the pickles, with the standard unpickler."""
  loaded = [pickle.load(io.BytesIO(batches[n]), encoding="bytes") for n in names]
  data = np.concatenate([b[b"data"] for b in loaded])
  return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.concatenate([b[b"labels"] for b in loaded])


@pytest.fixture
def cifar_release(tmp_path):
  batches = cifar_fixture.release_batches(train_sizes=(30, 20), test_size=10, noise=True)
  cifar_fixture.write_release(tmp_path / cifar10.ARCHIVE, batches)
  return tmp_path, batches


def _cifar_config(folder, **overrides):
  overrides.setdefault("cache_dir", str(folder / "cache"))
  data = cifar10.data_config(dir=str(folder), **overrides)
  return _config(data, cifar10.seq_len_of(data))


def test_cifar_grayscale_pixels_labels_and_lra_splits(cifar_release):
  folder, batches = cifar_release
  config = _cifar_config(folder)
  cifar10.validate_config(config)
  sources = {s: cifar10.make_source(config, s) for s in ("train", "validation", "test")}
  assert {s: len(v) for s, v in sources.items()} == {"train": 45, "validation": 5, "test": 10}
  assert sources["train"].info.vocab_size == 256 and sources["train"].info.num_classes == 10
  for split, names, parts in (
    ("train", ["data_batch_1", "data_batch_2"], ("train", "validation")),
    ("test", ["test_batch"], ("test",)),
  ):
    images, labels = _decode_batches(batches, names)
    order = _tfds_key_order(split, len(labels))
    got = [ex for part in parts for ex in _all(sources[part])]
    for ex, i in zip(got, order, strict=True):
      r, g, b = (images[i, :, :, c].astype(np.float32) / np.float32(255) for c in range(3))
      gray = ((r * np.float32(0.2989) + g * np.float32(0.5870)) + b * np.float32(0.1140)) * np.float32(255.5)
      assert np.array_equal(ex["inputs"], gray.astype(np.uint8).reshape(-1).astype(np.int32))
      assert ex["targets"] == labels[i] and ex["targets"].dtype == np.int32
      assert ex["mask"].dtype == bool and ex["mask"].shape == (1024,) and ex["mask"].all()
      assert ex["weights"].dtype == np.float32 and ex["weights"] == 1


def test_cifar_rgb_tokens(cifar_release):
  folder, batches = cifar_release
  source = cifar10.make_source(_cifar_config(folder, grayscale=False, test_split="test[:3]"), "test")
  images, _ = _decode_batches(batches, ["test_batch"])
  for ex, i in zip(_all(source), _tfds_key_order("test", 10)[:3]):
    assert ex["inputs"].shape == (3072,) and ex["mask"].all()
    assert np.array_equal(ex["inputs"].reshape(32, 32, 3), images[i])  # R, G, B per pixel, raster order


def test_cifar_image_size_box_averages_before_grayscale(cifar_release):
  folder, batches = cifar_release
  source = cifar10.make_source(_cifar_config(folder, image_size=16, test_split="test[:4]"), "test")
  images, _ = _decode_batches(batches, ["test_batch"])
  for ex, i in zip(_all(source), _tfds_key_order("test", 10)[:4]):
    blocks = images[i].astype(np.int64).reshape(16, 2, 16, 2, 3)
    small = np.floor(blocks.sum(axis=(1, 3)) / 4 + 0.5).astype(np.uint8)  # mean, rounded half up
    assert ex["inputs"].shape == (256,) and np.array_equal(ex["inputs"], cifar10.rgb_to_gray(small).reshape(-1))
  with pytest.raises(ConfigError, match="data.image_size 12 is not a divisor of 32"):
    cifar10.validate_config(_config(cifar10.data_config(dir=str(folder), image_size=12), 144))


def test_cifar_folder_and_archive_agree_and_cache_is_reused(cifar_release, tmp_path_factory, monkeypatch):
  folder, _ = cifar_release
  extracted = tmp_path_factory.mktemp("extracted")
  with tarfile.open(folder / cifar10.ARCHIVE) as archive:
    archive.extractall(extracted, filter="data")
  want = _all(cifar10.make_source(_cifar_config(folder), "validation"))
  for where in (extracted, extracted / cifar10.FOLDER):
    assert _same(_all(cifar10.make_source(_cifar_config(where, cache_dir=str(folder / "c2")), "validation")), want)
  monkeypatch.setattr(cifar10, "read_release", lambda *a: pytest.fail("cache not used"))
  source = cifar10.make_source(_cifar_config(folder), "validation")
  blob = pickle.dumps(source)
  assert len(blob) < 2000 and _same(_all(pickle.loads(blob)), want)


def _tfds_cifar10(data_dir, batches):
  import PIL.Image
  import tensorflow_datasets as tfds

  class Cifar10(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("3.0.2")

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            "id": tfds.features.Text(),
            "image": tfds.features.Image(shape=(32, 32, 3)),
            "label": tfds.features.ClassLabel(num_classes=10),
          }
        ),
        supervised_keys=("image", "label"),
      )

    def _split_generators(self, dl_manager):
      return {
        "train": self._generate_examples("train_", ["data_batch_1", "data_batch_2"]),
        "test": self._generate_examples("test_", ["test_batch"]),
      }

    def _generate_examples(self, prefix, names):
      images, labels = _decode_batches(batches, names)
      for index, (image, label) in enumerate(zip(images, labels)):  # keys as the real builder's
        yield index, {"id": f"{prefix}{index:05d}", "image": PIL.Image.fromarray(image), "label": int(label)}

  Cifar10(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_cifar_tfds_source_equals_files_in_order(cifar_release, tmp_path_factory):
  folder, batches = cifar_release
  tfds_dir = tmp_path_factory.mktemp("tfds")
  _tfds_cifar10(tfds_dir, batches)
  for split in ("train", "validation", "test"):
    files_source = cifar10.make_source(_cifar_config(folder), split)
    tfds_source = cifar10.make_source(_cifar_config(tfds_dir, source="tfds"), split)
    assert _same(_all(tfds_source), _all(files_source)), split  # same slices, same order
  assert len(pickle.dumps(tfds_source)) < 2000


def _replace(batches, name, payload):
  return dict(batches, **{name: payload})


def _bad_pickle():
  return b"\x80\x02cos\nsystem\nU\x04trueR."


@pytest.mark.parametrize(
  "case, message",
  [
    ("no_test_batch", "holds no cifar-10-batches-py/test_batch"),
    ("no_train_batch", "holds no cifar-10-batches-py/data_batch_N"),
    ("garbage", "member 'cifar-10-batches-py/data_batch_2' .* is not a readable CIFAR-10 batch pickle"),
    ("code", "global os.system is not part of a CIFAR batch"),
    ("label", "test_batch' .* has label 10 at row 3, outside 0..9"),
    ("shape", "has b'data' uint8\\[4, 1024\\], not uint8\\[N, 3072\\]"),
    ("not_gzip", "is not a readable gzip tar archive"),
  ],
)
def test_cifar_errors_name_file_and_layout(tmp_path, case, message):
  batches = cifar_fixture.release_batches(train_sizes=(4, 4), test_size=4)
  if case == "no_test_batch":
    del batches["test_batch"]
  if case == "no_train_batch":
    batches = {"test_batch": batches["test_batch"]}
  if case == "garbage":
    batches = _replace(batches, "data_batch_2", b"\x80\x02}(U\x04data")
  if case == "code":
    batches = _replace(batches, "data_batch_1", _bad_pickle())
  if case == "label":
    batches = _replace(
      batches,
      "test_batch",
      cifar_fixture.batch_pickle(np.zeros((4, 3072), np.uint8), [1, 2, 3, 10], "testing batch 1 of 1"),
    )
  if case == "shape":
    batches = _replace(
      batches,
      "data_batch_1",
      cifar_fixture.batch_pickle(np.zeros((4, 1024), np.uint8), [0, 1, 2, 3], "training batch 1 of 5"),
    )
  cifar_fixture.write_release(tmp_path / cifar10.ARCHIVE, batches)
  if case == "not_gzip":
    (tmp_path / cifar10.ARCHIVE).write_bytes(b"\x00" * 100)
  with pytest.raises(DataError, match=message) as info:
    cifar10.make_source(_cifar_config(tmp_path), "test")
  text = str(info.value)
  assert str(tmp_path / cifar10.ARCHIVE) in text and "data_batch_1..5 and test_batch" in text
  assert "www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in text and "tfds build cifar10" in text


def test_cifar_missing_release_and_bad_config(tmp_path):
  with pytest.raises(DataError, match="holds neither cifar-10-python.tar.gz nor cifar-10-batches-py/test_batch"):
    cifar10.validate_config(_cifar_config(tmp_path))
  cifar_fixture.write_release(tmp_path / cifar10.ARCHIVE, cifar_fixture.release_batches((4,), 4))
  data = cifar10.data_config(dir=str(tmp_path), cache_dir=str(tmp_path / "cache"))
  with pytest.raises(ConfigError, match="train.seq_len 512 does not match the 1024 grayscale pixels"):
    cifar10.validate_config(_config(data, 512))
  with pytest.raises(ConfigError, match="names split 'valid'"):
    cifar10.validate_config(_cifar_config(tmp_path, validation_split="valid[:10%]"))
  with pytest.raises(ConfigError, match="not of the form"):
    cifar10.validate_config(_cifar_config(tmp_path, test_split="test[::2]"))
  with pytest.raises(DataError, match="holds no images"):
    cifar10.make_source(_cifar_config(tmp_path, validation_split="train[90%:]"), "validation")
  with pytest.raises(ConfigError, match="task 'lm' cannot use the cifar10 dataset"):
    data_lib.validate_config(ml_collections.ConfigDict(dict(task="lm", data=data, train=dict(seq_len=1024))))


def test_tfds_order_is_tfds_hashing():
  from tensorflow_datasets.core import hashing

  hasher = hashing.Hasher("train")
  assert list(cifar10.tfds_order("train", 200)) == sorted(range(200), key=hasher.hash_key)
  assert "tensorflow" not in sys.modules  # tfds works here without TensorFlow
