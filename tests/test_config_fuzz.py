"""Random override sets on every family's `tiny` config: success or the framework's own error.

Each example loads a config with random overrides (valid and invalid values, misspelt keys,
wrong types, sizes that do not divide), then does what the trainer does before its first step:
opens the data, reads and checks the first batch, builds the state's shapes and shardings, and
traces one train step with those shapes (`jax.eval_shape`: every shape, dtype and Python-level
check of the step, without compiling it). It must either succeed or raise a `UserError`;
anything else (a raw exception from inside JAX, flax or numpy) fails the test.
"""

import pathlib

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fixtures
import lra_core
from lra_core import layout, registry, sharding
from lra_core.data import pipeline
from lra_core.errors import UserError
from lra_core.run import data_setup, optim
from lra_core.run.batches import abstract_batch
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step

# Keys every family has, with candidate values (valid and invalid, as command-line text); each
# family's smoke record adds its own (`fuzz`).
COMMON = {
  "train.batch_size": ["1", "2", "4", "8", "6", "0", "-2", "many"],
  "train.seq_len": ["8", "16", "24", "32", "33", "0"],
  "train.grad_accum_steps": ["1", "2", "3", "0"],
  "model.d_model": ["16", "32", "48", "33", "0"],
  "model.num_layers": ["1", "0"],
  "model.dropout": ["0.0", "0.1", "1.5", "-0.1"],
  "model.dtype": ["float32", "bfloat16", "float8"],
  "optim.lr": ["0.001", "0.0", "-1.0"],
  "optim.name": ["adamw", "adafactor", "sgd", "adam_w"],
  "optim.schedule": ["cosine", "constant", "linear", "bogus"],
  "mesh.data": ["1", "2", "-1", "0", "3"],
  "mesh.tensor": ["1", "2", "3"],
  "train.steps": ["1", "3", "0", "x"],
}
FAMILIES = {f.name: f.smoke for f in registry.families()}
# Keys that do not exist: the error must name them.
MISSPELT = ["model.d_modle", "train.stepz", "optim.learning_rate", "mesh.model"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return {
    name: fixtures.load(name).build(pathlib.Path(tmp_path_factory.mktemp(name)))
    for name in sorted({smoke.data for smoke in FAMILIES.values()})
  }


@st.composite
def cases(draw):
  family = draw(st.sampled_from(sorted(FAMILIES)))
  smoke = FAMILIES[family]
  menu = {**COMMON, **smoke.fuzz}
  keys = draw(st.lists(st.sampled_from(sorted(menu)), min_size=3, max_size=5, unique=True))
  overrides = [*smoke.overrides, *smoke.light] + [f"{k}={draw(st.sampled_from(menu[k]))}" for k in keys]
  if draw(st.integers(0, 9)) == 0:
    overrides.append(f"{draw(st.sampled_from(MISSPELT))}=1")
  return smoke.config, smoke.data, overrides


def before_first_step(spec, data_overrides, overrides):
  """What the trainer does up to the first step, with the step traced instead of compiled."""
  config = lra_core.load_config(spec, [*data_overrides, *overrides])
  mesh = layout.make_mesh(config.mesh)
  sources, task = data_setup.setup_data(config, ["train"], mesh)
  reader = pipeline.BatchReader(config, sources["train"], train=True, batch_size=config.train.batch_size)
  first = reader(0)
  data_setup.check_batch(first, config, 0)
  tx, schedule = optim.make_optimizer(config)
  state_spec = make_state_spec(config, mesh, tx)
  batch = abstract_batch(first, mesh, config.sharding.rules)
  with sharding.activate(mesh, config.sharding.rules):
    jax.eval_shape(make_train_step(config, state_spec, task, tx, schedule), state_spec.abstract, batch)


@pytest.mark.slow  # 100 examples, a model built for each valid one; tests/test_config.py has the fixed cases
@settings(
  max_examples=100,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases())
def test_random_overrides_succeed_or_fail_with_one_clear_sentence(case, data):
  spec, fixture, overrides = case
  try:
    before_first_step(spec, data[fixture], overrides)
  except UserError as e:
    message = str(e)
    assert message and "\n" not in message and message.endswith((".", "?")), (overrides, message)
    if message.startswith("unknown config key"):  # it names one of the keys given
      assert any(message.startswith(f"unknown config key {o.split('=')[0]!r}") for o in overrides), message
