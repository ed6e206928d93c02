"""Block padding of the text LM data path (Block Transformer, Appendix H): documents start and end
on block boundaries after 0..L-1 random left pads, windows give back the stream once pads are
dropped, no block mixes documents, pads carry no loss, the padding is fixed across runs and
pickling, and with block padding off the examples are unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import lra_core
from fixtures import c4_mlm as c4_mlm_fixture
from fixtures import pg19 as pg19_fixture
from lra_core import data as data_lib
from lra_core.data import packing, tokenizer
from lra_core.data import text as text_corpus
from lra_core.data.datasets import c4, pg19
from lra_core.errors import ConfigError, DataError

TOK = tokenizer.ByteTokenizer()
PAD = TOK.pad_id


def _corpus(num_docs: int = 60, max_len: int = 90, seed: int = 0) -> packing.Corpus:
  """Documents of 0..max_len letters, some longer than a row, each followed by eos."""
  rng = np.random.default_rng(seed)
  texts = ["".join(rng.choice(list("abc de"), size=rng.integers(0, max_len))) for _ in range(num_docs)]
  return packing.Corpus(**packing.build_corpus(texts, TOK))


def _oracle(corpus: packing.Corpus, left: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """The padded stream written out document by document, and the document of each position."""
  ids, docs = [], []
  for d in range(corpus.num_documents):
    doc = corpus.tokens[corpus.starts[d] : corpus.starts[d + 1]].tolist()
    right = -(int(left[d]) + len(doc)) % block
    ids += [PAD] * int(left[d]) + doc + [PAD] * right
    docs += [d] * (int(left[d]) + len(doc) + right)
  return np.asarray(ids), np.asarray(docs)


def _rows(source) -> list[dict]:
  return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("block", [1, 4, 8, 16])
def test_concat_windows_cut_the_padded_stream_with_documents_on_block_boundaries(block):
  corpus, seq_len = _corpus(), 32
  source = packing.CorpusSequences(corpus, TOK, seq_len, packing="concat", block_padding=block, padding_seed=7)
  left, begins = source.layout
  assert ((0 <= left) & (left < block)).all() and (begins % block == 0).all()
  stream, docs = _oracle(corpus, left, block)
  np.testing.assert_array_equal(begins, np.searchsorted(docs, np.arange(corpus.num_documents + 1)))
  assert source.stream_len == len(stream) and len(source) == (len(stream) - 1) // seq_len
  rows = _rows(source)
  for i, ex in enumerate(rows):
    np.testing.assert_array_equal(ex["inputs"], stream[i * seq_len : (i + 1) * seq_len])
    np.testing.assert_array_equal(ex["targets"], stream[i * seq_len + 1 : (i + 1) * seq_len + 1])
    window_docs = docs[i * seq_len : (i + 1) * seq_len]
    np.testing.assert_array_equal(ex["segment_ids"], window_docs - window_docs[0] + 1)
    # No block of L aligned positions holds two documents.
    assert (ex["segment_ids"].reshape(-1, block) == ex["segment_ids"][::block, None]).all()
    # Loss exactly where the target is a real token, also where the input is a left pad.
    np.testing.assert_array_equal(ex["weights"], ex["targets"] != PAD)
    assert (ex["words"] <= ex["weights"]).all()
  # Without the pads the windows are the original stream, in order, nothing lost or repeated.
  covered = np.concatenate([ex["inputs"] for ex in rows] + [rows[-1]["targets"][-1:]])
  real = covered[covered != PAD]
  np.testing.assert_array_equal(real, corpus.tokens[: len(real)])
  assert len(corpus.tokens) - len(real) < seq_len + 1  # only the tail after the last window is cut


@pytest.mark.parametrize("lm", [True, False])
@pytest.mark.parametrize("block", [4, 8])
def test_packed_rows_hold_whole_padded_documents_and_keep_long_ones_block_aligned(block, lm):
  corpus, seq_len = _corpus(max_len=150), 32
  source = packing.CorpusSequences(corpus, TOK, seq_len, packing="pack", lm=lm, block_padding=block, padding_seed=3)
  left, begins = source.layout
  stream, docs = _oracle(corpus, left, block)
  rows = source.rows
  assert rows[0, 0] == 0 and rows[-1, 1] == len(stream)
  # Every row starts a block into its document's padded span, so row blocks are stream blocks.
  assert ((rows[:, 0] - begins[docs[rows[:, 0]]]) % block == 0).all()
  # The inputs of consecutive rows tile the padded stream (a long document's rows overlap by
  # its one target token), so without pads they give back the original stream exactly once.
  input_ends = np.minimum(rows[:, 1], rows[:, 0] + seq_len)
  np.testing.assert_array_equal(rows[1:, 0], input_ends[:-1])
  inputs = []
  for (begin, end), ex in zip(rows, _rows(source)):
    n = end - begin
    full = np.concatenate([ex["inputs"], ex["targets"][-1:]]) if lm else ex["inputs"]
    np.testing.assert_array_equal(full[:n], stream[begin:end])
    assert (full[n:] == PAD).all() and (ex["segment_ids"][n:] == 0).all()
    segments = ex["segment_ids"]
    assert (segments.reshape(-1, block) == segments[::block, None]).all()
    inputs.append(ex["inputs"][: input_ends[len(inputs)] - begin])
    if lm:
      next_segments = np.append(segments[1:], 0 if n <= seq_len else segments[-1])
      same_doc = (segments > 0) & (segments == next_segments)
      np.testing.assert_array_equal(ex["weights"], same_doc & (ex["targets"] != PAD))
      assert (ex["words"] <= ex["weights"]).all()
    else:
      np.testing.assert_array_equal(ex["weights"], (segments > 0) & (ex["inputs"] != PAD))
  inputs = np.concatenate(inputs)
  np.testing.assert_array_equal(inputs[inputs != PAD], corpus.tokens)


def test_left_pads_are_roughly_uniform():
  block, num_docs = 8, 4000
  starts = np.arange(num_docs + 1, dtype=np.int64) * 5
  left, begins = packing.block_layout(starts, block, seed=11)
  counts = np.bincount(left, minlength=block)
  assert len(counts) == block and num_docs == counts.sum()
  # Each count is 500 +- 21 (one sd); a 25% band is a loose check that misses no real bias.
  assert (np.abs(counts - num_docs / block) < 0.25 * num_docs / block).all(), counts
  np.testing.assert_array_equal(np.diff(begins), (left.astype(np.int64) + 5 + block - 1) // block * block)


def test_padding_is_fixed_by_the_seed_and_survives_pickling():
  corpus = _corpus()
  make = lambda seed: packing.CorpusSequences(corpus, TOK, 16, block_padding=8, padding_seed=seed)
  first, again, other = make(5), make(5), make(6)
  for a, b in zip(_rows(first), _rows(again)):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(first.layout[0], other.layout[0])
  blob = pickle.dumps(first)
  restored = pickle.loads(blob)
  assert restored._layout is None  # rebuilt from the seed, not shipped
  for a, b in zip(_rows(first), _rows(restored)):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_block_padding_off_leaves_the_examples_unchanged():
  corpus = _corpus(max_len=150)
  for kind in ("concat", "pack"):
    for lm in (True, False):
      plain = packing.CorpusSequences(corpus, TOK, 24, packing=kind, lm=lm)
      off = packing.CorpusSequences(corpus, TOK, 24, packing=kind, lm=lm, block_padding=0, padding_seed=9)
      assert off.layout is None and len(off) == len(plain)
      for a, b in zip(_rows(plain), _rows(off)):
        assert a.keys() == b.keys()
        for key in a:
          assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes()
  source = packing.CorpusSequences(corpus, TOK, 24)
  np.testing.assert_array_equal(source[3]["inputs"], corpus.tokens[72:96])


def test_bad_block_padding_is_rejected():
  corpus = _corpus()
  with pytest.raises(DataError, match="block_padding 5 must be 0 or a positive divisor"):
    packing.CorpusSequences(corpus, TOK, 32, block_padding=5)
  assert pg19.data_config().block_padding == 0 and c4.data_config().block_padding == 0

  def check(**overrides):
    config = lra_core.load_config(pg19_fixture.SPEC, ["train.seq_len=100"])
    config.data.update(overrides)
    text_corpus.check_settings(config)

  check(block_padding=4)
  with pytest.raises(ConfigError, match=r"^train.seq_len 100 is not a multiple of data.block_padding 8\.$"):
    check(block_padding=8)
  with pytest.raises(ConfigError, match="data.block_padding -1 must be a non-negative integer"):
    check(block_padding=-1)


def test_pg19_and_c4_sources_take_block_padding_from_the_config(tmp_path):
  (tmp_path / "pg19").mkdir()
  overrides = pg19_fixture.build(tmp_path / "pg19")
  config = lra_core.load_config(pg19_fixture.SPEC, overrides + ["data.block_padding=8"])
  source = data_lib.make_source(config, "train")
  assert source.block_padding == 8 and source.padding_seed == text_corpus.padding_seed("pg19-train")
  assert (source.layout[1] % 8 == 0).all() and source.stream_len > len(source.corpus.tokens)
  # Pickled as file names, the layout rebuilt from the seed: small, and the same rows.
  blob = pickle.dumps(source)
  assert len(blob) < 2000
  restored = pickle.loads(blob)
  for i in (0, len(source) // 2, len(source) - 1):
    for key, value in source[i].items():
      np.testing.assert_array_equal(restored[i][key], value)
  # A second source (as after a restart) pads alike.
  np.testing.assert_array_equal(data_lib.make_source(config, "train").layout[0], source.layout[0])

  (tmp_path / "c4").mkdir()
  overrides = c4_mlm_fixture.build(tmp_path / "c4")
  config = lra_core.load_config(c4_mlm_fixture.SPEC, overrides + ["data.block_padding=16"])
  source = data_lib.make_source(config, "train")
  assert source.block_padding == 16 and source.packing == "pack"
  ex = source[0]
  assert (ex["segment_ids"].reshape(-1, 16) == ex["segment_ids"][::16, None]).all()
  np.testing.assert_array_equal(ex["weights"], (ex["segment_ids"] > 0) & (ex["inputs"] != PAD))
