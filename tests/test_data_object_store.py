"""Release files in a bucket: every loader that reads files gives, from a gs:// data.dir (the
in-memory server of tests/conftest.py), the examples it gives from the same fixture in a local
folder, and the same one-sentence errors when the folder or a file is missing.

The fixtures are tests/fixtures/<dataset>.py, built locally and copied up with `fs.upload_tree`.
The decoded-data cache stays local (a separate folder per side, so the bucket side really reads
the bucket).
"""

import hashlib
import importlib.util
import re
import tarfile

import numpy as np
import pytest

import fixtures
import lra_core
from lra_core import data as data_lib
from lra_core import registry
from lra_core.data import cache, files, tokenizer
from lra_core.dataset_record import SPLITS
from lra_core.errors import ConfigError, DataError
from lra_core.runtime import fs


def _configs(name, tmp_path, fake_gcs, *, layout=None):
  """(local config, bucket config) of fixture `name`; `layout(root)` may rearrange the local
  folder (e.g. extract an archive) before it is copied up."""
  module = fixtures.load(name)
  root = tmp_path / "local"
  root.mkdir()
  overrides = module.build(root)
  if layout is not None:
    root = layout(root)
    overrides = [f"data.dir={root}" if o.startswith("data.dir=") else o for o in overrides]
  url = fake_gcs(name)
  fs.upload_tree(root, fs.path(url))
  remote = []
  for o in overrides:
    if o.startswith("data.dir="):
      o = f"data.dir={url}"
    elif o.startswith("data.cache_dir="):
      o = f"data.cache_dir={tmp_path / 'bucket_cache'}"
    remote.append(o)
  return lra_core.load_config(module.SPEC, overrides), lra_core.load_config(module.SPEC, remote)


def _assert_same_examples(local, remote):
  registry.dataset_module(remote.data.name).validate_config(remote)
  for split in SPLITS:
    want, got = data_lib.make_source(local, split), data_lib.make_source(remote, split)
    assert len(got) == len(want) > 0, split
    assert got.info == want.info
    for i in range(len(want)):
      a, b = want[i], got[i]
      assert sorted(a) == sorted(b), (split, i)
      for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=f"{split} {i} {key}")


# ----------------------------------------------------------------------------- same examples


@pytest.mark.parametrize(
  "name",
  [
    "enwik8",
    "listops",
    pytest.param("retrieval", marks=pytest.mark.slow),
    pytest.param("pg19", marks=pytest.mark.slow),
    pytest.param("c4", marks=pytest.mark.slow),  # with its SentencePiece model in the bucket
    pytest.param("c4_mlm", marks=pytest.mark.slow),  # document slices of one shard
    pytest.param("imagenet64", marks=pytest.mark.slow),
    pytest.param("imdb", marks=pytest.mark.slow),
    pytest.param("cifar10", marks=pytest.mark.slow),
    pytest.param("pathfinder", marks=pytest.mark.slow),
  ],
)
def test_a_bucket_gives_the_examples_of_a_local_folder(name, tmp_path, fake_gcs):
  _assert_same_examples(*_configs(name, tmp_path, fake_gcs))


def _extract(archive_name, subfolder):
  def layout(root):
    out = root.parent / "extracted"
    with tarfile.open(root / archive_name) as archive:
      archive.extractall(out, filter="data")
    return out / subfolder

  return layout


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,archive,subfolder",
  [
    ("imdb", "aclImdb_v1.tar.gz", "aclImdb"),
    ("cifar10", "cifar-10-python.tar.gz", "cifar-10-batches-py"),
  ],
)
def test_an_extracted_release_in_a_bucket_reads_like_a_local_one(name, archive, subfolder, tmp_path, fake_gcs):
  _assert_same_examples(*_configs(name, tmp_path, fake_gcs, layout=_extract(archive, subfolder)))


def test_bucket_files_are_cached_locally_by_url_size_and_mtime(tmp_path, fake_gcs):
  _, remote = _configs("imagenet64", tmp_path, fake_gcs)
  url = remote.data.dir + "/val_data.npz"
  (entry,) = cache.file_fingerprint([url])
  assert entry[0] == url and entry[1] == files.size(url) > 0
  first = data_lib.make_source(remote, "validation")[3]
  entries = sorted(p.name for p in (tmp_path / "bucket_cache").iterdir())
  assert len(entries) == 1 and entries[0].startswith("imagenet64-")  # local, decoded once
  second = data_lib.make_source(remote, "validation")[3]
  assert sorted(p.name for p in (tmp_path / "bucket_cache").iterdir()) == entries  # memory-mapped again
  np.testing.assert_array_equal(first["targets"], second["targets"])
  fs.path(url).write_bytes(b"rewritten")
  assert cache.file_fingerprint([url]) != [entry]  # a rewritten object builds a new entry


def test_sentencepiece_trains_from_and_into_a_bucket_and_loads_from_its_bytes(tmp_path, fake_gcs):
  (tmp_path / "books").mkdir()
  (tmp_path / "books" / "1.txt").write_text("the whale and the sea\nthe ship and the captain\n" * 30)
  url = fake_gcs("pg19")
  fs.upload_tree(tmp_path, fs.path(url))
  local = tokenizer.train([str(tmp_path / "books")], str(tmp_path / "spm"), vocab_size=40)
  remote = tokenizer.train([f"{url}/books"], f"{url}/spm", vocab_size=40)
  assert remote == f"{url}/spm.model" and fs.path(f"{url}/spm.vocab").is_file()
  want, got = tokenizer.make_tokenizer(local), tokenizer.make_tokenizer(remote)
  pieces = lambda tok: [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
  assert pieces(got) == pieces(want)  # the same vocabulary (the files differ only in model_prefix)
  np.testing.assert_array_equal(got.encode("the ship and the sea"), want.encode("the ship and the sea"))
  assert got.fingerprint() == "spm:" + hashlib.sha256(fs.path(remote).read_bytes()).hexdigest()[:16]
  with pytest.raises(DataError, match=re.escape(f"SentencePiece model {url + '/x.model'!r} does not exist")):
    tokenizer.make_tokenizer(url + "/x.model")


# ----------------------------------------------------------------------------- errors


def _error(config):
  with pytest.raises((ConfigError, DataError)) as info:
    registry.dataset_module(config.data.name).validate_config(config)
    for split in SPLITS:
      data_lib.make_source(config, split)
  return info.type, str(info.value)


@pytest.mark.parametrize(
  "name", ["enwik8", "listops", "retrieval", "pg19", "c4", "imagenet64", "imdb", "cifar10", "pathfinder"]
)
def test_a_missing_bucket_folder_gives_the_local_sentence(name, tmp_path, fake_gcs):
  module = fixtures.load(name)
  url, local = fake_gcs(name), tmp_path / "nothing" / name
  overrides = [o for o in module.build(tmp_path) if not o.startswith("data.dir=")]
  kind, message = _error(lra_core.load_config(module.SPEC, overrides + [f"data.dir={local}"]))
  remote_kind, remote_message = _error(lra_core.load_config(module.SPEC, overrides + [f"data.dir={url}"]))
  assert remote_kind is kind
  assert remote_message == message.replace(str(local), url)
  assert remote_message.count(". ") == 0 and remote_message.endswith(".")  # one sentence


@pytest.mark.parametrize("name", ["imdb", "cifar10"])
def test_a_missing_bucket_tfds_data_dir_gives_the_local_sentence(name, tmp_path, fake_gcs):
  module = fixtures.load(name)
  url, local = fake_gcs(name), tmp_path / "nothing"
  base = [f"data.cache_dir={tmp_path / 'cache'}", "data.source=tfds"]
  kind, message = _error(lra_core.load_config(module.SPEC, base + [f"data.dir={local}"]))
  remote_kind, remote_message = _error(lra_core.load_config(module.SPEC, base + [f"data.dir={url}"]))
  assert remote_kind is kind is DataError
  assert remote_message == message.replace(str(local), url) and "tfds data_dir" in remote_message


@pytest.mark.parametrize(
  "name,missing",
  [
    ("imagenet64", "val_data.npz"),
    ("listops", "basic_test.tsv"),
    ("retrieval", "new_aan_pairs.test.tsv"),
    ("pg19", "metadata.csv"),
  ],
)
def test_a_missing_or_empty_bucket_file_gives_the_local_sentence(name, missing, tmp_path, fake_gcs):
  module = fixtures.load(name)
  root = tmp_path / "local"
  root.mkdir()
  overrides = [o for o in module.build(root) if not o.startswith("data.dir=")]
  for content in (None, b""):
    if content is None:
      (root / missing).unlink()
    else:
      (root / missing).write_bytes(content)
    url = fake_gcs(name)
    fs.upload_tree(root, fs.path(url))
    kind, message = _error(lra_core.load_config(module.SPEC, overrides + [f"data.dir={root}"]))
    remote_kind, remote_message = _error(lra_core.load_config(module.SPEC, overrides + [f"data.dir={url}"]))
    assert remote_kind is kind
    assert remote_message == message.replace(str(root), url)


# ----------------------------------------------------------------------------- missing packages


@pytest.mark.parametrize(
  "name", ["enwik8", "pg19", "imagenet64", "listops", "retrieval", "imdb", "cifar10", "pathfinder", "c4"]
)
def test_a_scheme_without_its_package_is_one_sentence_naming_it(name, tmp_path, monkeypatch):
  module = fixtures.load(name)
  overrides = [o for o in module.build(tmp_path) if not o.startswith("data.dir=")]
  real = importlib.util.find_spec
  hidden = {"gcsfs", "tensorflow"}
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a))
  config = lra_core.load_config(module.SPEC, overrides + ["data.dir=gs://some-bucket/data"])
  with pytest.raises(
    ConfigError,
    match=re.escape(
      "data.dir 'gs://some-bucket/data' needs the gcsfs package for gs:// paths; install it with pip install gcsfs."
    ),
  ):
    registry.dataset_module(config.data.name).validate_config(config)
  if importlib.util.find_spec("adlfs") is None:
    config = lra_core.load_config(module.SPEC, overrides + ["data.dir=az://container/data"])
    with pytest.raises(ConfigError, match=r"needs the adlfs package for az:// paths; install it"):
      registry.dataset_module(config.data.name).validate_config(config)


def test_a_bucket_cache_dir_is_refused_in_one_sentence(tmp_path):
  module = fixtures.load("imagenet64")
  overrides = module.build(tmp_path) + ["data.cache_dir=gs://some-bucket/cache"]
  config = lra_core.load_config(module.SPEC, overrides)
  with pytest.raises(ConfigError, match=r"^data.cache_dir 'gs://some-bucket/cache' is not a local folder; .*\.$"):
    data_lib.make_source(config, "validation")
