"""LRA Pathfinder / Path-X: loader against independent decoding, tfds's own split order,
the cache, one-sentence errors, and the configs."""

import hashlib
import pathlib
import pickle
import re

import ml_collections
import numpy as np
import pytest
from PIL import Image

import lra_core
from fixtures import pathfinder as fixture
from lra_core.data.datasets.lra import pathfinder, pathfinder_generator
from lra_core.dataset_record import SPLITS
from lra_core.errors import ConfigError, DataError

RES = fixture.RESOLUTION
HARD = "curv_contour_length_14"


def _config(folder, *, seq_len=RES * RES, cache=None, **data):
  data.setdefault("resolution", RES)
  return ml_collections.ConfigDict(
    dict(
      data=pathfinder.data_config(dir=str(folder), cache_dir=str(cache or pathlib.Path(folder) / "cache"), **data),
      train=dict(seq_len=seq_len),
    )
  )


@pytest.fixture
def release(tmp_path):
  fixture.write_difficulty(tmp_path / HARD)
  return tmp_path


def _expected(folder: pathlib.Path, split_name: str):
  """(pixels, label) of every listed image, sorted as tfds sorts: int(md5(salt + key)) ascending."""
  items = []
  for meta in sorted((folder / "metadata").glob("*.npy")):
    for number, line in enumerate(meta.read_text().split("\n")[:-1], start=1):
      f = line.split(" ")
      key = f"{f[0]}_{f[1]}_{number}"
      order = int(hashlib.md5((split_name + key).encode()).hexdigest(), 16)
      pixels = np.array(Image.open(folder / f[0] / f[1]), dtype=np.int32).reshape(-1)
      items.append((order, pixels, int(f[3])))
  items.sort(key=lambda item: item[0])
  return [(p, y) for _, p, y in items]


def test_examples_match_independent_decoding_in_tfds_order(release):
  expected = _expected(release / HARD, "hard")
  assert len(expected) == 80
  config = _config(release)
  pathfinder.validate_config(config)
  got = []
  for split, size in zip(SPLITS, (64, 8, 8)):  # [:80%], [80%:90%], [90%:] of 80
    source = pathfinder.make_source(config, split)
    assert len(source) == size and source.info.vocab_size == 256 and source.info.num_classes == 2
    for i in range(size):
      ex = source[i]
      assert ex["inputs"].shape == ex["mask"].shape == (RES * RES,)
      assert ex["inputs"].dtype == np.int32 and ex["mask"].dtype == bool and ex["mask"].all()
      assert ex["targets"].shape == () and ex["targets"].dtype == np.int32
      assert ex["weights"].shape == () and ex["weights"].dtype == np.float32 and ex["weights"] == 1
      assert 0 <= ex["inputs"].min() and ex["inputs"].max() <= 255
      got.append((ex["inputs"], int(ex["targets"])))
    np.testing.assert_array_equal(source[-1]["inputs"], source[size - 1]["inputs"])
    with pytest.raises(IndexError):
      source[size]
  # The three splits partition the images, in tfds order.
  for (pixels, label), (want_pixels, want_label) in zip(got, expected, strict=True):
    np.testing.assert_array_equal(pixels, want_pixels)
    assert label == want_label


def test_splits_equal_those_of_a_tfds_builder_written_like_lras(release, tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  folder = release / HARD

  class Pathfinder8(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """LRA's keys and one split per difficulty; a Tensor instead of an Image (no TensorFlow)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            "image": tfds.features.Tensor(shape=(RES, RES, 1), dtype=np.uint8),
            "label": tfds.features.ClassLabel(num_classes=2),
          }
        ),
      )

    def _split_generators(self, dl_manager):
      return {"hard": self._generate_examples()}

    def _generate_examples(self):
      for meta in sorted((folder / "metadata").glob("*.npy")):
        for example_id, line in enumerate(meta.read_text().split("\n")[:-1], start=1):
          m = line.split(" ")
          image = np.asarray(Image.open(folder / m[0] / m[1]))[:, :, None]
          yield "_".join([m[0], m[1], str(example_id)]), {"image": image, "label": int(m[3])}

  builder = Pathfinder8(data_dir=str(tmp_path / "tfds"), file_format="array_record")
  builder.download_and_prepare()
  for split, part in pathfinder.SPLIT_SLICES.items():
    theirs = builder.as_data_source(split="hard" + part)
    ours = pathfinder.make_source(_config(release), split)
    assert len(theirs) == len(ours)
    for i in range(len(ours)):
      np.testing.assert_array_equal(ours[i]["inputs"], theirs[i]["image"].reshape(-1))
      assert ours[i]["targets"] == theirs[i]["label"]


def test_decoded_once_then_memory_mapped_and_rebuilt_when_metadata_changes(release, monkeypatch):
  calls = []
  real = pathfinder.decode_difficulty
  monkeypatch.setattr(pathfinder, "decode_difficulty", lambda *a: calls.append(a) or real(*a))
  config = _config(release)
  first = pathfinder.make_source(config, "train")
  pathfinder.make_source(config, "test")
  assert len(calls) == 1 and isinstance(first.arrays["pixels"], np.memmap)
  assert first.arrays["pixels"].shape == (80, RES * RES) and first.arrays["pixels"].dtype == np.uint8
  meta = release / HARD / "metadata" / "1.npy"
  lines = meta.read_text().splitlines(keepends=True)
  meta.write_text("".join(lines[:-1]))  # one image fewer
  again = pathfinder.make_source(config, "train")
  assert len(calls) == 2 and again.arrays["labels"].shape == (79,)
  blob = pickle.dumps(first)
  assert len(blob) < 2000
  clone = pickle.loads(blob)
  np.testing.assert_array_equal(clone[5]["inputs"], first[5]["inputs"])
  assert len(clone) == len(first)


def test_empty_png_is_dropped_after_slicing_like_lra(release):
  order = [f"imgs/{b}/sample_{k}.png" for b in range(2) for k in range(40)]
  keys = [f"imgs/{b}_sample_{k}.png_{k + 1}" for b in range(2) for k in range(40)]
  hashed = sorted(range(80), key=lambda i: int(hashlib.md5(("hard" + keys[i]).encode()).hexdigest(), 16))
  victim = order[hashed[70]]  # position 70: inside validation = [64, 72)
  (release / HARD / victim).write_bytes(b"")
  sizes = {s: len(pathfinder.make_source(_config(release), s)) for s in SPLITS}
  assert sizes == {"train": 64, "validation": 7, "test": 8}


def test_any_resolution_and_difficulty(tmp_path):
  fixture.write_difficulty(tmp_path / "curv_baseline", resolution=5, batches=1, per_batch=20)
  source = pathfinder.make_source(_config(tmp_path, seq_len=25, resolution=5, difficulty="easy"), "validation")
  assert len(source) == 2 and source[0]["inputs"].shape == (25,)


def _message(excinfo) -> str:
  return str(excinfo.value)


def test_missing_folders_name_the_path_and_layout(tmp_path):
  with pytest.raises(ConfigError, match="data.dir is empty"):
    pathfinder.validate_config(_config(""))
  with pytest.raises(DataError) as e:
    pathfinder.validate_config(_config(tmp_path / "nowhere"))
  assert "nowhere" in _message(e) and "lra_release.gz" in _message(e)
  with pytest.raises(DataError) as e:
    pathfinder.validate_config(_config(tmp_path))
  assert str(tmp_path / HARD) in _message(e)
  assert f"{tmp_path}/{HARD}/metadata/*.npy text files and imgs/<batch>/*.png" in _message(e)
  assert f"pathfinder{RES} layout" in _message(e)
  (tmp_path / HARD / "imgs").mkdir(parents=True)
  with pytest.raises(DataError, match=re.escape(f"no files match '{tmp_path / HARD / 'metadata/*.npy'}'")):
    pathfinder.validate_config(_config(tmp_path))


@pytest.mark.parametrize(
  "line, message",
  [
    ("imgs/0 sample_0.png 0\n", "line 2: 'imgs/0 sample_0.png 0' has 3 space-separated fields"),
    ("imgs/0 sample_0.png 0 2 1.0\n", "line 2: label '2' (field 4) is not 0 or 1"),
    ("imgs/0 sample_99.png 0 1 1.0\n", "line 2: image"),
  ],
)
def test_bad_metadata_lines_name_file_and_line(release, line, message):
  meta = release / HARD / "metadata" / "0.npy"
  lines = meta.read_text().splitlines(keepends=True)
  meta.write_text(lines[0] + line + "".join(lines[2:]))
  with pytest.raises(DataError, match=re.escape(message)) as e:
    pathfinder.make_source(_config(release), "train")
  assert str(meta) in _message(e)
  if "sample_99" in line:
    assert "sample_99.png' does not exist" in _message(e)


def test_bad_images_name_the_file(release):
  bad = release / HARD / "imgs" / "1" / "sample_3.png"
  Image.new("L", (RES + 1, RES)).save(bad)
  with pytest.raises(DataError, match=re.escape(f"image '{bad}' is {RES + 1}x{RES} pixels; expected {RES}x{RES}")):
    pathfinder.make_source(_config(release), "train")
  Image.new("RGB", (RES, RES)).save(bad)
  with pytest.raises(DataError, match=re.escape(f"image '{bad}' has PNG mode 'RGB'; expected 8-bit greyscale")):
    pathfinder.make_source(_config(release), "train")
  bad.write_bytes(b"not a png")
  with pytest.raises(DataError, match=re.escape(f"image '{bad}' is not a readable PNG")):
    pathfinder.make_source(_config(release), "train")


def test_config_errors(release):
  with pytest.raises(ConfigError, match=re.escape("train.seq_len 1024 is not data.resolution 8 squared (64)")):
    pathfinder.validate_config(_config(release, seq_len=1024))
  with pytest.raises(ConfigError, match="data.difficulty 'medium' is not one of"):
    pathfinder.validate_config(_config(release, difficulty="medium"))
  with pytest.raises(ConfigError, match="data.resolution 0 must be a positive integer"):
    pathfinder.validate_config(_config(release, resolution=0))
  with pytest.raises(ConfigError, match="is not a field of the pathfinder dataset"):
    pathfinder.data_config(size=32)


def test_configs_follow_lra_and_tiny_runs_on_the_fixture(release):
  pf = lra_core.load_config("configs/lra/pathfinder/transformer.py")
  assert (pf.train.seq_len, pf.data.resolution, pf.data.difficulty, pf.train.batch_size) == (1024, 32, "hard", 512)
  assert (pf.model.num_layers, pf.model.d_model, pf.model.num_heads, pf.model.head_dim, pf.model.d_ff) == (
    4,
    32,
    4,
    4,
    32,
  )
  assert (pf.model.pooling, pf.model.position, pf.optim.schedule, pf.optim.lr) == ("mean", "sinusoid", "cosine", 1e-3)
  px = lra_core.load_config("configs/lra/pathx/transformer.py:plus")
  assert (px.train.seq_len, px.data.resolution, px.optim.clip_norm, px.model.num_layers) == (16384, 128, 1.0, 1)
  assert px.model.rope and lra_core.load_config("configs/lra/pathx/transformer.py").model.position == "learned"
  for spec in ("configs/lra/pathfinder/transformer.py:tiny", "configs/lra/pathx/transformer.py:tiny,plusplus"):
    config = lra_core.load_config(spec, fixture.build(release))
    pathfinder.validate_config(config)
    assert len(pathfinder.make_source(config, "test")) == 8


def test_stats_cli(release, capsys):
  pathfinder.main(["stats", str(release), f"--resolution={RES}", f"--cache_dir={release / 'cache'}"])
  out = capsys.readouterr().out
  assert "80 images, 0 empty" in out and "train: 64 examples, label 1 fraction" in out
  with pytest.raises(SystemExit, match="error: .*curv_baseline"):
    pathfinder.main(["stats", str(release), "--difficulty=easy"])


# ----------------------------------------------------------------------------- generator


def _point_distance(px, py, dash) -> float:
  x0, y0, x1, y1 = dash
  vx, vy = x1 - x0, y1 - y0
  t = min(max(((px - x0) * vx + (py - y0) * vy) / (vx * vx + vy * vy), 0.0), 1.0)
  return float(np.hypot(px - x0 - t * vx, py - y0 - t * vy))


def _segment_distance(a, b) -> float:
  """Distance of two segments that do not cross."""
  return min(
    _point_distance(*a[:2], b), _point_distance(*a[2:], b), _point_distance(*b[:2], a), _point_distance(*b[2:], a)
  )


@pytest.mark.parametrize("resolution, contour_length", [(32, 14), (32, 6), (64, 9)])
def test_generated_label_is_whether_a_chain_of_dashes_joins_the_dots(resolution, contour_length):
  """Oracle: dashes closer than a gap (+0.2 px) are linked, a dot links to dashes it touches."""
  gap, radius = resolution / 32, 1.5 * resolution / 32
  rng = np.random.default_rng(0)
  labels = []
  for _ in range(12):
    scene = pathfinder_generator.sample_scene(rng, resolution, contour_length)
    assert [len(c) for c in scene.contours[:2]] == [contour_length] * 2
    dashes = [d for c in scene.contours for d in c]
    assert all(1 <= v <= resolution - 1 for d in dashes for v in d)
    n = len(dashes)
    parent = list(range(n + 2))

    def find(i):
      while parent[i] != i:
        i = parent[i]
      return i

    for i in range(n):
      for j in range(i + 1, n):
        if _segment_distance(dashes[i], dashes[j]) <= gap + 0.2:
          parent[find(i)] = find(j)
    for k, (x, y) in enumerate(scene.dots):
      for i in range(n):
        if _point_distance(x, y, dashes[i]) <= radius:
          parent[find(n + k)] = find(i)
    assert (find(n) == find(n + 1)) == bool(scene.label)
    image = pathfinder_generator.render(scene)
    assert image.shape == (resolution, resolution) and image.dtype == np.uint8
    assert all(image[int(y), int(x)] > 200 for x, y in scene.dots)
    labels.append(scene.label)
  assert 0 < sum(labels) < len(labels)


def test_generate_writes_the_release_layout_the_loader_reads(tmp_path, capsys):
  folder = pathfinder_generator.generate(tmp_path / "a", resolution=16, contour_length=6, num=12, batch_size=5, seed=1)
  assert folder == tmp_path / "a" / "curv_baseline"
  assert sorted(p.name for p in (folder / "metadata").iterdir()) == ["0.npy", "1.npy", "2.npy"]
  lines = (folder / "metadata" / "2.npy").read_text().splitlines()
  assert lines[0].startswith("imgs/2 sample_10.png 10 ") and len(lines) == 2
  pathfinder.main(
    [
      "generate",
      f"--out={tmp_path / 'b'}",
      "--resolution=16",
      "--contour_length=6",
      "--num=12",
      "--batch_size=5",
      "--seed=1",
    ]
  )
  assert "wrote 12 Pathfinder-style 16x16 images" in capsys.readouterr().out
  for path in sorted(folder.rglob("*.*")):  # same seed, same bytes
    assert (tmp_path / "b" / path.relative_to(tmp_path / "a")).read_bytes() == path.read_bytes()
  arrays = pathfinder.load_difficulty(str(tmp_path / "a"), "easy", 16, str(tmp_path / "cache"))
  assert arrays["pixels"].shape == (12, 256) and not arrays["empty"].any()
  with pytest.raises(ConfigError, match="resolution 8 must be at least 16"):
    pathfinder_generator.generate(tmp_path / "c", resolution=8)
