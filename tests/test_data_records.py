"""Each dataset declares its facts once, in the `DATASET` record of its module (lra_core.data.Dataset),
and is found by its name: these tests loop over what the lookup finds, so a new dataset module is
covered by declaring its record."""

import importlib
import re

import pytest

import fixtures
import lra_core
from lra_core import data as data_lib
from lra_core import registry, task_kinds
from lra_core.dataset_record import SPLITS, Dataset
from lra_core.errors import ConfigError
from lra_core.run.data_setup import config_data_info


def test_every_record_is_declared_under_its_module_name_with_known_tasks_and_splits():
  names = registry.dataset_names()
  assert len(names) >= 9  # bytes, pg19, c4, imagenet64 and the five LRA sets
  for name in names:
    module = registry.dataset_module(name)
    record = registry.dataset(name)
    assert module.DATASET is record and module.__name__.rpartition(".")[2] == record.name == name
    assert record.unit and record.tasks and set(record.tasks) <= set(task_kinds.TASKS), record
    assert record.splits and set(record.splits) <= set(SPLITS), record
    assert module.data_config().name == name  # the config section's default name is the record's


def test_no_record_goes_unfound():
  """A record under another name than its module's would never be looked up, and a stem found in
  both folders would make a name ambiguous."""
  stems, declared = [], {}
  for package in registry.DATASET_PACKAGES:
    for path in registry.package_folder(package).glob("*.py"):
      if path.stem.startswith("_"):
        continue
      stems.append(path.stem)
      record = getattr(importlib.import_module(f"{package}.{path.stem}"), "DATASET", None)
      if isinstance(record, Dataset):
        declared[path.stem] = record.name
  assert len(stems) == len(set(stems)), sorted(stems)
  assert declared == {name: name for name in registry.dataset_names()}


def test_the_registry_lists_dataset_modules_only():
  """Datasets are found by their DATASET assignment, read off each module's text: the helpers beside them
  are not among the modules the registry would import."""
  assert sorted(registry.dataset_modules()) == list(registry.dataset_names())
  assert {"packing", "tokenizer", "pathfinder_generator"}.isdisjoint(registry.dataset_modules())


@pytest.mark.parametrize("name", ["enwik9", "packing", "pathfinder_generator", "", 3])
def test_an_unknown_name_is_one_sentence_listing_the_datasets(name):
  with pytest.raises(ConfigError) as info:
    registry.dataset_module(name)
  message = str(info.value)
  assert f"data.name {name!r} is not a dataset" in message and "\n" not in message
  assert all(repr(n) in message for n in registry.dataset_names())


def test_a_task_the_dataset_does_not_serve_is_refused_before_any_file_is_read():
  config = lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["task=mlm"])
  message = re.escape("task 'mlm' cannot use the listops dataset; expected one of ['classify'].")
  with pytest.raises(ConfigError, match=message):
    data_lib.validate_config(config)
  with pytest.raises(ConfigError, match=message):
    data_lib.make_source(config, "train")


def test_a_split_the_dataset_does_not_have_is_refused():
  config = lra_core.load_config("configs/lra/listops/transformer.py:tiny")
  with pytest.raises(ConfigError, match="split 'dev' is not one of"):
    data_lib.make_source(config, "dev")


@pytest.mark.parametrize("fixture", fixtures.available())
def test_unit_and_document_fields_are_read_from_the_record(fixture):
  config = lra_core.load_config(fixtures.load(fixture).SPEC)
  record = registry.dataset(config.data.name)
  assert config_data_info(config).unit == record.unit
  fields = data_lib.example_fields(config)
  assert ("segment_ids" in fields) == record.packed_documents
  assert ("words" in fields) == (record.packed_documents and task_kinds.kind(config.task).causal)


def test_every_dataset_has_a_fixture_in_its_real_format():
  """tests/test_data_guarantees.py checks the loaders on these fixtures."""
  covered = {lra_core.load_config(fixtures.load(name).SPEC).data.name for name in fixtures.available()}
  assert covered == set(registry.dataset_names())
