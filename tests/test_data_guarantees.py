"""Pipeline guarantees, checked for every dataset on a fixture in its real distribution format.

For each fixture (tests/fixtures/<dataset>.py): every split loads with constant shapes and ids in
the vocabulary; two simulated processes read disjoint rows that together cover an epoch; a
resumed iterator yields exactly the batches of an uninterrupted one; the same seed gives the
same batches; and the dataset's tiny config trains and evaluates end to end.
"""

import json

import numpy as np
import pytest

import fixtures
import lra_core
from lra_core import data as data_lib
from lra_core import registry
from lra_core.data import pipeline
from lra_core.dataset_record import SPLITS
from lra_core.train import train_and_evaluate

NAMES = fixtures.available()


@pytest.fixture(scope="module", params=NAMES)
def dataset(request, tmp_path_factory):
  name = request.param
  module = fixtures.load(name)
  root = tmp_path_factory.mktemp(name)
  overrides = module.build(root)
  config = lra_core.load_config(module.SPEC, overrides)
  return name, module, overrides, config, root


def _sources(config):
  return {split: data_lib.make_source(config, split) for split in SPLITS}


def _signature(example):
  return {k: (v.shape, v.dtype) for k, v in example.items()}


def test_splits_load_with_constant_shapes_and_valid_ids(dataset):
  _, _, _, config, _ = dataset
  registry.dataset_module(config.data.name).validate_config(config)
  for split, source in _sources(config).items():
    assert len(source) >= 8, split
    first = source[0]
    info = source.info
    for i in list(range(min(len(source), 16))) + [len(source) - 1]:
      example = source[i]
      assert _signature(example) == _signature(first), (split, i)
      assert 0 <= example["inputs"].min() and example["inputs"].max() < info.vocab_size, (split, i)
      if info.num_classes:
        assert 0 <= int(example["targets"]) < info.num_classes
      elif "targets" in example:
        assert 0 <= example["targets"].min() and example["targets"].max() < info.vocab_size
      assert example["weights"].max() > 0, "a real example must carry weight"
    zero = {k: np.zeros_like(v) for k, v in first.items()}
    assert zero["weights"].sum() == 0  # the pipeline's padding example weighs nothing


class Recording:
  """A source that remembers which examples were read."""

  def __init__(self, source):
    self.source, self.info, self.read = source, source.info, []

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    self.read.append(int(i) % len(self.source))
    return self.source[i]


def test_two_processes_read_disjoint_rows_covering_an_epoch(dataset):
  _, _, _, config, _ = dataset
  train = data_lib.make_source(config, "train")
  n = len(train)
  reads = []
  for process in range(2):
    recording = Recording(train)
    reader = pipeline.BatchReader(config, recording, train=True, batch_size=2, process_index=process, process_count=2)
    recording.read.clear()  # the reader looks at example 0 once for the padding shapes
    for step in range(n // 2):
      reader(step * reader.windows)
    reads.append(recording.read)
  assert not set(reads[0]) & set(reads[1])
  assert len(reads[0]) == len(set(reads[0])) == n // 2
  assert len(set(reads[0]) | set(reads[1])) == 2 * (n // 2)


def _batches(iterator, count):
  return [next(iterator) for _ in range(count)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_resumed_iterator_yields_the_uninterrupted_batches(dataset):
  _, _, _, config, _ = dataset
  batch = 4
  total = max(6, 2 * len(data_lib.make_source(config, "train")) // batch)  # crosses an epoch

  def reader():  # a fresh source and reader, as a restarted process builds them
    return pipeline.BatchReader(config, data_lib.make_source(config, "train"), train=True, batch_size=batch)

  uninterrupted = _batches(pipeline.iterate(reader(), 0, total), total)
  first = pipeline.iterate(reader(), 0, total)
  head = _batches(first, total // 2 + 1)
  state = first.get_state()
  resumed = pipeline.iterate(reader(), 0, total)
  resumed.set_state(state)
  _assert_same(head + _batches(resumed, total - len(head)), uninterrupted)
  # The trainer restarts from the step stored in its checkpoint: the same batches again.
  _assert_same(_batches(pipeline.iterate(reader(), len(head), total), total - len(head)), uninterrupted[len(head) :])


def test_same_seed_same_batches_other_seed_other_order(dataset):
  _, _, _, config, _ = dataset
  source = data_lib.make_source(config, "train")

  def first_batches(seed):
    c = config.copy_and_resolve_references()
    c.train.seed = seed
    reader = pipeline.BatchReader(c, source, train=True, batch_size=4)
    return [reader(s) for s in range(3)]

  _assert_same(first_batches(0), first_batches(0))
  other = first_batches(1)
  assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first_batches(0), other))


def test_evaluation_covers_each_split_once(dataset):
  _, _, _, config, _ = dataset
  for split in ("validation", "test"):
    source = Recording(data_lib.make_source(config, split))
    reader = pipeline.BatchReader(config, source, train=False, batch_size=3)
    for s in range(reader.num_eval_batches()):
      reader(s)
    assert sorted(set(source.read)) == list(range(len(source)))


@pytest.mark.slow
def test_tiny_config_trains_and_evaluates_on_the_fixture(dataset):
  name, _, overrides, _, root = dataset
  module = fixtures.load(name)
  config = lra_core.load_config(
    module.SPEC,
    overrides
    + ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2", "train.log_every=1"],
  )
  summary = train_and_evaluate(config, workdir=str(root / "run"))
  assert np.isfinite(summary["param_checksum"])
  finals = {k: v for k, v in summary.items() if isinstance(v, float) and "loss" in k}
  assert finals and all(np.isfinite(v) for v in finals.values()), summary
  if config.task in ("lm",) and "words" in data_lib.make_source(config, "validation")[0]:
    assert any("word_perplexity" in k for k in summary), summary
  assert json.loads((root / "run" / "summary.json").read_text())["param_checksum"] == summary["param_checksum"]


def test_stats_command_reports_counts_labels_and_throughput(tmp_path, capsys):
  module = fixtures.load("retrieval")
  overrides = module.build(tmp_path)
  from lra_core.data import stats

  stats.main(
    [f"--config={module.SPEC}"]
    + [f"--config.{o}" for o in overrides]
    + ["--splits=train,test", "--throughput=50", "--batch_size=4"]
  )
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [(s["split"], s["examples"]) for s in lines] == [("train", 24), ("test", 10)]
  assert lines[0]["labels"] == {"0": 12, "1": 12} and lines[0]["majority"] == 0.5
  assert lines[0]["fields"]["inputs"] == "int32[2, 24]"
  assert all(s["pipeline_examples_per_s"] > 0 and s["random_access_per_s"] > 0 for s in lines)
