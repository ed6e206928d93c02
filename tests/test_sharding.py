"""Sharded training on 8 host devices equals single-device training; checkpoints move between meshes."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lra_core
from lra_core import layout, registry, sharding
from lra_core.bench.shardings import parameter_layout, summarize
from lra_core.checkpoints.checkpointer import Checkpointer, digests
from lra_core.data import DataInfo
from lra_core.layout import mesh_axes_used
from lra_core.run import optim
from lra_core.run.batches import to_device
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task

SPEC = "configs/enwik8/transformer.py:tiny,plusplus"
# Float32 sums are reduced in a different order when split across devices.
TOLERANCE = dict(rtol=2e-5, atol=2e-6)


def batches(num, batch_size=8, seq_len=64, windows=1, documents=False):
  """Random token batches; with windows > 1, consecutive update windows of one sequence batch; with
  `documents`, rows packed with documents of random lengths (segment_ids from 1, about 1 in 12 tokens
  starts one)."""
  rng, doc_rng = np.random.default_rng(0), np.random.default_rng(1)  # the same tokens with or without documents
  for i in range(num):
    tokens = rng.integers(0, 256, size=(batch_size, seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((batch_size, seq_len), np.float32)}
    if windows > 1:
      batch["reset"] = np.asarray(i % windows == 0)
    if documents:
      starts = doc_rng.random((batch_size, seq_len)) < 1 / 12
      batch["segment_ids"] = (1 + np.cumsum(starts, axis=1)).astype(np.int32)
    yield batch


def train(mesh_overrides, steps=3, extra=(), spec=SPEC, windows=1, documents=False, start=None):
  """`steps` train steps of `spec` on the mesh: (config, mesh, state spec, state, losses). From `start` (a
  state from `first_state`, placed on this mesh's shardings) where given, else from the jitted initializer."""
  config = lra_core.load_config(spec, [*mesh_overrides, *extra])
  mesh = layout.make_mesh(config.mesh)
  rules = config.sharding.rules
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  task = make_task(config, DataInfo(vocab_size=256, unit="byte"))
  with sharding.activate(mesh, rules):
    step = jax.jit(make_train_step(config, spec, task, tx, schedule), out_shardings=(spec.shardings, None))
    state = initial(spec, start)
    losses = []
    seq_len = config.train.update_len or config.train.seq_len
    for batch in batches(steps, seq_len=seq_len, windows=windows, documents=documents):
      state, metrics = step(state, to_device(batch, mesh, rules))
      losses.append(float(metrics["loss"][0] / metrics["loss"][1]))
  return config, mesh, spec, state, losses


def initial(spec, start=None):
  """The state a run begins from: `start` (from `first_state`) placed on `spec`'s shardings, else a fresh one
  from the jitted initializer."""
  return spec.init() if start is None else jax.device_put(start, spec.shardings)


def first_state(mesh_overrides, extra=(), spec=SPEC):
  """The initializer's state of `spec` on the mesh (a state any other mesh can start from)."""
  config = lra_core.load_config(spec, [*mesh_overrides, *extra])
  mesh = layout.make_mesh(config.mesh)
  tx, _ = optim.make_optimizer(config)
  with sharding.activate(mesh, config.sharding.rules):
    return make_state_spec(config, mesh, tx).init()


ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
EIGHT_DEVICES = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@functools.cache
def one_document_rows_on_one_device(spec):
  """Three steps of `spec` with dropout on one device, each row one sequence: the reference of
  test_latte_macchiato_sharded_equals_single_device and the unmasked losses of
  test_packed_documents_sharded_equal_single_device (without segment_ids data.document_mask changes no
  program: the two compiled the same train step), trained once for both."""
  return train(ONE_DEVICE, spec=spec, extra=["model.dropout=0.1"])


@pytest.fixture(scope="module")
def single():
  return train(ONE_DEVICE, extra=["model.dropout=0.1"])


@pytest.fixture(scope="module")
def sharded():
  return train(EIGHT_DEVICES, extra=["model.dropout=0.1"])


def test_sharded_step_equals_single_device(single, sharded):
  assert jax.device_count() == 8
  _, mesh, spec, state8, losses8 = sharded
  _, _, _, state1, losses1 = single
  assert mesh.size == 8
  np.testing.assert_allclose(losses8, losses1, **TOLERANCE)
  for a, b in zip(jax.tree.leaves(state8["params"]), jax.tree.leaves(state1["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
  # The parameters really are split: the embedding over (tensor, fsdp), MLP kernels too.
  embedding = state8["params"]["embed"]["embedding"]
  assert embedding.sharding.spec == P("tensor", "fsdp")
  assert len(embedding.addressable_shards) == 8 and embedding.addressable_shards[0].data.shape == (128, 32)
  up = spec.shardings["params"]["blocks"][0]["mlp"]["up"]["kernel"]
  assert up.spec == P("fsdp", "tensor")
  # Optimizer moments follow their parameters.
  mu = state8["opt_state"]
  moments = [x for x in jax.tree.leaves(mu) if x.shape == embedding.shape]
  assert moments and all(m.sharding.spec == P("tensor", "fsdp") for m in moments)


@pytest.mark.slow
def test_transformer_vq_sharded_windows_equal_single_device():
  """Codebook EMA statistics, the carried cache and the commitment loss are global-batch quantities:
  8-way data/FSDP/tensor sharding must not change them (no pmap-style per-device statistics)."""
  spec = "configs/enwik8/transformer_vq.py:tiny"
  drop = ["model.dropres=0.1", "model.droplyr=0.2", "model.dropsin=0.1"]
  _, _, _, state1, losses1 = train(ONE_DEVICE, steps=6, extra=drop, spec=spec, windows=4)
  _, mesh, _, state8, losses8 = train(EIGHT_DEVICES, steps=6, extra=drop, spec=spec, windows=4)
  assert mesh.size == 8
  np.testing.assert_allclose(losses8, losses1, **TOLERANCE)
  for part in ("params", "model_state", "carry"):
    for a, b in zip(jax.tree.leaves(state8[part]), jax.tree.leaves(state1[part])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
  counts = state1["model_state"]["units"][0]["quantizer"]["c_count"]
  assert not np.allclose(np.asarray(counts), 1.0)  # the codebooks did move


@pytest.mark.slow
def test_latte_macchiato_sharded_equals_single_device():
  """The causal Latte scan, RG-LRU, banded window attention and head-split latents under 8-way
  data / FSDP / tensor sharding give the single-device losses and parameters."""
  spec = "configs/c4/latte.py:tiny,latte_rglru_swa++"
  _, _, _, state1, losses1 = one_document_rows_on_one_device(spec)
  _, mesh, sharded_spec, state8, losses8 = train(EIGHT_DEVICES, spec=spec, extra=["model.dropout=0.1"])
  assert mesh.size == 8
  np.testing.assert_allclose(losses8, losses1, **TOLERANCE)
  for a, b in zip(jax.tree.leaves(state8["params"]), jax.tree.leaves(state1["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
  query = sharded_spec.shardings["params"]["blocks"][0]["attn"]["query"]["kernel"]
  assert query.spec == P("fsdp", "tensor", None)  # [embed, heads, latents]: heads split over tensor


@pytest.mark.parametrize(
  "spec",
  [
    "configs/c4/transformer.py:tiny,lm",
    pytest.param("configs/c4/latte.py:tiny,latte_rglru_swa++", marks=pytest.mark.slow),
  ],
)
def test_packed_documents_sharded_equal_single_device(spec):
  """Rows of packed documents (segment_ids: attention, the Latte scan, RG-LRU and positions restart at
  each document) under 8-way data / FSDP / tensor sharding: the single device's losses and parameters
  after three steps, and the documents really are masked apart (the losses differ from one document
  per row)."""
  losses1 = _documents_sharded_equal_single_device(spec, ["data.document_mask=true", "model.dropout=0.1"])
  _, _, _, _, whole_rows = one_document_rows_on_one_device(spec)
  assert not np.allclose(losses1, whole_rows)


@pytest.mark.slow
def test_rope_scaled_transformer_sharded_equals_single_device():
  """YaRN-scaled rotary positions (per-document positions, past the trained length of 16) with packed
  documents under 8-way data / FSDP / tensor sharding: the single device's losses and parameters."""
  spec = "configs/c4/transformer.py:tiny,lm,plusplus"
  extra = ["data.document_mask=true", "model.dropout=0.1", "model.rope_scaling.type=yarn"]
  extra += ["model.rope_scaling.factor=4", "model.rope_scaling.original_max_len=16"]
  _documents_sharded_equal_single_device(spec, extra)


def _documents_sharded_equal_single_device(spec: str, extra: list[str]) -> np.ndarray:
  """Trains `spec` on packed documents on one device and under 8-way data / FSDP / tensor sharding,
  asserts equal losses and parameters, and returns the single device's losses."""
  _, _, _, state1, losses1 = train(ONE_DEVICE, spec=spec, extra=extra, documents=True)
  _, mesh, _, state8, losses8 = train(EIGHT_DEVICES, spec=spec, extra=extra, documents=True)
  assert mesh.size == 8
  np.testing.assert_allclose(losses8, losses1, **TOLERANCE)
  for a, b in zip(jax.tree.leaves(state8["params"]), jax.tree.leaves(state1["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
  return losses1


def test_checkpoint_saved_on_eight_devices_restores_on_one(tmp_path, single, sharded):
  _, _, _, state8, _ = sharded
  _, _, spec1, _, _ = single
  ckpt = Checkpointer(tmp_path)
  ckpt.save(3, state8, {"next_batch": 3})
  ckpt.wait()
  restored, meta = ckpt.restore(3, spec1.abstract)
  ckpt.close()
  # The digests recorded from the 8-device arrays are those of the 1-device ones (restore checked them).
  assert meta == {"next_batch": 3, "digests": digests(restored)} and len(meta["digests"]) == len(
    jax.tree.leaves(state8)
  )
  assert jax.tree.structure(restored) == jax.tree.structure(state8)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state8)):
    assert a.sharding.num_devices == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_round_trip_is_exact(tmp_path, single):
  _, _, spec, state, _ = single
  ckpt = Checkpointer(tmp_path)
  ckpt.save(7, state, {"next_batch": 7})
  ckpt.close()
  restored, _ = Checkpointer(tmp_path).restore(7, spec.abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(state)  # optax namedtuples intact
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_logical_rules_replicate_what_does_not_divide():
  mesh = layout.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  rules = lra_core.config.DEFAULT_RULES
  assert sharding.logical_to_spec(("embed", "mlp"), rules, mesh, (64, 128)) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("embed", "mlp"), rules, mesh, (63, 128)) == P(None, "tensor")
  assert sharding.logical_to_spec(("batch", "length"), rules, mesh, (8, 5)) == P(("data", "fsdp"), None)
  # One mesh axis is never used twice in a spec.
  assert sharding.logical_to_spec(("mlp", "heads"), rules, mesh, (8, 8)) == P("tensor", None)


def test_mesh_errors_are_clear():
  with pytest.raises(lra_core.ConfigError, match="needs 16 devices, but only 8"):
    layout.make_mesh({"data": 4, "fsdp": 4, "tensor": 1})
  # The sentence names the overrides that fit the devices there are (a run trained on more, read on one).
  with pytest.raises(
    lra_core.ConfigError,
    match=r"needs 8 devices, but only 1 are available; with --config\.mesh\.sequence=1 the mesh fits them\.$",
  ):
    layout.mesh_shape({"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}, 1)
  with pytest.raises(lra_core.ConfigError, match=r"; with --config\.mesh\.fsdp=2 the mesh fits them\.$"):
    layout.make_mesh({"data": 4, "fsdp": 4, "tensor": 1})
  with pytest.raises(lra_core.ConfigError, match=r"; with --config\.mesh\.data=1 --config\.mesh\.sequence=1 the mesh"):
    layout.mesh_shape({"data": 4, "sequence": 8}, 1)
  with pytest.raises(lra_core.ConfigError, match="not a multiple of 3"):
    layout.make_mesh({"data": -1, "fsdp": 3, "tensor": 1})


@pytest.mark.parametrize("family", registry.families(), ids=lambda family: family.name)
def test_every_model_family_splits_its_parameters_over_fsdp_and_tensor(family):
  mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  name, smoke = family.name, family.smoke
  rows = parameter_layout(lra_core.load_config(smoke.config, [*smoke.overrides, *mesh]), num_devices=8)
  assert all(r["logical_axes"] is not None for r in rows), name
  # Every matrix over the model width is split over fsdp; what is not (per-head RG-LRU gates,
  # split over tensor instead) weighs more in a tiny model than at paper size.
  unsplit = [r["path"] for r in rows if "embed" in r["logical_axes"] and "fsdp" not in mesh_axes_used(r["spec"])]
  assert not unsplit, (name, unsplit)
  s = summarize(rows)
  assert s["fsdp"] > 0.9 and s["tensor"] > 0.5, (name, s)


def test_sharding_rules_are_selected_by_config():
  """Without the `embed -> fsdp` rule the fsdp axis only splits the batch (plain data parallelism)."""
  rules = "(('batch', ('data', 'fsdp')), ('heads', 'tensor'), ('kv_heads', 'tensor'), ('mlp', 'tensor'))"
  config = lra_core.load_config(SPEC, ["mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1", f"sharding.rules={rules}"])
  rows = parameter_layout(config, num_devices=8)
  up = next(r for r in rows if r["path"].endswith("mlp/up/kernel"))
  assert up["spec"] == P(None, "tensor") and up["per_device"] == up["size"] // 2
  default = parameter_layout(lra_core.load_config(SPEC, ["mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1"]), 8)
  up = next(r for r in default if r["path"].endswith("mlp/up/kernel"))
  assert up["spec"] == P("fsdp", "tensor") and up["per_device"] == up["size"] // 8
