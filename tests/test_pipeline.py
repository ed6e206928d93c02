"""Batches are a pure function of (seed, step), split across processes, windowed, padded for eval."""

import grain
import ml_collections
import numpy as np
import pytest

from lra_core.data import DataInfo, pipeline


class Numbers:
  """A source whose example i is recognisable: inputs = i * 100 + arange(T)."""

  info = DataInfo(vocab_size=10_000)

  def __init__(self, n, seq_len):
    self.n, self.seq_len = n, seq_len

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    x = (i * 100 + np.arange(self.seq_len)).astype(np.int32)
    return {"inputs": x, "targets": x + 1, "weights": np.ones(self.seq_len, np.float32)}


def make_config(task="lm", seq_len=8, update_len=0, seed=0):
  c = ml_collections.ConfigDict()
  c.task = task
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len, update_len=update_len, seed=seed))
  return c


def ids(batch):
  return (batch["inputs"][:, 0] // 100).tolist()


def test_train_batches_are_deterministic_and_cover_each_epoch():
  source = Numbers(12, 8)
  reader = pipeline.BatchReader(make_config(), source, train=True, batch_size=4)
  first = [ids(reader(s)) for s in range(6)]
  again = pipeline.BatchReader(make_config(), source, train=True, batch_size=4)
  assert [ids(again(s)) for s in range(6)] == first
  epoch1, epoch2 = sum(first[:3], []), sum(first[3:], [])
  assert sorted(epoch1) == sorted(epoch2) == list(range(12))
  assert epoch1 != epoch2  # reshuffled per epoch
  other = pipeline.BatchReader(make_config(seed=1), source, train=True, batch_size=4)
  assert [ids(other(s)) for s in range(3)] != first[:3]


def test_resuming_the_iterator_continues_the_same_stream():
  reader = pipeline.BatchReader(make_config(), Numbers(20, 8), train=True, batch_size=4)
  whole = [ids(b) for b in pipeline.iterate(reader, 0, 8)]
  resumed = [ids(b) for b in pipeline.iterate(reader, 5, 8)]
  assert resumed == whole[5:]


def test_processes_read_disjoint_rows_of_the_same_global_batch():
  source, config = Numbers(32, 8), make_config()
  one = pipeline.BatchReader(config, source, train=True, batch_size=8, process_index=0, process_count=1)
  parts = [
    pipeline.BatchReader(config, source, train=True, batch_size=8, process_index=p, process_count=4) for p in range(4)
  ]
  for s in range(5):
    assert sum((ids(r(s)) for r in parts), []) == ids(one(s))
  with pytest.raises(ValueError, match="not a multiple of the process count"):
    pipeline.BatchReader(config, source, train=True, batch_size=6, process_index=0, process_count=4)


def test_update_windows_split_sequences_along_time():
  config = make_config(seq_len=8, update_len=2)
  reader = pipeline.BatchReader(config, Numbers(10, 8), train=True, batch_size=2)
  assert pipeline.num_windows(config) == 4
  windows = [reader(s) for s in range(8)]
  assert [bool(w["reset"]) for w in windows] == [True, False, False, False] * 2
  whole = np.concatenate([w["inputs"] for w in windows[:4]], axis=1)
  np.testing.assert_array_equal(whole % 100, np.tile(np.arange(8), (2, 1)))
  assert len({tuple(ids(w)) for w in windows[:4]}) == 1  # one sequence batch
  assert windows[4]["targets"].shape == (2, 2)
  # One window per sequence: every batch starts afresh. Classification has no windows at all.
  whole_reader = pipeline.BatchReader(make_config(seq_len=8), Numbers(10, 8), train=True, batch_size=2)
  assert all(bool(whole_reader(s)["reset"]) for s in range(3))
  assert pipeline.num_windows(make_config(task="classify", update_len=2)) == 1
  classify = pipeline.BatchReader(make_config(task="classify"), Numbers(10, 8), train=True, batch_size=2)
  assert "reset" not in classify(0)


def test_eval_covers_the_split_once_and_pads_with_zero_weight():
  reader = pipeline.BatchReader(make_config(), Numbers(10, 8), train=False, batch_size=4)
  assert reader.num_eval_batches() == 3 and reader.num_eval_batches(limit=2) == 2
  batches = list(pipeline.iterate(reader, 0, reader.num_eval_batches()))
  weights = np.concatenate([b["weights"][:, 0] for b in batches])
  assert weights.tolist() == [1.0] * 10 + [0.0] * 2
  assert sum((ids(b) for b in batches), [])[:10] == list(range(10))


def test_empty_source_is_refused():
  with pytest.raises(ValueError, match="empty"):
    pipeline.BatchReader(make_config(), Numbers(0, 8), train=True, batch_size=4)


def test_training_order_is_grains_shuffle_of_each_epoch():
  source = Numbers(37, 4)
  reader = pipeline.BatchReader(make_config(seq_len=4, seed=5), source, train=True, batch_size=1)
  reference = grain.MapDataset.source(source).shuffle(seed=5).repeat()
  for i in range(3 * 37):
    assert reader.example_index(i) == reference[i]["inputs"][0] // 100
