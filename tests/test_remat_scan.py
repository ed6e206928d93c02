"""model.remat and model.scan_layers change how a model runs, never what it computes.

Oracle: the plain model (no remat, layers unrolled) with the same parameters. Every family's
smoke config is checked for identical initialisation, forward values and gradients; real train
steps give the same param_checksum; checkpoints convert between the layouts; decoding reads
scanned stacks; stacked parameters keep their sharding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import lra_core
from lra_core import layout, registry, sharding
from lra_core.bench.shardings import parameter_layout
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.data import pipeline
from lra_core.errors import CheckpointError, ConfigError
from lra_core.registry import build_model
from lra_core.run import optim
from lra_core.run.data_setup import config_data_info
from lra_core.run.state import make_state_spec, param_checksum, scan_params, unscan_params
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task

FAMILIES = {f.name: f.smoke for f in registry.families()}
# (remat, scan_layers) against the plain model: every family runs scan with full remat; the families
# whose tiny models compile fast also run a policy unscanned, the transformer the rest (scan alone,
# the third policy), to keep compiles few.
VARIANTS = {name: (("full", True),) for name in FAMILIES}
for name in ("transformer", "transformer_vq", "latte", "flash"):
  VARIANTS[name] += (("dots_no_batch", False),)
VARIANTS["transformer"] += (("dots", False), ("none", True))


def load(name, remat="none", scan=False, *extra):
  smoke = FAMILIES[name]
  return lra_core.load_config(
    smoke.config, [*smoke.overrides, f"model.remat={remat}", f"model.scan_layers={scan}", *extra]
  )


def random_batch(config, batch_size=2):
  """A batch in the trainer's layout (pipeline.batch_fields) with random ids in range."""
  rng = np.random.default_rng(0)
  vocab = config.model.get("vocab_size", 256)
  classes = config.model.get("num_classes", 0) or vocab
  batch = {}
  for name, (shape, dtype) in pipeline.batch_fields(config, batch_size).items():
    dtype = np.dtype(dtype)
    if dtype == np.dtype(bool):
      batch[name] = np.ones(shape, bool)
    elif np.issubdtype(dtype, np.integer):
      batch[name] = rng.integers(0, classes if name == "targets" else vocab, shape).astype(dtype)
    else:
      batch[name] = rng.uniform(0.1, 1.0, shape).astype(dtype)
  return batch


def pure_state(config):
  model = build_model(config, seed=0)
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def loss_and_grads(config, batch):
  graphdef, params, rest = pure_state(config)
  task = make_task(config, config_data_info(config))

  def loss(params):
    model = nnx.merge(graphdef, params, rest)
    b = task.prepare(dict(batch), jax.random.key(1))
    carry = model.init_carry(2) if registry.family(config.model.name).keeps_carry(config) else None
    value, _, _ = task.loss_and_metrics(
      model, b, normalizer=task.normalizer(b), rngs=nnx.Rngs(dropout=jax.random.key(2)), carry=carry
    )
    return value

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return params, value, grads


def assert_trees_close(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.parametrize(
  "name", [pytest.param(name, marks=() if name == "transformer" else pytest.mark.slow) for name in sorted(FAMILIES)]
)
def test_remat_and_scan_keep_init_values_and_gradients(name):
  base = load(name)
  batch = random_batch(base)
  params, value, grads = loss_and_grads(base, batch)
  for remat, scan in VARIANTS[name]:
    p, v, g = loss_and_grads(load(name, remat, scan), batch)
    if scan:  # the stacks really are stacked, and hold exactly the per-layer parameters
      assert jax.tree.structure(p) != jax.tree.structure(params)
    assert_trees_close(unscan_params(p), params, rtol=0, atol=0)
    assert param_checksum(p) == param_checksum(params)
    np.testing.assert_allclose(v, value, rtol=0, atol=1e-6, err_msg=f"{name} {remat} scan={scan}")
    assert_trees_close(unscan_params(g), grads, rtol=1e-5, atol=1e-6)


def run_steps(config, steps=2):
  """`steps` real train steps (the trainer's jitted step, dropout on) from the seed's init."""
  mesh = layout.make_mesh(config.mesh, jax.devices()[:1])
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  task = make_task(config, config_data_info(config))
  step = jax.jit(make_train_step(config, spec, task, tx, schedule))
  state = spec.init()
  with sharding.activate(mesh, config.sharding.rules):
    for i in range(steps):
      state, _ = step(state, random_batch(config, config.train.batch_size))
  return state


@pytest.mark.parametrize("name", ["transformer", pytest.param("transformer_vq", marks=pytest.mark.slow)])
def test_train_steps_give_the_same_checksum(name):
  """Dropout (listops), LayerDrop, codebook EMA updates and the carried cache (Transformer-VQ)."""
  plain = run_steps(load(name))
  other = run_steps(load(name, "full", True))
  assert param_checksum(other["params"]) == pytest.approx(param_checksum(plain["params"]), rel=1e-6)
  assert_trees_close(unscan_params(other["model_state"]), plain["model_state"], rtol=1e-5, atol=1e-6)
  assert_trees_close(other["opt_state"], plain["opt_state"], rtol=1e-4, atol=1e-6)
  if "carry" in plain:
    assert_trees_close(other["carry"], plain["carry"], rtol=1e-5, atol=1e-6)


def test_state_conversion_round_trips_and_checkpoint_names_the_switch(tmp_path):
  plain_config, scan_config = load("transformer_vq"), load("transformer_vq", "none", True)
  tx, _ = optim.make_optimizer(plain_config)

  def state(config):
    _, params, rest = pure_state(config)
    return {"params": params, "model_state": rest}

  plain, scanned = state(plain_config), state(scan_config)
  # The optimizer keeps its state per layer either way (lra_core.layer_stacks.per_layer_optimizer).
  scan_tx, _ = optim.make_optimizer(scan_config)
  assert_trees_close(scan_tx.init(scanned["params"]), tx.init(plain["params"]), rtol=0, atol=0)
  assert_trees_close(unscan_params(scanned), plain, rtol=0, atol=0)
  assert_trees_close(scan_params(plain, scan_config), scanned, rtol=0, atol=0)
  assert_trees_close(unscan_params(scan_params(plain, scan_config)), plain, rtol=0, atol=0)

  ckpt = Checkpointer(tmp_path, async_save=False)
  ckpt.save(1, plain, {"next_batch": 1})
  ckpt.wait()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), scanned)
  with pytest.raises(CheckpointError, match=r"model\.scan_layers=False .* model\.scan_layers=True; .*scan_params\.$"):
    ckpt.restore(1, abstract)
  restored, _ = ckpt.restore(1, None)  # converting by hand is the way across
  assert_trees_close(scan_params(restored["params"], scan_config), scanned["params"], rtol=0, atol=0)
  ckpt.close()


def test_unknown_remat_is_one_sentence_before_any_build():
  with pytest.raises(
    ConfigError,
    match=r"^model\.remat 'fast' is not one of \['none', 'full', 'dots', "
    r"'dots_no_batch'\]\.$",
  ):
    load("transformer", "fast")


def test_stacked_parameters_keep_their_sharding_with_an_unsplit_layer_axis():
  mesh_args = ("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2")
  plain = {r["path"]: r for r in parameter_layout(load("transformer", "none", False, *mesh_args), 4)}
  rows = parameter_layout(load("transformer", "none", True, *mesh_args), 4)
  stacked = [r for r in rows if "stacked_layers" in r["path"]]
  assert stacked and any(layout.mesh_axes_used(r["spec"]) for r in stacked)
  for row in stacked:
    layer0 = plain[row["path"].replace("stacked_layers", "0")]
    assert row["logical_axes"] == ("layers",) + tuple(layer0["logical_axes"])
    assert row["spec"] == P(None, *layer0["spec"])


@pytest.mark.parametrize(
  "spec",
  [
    "configs/enwik8/transformer.py:tiny",
    "configs/enwik8/transformer_vq.py:tiny",
    "configs/imagenet64/fit_ar.py:tiny",
    "configs/c4/block_transformer.py:tiny",
  ],
)
def test_decoding_reads_scanned_stacks(spec):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 5)), jnp.int32)

  def decode(scan):
    model = build_model(lra_core.load_config(spec, [f"model.scan_layers={scan}"]), seed=0)
    model.eval()
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
      model = nnx.merge(graphdef, state)
      decode_state, logits = model.init_decode_state(2, 8), []
      for i in range(tokens.shape[1]):
        out, decode_state = model.decode_step(tokens[:, i : i + 1], decode_state)
        logits.append(out)
      return jnp.concatenate(logits, axis=1)

    return run(state)

  np.testing.assert_allclose(decode(True), decode(False), rtol=1e-5, atol=1e-5)
