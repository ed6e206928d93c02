"""Shared data machinery: cache, split slices, layout errors, tokenizers, packing, tfds access."""

import logging
import os
import pathlib
import stat
import tempfile
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lra_core
from lra_core.data import DataInfo, cache, files, packing, tfds_source, tokenizer
from lra_core.data.datasets import bytes as bytes_data
from lra_core.data.datasets.lra import listops
from lra_core.errors import ConfigError, DataError
from lra_core.tasks.lm import LMTask

# ----------------------------------------------------------------------------- cache


def test_cached_arrays_build_once_and_memory_map(tmp_path):
  calls = []

  def build():
    calls.append(1)
    return {"x": np.arange(10, dtype=np.int32), "y": np.ones((2, 3), np.uint8)}

  key = {"files": [("a", 1, 2)], "v": 1}
  first = cache.cached_arrays("demo", key, build, root=str(tmp_path))
  second = cache.cached_arrays("demo", key, build, root=str(tmp_path))
  assert len(calls) == 1
  np.testing.assert_array_equal(second["x"], np.arange(10))
  assert isinstance(second["y"], np.memmap) and not second["y"].flags.writeable
  assert first["y"].shape == (2, 3)
  cache.cached_arrays("demo", dict(key, v=2), build, root=str(tmp_path))
  assert len(calls) == 2  # another key builds another entry
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_shared_cache_s_entries_are_readable_by_the_group_and_another_user_s_are_one_sentence(tmp_path, monkeypatch):
  """Entries get the permissions a plain mkdir gives (tempfile's 0700 locked out the other users of a
  shared $LRA_CORE_CACHE); an entry this user may not read is one sentence, not a PermissionError."""
  previous = os.umask(0o002)  # a group that shares the cache
  try:
    cache.cached_arrays("demo", {"v": 1}, lambda: {"x": np.arange(3)}, root=str(tmp_path))
  finally:
    os.umask(previous)
  (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("demo-")]
  assert stat.S_IMODE(entry.stat().st_mode) == 0o775

  def refused(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self))

  monkeypatch.setattr(pathlib.Path, "is_file", refused)  # the root running this suite reads anything
  with pytest.raises(ConfigError, match=r"the data cache .* cannot be read \(Permission denied\); it belongs to"):
    cache.cached_arrays("demo", {"v": 1}, lambda: {"x": np.arange(3)}, root=str(tmp_path))


def test_a_cache_shared_by_a_group_takes_its_entries_and_one_only_read_is_one_warning(tmp_path, monkeypatch, caplog):
  """A cache folder its owner made group-writable (chmod g+ws): entries made there are group-writable
  and keep its group (setgid), so another user of the group can add to it. One this user may only read:
  a new entry is built in memory with one warning for the folder (it was a PermissionError traceback);
  ListOps, whose generator writes files, says so in one sentence."""
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o2775)
  previous = os.umask(0o022)
  try:
    cache.cached_arrays("demo", {"v": 1}, lambda: {"x": np.arange(3)}, root=str(shared))
  finally:
    os.umask(previous)
  (entry,) = [p for p in shared.iterdir() if p.name.startswith("demo-")]
  assert stat.S_IMODE(entry.stat().st_mode) & 0o2070 == 0o2070

  def refused(*args, **kwargs):
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(tempfile, "mkdtemp", refused)  # the root running this suite may write anywhere
  with caplog.at_level(logging.WARNING):
    for v in (2, 3):
      arrays = cache.cached_arrays("demo", {"v": v}, lambda: {"x": np.arange(4)}, root=str(shared))
      np.testing.assert_array_equal(arrays["x"], np.arange(4))
      assert not arrays["x"].flags.writeable
  said = [r.getMessage() for r in caplog.records if "takes no new entries (Permission denied)" in r.getMessage()]
  assert len(said) == 1 and said[0].endswith("What it lacks is built in memory at every start."), said
  config = lra_core.load_config("configs/lra/listops/transformer.py:tiny", [f"data.cache_dir={shared}"])
  with pytest.raises(ConfigError, match=r"^the data cache .* takes no new entries \(Permission denied\): ask its"):
    listops.ensure_generated(config.data)


def test_file_fingerprint_changes_when_a_file_is_rewritten(tmp_path):
  path = tmp_path / "f.txt"
  path.write_text("one")
  before = cache.file_fingerprint([path])
  path.write_text("one more")
  assert cache.file_fingerprint([path]) != before


@pytest.mark.parametrize("where", [0, 50_000, 99_999])
def test_file_fingerprint_changes_when_a_file_is_rewritten_keeping_its_size_and_mtime(tmp_path, where):
  """A byte changed at the start, middle or end of a 100 kB file, its mtime put back (`touch -r`)."""
  path = tmp_path / "f.bin"
  path.write_bytes(bytes(100_000))
  before, stat = cache.file_fingerprint([path]), path.stat()
  with open(path, "r+b") as f:
    f.seek(where)
    f.write(b"x")
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  after = cache.file_fingerprint([path])
  assert after[0][:3] == before[0][:3] and after != before


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize(
  "spec,n,expected",
  [
    ("train", 10, (0, 10)),
    ("train[:90%]", 10, (0, 9)),
    ("train[90%:]", 10, (9, 10)),
    ("x[2:5]", 10, (2, 5)),
    ("x[-3:]", 10, (7, 10)),
    ("x[:-20%]", 10, (0, 8)),
    ("x[:50]", 10, (0, 10)),
  ],
)
def test_slice_range(spec, n, expected):
  assert files.slice_range(spec, n) == expected


def test_slices_partition_like_tfds():
  for n in (1, 7, 101, 45000):
    a, b = files.slice_range("t[:90%]", n), files.slice_range("t[90%:]", n)
    assert a[0] == 0 and a[1] == b[0] and b[1] == n


@pytest.mark.parametrize("bad", ["train[", "train[1:2:3]", "a b", "x[150%:]"])
def test_bad_split_specs_are_config_errors(bad):
  with pytest.raises(ConfigError):
    files.slice_range(bad, 10)


def test_layout_errors_name_path_layout_and_command(tmp_path):
  layout, prepare = "<dir>/train/*.txt", "download it with `gsutil ...`"
  with pytest.raises(ConfigError, match=r"data.dir is empty; expected a folder with <dir>/train/\*.txt"):
    files.require_dir("", layout=layout, prepare=prepare)
  with pytest.raises(DataError, match=r"is not a folder; expected <dir>/train/\*.txt \(download it"):
    files.require_dir(str(tmp_path / "nope"), layout=layout, prepare=prepare)
  with pytest.raises(DataError, match=r"no files match .*train/\*.txt"):
    files.require_files(tmp_path, "train/*.txt", layout=layout, prepare=prepare)
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(DataError, match="empty.txt' is empty"):
    files.require_file(tmp_path / "empty.txt", layout=layout, prepare=prepare)


# ----------------------------------------------------------------------------- tokenizers

TEXT = "The quick brown fox\njumps over  the lazy dog.\n\nZürich, naïve café 日本語.\n"


def test_byte_tokenizer_round_trip_and_specials():
  tok = tokenizer.ByteTokenizer()
  ids = tok.encode(TEXT)
  assert ids.min() >= 2 and ids.max() < tok.vocab_size == 258
  assert tok.decode(ids) == TEXT
  assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == TEXT
  with pytest.raises(DataError, match="outside the byte vocabulary"):
    tok.decode([300])


def test_byte_word_starts_count_whitespace_words():
  tok = tokenizer.ByteTokenizer()
  ids = np.concatenate([[tok.eos_id], tok.encode(TEXT)])
  assert tok.word_starts(ids[:-1], ids[1:]).sum() == len(TEXT.split())


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
  root = tmp_path_factory.mktemp("spm")
  corpus = root / "books"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(400)]
  words += [f"w{i}{c}" for i in range(60) for c in "abc"]
  (corpus / "1.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(300)) + "\n")
  code = tokenizer.main(["--train", f"--input={corpus}", f"--model_prefix={root / 'bpe'}", "--vocab_size=200"])
  assert code == 0
  return root / "bpe.model"


def test_sentencepiece_training_cli_and_numbering(spm_model, capsys):
  tok = tokenizer.make_tokenizer(str(spm_model))
  assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (200, 0, 1)
  text = "w1a w22b w59c"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.word_starts(ids, ids).sum() == 3
  assert tokenizer.main(["--model", str(spm_model), "--encode", text]) == 0
  assert "decodes to 'w1a w22b w59c'" in capsys.readouterr().out


def test_tokenizer_errors(tmp_path, capsys):
  with pytest.raises(DataError, match="does not exist; train one with `python -m lra_core.data.tokenizer"):
    tokenizer.make_tokenizer(str(tmp_path / "missing.model"))
  with pytest.raises(ConfigError, match="data.tokenizer is empty"):
    tokenizer.make_tokenizer("")
  (tmp_path / "bad.model").write_bytes(b"not a model")
  with pytest.raises(DataError, match="cannot be read"):
    tokenizer.make_tokenizer(str(tmp_path / "bad.model"))
  assert tokenizer.main(["--train", f"--input={tmp_path / 'nothing'}", f"--model_prefix={tmp_path / 'm'}"]) == 2
  assert "does not exist" in capsys.readouterr().err
  (tmp_path / "c4.json").write_text('{"url": "x"}\n')
  with pytest.raises(DataError, match="line 1 of .*c4.json' is not a JSON object with a 'text' field"):
    list(tokenizer.iter_lines([tmp_path / "c4.json"]))


# ----------------------------------------------------------------------------- packing


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(2, 16))
def test_pack_rows_keep_order_cover_stream_and_never_split_fitting_documents(lengths, row_len):
  starts = np.concatenate([[0], np.cumsum(lengths)])
  rows = packing.pack_rows(starts, row_len)
  assert rows[0, 0] == 0 and rows[-1, 1] == starts[-1]
  np.testing.assert_array_equal(rows[1:, 0], rows[:-1, 1])  # contiguous, in order
  assert ((rows[:, 1] - rows[:, 0] >= 1) & (rows[:, 1] - rows[:, 0] <= row_len)).all()
  boundaries = set(rows[:, 0].tolist())
  for a, b in zip(starts[:-1], starts[1:]):
    if b - a <= row_len:  # a document that fits a row is never cut
      inside = [r for r in boundaries if a < r < b]
      assert not inside


def _corpus(texts):
  tok = tokenizer.ByteTokenizer()
  return packing.Corpus(**packing.build_corpus(texts, tok)), tok


DOCS = ["alpha beta", "gamma delta epsilon zeta", "eta", "theta iota kappa lambda mu nu xi"]


def test_concat_windows_tile_the_stream_with_document_ids():
  corpus, tok = _corpus(DOCS)
  assert corpus.tokens[corpus.starts[1:] - 1].tolist() == [tok.eos_id] * len(DOCS)
  source = packing.CorpusSequences(corpus, tok, 8, packing="concat")
  assert len(source) == (len(corpus.tokens) - 1) // 8
  stream = np.concatenate([source[i]["inputs"] for i in range(len(source))])
  np.testing.assert_array_equal(stream, corpus.tokens[: len(stream)])
  for i in range(len(source)):
    ex = source[i]
    np.testing.assert_array_equal(ex["targets"], corpus.tokens[i * 8 + 1 : i * 8 + 9])
    assert ex["weights"].min() == 1.0
    docs = corpus.document_of(np.arange(i * 8, i * 8 + 8))
    np.testing.assert_array_equal(ex["segment_ids"], docs - docs[0] + 1)


def test_packed_rows_hold_whole_documents_and_mask_cross_document_targets():
  corpus, tok = _corpus(DOCS)
  source = packing.CorpusSequences(corpus, tok, 24, packing="pack")
  for i in range(len(source)):
    ex = source[i]
    real = ex["segment_ids"] > 0
    # Weight exactly where the target is a real token of the input's document.
    begin, end = source.rows[i]
    pos = np.arange(begin, begin + 24)
    same_doc = (pos + 1 < end) & (corpus.document_of(pos) == corpus.document_of(pos + 1))
    np.testing.assert_array_equal(ex["weights"], same_doc)
    assert (ex["inputs"][~real] == tok.pad_id).all()
    np.testing.assert_array_equal(ex["inputs"][real], corpus.tokens[begin : min(end, begin + 24)])
    np.testing.assert_array_equal(ex["targets"][: end - begin - 1], corpus.tokens[begin + 1 : end])
  np.testing.assert_array_equal(np.concatenate([corpus.tokens[b:e] for b, e in source.rows]), corpus.tokens)


def test_mlm_rows_are_packed_without_targets():
  corpus, tok = _corpus(DOCS)
  source = packing.CorpusSequences(corpus, tok, 16, packing="pack", lm=False)
  ex = source[0]
  assert set(ex) == {"inputs", "weights", "segment_ids"} and ex["inputs"].shape == (16,)
  np.testing.assert_array_equal(ex["weights"], ex["segment_ids"] > 0)
  total = sum(source[i]["weights"].sum() for i in range(len(source)))
  assert total == len(corpus.tokens)  # every token in exactly one row


def test_word_marks_over_a_concat_pass_count_the_words():
  corpus, tok = _corpus(DOCS)
  source = packing.CorpusSequences(corpus, tok, 5, packing="concat")
  covered = len(source) * 5 + 1
  stream = np.where(corpus.tokens[:covered] == tok.eos_id, tok.encode(" ")[0], corpus.tokens[:covered])
  expected = len(tok.decode(stream).split()) - 1  # the first word is never a target
  assert sum(source[i]["words"].sum() for i in range(len(source))) == expected


def test_too_short_corpus_and_bad_packing():
  corpus, tok = _corpus(["ab"])
  with pytest.raises(DataError, match="fewer than one sequence"):
    packing.CorpusSequences(corpus, tok, 64)
  with pytest.raises(DataError, match="packing 'zip'"):
    packing.CorpusSequences(corpus, tok, 1, packing="zip")


def test_word_perplexity_is_total_loss_over_words():
  task = LMTask(lra_core.load_config("configs/pg19/transformer.py:tiny"), DataInfo(vocab_size=10))
  out = task.finalize({"loss": (12.0, 6.0), "word_loss": (12.0, 4.0)})
  assert out["word_perplexity"] == pytest.approx(np.exp(3.0))
  assert out["perplexity"] == pytest.approx(np.exp(2.0))


# ----------------------------------------------------------------------------- tfds, enwik8 note


def test_unprepared_tfds_dataset_says_how_to_prepare(tmp_path):
  with pytest.raises(
    DataError,
    match=r"'imdb_reviews' is not prepared under .*tfds build imdb_reviews "
    r"--file_format=array_record",
  ):
    tfds_source.open_split("imdb_reviews", "train", str(tmp_path))


def test_short_enwik8_logs_the_scaled_standard_split(tmp_path, caplog):
  import ml_collections

  path = tmp_path / "enwik8.zip"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("enwik8", b"x" * 1000)
  config = ml_collections.ConfigDict(
    {"task": "lm", "train": {"seq_len": 8}, "data": bytes_data.data_config(path=str(path))}
  )
  with caplog.at_level(logging.INFO):
    bytes_data.make_source(config, "validation")
  assert (
    "standard 90M/5M/5M split of the 100,000,000-byte enwik8, scaled proportionally to this "
    "file's 1,000 bytes" in caplog.text
  )
