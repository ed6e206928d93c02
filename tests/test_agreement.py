"""The processes of a multi-process run agree at start on their config and code (lra_core/runtime/agreement.py).

Process 1 of 2 here, over a fake coordination store holding what process 0 published; the two real
processes of tests/test_multiprocess.py check the same end to end."""

import json

import jax
import pytest

import lra_core
from fixtures import listops
from lra_core.errors import ConfigError
from lra_core.runtime import agreement, process_end


class _Store:
  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value):
    assert key not in self.values
    self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    return self.values[key]


@pytest.fixture
def process_1(monkeypatch):
  store = _Store()
  monkeypatch.setattr(process_end, "coordination_client", lambda: store)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  return store


def _publish_as_process_0(store, config, code=None):
  store.values[f"{agreement.KEY}/0"] = json.dumps(
    {"config": agreement.config_table(config), "code": code or agreement.code_table()}
  )


def test_the_same_config_and_code_pass(process_1):
  config = lra_core.load_config(listops.SPEC, ["optim.lr=1e-3"])
  _publish_as_process_0(process_1, config)
  agreement.check(config)
  assert json.loads(process_1.values[f"{agreement.KEY}/1"])["config"]["optim.lr"] == "0.001"


def test_another_setting_is_one_sentence_naming_its_key(process_1):
  _publish_as_process_0(process_1, lra_core.load_config(listops.SPEC, ["optim.lr=1e-3"]))
  with pytest.raises(
    ConfigError,
    match=r"^process 1 was not started like process 0: config key optim.lr is 0.5 here and 0.001 on process 0; "
    r"start every process of a run with the same flags and the same code.$",
  ):
    agreement.check(lra_core.load_config(listops.SPEC, ["optim.lr=0.5"]))


def test_where_each_host_keeps_its_data_may_differ(process_1):
  _publish_as_process_0(process_1, lra_core.load_config(listops.SPEC, ["data.dir=/mnt/a", "data.num_threads=2"]))
  agreement.check(lra_core.load_config(listops.SPEC, ["data.dir=/local/b", "data.num_threads=8"]))


def test_other_code_is_one_sentence_naming_the_file(process_1):
  config = lra_core.load_config(listops.SPEC)
  code = agreement.code_table()
  assert "lra_core/train.py" in code and any(name.startswith("lra_core/models/") for name in code)
  assert any(name.startswith("lra_core/kernels/") for name in code)
  _publish_as_process_0(process_1, config, dict(code, **{"lra_core/train.py": "0" * 16}))
  with pytest.raises(ConfigError, match=r"source file lra_core/train.py differs \(against process 0\); start every"):
    agreement.check(config)


def test_one_process_compares_nothing(monkeypatch):
  monkeypatch.setattr(process_end, "coordination_client", lambda: None)
  agreement.check(lra_core.load_config(listops.SPEC))
