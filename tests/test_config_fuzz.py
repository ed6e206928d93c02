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
from hypothesis import HealthCheck, given, settings, strategies as st

import fixtures.c4
import fixtures.enwik8
import fixtures.listops
import lra_core
from lra_core import experiment, optim, sharding
from lra_core.data import pipeline
from lra_core.errors import UserError
from lra_core.state import make_state_spec
from lra_core.steps import make_train_step

# family -> (spec, fixture, {key: candidate values, as command-line text})
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
FAMILIES = {
    "transformer": ("configs/lra/listops/transformer.py:tiny", fixtures.listops, {
        "model.num_heads": ["1", "2", "3", "4", "0"], "model.num_kv_heads": ["0", "1", "2", "3"],
        "model.position": ["sinusoid", "learned", "rope", "none", "bogus"], "model.window": ["0", "4", "-1"],
        "model.vocab_size": ["8", "16", "64"], "model.num_classes": ["10", "4"]}),
    "transformer_vq": ("configs/enwik8/transformer_vq.py:tiny", fixtures.enwik8, {
        "model.block_len": ["4", "8", "5", "16", "0"], "model.n_code": ["8", "16", "0"],
        "train.update_len": ["0", "8", "16", "7"], "model.head_type": ["shga", "mqa", "mha", "xyz"],
        "model.num_heads": ["1", "2", "3"], "model.reduction": ["serial", "matmul", "assoc", "bogus"],
        "model.vocab_size": ["256", "100"]}),
    "latte": ("configs/lra/listops/latte.py:tiny", fixtures.listops, {
        "model.num_latents": ["4", "8", "0"], "model.chunk": ["1", "4", "5", "0"],
        "model.num_heads": ["1", "2", "3"], "model.variant": ["latte", "latte++", "macchiato", "bad"],
        "model.mixer": ["none", "conv", "rglru", "bogus"]}),
    "flash": ("configs/c4/flash.py:tiny", fixtures.c4, {
        "model.chunk": ["4", "16", "5", "0"], "model.expansion": ["1", "2", "0"], "model.qk_dim": ["8", "16", "0"],
        "model.variant": ["flash", "flash_quad", "flash_local", "nope"], "mlm.mask_rate": ["0.15", "0.0", "1.5"]}),
    "fit": ("configs/lra/listops/fit.py:tiny", fixtures.listops, {
        "model.group_size": ["8", "16", "5", "0"], "model.latents_per_group": ["1", "4", "0"],
        "model.layers": ["L(1)G(1)L(1)", "L(2)", "G(1)", "L(1)X(2)", "L("], "model.overlap": ["0", "2", "-1", "16"],
        "model.latent_heads": ["1", "2", "3"], "model.d_latent": ["16", "32", "30"]}),
    "block_transformer": ("configs/c4/block_transformer.py:tiny", fixtures.c4, {
        "model.block_len": ["2", "4", "3", "0"], "model.embedder": ["lookup", "encoder", "cls", "x"],
        "model.token_decoder": ["prefix", "summation", "cross_attention", "y"], "model.prefix_len": ["1", "2", "0"],
        "model.num_heads": ["2", "4", "3"]}),
}
# Fixed overrides that keep the traced step small (one layer where the family has that knob).
LIGHT = {"transformer": ["model.num_layers=1"], "transformer_vq": ["model.num_layers=1"],
         "latte": ["model.num_layers=1"], "flash": ["model.num_layers=1"], "fit": [],
         "block_transformer": ["model.num_layers=1", "model.token_num_layers=1"]}
# Keys that do not exist: the error must name them.
MISSPELT = ["model.d_modle", "train.stepz", "optim.learning_rate", "mesh.model"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  built = {}
  for module in (fixtures.listops, fixtures.enwik8, fixtures.c4):
    root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
    built[module] = module.build(pathlib.Path(root))
  return built


@st.composite
def cases(draw):
  family = draw(st.sampled_from(sorted(FAMILIES)))
  spec, fixture, own = FAMILIES[family]
  menu = {**COMMON, **own}
  keys = draw(st.lists(st.sampled_from(sorted(menu)), min_size=3, max_size=5, unique=True))
  overrides = LIGHT[family] + [f"{k}={draw(st.sampled_from(menu[k]))}" for k in keys]
  if draw(st.integers(0, 9)) == 0:
    overrides.append(f"{draw(st.sampled_from(MISSPELT))}=1")
  return spec, fixture, overrides


def before_first_step(spec, data_overrides, overrides):
  """What the trainer does up to the first step, with the step traced instead of compiled."""
  config = lra_core.load_config(spec, [*data_overrides, *overrides])
  mesh = sharding.make_mesh(config.mesh)
  sources, task = experiment.setup_data(config, ["train"], mesh)
  reader = pipeline.BatchReader(config, sources["train"], train=True, batch_size=config.train.batch_size)
  first = reader(0)
  experiment.check_batch(first, config, 0)
  tx, schedule = optim.make_optimizer(config)
  state_spec = make_state_spec(config, mesh, tx)
  batch = experiment.abstract_batch(first, mesh, config.sharding.rules)
  with sharding.activate(mesh, config.sharding.rules):
    jax.eval_shape(make_train_step(config, state_spec, task, tx, schedule), state_spec.abstract, batch)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
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
