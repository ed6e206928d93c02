"""Byte-level LM and LRA Retrieval sources, on fixtures written in the real file formats."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import subprocess
import sys
import time
import zipfile

import ml_collections
import numpy as np
import pytest

from lra_core import data as data_lib
from lra_core.data.datasets import bytes as bytes_data
from lra_core.data.datasets.lra import retrieval
from lra_core.dataset_record import SPLITS
from lra_core.errors import ConfigError, DataError

TEXT = ("<mediawiki> Zürich, Ελληνικά, 日本語 and plain ASCII; " * 40).encode("utf-8")


def _config(data, seq_len: int, task: str) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(dict(data=data, train=dict(seq_len=seq_len), task=task))
  config.lock()
  return config


def _bytes_config(path, seq_len=16, task="lm", **overrides):
  return _config(bytes_data.data_config(path=str(path), **overrides), seq_len, task)


@pytest.fixture
def payload() -> bytes:
  rng = np.random.default_rng(0)
  return TEXT + rng.integers(0, 256, size=4000, dtype=np.uint8).tobytes()


@pytest.fixture
def raw_file(tmp_path, payload):
  path = tmp_path / "enwik8"
  path.write_bytes(payload)
  return path


@pytest.fixture
def zip_file(tmp_path, payload):
  path = tmp_path / "enwik8.zip"
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
    archive.writestr("enwik8", payload)
  return path


@pytest.fixture
def gz_file(tmp_path, payload):
  path = tmp_path / "enwik8.gz"
  path.write_bytes(gzip.compress(payload))
  return path


# ---------------------------------------------------------------- bytes


def test_windows_are_consecutive_and_targets_shift_by_one(raw_file, payload):
  seq_len = 16
  config = _bytes_config(raw_file, seq_len)
  bytes_data.validate_config(config)
  ranges = bytes_data.split_ranges(len(payload), (0.9, 0.05, 0.05))
  data = np.frombuffer(payload, np.uint8).astype(np.int32)
  for split, (start, stop) in ranges.items():
    source = data_lib.make_source(config, split)
    assert len(source) == (stop - start - 1) // seq_len
    assert source.info == data_lib.DataInfo(vocab_size=256, unit="byte")
    for i in (0, 1, len(source) - 1):
      ex = source[i]
      begin = start + i * seq_len
      np.testing.assert_array_equal(ex["inputs"], data[begin : begin + seq_len])
      np.testing.assert_array_equal(ex["targets"], data[begin + 1 : begin + seq_len + 1])
      np.testing.assert_array_equal(ex["weights"], np.ones(seq_len, np.float32))
      dtypes = (ex["inputs"].dtype, ex["targets"].dtype, ex["weights"].dtype)
      assert dtypes == (np.int32, np.int32, np.float32)
      assert begin + seq_len + 1 <= stop  # never reads into the next split
    # Window i's last target is window i+1's first input.
    assert source[0]["targets"][-1] == source[1]["inputs"][0]
    with pytest.raises(IndexError):
      source[len(source)]


def test_split_ranges_are_contiguous_with_requested_fractions():
  fractions = (0.7, 0.2, 0.1)
  for num_bytes in (1000, 12_345, 99_999):
    ranges = bytes_data.split_ranges(num_bytes, fractions)
    spans = [ranges[s] for s in SPLITS]
    assert spans[0][0] == 0 and spans[-1][1] == num_bytes
    for (_, stop), (start, _) in zip(spans, spans[1:]):
      assert stop == start
    for (start, stop), f in zip(spans, fractions):
      assert abs((stop - start) - f * num_bytes) <= 1
  # The usual enwik8 boundaries.
  assert bytes_data.split_ranges(10**8, (0.9, 0.05, 0.05)) == {
    "train": (0, 90_000_000),
    "validation": (90_000_000, 95_000_000),
    "test": (95_000_000, 10**8),
  }


@pytest.mark.parametrize("archive", ["zip_file", "gz_file"])
def test_compressed_files_read_like_the_raw_file(request, raw_file, archive):
  compressed = request.getfixturevalue(archive)
  for split in SPLITS:
    want = bytes_data.make_source(_bytes_config(raw_file), split)
    got = bytes_data.make_source(_bytes_config(compressed), split)
    assert len(got) == len(want) > 0
    for i in range(len(want)):
      np.testing.assert_array_equal(got[i]["inputs"], want[i]["inputs"])
      np.testing.assert_array_equal(got[i]["targets"], want[i]["targets"])


def test_dir_and_filename_and_mlm_task(zip_file):
  config = _config(bytes_data.data_config(dir=str(zip_file.parent), filename=zip_file.name), 32, "mlm")
  bytes_data.validate_config(config)
  ex = bytes_data.make_source(config, "train")[3]
  assert ex["inputs"].shape == ex["weights"].shape == (32,)


def test_a_compressed_filename_finds_the_raw_file_beside_it(payload, tmp_path):
  """data.dir holding the raw `enwik8` where the config names `enwik8.zip` (docs/data.md: either);
  where both are there, the named one."""
  (tmp_path / "enwik8").write_bytes(payload)
  config = _config(bytes_data.data_config(dir=str(tmp_path), filename="enwik8.zip"), 32, "lm")
  assert bytes_data.file_path(config.data) == str(tmp_path / "enwik8")
  assert bytes_data.make_source(config, "train")[0]["inputs"].shape == (32,)
  (tmp_path / "enwik8.zip").write_bytes(b"")
  assert bytes_data.file_path(config.data) == str(tmp_path / "enwik8.zip")


def test_source_pickles_without_its_data(raw_file):
  source = bytes_data.make_source(_bytes_config(raw_file), "validation")
  blob = pickle.dumps(source)
  assert len(blob) < 1000
  np.testing.assert_array_equal(pickle.loads(blob)[2]["inputs"], source[2]["inputs"])


TRUNCATE_UNDER_A_RUN = """
import os, sys
from lra_core.data.datasets.bytes import ByteWindows, load_bytes
path = sys.argv[1]
windows = ByteWindows(path, 0, os.path.getsize(path), 64, load_bytes(path))
windows[0]
os.truncate(path, 1000)  # cut short while the run reads it
try:
  windows[len(windows) - 1]
except Exception as e:
  print(type(e).__name__, e)
"""


def test_a_byte_file_cut_short_under_a_run_is_a_sentence_not_a_sigbus(tmp_path):
  """Read past the end of a file cut short under it, a memory mapping killed the process with SIGBUS
  and no message (here in a child process, which that would kill)."""
  path = tmp_path / "enwik8"
  path.write_bytes(bytes(range(256)) * 100)
  done = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_A_RUN, str(path)], capture_output=True, text=True)
  assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
  assert done.stdout.startswith("DataError byte file ") and "holds 1,000 bytes where it held 25,600" in done.stdout


def test_a_byte_file_rewritten_under_a_run_is_a_warning_once(tmp_path, caplog):
  path = tmp_path / "enwik8"
  path.write_bytes(bytes(range(256)) * 100)
  windows = bytes_data.ByteWindows(str(path), 0, 25600, 64, bytes_data.load_bytes(str(path)))
  windows[0]
  path.write_bytes(bytes(reversed(range(256))) * 100)  # the same size, other bytes
  os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
  windows[1]
  windows[2]
  assert caplog.text.count("was rewritten while the run read it") == 1


def test_encode_decode_round_trip():
  text = "Zürich – Ελληνικά – 日本語 – ascii"
  ids = bytes_data.encode(text)
  assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
  assert bytes_data.decode(ids) == text
  assert bytes_data.decode(np.asarray(ids, np.int32)) == text
  assert bytes_data.decode(ids[: -len(" ascii") - 1]).endswith("\ufffd")  # cut inside a character
  with pytest.raises(DataError, match="256"):
    bytes_data.decode([65, 256])


def test_missing_and_empty_files_name_the_path(tmp_path):
  missing = tmp_path / "nope.zip"
  with pytest.raises(DataError, match=re.escape(str(missing))):
    bytes_data.validate_config(_bytes_config(missing))
  empty = tmp_path / "empty"
  empty.write_bytes(b"")
  with pytest.raises(DataError, match=re.escape(str(empty))):
    bytes_data.validate_config(_bytes_config(empty))
  with pytest.raises(DataError, match=re.escape(str(empty))):
    bytes_data.make_source(_bytes_config(empty), "train")
  empty_member = tmp_path / "empty.zip"
  with zipfile.ZipFile(empty_member, "w") as archive:
    archive.writestr("enwik8", b"")
  with pytest.raises(DataError, match=re.escape(str(empty_member))):
    bytes_data.validate_config(_bytes_config(empty_member))
  two = tmp_path / "two.zip"
  with zipfile.ZipFile(two, "w") as archive:
    archive.writestr("a", b"x" * 100)
    archive.writestr("b", b"y" * 100)
  with pytest.raises(DataError, match="expected exactly one"):
    bytes_data.validate_config(_bytes_config(two))
  with pytest.raises(ConfigError, match="data.path"):
    bytes_data.validate_config(_config(bytes_data.data_config(), 16, "lm"))


def test_a_damaged_zip_and_a_missing_file_are_one_sentence_each(zip_file, tmp_path):
  """Bytes overwritten in the middle of the compressed member (its data, past the local header): zlib's
  error becomes one sentence naming the file; a missing file's sentence names the settings to fix."""
  raw = bytearray(zip_file.read_bytes())
  raw[60:200] = bytes(140)
  damaged = tmp_path / "damaged" / "enwik8.zip"
  damaged.parent.mkdir()
  damaged.write_bytes(bytes(raw))
  with pytest.raises(DataError, match=rf"zip file '{re.escape(str(damaged))}' is not a readable zip archive \(") as e:
    bytes_data.validate_config(_bytes_config(damaged))
  assert "\n" not in str(e.value)
  with pytest.raises(DataError, match=r"does not exist; set --config.data.dir to the folder that holds it"):
    bytes_data.validate_config(_bytes_config(tmp_path / "nope" / "enwik8.zip"))


def test_a_known_file_of_another_size_is_warned_about(raw_file, payload, caplog):
  """enwik8 is 10^8 bytes; a sample of it trains, with one warning saying its numbers are not the papers'."""
  bytes_data.validate_config(_bytes_config(raw_file))
  said = [r.getMessage() for r in caplog.records if "published enwik8 has 100,000,000" in r.getMessage()]
  assert said == [
    f"{raw_file} holds {len(payload):,} bytes where the published enwik8 has 100,000,000: a sample "
    "or a cut file, whose results are not comparable to published ones"
  ]


def test_too_short_split_names_split_length_and_seq_len(raw_file, payload):
  # The test split is the shortest; a window of T+1 = test_len+1 bytes cannot fit in it.
  fractions = (0.9, 0.06, 0.04)
  test_len = len(payload) - bytes_data.split_ranges(len(payload), fractions)["test"][0]
  config = _bytes_config(raw_file, seq_len=test_len, split_fractions=fractions)
  with pytest.raises(DataError, match=rf"'test'.*{test_len} bytes.*{test_len + 1}"):
    bytes_data.validate_config(config)
  with pytest.raises(DataError, match="'test'"):
    bytes_data.make_source(config, "test")
  exact = _bytes_config(raw_file, seq_len=test_len - 1, split_fractions=fractions)
  bytes_data.validate_config(exact)
  assert len(bytes_data.make_source(exact, "test")) == 1


@pytest.mark.parametrize("fractions", [(0.9, 0.05, 0.04), (1.1, -0.05, -0.05), (0.9, 0.1, 0.0), (0.5, 0.5)])
def test_bad_fractions_are_config_errors(raw_file, fractions):
  with pytest.raises(ConfigError, match="split_fractions"):
    bytes_data.validate_config(_bytes_config(raw_file, split_fractions=fractions))


def test_bad_config_fields_are_config_errors(raw_file):
  with pytest.raises(ConfigError, match="data.file"):
    bytes_data.data_config(file="x")
  with pytest.raises(ConfigError, match="train.seq_len"):
    bytes_data.validate_config(_bytes_config(raw_file, seq_len=0))
  with pytest.raises(ConfigError, match="task 'classify' cannot use the bytes dataset"):
    data_lib.validate_config(_bytes_config(raw_file, task="classify"))


# ---------------------------------------------------------------- retrieval

# (label as written, id1, id2, text1, text2): labels as LRA's float reader accepts them,
# texts with quotes (the reader does not treat them specially), non-ASCII and an empty text.
PAIRS = {
  "train": [
    ("1", "P01-1001", "P02-2002", 'a "quoted" title, long enough to be cut' * 3, "short"),
    ("0", "W03-0301", "J04-0404", "Zürich 日本語", ""),
    ("1.0", "A", "B", "x" * 7, "y" * 8),
  ],
  "validation": [("0.0", "C", "D", "eval one", "eval two")],
  "test": [("1", "E", "F", "test one", "test two"), ("0", "G", "H", "t", "u")],
}


def _write_aan(folder, pairs=PAIRS):
  folder.mkdir(exist_ok=True)
  for split, rows in pairs.items():
    lines = ["\t".join(row) + "\n" for row in rows]
    (folder / retrieval.FILES[split]).write_text("".join(lines), encoding="utf-8")
  return folder


def _retrieval_config(folder, seq_len=8):
  return _config(retrieval.data_config(dir=str(folder)), seq_len, "retrieval")


def test_file_names_follow_the_lra_release():
  assert retrieval.FILES == {
    "train": "new_aan_pairs.train.tsv",
    "validation": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
  }


def test_retrieval_pads_truncates_and_masks(tmp_path):
  seq_len = 8
  config = _retrieval_config(_write_aan(tmp_path / "aan"), seq_len)
  retrieval.validate_config(config)
  for split, rows in PAIRS.items():
    source = data_lib.make_source(config, split)
    assert len(source) == len(rows)
    assert source.info == data_lib.DataInfo(vocab_size=257, num_classes=2, unit="byte")
    for ex, (label, _, _, *texts) in zip((source[i] for i in range(len(source))), rows):
      assert ex["inputs"].shape == ex["mask"].shape == (2, seq_len)
      assert (ex["inputs"].dtype, ex["mask"].dtype) == (np.int32, np.bool_)
      assert ex["targets"].shape == ex["weights"].shape == ()
      assert ex["targets"].dtype == np.int32 and ex["weights"].dtype == np.float32 and ex["weights"] == 1
      assert ex["targets"] == int(float(label))
      for k, text in enumerate(texts):
        # Oracle: LRA's byte encoder (byte + 1), cut to T bytes, 0-padded.
        want = [b + 1 for b in text.encode("utf-8")[:seq_len]]
        want += [0] * (seq_len - len(want))
        np.testing.assert_array_equal(ex["inputs"][k], want)
        np.testing.assert_array_equal(ex["mask"][k], np.asarray(want) != 0)


def test_retrieval_decode_and_long_sequences(tmp_path):
  config = _retrieval_config(_write_aan(tmp_path / "aan"), seq_len=512)
  ex = retrieval.make_source(config, "train")[1]
  assert retrieval.decode(ex["inputs"][0]) == "Zürich 日本語"
  assert not ex["mask"][1].any()  # an empty text is all padding
  assert retrieval.decode(retrieval.encode("abc", 2)) == "ab"


def test_retrieval_missing_file_and_dir(tmp_path):
  folder = _write_aan(tmp_path / "aan")
  (folder / "new_aan_pairs.eval.tsv").unlink()
  with pytest.raises(DataError, match="new_aan_pairs.eval.tsv"):
    retrieval.validate_config(_retrieval_config(folder))
  with pytest.raises(DataError, match=re.escape(str(folder / "new_aan_pairs.eval.tsv"))):
    retrieval.make_source(_retrieval_config(folder), "validation")
  with pytest.raises(ConfigError, match="data.dir"):
    retrieval.validate_config(_retrieval_config(""))


@pytest.mark.parametrize(
  "bad_line, message",
  [
    ("1\tA\tB\tonly four", "line 2 .* 4 tab-separated columns"),
    ("1\tA\tB\ttext\twith\ttab", "line 2 .* 6 tab-separated columns"),
    ("yes\tA\tB\tx\ty", "line 2 .* label 'yes'"),
    ("0.5\tA\tB\tx\ty", "line 2 .* label '0.5'"),
    ("2\tA\tB\tx\ty", "line 2 .* label '2'"),
  ],
)
def test_retrieval_malformed_lines_name_file_and_line(tmp_path, bad_line, message):
  pairs = dict(PAIRS, test=[PAIRS["test"][0], tuple(bad_line.split("\t"))])
  folder = _write_aan(tmp_path / "aan", pairs)
  path = folder / retrieval.FILES["test"]
  with pytest.raises(DataError, match=message) as info:
    retrieval.make_source(_retrieval_config(folder), "test")
  assert str(path) in str(info.value)


def test_retrieval_accepts_crlf_and_trailing_blank_lines(tmp_path):
  folder = _write_aan(tmp_path / "aan")
  path = folder / retrieval.FILES["test"]
  path.write_bytes(b"1\tE\tF\ttest one\ttest two\r\n0\tG\tH\tt\tu\r\n\n")
  want = retrieval.make_source(_retrieval_config(_write_aan(tmp_path / "ref")), "test")
  got = retrieval.make_source(_retrieval_config(folder), "test")
  assert len(got) == len(want) == 2
  for i in range(2):
    for key in ("inputs", "mask", "targets"):
      np.testing.assert_array_equal(got[i][key], want[i][key])


def test_retrieval_bad_config(tmp_path):
  folder = _write_aan(tmp_path / "aan")
  with pytest.raises(ConfigError, match="task 'classify' cannot use the retrieval dataset"):
    data_lib.validate_config(_config(retrieval.data_config(dir=str(folder)), 8, "classify"))
  with pytest.raises(ConfigError, match="data.path"):
    retrieval.data_config(path="x")
