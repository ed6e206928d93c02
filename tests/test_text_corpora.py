"""PG-19 and C4 text corpora on fixtures in the release formats: exact token streams against an
independent encoding, word counts for word-level perplexity, packing, slices, tfds, caching,
the SentencePiece training command and one-sentence errors that name the file and layout."""

from __future__ import annotations

import gzip
import logging
import pickle
import re

import numpy as np
import pytest
import sentencepiece as spm

import lra_core
from fixtures import c4 as c4_fixture
from fixtures import c4_mlm as c4_mlm_fixture
from fixtures import pg19 as pg19_fixture
from fixtures import pg19_tfds as pg19_tfds_fixture
from lra_core import data as data_lib
from lra_core.data import text as text_corpus
from lra_core.data import tokenizer
from lra_core.data.datasets import c4, pg19
from lra_core.dataset_record import SPLITS
from lra_core.errors import ConfigError, DataError


def _load(fixture, root, *overrides):
  root.mkdir(parents=True, exist_ok=True)
  return lra_core.load_config(fixture.SPEC, fixture.build(root) + list(overrides))


def _books(split):
  """(id, stripped text) of the fixture's books of `split`, in id order."""
  return sorted((i, pg19_fixture.book_text(i).strip()) for s, i, _, _ in pg19_fixture.BOOKS if s == split)


def _byte_stream(texts) -> np.ndarray:
  """Independent encoding: UTF-8 bytes + 2, each document followed by eos (1)."""
  ids = []
  for text in texts:
    ids += [b + 2 for b in text.encode("utf-8")] + [1]
  return np.asarray(ids)


def _all(source, field):
  return np.stack([source[i][field] for i in range(len(source))])


# ----------------------------------------------------------------------------- PG-19


def test_pg19_concat_windows_equal_the_independent_byte_stream(tmp_path):
  config = _load(pg19_fixture, tmp_path)
  pg19.validate_config(config)
  seq_len = config.train.seq_len
  for split in SPLITS:
    books = _books(split)
    stream = _byte_stream(text for _, text in books)
    source = data_lib.make_source(config, split)
    assert len(source) == (len(stream) - 1) // seq_len >= 8
    assert source.info == data_lib.DataInfo(vocab_size=258, unit="byte", pad_id=0)
    np.testing.assert_array_equal(source.doc_ids, [i for i, _ in books])
    for i in (0, 1, len(source) - 1):
      ex = source[i]
      assert {k: (v.shape, v.dtype) for k, v in ex.items()} == {
        "inputs": ((seq_len,), np.int32),
        "targets": ((seq_len,), np.int32),
        "weights": ((seq_len,), np.float32),
        "segment_ids": ((seq_len,), np.int32),
        "words": ((seq_len,), np.float32),
      }
      np.testing.assert_array_equal(ex["inputs"], stream[i * seq_len : (i + 1) * seq_len])
      np.testing.assert_array_equal(ex["targets"], stream[i * seq_len + 1 : (i + 1) * seq_len + 1])
      np.testing.assert_array_equal(ex["weights"], 1.0)
    # Segment ids restart at 1 in every window and step by one after each eos.
    ex = source[len(source) // 2]
    np.testing.assert_array_equal(ex["segment_ids"], 1 + np.concatenate([[0], np.cumsum(ex["inputs"][:-1] == 1)]))
    assert _all(source, "inputs").max() < 258


@pytest.mark.parametrize("split", SPLITS)
def test_pg19_word_marks_count_the_whitespace_words_of_the_split(tmp_path, split):
  # With T = 1 a concat pass predicts every token but the first, so the words it marks are all
  # whitespace-separated words of the split's books except the very first one.
  overrides = pg19_fixture.build(tmp_path)
  texts = [text for _, text in _books(split)]
  source = data_lib.make_source(lra_core.load_config(pg19_fixture.SPEC, overrides + ["train.seq_len=1"]), split)
  whole = sum(len(text.encode("utf-8").split()) for text in texts)
  assert _all(source, "words").sum() == whole - 1
  # With T = 32 the pass stops before the last T+1 window; count the words of what it covers.
  source = data_lib.make_source(lra_core.load_config(pg19_fixture.SPEC, overrides + ["train.seq_len=32"]), split)
  text = b"".join(t.encode("utf-8") + b"\n" for t in texts)  # eos separates words like a newline
  covered = text[: len(source) * 32 + 1]
  assert _all(source, "words").sum() == len(covered.split()) - 1


def test_pg19_tfds_gives_the_same_books_as_the_files(tmp_path):
  files_config = _load(pg19_fixture, tmp_path / "files")
  tfds_config = _load(pg19_tfds_fixture, tmp_path / "tfds")
  pg19.validate_config(tfds_config)
  for split in SPLITS:
    by_id = {}
    for config in (files_config, tfds_config):
      source = data_lib.make_source(config, split)
      starts, tokens = source.corpus.starts, source.corpus.tokens
      by_id[config.data.source] = {
        int(i): tokens[starts[d] : starts[d + 1]].tolist() for d, i in enumerate(source.doc_ids)
      }
    assert by_id["files"] == by_id["tfds"] and len(by_id["files"]) == len(_books(split))


def test_pg19_second_source_reuses_the_cached_stream_and_pickles_small(tmp_path, monkeypatch):
  config = _load(pg19_fixture, tmp_path)
  first = data_lib.make_source(config, "train")
  calls = []
  monkeypatch.setattr(text_corpus, "build_corpus", lambda *a: calls.append(a))
  again = data_lib.make_source(config, "train")
  assert not calls and isinstance(again.corpus.tokens, np.memmap)
  np.testing.assert_array_equal(again[3]["inputs"], first[3]["inputs"])
  blob = pickle.dumps(again)
  assert len(blob) < 2000
  np.testing.assert_array_equal(pickle.loads(blob)[5]["targets"], first[5]["targets"])
  # A rewritten book is a new cache entry.
  book = tmp_path / "train" / "84.txt"
  book.write_text(book.read_text(encoding="utf-8").rstrip() + " more words\n", encoding="utf-8")
  monkeypatch.undo()
  assert len(data_lib.make_source(config, "train").corpus.tokens) == len(first.corpus.tokens) + len(" more words")


def test_pg19_errors_name_the_file_and_the_layout(tmp_path):
  def error(match, *overrides, kind=DataError):
    config = lra_core.load_config(
      pg19_fixture.SPEC, [f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *overrides]
    )
    with pytest.raises(kind, match=match) as info:
      pg19.validate_config(config)
    assert "\n" not in str(info.value)

  error(
    re.escape(f"{tmp_path / 'nope'}' is not a folder; expected the PG-19 release layout"),
    f"data.dir={tmp_path / 'nope'}",
  )
  error(
    re.escape(
      f"no files match '{tmp_path}/train/*.txt'; expected the PG-19 release layout "
      f"<dir>/{{train,validation,test}}/<id>.txt with <dir>/metadata.csv (copy it with `gsutil"
    )
  )
  pg19_fixture.build(tmp_path)
  error(r"data.packing 'rows' is not one of", "data.packing=rows", kind=ConfigError)
  error(r"data.source 'hf' is not one of", "data.source=hf", kind=ConfigError)
  error(
    re.escape(f"data.tokenizer '{tmp_path / 'spm_bpe32k.model'}' does not exist")
    + ".*"
    + re.escape(f"python -m lra_core.data.tokenizer --train --input={tmp_path}/train"),
    "data.tokenizer=spm_bpe32k.model",
  )
  (tmp_path / "validation" / "4300.txt").write_text("Ulysses", encoding="utf-8")
  error(re.escape(f"book '{tmp_path / 'validation' / '4300.txt'}' has no line in '{tmp_path / 'metadata.csv'}'"))
  (tmp_path / "validation" / "4300.txt").unlink()
  (tmp_path / "test" / "notes.txt").write_text("x", encoding="utf-8")
  error(re.escape(f"book file '{tmp_path / 'test' / 'notes.txt'}' is not named <id>.txt"))
  (tmp_path / "test" / "notes.txt").unlink()
  (tmp_path / "metadata.csv").write_text("id,short_book_title,publication_date,url\n", encoding="utf-8")
  error(re.escape(f"line 1 of '{tmp_path / 'metadata.csv'}' is not `id,short_book_title,publication_date,url`"))
  (tmp_path / "metadata.csv").unlink()
  error(re.escape(f"'{tmp_path / 'metadata.csv'}' does not exist; expected the PG-19 release layout"))
  error(
    r"tfds dataset 'pg19' is not prepared under .*tfds build pg19 --file_format=array_record",
    "data.source=tfds",
    f"data.tfds_dir={tmp_path / 'tfds'}",
  )


def test_pg19_non_utf8_book_names_the_file(tmp_path):
  config = _load(pg19_fixture, tmp_path)
  (tmp_path / "test" / "219.txt").write_bytes(b"caf\xe9 au lait")
  with pytest.raises(DataError, match=re.escape(f"book '{tmp_path / 'test' / '219.txt'}' is not UTF-8")):
    data_lib.make_source(config, "test")


# ----------------------------------------------------------------------------- SentencePiece


def test_tokenizer_cli_trains_a_model_that_pg19_reads_and_counts_words_with(tmp_path, capsys):
  pg19_fixture.build(tmp_path)
  prefix = tmp_path / "spm" / "bpe"
  argv = [f"--input={tmp_path / 'train'}", f"--model_prefix={prefix}", "--vocab_size=80", "--train"]
  assert tokenizer.main(argv) == 0
  assert "wrote" in capsys.readouterr().out
  sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
  assert (sp.get_piece_size(), sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (80, 0, 1, 2, -1)
  assert tokenizer.main(argv[:2] + ["--vocab_size=100000", "--train"]) == 2
  assert "SentencePiece training failed" in capsys.readouterr().err

  config = _load(pg19_fixture, tmp_path, "data.tokenizer=spm/bpe.model", "train.seq_len=1")
  pg19.validate_config(config)
  for split in SPLITS:
    books = _books(split)
    source = data_lib.make_source(config, split)
    assert source.info.vocab_size == 80 and source.info.unit == "token"
    want = np.concatenate([np.append(sp.encode(text), sp.eos_id()) for _, text in books])
    np.testing.assert_array_equal(source.corpus.tokens, want)
    # One "▁"-initial piece per whitespace-separated word, as for bytes.
    whole = sum(len(text.split()) for _, text in books)
    assert _all(source, "words").sum() == whole - 1
  encode, decode = data_lib.text_codec(config)
  text = "the whale said “Call me Ishmael.”"
  assert decode(encode(text)) == text


# ----------------------------------------------------------------------------- C4


def _c4_docs(seed, count):
  return [d["text"] for d in c4_fixture.documents(seed, count)]


def test_c4_lm_streams_match_sentencepiece_and_test_reads_validation(tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(c4, "_NOTED", set())
  config = _load(c4_fixture, tmp_path)
  c4.validate_config(config)
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
  texts = {"train": _c4_docs(0, 30) + _c4_docs(1, 30), "validation": _c4_docs(2, 30), "test": _c4_docs(2, 30)}
  with caplog.at_level(logging.INFO):
    sources = {split: data_lib.make_source(config, split) for split in SPLITS}
  assert (
    "c4 has no test split: the test split reads the validation data 'c4-validation.*-of-00008.json.gz'" in caplog.text
  )
  for split, source in sources.items():
    want = np.concatenate([np.append(sp.encode(t), 1) for t in texts[split]])
    np.testing.assert_array_equal(source.corpus.tokens, want)
    assert len(source) == (len(want) - 1) // 32 >= 8 and source.info.vocab_size == 64
    np.testing.assert_array_equal(source[2]["targets"], want[65:97])
  assert sources["test"].corpus.tokens.filename == sources["validation"].corpus.tokens.filename
  encode, decode = c4.codec(config)
  line = " ".join(texts["train"][0].split())  # SentencePiece's normalizer turns newlines into spaces
  assert decode(encode(line)) == line


def test_c4_mlm_packs_whole_documents_from_slices_of_one_shard(tmp_path):
  config = _load(c4_mlm_fixture, tmp_path)
  c4.validate_config(config)
  texts = _c4_docs(3, 100)
  seen = []
  for split, (start, stop) in zip(SPLITS, ((0, 60), (60, 80), (80, 100))):
    source = data_lib.make_source(config, split)
    np.testing.assert_array_equal(source.doc_ids, np.arange(start, stop))
    seen += source.doc_ids.tolist()
    stream = _byte_stream(texts[start:stop])
    rows = [source[i] for i in range(len(source))]
    assert all(set(r) == {"inputs", "weights", "segment_ids"} and r["inputs"].shape == (32,) for r in rows)
    # Rows hold the stream in order, without loss; padding (id 0, weight 0) only at row ends.
    np.testing.assert_array_equal(np.concatenate([r["inputs"][r["weights"] > 0] for r in rows]), stream)
    for r in rows:
      real = r["weights"] > 0
      assert real[0] and np.all(real[: real.sum()]) and np.all(r["inputs"][~real] == 0)
      # A row ends at a document end (eos) unless a long document fills it completely.
      assert r["inputs"][real][-1] == 1 or real.all()
  assert sorted(seen) == list(range(100))


def test_c4_slices_and_patterns(tmp_path):
  assert c4.split_pattern("c4-validation.*.json.gz[:90%]") == ("c4-validation.*.json.gz", "[:90%]")
  assert c4.split_pattern("c4-train.0000[0-4]-of-01024.json.gz") == ("c4-train.0000[0-4]-of-01024.json.gz", "")
  with pytest.raises(ConfigError, match="split 'files\\[a:b\\]' is not of the form"):
    c4.split_pattern("c4-validation.*.json.gz[a:b]")
  config = _load(c4_mlm_fixture, tmp_path, "data.train_files=c4-validation.*.json.gz[10:-85]")
  np.testing.assert_array_equal(data_lib.make_source(config, "train").doc_ids, np.arange(10, 15))


def test_c4_errors_name_the_file_and_the_layout(tmp_path):
  shard = tmp_path / "c4-validation.00000-of-00008.json.gz"

  def error(match, *overrides, kind=DataError):
    config = lra_core.load_config(
      c4_mlm_fixture.SPEC,
      [f"data.dir={tmp_path}", "train.seq_len=8", f"data.cache_dir={tmp_path / 'cache'}", *overrides],
    )
    with pytest.raises(kind, match=match) as info:
      data_lib.validate_config(config)
      for split in SPLITS:
        c4.make_source(config, split)
    assert "\n" not in str(info.value)

  error(
    re.escape(
      f"no files match '{tmp_path}/c4-train.*-of-01024.json.gz'; expected allenai/c4 en/ shards "
      f"(gzip, one JSON object per line with text, timestamp and url)"
    )
  )
  one = "data.train_files=c4-validation.*.json.gz"
  c4_fixture.write_shard(shard, c4_fixture.documents(0, 3))
  error(r"task 'classify' cannot use the c4 dataset", one, "task=classify", "model.num_classes=2", kind=ConfigError)
  error(
    re.escape(f"data.tokenizer '{tmp_path / 't5.model'}' does not exist") + ".*sentencepiece.model",
    one,
    "data.tokenizer=t5.model",
  )
  shard.write_bytes(gzip.compress(b'{"text": "fine", "url": "u"}\n{"url": "no text"}\n'))
  error(re.escape(f"line 2 of '{shard}' is not a JSON object with a \"text\" string; expected allenai/c4"), one)
  shard.write_bytes(gzip.compress(b'{"text": "fine"}\n{"text": "cut off'))
  error(re.escape(f"line 2 of '{shard}'"), one)
  shard.write_bytes(b"not gzip at all")
  error(re.escape(f"'{shard}' cannot be read as gzip UTF-8 JSON lines"), one)
  error(
    r"data.tfds_splits \('train',\) has 1 entries", "data.source=tfds", "data.tfds_splits=('train',)", kind=ConfigError
  )


def test_c4_tfds_source_with_slices_and_test_from_validation(tmp_path):
  import tensorflow_datasets as tfds

  docs = {"train": _c4_docs(4, 20), "validation": _c4_docs(5, 12)}

  class C4(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """tfds c4/en 3.1.0 with the installed builder's features."""

    VERSION = tfds.core.Version("3.1.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]
    code_path = None  # no checksums file to look up (see fixtures/pg19_tfds.py)

    def _info(self):
      names = ("text", "url", "content-type", "content-length", "timestamp")
      return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in names})
      )

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(split) for split in docs}

    def _generate_examples(self, split):
      for i, text in enumerate(docs[split]):
        yield (
          i,
          {
            "text": text,
            "url": f"https://example.com/{i}",
            "content-type": "text/plain",
            "content-length": str(len(text)),
            "timestamp": "2019-04-19T08:56:10Z",
          },
        )

  C4(config="en", data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
  config = lra_core.load_config(
    c4_fixture.SPEC,
    [
      "data.source=tfds",
      f"data.tfds_dir={tmp_path / 'tfds'}",
      f"data.cache_dir={tmp_path / 'cache'}",
      "train.seq_len=16",
      "data.tfds_splits=('train[:50%]', 'validation', '')",
    ],
  )
  c4.validate_config(config)
  sources = {split: data_lib.make_source(config, split) for split in SPLITS}
  got = {}
  for split, source in sources.items():
    starts = source.corpus.starts
    got[split] = [source.tokenizer.decode(source.corpus.tokens[a:b]) for a, b in zip(starts[:-1], starts[1:])]
  # tfds stores records in its own shuffled order: compare as sets; train[:50%] is 10 of the 20.
  assert sorted(got["validation"]) == sorted(got["test"]) == sorted(docs["validation"])
  assert len(got["train"]) == 10 and set(got["train"]) < set(docs["train"])
