"""One sequence split over chips (mesh.sequence, kernels/context_parallel.py) computes what one chip computes.

Oracle: the same step with the time axis whole. On 8 host devices, every family that splits a
sequence trains with mesh.sequence 8 and with data 2 x sequence 4 (softmax attention's ring also with
mesh.sequence 2) to the unsplit losses and parameters (float32 rounding: sums are reduced in another
order), with packed documents whose boundaries fall on and off the chips' boundaries; the kernels alone
match in values and gradients with the XLA and the Pallas (interpret) cores on 2, 8 and 2 x 4 chips;
the compiled step moves no activation's whole time axis between chips; a run resumed with another
mesh.sequence ends where the uninterrupted one does.
"""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sharding import TOLERANCE, first_state, initial, train

import lra_core
import tiers
from lra_core import layout, sharding
from lra_core.checkpoints import saved_config
from lra_core.config import DEFAULT_RULES
from lra_core.data import DataInfo
from lra_core.errors import ConfigError
from lra_core.kernels import context_parallel
from lra_core.kernels import latte as latte_kernels
from lra_core.kernels import mixed_chunk as flash_kernels
from lra_core.kernels import vq as vq_kernels
from lra_core.kernels.softmax import library as library_attention
from lra_core.kernels.softmax import reference as attention
from lra_core.kernels.softmax.ring import ring_attention
from lra_core.run import optim
from lra_core.run.batches import abstract_batch, to_device
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task
from lra_core.train import train_and_evaluate

ONE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.sequence=1"]
# The fewest chips (a ring of 2: both neighbours are one chip), the most (8: one block or chunk per chip
# in most configs), and a split of 4 beside a data axis. mesh.sequence 4 alone, the last one's split without
# its data axis, is left out (every family's first config on it: 48 s of the full suite's test time).
MESHES = {
  "sequence2": ["mesh.data=1", "mesh.sequence=2"],
  "sequence8": ["mesh.data=1", "mesh.sequence=8"],
  "data2_sequence4": ["mesh.data=2", "mesh.sequence=4"],
}
QUICK = ("data2_sequence4",)  # the quick tier's mesh; the others run in the full suite
CAUSAL = {
  "latte": "configs/c4/latte.py:tiny,latte",
  "latte_conv_swa": "configs/c4/latte.py:tiny,latte_conv_swa++",
  "latte_rglru_swa": "configs/c4/latte.py:tiny,latte_rglru_swa++",
  "latte_pallas": "configs/c4/latte.py:tiny,latte_rglru_swa++",
  "linear_transformer": "configs/enwik8/linear_transformer.py:tiny",
  "flash": "configs/c4/flash.py:tiny,lm",
  "flash_pallas": "configs/c4/flash.py:tiny,lm",
  "flash_mlm": "configs/c4/flash.py:tiny",  # non-causal: the global sums also come from the chips after
  "flash_quad": "configs/pg19/flash.py:tiny,flash_quad",  # one chunk over every chip: the gathered keys
  "flash_quad_mlm": "configs/c4/flash_quad.py:tiny",
  "transformer_vq": "configs/enwik8/transformer_vq.py:tiny",
  "transformer_vq_pallas": "configs/enwik8/transformer_vq.py:tiny",
  "transformer_vq_full": "configs/enwik8/transformer_vq.py:tiny,full",  # ring attention, no XL bias
  "transformer": "configs/enwik8/transformer.py:tiny",  # softmax attention: ring attention
  "transformer++_gqa": "configs/enwik8/transformer.py:tiny,plusplus",
  "transformer++_yarn": "configs/enwik8/transformer.py:tiny,plusplus",  # RoPE scaled: positions per chip
  "transformer_window": "configs/enwik8/transformer.py:tiny",
  "transformer_zigzag": "configs/enwik8/transformer.py:tiny",  # without dropout: the zig-zag order
  "transformer_plain": "configs/enwik8/transformer.py:tiny",
  "block_transformer": "configs/c4/block_transformer.py:tiny",
  "fit_ar": "configs/imagenet64/fit_ar.py:tiny,overlap",
}
EXTRA = {
  "latte_pallas": ["model.impl=pallas"],
  "flash_pallas": ["model.impl=pallas", "model.chunk=8"],
  "transformer++_yarn": [
    "model.rope_scaling.type=yarn",
    "model.rope_scaling.factor=4",
    "model.rope_scaling.original_max_len=16",
  ],
}
EXTRA["flash"] = EXTRA["flash_mlm"] = ["model.chunk=8"]  # whole chunks on each of 8 chips
VQ_DROPOUT = ["model.dropres=0.1", "model.droplyr=0.2", "model.dropsin=0.1"]
EXTRA["transformer_vq"] = ["train.update_len=64", "model.block_len=8", *VQ_DROPOUT]  # one block per chip of 8
EXTRA["transformer_vq_pallas"] = EXTRA["transformer_vq"] + ["model.impl=pallas"]
EXTRA["transformer_vq_full"] = ["train.update_len=64", "model.rel_bias=False", *VQ_DROPOUT]
BIDIRECTIONAL = {
  "latte_bidirectional": "configs/lra/listops/latte.py:tiny",
  "latte_bidirectional_conv": "configs/lra/listops/latte.py:tiny",
  "transformer_bidirectional": "configs/lra/listops/transformer.py:tiny",  # ring attention, no mask order
  "fit_encoder": "configs/lra/listops/fit.py:tiny",  # 4 groups of 16: the global layers as ring attention
}
EXTRA["latte_bidirectional_conv"] = ["model.mixer=conv", "model.window=8", "model.vapor=False"]
EXTRA["transformer++_gqa"] = ["model.num_kv_heads=2", "model.dropout=0.1"]
EXTRA["transformer_window"] = ["model.window=8"]
# one result in either order (the order only moves work between chips), each the unsplit one
EXTRA["transformer_zigzag"] = ["model.dropout=0"]
EXTRA["transformer_plain"] = ["model.dropout=0", "model.ring_order=plain"]
# No biases: a key bias shifts a query's scores all alike, so its true gradient is 0 and Adam would turn
# the rounding noise left in its place into full-size, sign-random updates.
EXTRA["block_transformer"] = ["model.token_num_layers=1", "model.use_bias=False"]
CAUSAL["block_transformer_plain"] = "configs/c4/block_transformer.py:tiny"
EXTRA["block_transformer_plain"] = [*EXTRA["block_transformer"], "model.dropout=0.1"]  # the plain order
CAUSAL["block_transformer_encoder"] = "configs/c4/block_transformer.py:tiny"
# blocks of 8, the token decoder 8 long (prefix 1 + 7 tokens): what a sequence axis of 2, 4, 8 would divide
EXTRA["block_transformer_encoder"] = [
  *EXTRA["block_transformer"],
  "model.embedder=encoder",
  "model.block_len=8",
  "model.prefix_len=1",
  "data.block_padding=8",
]
EXTRA["fit_ar"] = ["train.seq_len=384", "model.use_bias=False"]  # 8 groups of 48: the zig-zag order
CAUSAL["fit_ar_plain"] = "configs/imagenet64/fit_ar.py:tiny,overlap"
EXTRA["fit_ar_plain"] = [*EXTRA["fit_ar"], "model.dropout=0.1"]  # the plain order
EXTRA["transformer_bidirectional"] = ["model.attention_dropout=0", "model.pooling=mean"]  # no CLS step: T splits
# Splash over the gathered keys (kernels/softmax/library.py `_split_splash`, interpret mode): whole
# 128-step blocks on each of 4 chips, in the zig-zag order; against the same kernel on one chip.
SPLASH = ["train.seq_len=512", "model.attention_impl=splash", "model.dropout=0"]
CAUSAL["transformer++_splash"] = "configs/enwik8/transformer.py:tiny,plusplus"
EXTRA["transformer++_splash"] = [*SPLASH, "model.num_kv_heads=2"]
BIDIRECTIONAL["transformer_bidirectional_splash"] = "configs/lra/listops/transformer.py:tiny"
EXTRA["transformer_bidirectional_splash"] = [*SPLASH, *EXTRA["transformer_bidirectional"]]
EXTRA["fit_encoder"] = [
  "train.seq_len=128",
  "model.attention_dropout=0",
  "model.use_bias=False",
]  # 8 groups  # ring attention forms no probabilities whole


def mesh_of(data: int, sequence: int):
  return layout.make_mesh(dict(data=data, fsdp=1, sequence=sequence, tensor=1))


def params_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE)


def marks(mesh):
  return () if mesh in QUICK else pytest.mark.slow


# Each family's first config runs on sequence 8 (a block or chunk per chip: every chip both takes and
# passes on what crosses) and on data 2 x sequence 4; a variant of one (another mask, head layout, order,
# embedder or core), whose cross-chip steps the family's meshes already cover, on the quick mesh.
# The ring of 2, where a chip's two neighbours are one chip, is softmax attention's edge case: its ring
# runs there in both directions (causal and not); the scans' and the other rings' cross-chip steps are
# held on 2 chips by the kernels' own tests below (every core on 2, 8 and 2 x 4 chips).
FIRST_CONFIG_MESHES = ("sequence8", "data2_sequence4")
RING_OF_TWO = {"transformer", "transformer_bidirectional"}
VARIANT_MESHES = QUICK
VARIANTS = {
  "latte",  # latte_rglru_swa++ holds its layer, beside RG-LRU and the window attention
  "latte_pallas",  # the Pallas cores split: test_causal_latte_kernel_split_equals_whole and its peers
  "flash_pallas",
  "transformer_vq_pallas",
  "transformer++_gqa",
  "transformer++_yarn",
  "transformer_window",
  "transformer_zigzag",
  "transformer_plain",
  "block_transformer_encoder",
  "block_transformer_plain",
  "fit_ar_plain",
  "fit_encoder",
  "transformer++_splash",
  "transformer_bidirectional_splash",
}


def meshes_of(name):
  if name in VARIANTS:
    return VARIANT_MESHES
  return ("sequence2", *FIRST_CONFIG_MESHES) if name in RING_OF_TWO else FIRST_CONFIG_MESHES


def split_cases(names):
  """(name, mesh) pairs: the meshes of `meshes_of` (in the full suite: the quick tier keeps each family's
  first config on the quick mesh)."""
  return [
    pytest.param(name, mesh, marks=pytest.mark.slow if name in VARIANTS else marks(mesh))
    for name in names
    for mesh in meshes_of(name)
  ]


# -- the train step ------------------------------------------------------------------------------------

_REFERENCE, _FIRST = {}, {}


def reference(name, runner):
  if name not in _REFERENCE:
    _REFERENCE[name] = runner(ONE)
  return _REFERENCE[name]


def first(name, spec, extra):
  """`name`'s initial state, made once: the unsplit and the split runs all start from it, so that each
  split run compiles its step, not the initializer again (its values do not depend on the mesh; the
  initializer over a split mesh is held by test_transformer_vq_windows_split_over_chips_carry_the_cache_as_one
  and over data, fsdp and tensor by test_sharding.py)."""
  if name not in _FIRST:
    _FIRST[name] = first_state(ONE, extra, spec)
  return _FIRST[name]


ONE_LAYER = ["model.num_layers=1"]  # what crosses chips is per layer: one keeps the compiles short
# FIT's: local, global, local (every cross-attention)
LAYERS = {name: ["model.layers=L(1)G(1)L(1)"] for name in ("fit_ar", "fit_ar_plain", "fit_encoder")}


def causal_run(name):
  extra = [*LAYERS.get(name, ONE_LAYER), *EXTRA.get(name, [])]
  start = first(name, CAUSAL[name], extra)
  return lambda mesh: train(mesh, steps=2, spec=CAUSAL[name], extra=extra, documents=True, start=start)


@pytest.mark.parametrize("name, mesh", split_cases(CAUSAL))
def test_causal_families_split_over_chips_train_as_one(name, mesh):
  run = causal_run(name)
  _, _, _, state1, losses1 = reference(name, run)
  config, split_mesh, _, state, losses = run(MESHES[mesh])
  assert split_mesh.shape["sequence"] == config.mesh.sequence > 1
  np.testing.assert_allclose(losses, losses1, **TOLERANCE)
  params_close(state["params"], state1["params"])


def test_transformer_vq_windows_split_over_chips_carry_the_cache_as_one():
  """Update windows of 32 over 4 chips of 8 steps (one block each): the cache and the previous block
  come from the chips before, and the carry into the next window is the last chip's."""
  spec, extra = CAUSAL["transformer_vq"], ["train.update_len=32", *VQ_DROPOUT]
  _, _, _, state1, losses1 = train(ONE, steps=4, spec=spec, extra=extra, windows=2, documents=True)
  _, _, _, state, losses = train(MESHES["data2_sequence4"], steps=4, spec=spec, extra=extra, windows=2, documents=True)
  np.testing.assert_allclose(losses, losses1, **TOLERANCE)
  for part in ("params", "model_state", "carry"):
    params_close(state[part], state1[part])


def classify(spec, extra, mesh_overrides, steps=2, start=None):
  """Train steps of a classifier on padded rows (lengths 1/3 to all of seq_len), from `start` where given
  (as test_sharding.train): losses, state."""
  config = lra_core.load_config(spec, [*mesh_overrides, *extra])
  mesh, rules = layout.make_mesh(config.mesh), config.sharding.rules
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  m = config.model
  task = make_task(config, DataInfo(vocab_size=m.vocab_size, num_classes=m.num_classes))
  rng, t, losses = np.random.default_rng(0), config.train.seq_len, []
  with sharding.activate(mesh, rules):
    step = jax.jit(make_train_step(config, spec, task, tx, schedule), out_shardings=(spec.shardings, None))
    state = initial(spec, start)
    for _ in range(steps):
      mask = np.arange(t)[None] < rng.integers(t // 3, t + 1, size=(8, 1))
      batch = {
        "inputs": np.where(mask, rng.integers(1, m.vocab_size, size=(8, t)), 0).astype(np.int32),
        "mask": mask,
        "targets": rng.integers(0, m.num_classes, size=8).astype(np.int32),
        "weights": np.ones(8, np.float32),
      }
      state, metrics = step(state, to_device(batch, mesh, rules))
      losses.append(float(metrics["loss"][0] / metrics["loss"][1]))
  return losses, state


@pytest.mark.parametrize("name, mesh", split_cases(BIDIRECTIONAL))
def test_bidirectional_families_split_over_chips_train_as_one(name, mesh):
  extra = [*LAYERS.get(name, ONE_LAYER), *EXTRA.get(name, [])]
  start = first(name, BIDIRECTIONAL[name], extra)
  run = lambda overrides: classify(BIDIRECTIONAL[name], extra, overrides, start=start)
  losses1, state1 = reference(name, run)
  losses, state = run(MESHES[mesh])
  np.testing.assert_allclose(losses, losses1, **TOLERANCE)
  params_close(state["params"], state1["params"])


def compiled_step(spec, overrides):
  """(config, the trainer's train step of `spec` compiled for its mesh on the host devices)."""
  config = lra_core.load_config(spec, overrides)
  mesh, rules = layout.make_mesh(config.mesh), config.sharding.rules
  tx, schedule = optim.make_optimizer(config)
  state_spec = make_state_spec(config, mesh, tx)
  task = make_task(config, DataInfo(vocab_size=256, unit="byte"))
  t, rows = config.train.update_len or config.train.seq_len, config.train.batch_size
  batch = {name: np.zeros((rows, t), np.int32) for name in ("inputs", "targets", "segment_ids")}
  batch["weights"] = np.ones((rows, t), np.float32)
  with sharding.activate(mesh, rules):
    step = jax.jit(make_train_step(config, state_spec, task, tx, schedule), out_shardings=(state_spec.shardings, None))
    return config, step.lower(state_spec.abstract, abstract_batch(batch, mesh, rules)).compile()


def gathered_time_axes(spec, extra):
  """The collectives of the compiled train step (data 2 x sequence 4) whose result holds a whole
  update window's time axis: what a split that fell back to gathering the sequence would show."""
  config, compiled = compiled_step(spec, ["mesh.data=2", "mesh.sequence=4", "train.batch_size=8", *extra])
  t, hlo = config.train.update_len or config.train.seq_len, compiled.as_text()
  found = []
  for line in hlo.splitlines():
    op = re.search(r"= (.*?) (all-gather|all-to-all|collective-permute)(-start)?\(", line)
    for shape in re.findall(r"\[([\d,]*)\]", op.group(1)) if op else ():
      dims = [int(d) for d in shape.split(",") if d]
      if len(dims) > 1 and dims[1] == t:  # combined collectives give tuples: each of their shapes
        found.append(f"{op.group(2)} [{shape}]")
  return t, found


@pytest.mark.parametrize(
  "name", ["latte_rglru_swa", "linear_transformer", "flash", "transformer_vq", "transformer_vq_full", "transformer"]
)
def test_split_step_moves_no_activation_across_its_whole_length(name):
  t, found = gathered_time_axes(CAUSAL[name], EXTRA.get(name, []))
  assert t % 4 == 0 and t not in (16, 32)  # the model's widths: a gathered time axis is told apart
  assert not found, found


# Long enough that activations outweigh the parameters and optimizer state every chip keeps whole.
LONG = {"block_transformer": ["train.seq_len=2048"], "fit_ar": ["train.seq_len=3072"]}


@pytest.mark.parametrize("name", sorted(LONG))
def test_split_step_holds_a_chip_s_share_of_the_rows_it_cuts_into_blocks(name):
  """One row over 8 chips: the rows cut from it along the batch (a block's tokens, a group's) stay on
  the chip holding their steps, so a chip's temporaries are a fraction of the whole step's. (The
  Block Transformer's token decoder once ran every block on every chip: 2.8x below the whole step
  rather than 10.5x.)"""
  extra = ["mesh.data=1", "train.batch_size=1", *LAYERS.get(name, ONE_LAYER), *EXTRA[name], *LONG[name]]
  whole, split = (
    compiled_step(CAUSAL[name], [f"mesh.sequence={n}", *extra])[1].memory_analysis().temp_size_in_bytes for n in (1, 8)
  )
  assert split < whole / 5, (whole, split)


@pytest.mark.slow
def test_resumed_with_another_sequence_split_ends_where_the_uninterrupted_run_ends(tmp_path):
  spec = "configs/enwik8/linear_transformer.py:tiny"
  text = tmp_path / "corpus.txt"
  text.write_text(" ".join(np.random.default_rng(0).choice(["alpha", "beta", "gamma", "of"], size=4000)))
  run = ["train.steps=4", "train.eval_batches=1", f"data.path={text}", "mesh.data=1"]
  load = lambda *more: lra_core.load_config(spec, [*run, *more])
  full = train_and_evaluate(load("mesh.sequence=4"), tmp_path / "full")
  assert train_and_evaluate(load("mesh.sequence=1"), tmp_path / "split", stop_at_step=2) == {"stopped_at": 2}
  resumed = train_and_evaluate(load("mesh.sequence=4"), tmp_path / "split")
  # Two of the four steps ran unsplit: equal up to the order of float32 sums.
  assert resumed["param_checksum"] == pytest.approx(full["param_checksum"], rel=1e-6)
  assert resumed["test_loss"] == pytest.approx(full["test_loss"], rel=1e-5)


# -- the kernels ---------------------------------------------------------------------------------------


def documents(b, t, boundaries_at):
  """segment ids int32[B,T]: row 0 changes document exactly at `boundaries_at` (chip edges), the
  others at random places (about 1 in 6 tokens)."""
  rng = np.random.default_rng(3)
  ids = 1 + np.cumsum(rng.random((b, t)) < 1 / 6, axis=1)
  ids[0] = 1 + np.searchsorted(np.asarray(boundaries_at), np.arange(t), side="right")
  return jnp.asarray(ids, jnp.int32)


def split_equals_whole(fn, args, data, sequence, atol=2e-6):
  """fn's loss, output and gradients, whole and with time over `sequence` chips (data x sequence mesh)."""

  def loss(*a):
    y = fn(*a)
    return (y * jnp.sin(y)).sum(), y

  grad = lambda: jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
  (l1, y1), g1 = grad()
  with sharding.activate(mesh_of(data, sequence), DEFAULT_RULES):
    (l2, y2), g2 = grad()
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  for a, b in zip((y2, *g2), (y1, *g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def qkv(b=2, t=32, h=2, latents=4, d=3):
  ks = jax.random.split(jax.random.key(0), 3)
  return (
    jax.random.normal(ks[0], (b, t, h, latents)),
    3 * jax.random.normal(ks[1], (b, t, h, latents)),
    jax.random.normal(ks[2], (b, t, h, d)),
  )


@pytest.mark.parametrize("impl", latte_kernels.IMPLS)
@pytest.mark.parametrize("data,sequence", [(1, 2), (1, 8), (2, 4)])
def test_causal_latte_kernel_split_equals_whole(impl, data, sequence):
  q, k, v = qkv()
  seg = documents(2, 32, boundaries_at=[8, 16, 20])  # on the edges of 2, 4 and 8 chips, and off them
  state = latte_kernels.init_latte_state(2, 2, 4, 3)
  state = dict(state, num=state["num"] + 0.5, den=state["den"] + 1.0, max=state["max"] * 0 + 0.3)  # a carried state
  fn = lambda q, k, v: latte_kernels.causal_latte(q, k, v, impl=impl, chunk=4, segments=seg, state=state)
  split_equals_whole(fn, (q, k, v), data, sequence)
  fn = lambda q, k, v: latte_kernels.causal_latte(q, k, v, impl=impl, chunk=4)
  split_equals_whole(fn, (q, k, v), data, sequence)


@pytest.mark.parametrize("impl", latte_kernels.IMPLS)
def test_bidirectional_latte_kernel_split_equals_whole(impl):
  q, k, v = qkv()
  mask = jnp.arange(32)[None] < jnp.array([[32], [13]])
  fn = lambda q, k, v: latte_kernels.bidirectional_latte(q, k, v, impl=impl, mask=mask)
  split_equals_whole(fn, (q, k, v), 2, 4)


@pytest.mark.parametrize("impl", tiers.quick(list(flash_kernels.IMPLS), keep=[0]))
def test_mixed_chunk_attention_split_equals_whole(impl):
  """FLASH's global part in forms that hold every pair of its settings at least once (causal or not,
  "sum" or "mean", documents with one row's boundaries on the chips' edges or none, padding or none;
  causal rows take no padding), and the form with all of them but causality: 5 forms where all the
  combinations are 12, each a compile of the whole and of the split gradient."""
  b, t, h = 2, 64, 2
  ks = jax.random.split(jax.random.key(5), 5)
  qq, qk, lq, lk = (jax.random.normal(k, (b, t, h, 4)) for k in ks[:4])
  v = jax.random.normal(ks[4], (b, t, h, 3))
  seg = documents(b, t, boundaries_at=[16, 40])
  mask = jnp.arange(t)[None] < jnp.array([[t], [45]])
  forms = [
    (True, "mean", None, None),
    (True, "sum", seg, None),
    (False, "mean", seg, mask),
    (False, "sum", None, mask),
    (False, "sum", seg, None),
  ]
  for causal, norm, segments, padding in forms:
    kw = dict(chunk=4, causal=causal, quad_scale=0.25, lin_scale=0.25, global_norm=norm, impl=impl)
    fn = lambda *a: flash_kernels.mixed_chunk_attention(*a, segments=segments, mask=padding, **kw)
    # The split sums each chip's chunk states in another order: float32 rounding of gradients up to ~13
    # (one element of 768 missed 5e-5 by 1.4e-5 on a loaded host).
    split_equals_whole(fn, (qq, qk, lq, lk, v), 2, 4, atol=1e-4)


@pytest.mark.parametrize("impl", vq_kernels.IMPLS)
def test_vq_attention_split_equals_whole(impl):
  """The compressive cache and the previous block across chips: with and without documents (one
  row's boundaries on the chips' edges) and Transformer-XL position terms; the carry out too."""
  b, t, h, s, l = 2, 64, 2, 5, 4
  ks = jax.random.split(jax.random.key(6), 6)
  q, k, rel_q = (jax.random.normal(key, (b, t, h, 4)) for key in ks[:3])
  v = jax.random.normal(ks[3], (b, t, h, 3))
  codebook, table = jax.random.normal(ks[4], (h, s, 4)), jax.random.normal(ks[5], (h, l + 1, 4))
  z, _ = vq_kernels.quantize(k, codebook)
  k_hat = vq_kernels.codewords(z, codebook)
  seg = documents(b, t, boundaries_at=[16, 40])
  for segments, rel in itertools.product((None, seg), (False, True)):

    def fn(q, k_hat, v, codebook, rel_q):
      position = (rel_q, table) if rel else None
      out, carry = vq_kernels.vq_attention_blocks(
        q, k_hat, z, v, codebook, block_len=l, impl=impl, segments=segments, rel=position
      )
      return out + carry["mean"].sum() + carry["v"].sum()  # the carry after the last chip's last block

    split_equals_whole(fn, (q, k_hat, v, codebook, rel_q), 2, 4, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_window_attention_split_reads_its_neighbours_blocks(causal):
  q, k, v = qkv(h=2, latents=8, d=8)
  seg = documents(2, 32, boundaries_at=[8, 19])
  valid = jnp.arange(32)[None] < jnp.array([[32], [27]])
  fn = lambda q, k, v: attention.local_attention(q, k, v, window=4, causal=causal, k_valid=valid, segments=seg)
  split_equals_whole(fn, (q, k, v), 1, 8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("data,sequence", [(1, 2), (1, 8), (2, 4)])
def test_softmax_attention_split_is_a_ring_equal_to_the_whole(causal, data, sequence):
  """Ring attention (kernels/softmax/ring.py) against the whole masked scores: grouped heads (4 query
  heads on 2 key-value heads), documents on and off the chips' edges, padding."""
  ks = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(ks[0], (2, 32, 4, 8))
  k, v = (3 * jax.random.normal(key, (2, 32, 2, 8)) for key in ks[1:])
  seg = documents(2, 32, boundaries_at=[8, 19])
  valid = jnp.arange(32)[None] < jnp.array([[32], [27]])
  fn = lambda q, k, v: library_attention.self_attention(q, k, v, causal=causal, k_valid=valid, segments=seg)
  split_equals_whole(fn, (q, k, v), data, sequence, atol=5e-5)
  # queries in blocks of 2 rows per step (of a chip's 16, 8 or 4): split == whole == the reference
  blocked = lambda q, k, v: ring_attention(q, k, v, causal=causal, k_valid=valid, segments=seg, query_block=2)
  split_equals_whole(blocked, (q, k, v), data, sequence, atol=5e-5)
  pullback = lambda f: jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v)
  for a, b in zip(pullback(blocked), pullback(fn)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-5)
  np.testing.assert_allclose(
    np.asarray(jax.jit(blocked)(q, k, v)), np.asarray(jax.jit(fn)(q, k, v)), atol=1e-5, rtol=1e-5
  )


@pytest.mark.parametrize("window", [0, 4])
def test_soft_capped_scores_split_equal_the_whole(window):
  """Gemma 2's soft cap on the scores (kernels/softmax/reference.py `cap`) inside ring attention and the split
  sliding window: split == whole, and the cap changes the result (scores reach it)."""
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (2, 32, 4, 8))
  k, v = (3 * jax.random.normal(key, (2, 32, 2, 8)) for key in ks[1:])
  seg = documents(2, 32, boundaries_at=[8, 19])
  kw = dict(causal=True, window=window, segments=seg)
  fn = lambda q, k, v: library_attention.self_attention(q, k, v, soft_cap=2.0, **kw)
  split_equals_whole(fn, (q, k, v), 2, 4, atol=5e-5)
  uncapped = jax.jit(lambda q, k, v: library_attention.self_attention(q, k, v, **kw))(q, k, v)
  assert np.abs(np.asarray(jax.jit(fn)(q, k, v)) - np.asarray(uncapped)).max() > 1e-2


@pytest.mark.parametrize("data,sequence", [(1, 8), (2, 4)])
def test_ring_attention_masks_by_the_positions_it_is_given(data, sequence):
  """FIT-AR's group-causal latents: the causal mask compares each latent's group (8 groups of 4), so a
  group's latents read each other, also across a chip's edge; split == whole == the reference."""
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (2, 32, 4, 8))
  k, v = (3 * jax.random.normal(key, (2, 32, 2, 8)) for key in ks[1:])
  groups = jnp.repeat(jnp.arange(8), 4)
  valid = jnp.arange(32)[None] < jnp.array([[32], [24]])
  fn = lambda q, k, v: library_attention.self_attention(q, k, v, causal=True, k_valid=valid, positions=groups)
  split_equals_whole(fn, (q, k, v), data, sequence, atol=5e-5)
  ring = lambda q, k, v: ring_attention(q, k, v, causal=True, k_valid=valid, positions=groups, query_block=2)
  split_equals_whole(ring, (q, k, v), data, sequence, atol=5e-5)
  np.testing.assert_allclose(np.asarray(jax.jit(ring)(q, k, v)), np.asarray(jax.jit(fn)(q, k, v)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masks", ["documents and padding", "none"])
@pytest.mark.parametrize("data,sequence", [(1, 2), (1, 8), (2, 4)])
def test_the_zigzag_order_gives_the_plain_order_s_attention(data, sequence, masks):
  """Causal ring attention with every chip holding pieces i and 2n-1-i of time (context_parallel.to_zigzag):
  the same outputs and gradients as the whole sequence, back in the plain order. Without masks no ids,
  padding or positions go round the ring: each slice's positions follow from the chip it comes from."""
  ks = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(ks[0], (2, 32, 4, 8))
  k, v = (3 * jax.random.normal(key, (2, 32, 2, 8)) for key in ks[1:])
  seg = documents(2, 32, boundaries_at=[8, 19])
  valid = jnp.arange(32)[None] < jnp.array([[32], [27]])

  def fn(q, k, v):
    order = dict(batch=2, length=32)
    q, k, v, ok, ids = context_parallel.to_zigzag((q, k, v, valid, seg), **order)
    masked = dict(k_valid=ok, segments=ids) if masks != "none" else {}
    with context_parallel.zigzag_order():
      out = ring_attention(q, k, v, causal=True, **masked, query_block=2)
    return context_parallel.from_zigzag(out, **order)

  split_equals_whole(fn, (q, k, v), data, sequence, atol=5e-5)


def test_fold_restarts_where_a_chip_starts_anew():
  """Sums over 8 chips (values 1, 2, 4, ...), fresh on chips 3 and 6: chip i gets the sum since the
  last fresh chip before it (fold_before), or up to the first fresh chip after it (fold_after)."""
  values = 2.0 ** np.arange(8.0)
  fresh = np.isin(np.arange(8), [3, 6])
  before, after = [], []
  for i in range(8):
    start = max([j for j in range(i) if fresh[j]], default=0)
    before.append(100.0 * (start == 0) + float(values[start:i].sum()))
    stop = min([j for j in range(i + 1, 8) if fresh[j]], default=None)
    after.append(float(values[i + 1 : (stop + 1 if stop is not None else 8)].sum()) + 100.0 * (stop is None))

  def chip(v, f):
    edge = jnp.full((1,), 100.0)
    add = lambda a, b: a + b
    got = (
      context_parallel.fold_before(v[:, 0], add, edge, f[:, 0]),
      context_parallel.fold_after(v[:, 0], add, edge, f[:, 0]),
    )
    return jnp.stack(got, 1)[:, None]

  split = lambda v, f: context_parallel.per_chip(chip, (v, f), ("bt", "bt"), "bt.", batch=1, heads=1, length=8)
  with sharding.activate(mesh_of(1, 8), DEFAULT_RULES):
    got = jax.jit(split)(jnp.asarray(values)[None], jnp.asarray(fresh)[None])
  np.testing.assert_allclose(np.asarray(got[0]), np.stack([before, after], 1))


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence_split_equals_whole(reverse):
  a = jax.random.uniform(jax.random.key(1), (2, 32, 5))
  b = jax.random.normal(jax.random.key(2), (2, 32, 5))
  a = a.at[0, 8].set(0.0).at[1, 13].set(0.0)  # restarts on a chip edge and inside a chip
  split_equals_whole(lambda a, b: context_parallel.linear_recurrence(a, b, reverse=reverse), (a, b), 2, 4)


def test_fold_keeps_the_chips_order():
  """A fold of 2x2 matrix products (not commutative) over 8 chips: chip i gets m_0 ... m_{i-1}."""
  mats = jax.random.normal(jax.random.key(4), (8, 2, 2))
  expected = [np.eye(2)]
  for m in np.asarray(mats)[:-1]:
    expected.append(expected[-1] @ m)

  def chip(m):  # m [1, 1, 2, 2]: one row, this chip's matrix
    return context_parallel.fold_before(m[:, 0], jnp.matmul, jnp.eye(2)[None])[:, None]

  mesh = mesh_of(1, 8)
  split = lambda m: context_parallel.per_chip(chip, (m,), ("bt..",), "bt..", batch=1, heads=1, length=8)
  with sharding.activate(mesh, DEFAULT_RULES):
    got = jax.jit(split)(mats[None])
  np.testing.assert_allclose(np.asarray(got[0]), np.stack(expected), rtol=1e-5, atol=1e-6)


# -- configs -------------------------------------------------------------------------------------------


def test_sequence_split_config_errors_are_one_sentence():
  with pytest.raises(
    ConfigError, match=r"model combiner cannot split a sequence.*every row's summary.*latte.*transformer"
  ):
    lra_core.load_config("configs/c4/combiner.py:tiny", ["mesh.sequence=2"])
  with pytest.raises(ConfigError, match=r"model fit_denoiser cannot split a sequence.*square sub-images"):
    lra_core.load_config("configs/imagenet64/fit_denoiser.py:tiny", ["mesh.sequence=2"])
  with pytest.raises(ConfigError, match=r"model.grouping '2d' gathers each group from image rows"):
    lra_core.load_config("configs/lra/image/fit.py:tiny", ["mesh.sequence=2"])
  with pytest.raises(ConfigError, match=r"model.group_size 16 does not divide the 8 steps"):
    lra_core.load_config(BIDIRECTIONAL["fit_encoder"], ["mesh.sequence=8"])
  with pytest.raises(ConfigError, match=r"model.block_len 8 does not divide the 12 steps"):
    lra_core.load_config(
      CAUSAL["block_transformer"], ["mesh.sequence=4", "train.seq_len=48", "model.block_len=8", "data.block_padding=8"]
    )
  with pytest.raises(ConfigError, match=r"model.attention_dropout 0.1 acts on attention probabilities.*set it to 0"):
    lra_core.load_config("configs/enwik8/transformer.py:tiny", ["mesh.sequence=2", "model.attention_dropout=0.1"])
  with pytest.raises(ConfigError, match=r"model.pooling 'cls' puts a step before the sequence.*use 'mean' or 'max'"):
    lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["mesh.sequence=2", "model.attention_dropout=0"])
  with pytest.raises(ConfigError, match=r"train.seq_len 64 does not split into mesh.sequence=3"):
    lra_core.load_config("configs/enwik8/linear_transformer.py:tiny", ["mesh.sequence=3", "train.seq_len=64"])
  with pytest.raises(ConfigError, match=r"model.window 8 does not divide the 12 steps"):
    lra_core.load_config(CAUSAL["latte_rglru_swa"], ["mesh.sequence=4", "train.seq_len=48", "model.window=8"])
  with pytest.raises(ConfigError, match=r"mesh.sequence must be a positive integer"):
    lra_core.load_config(CAUSAL["latte"], ["mesh.sequence=-1"])
  with pytest.raises(ConfigError, match=r"ring attention, which takes no Transformer-XL position bias: set model.rel"):
    lra_core.load_config(CAUSAL["transformer_vq_full"], ["mesh.sequence=2", "train.update_len=64"])
  with pytest.raises(ConfigError, match=r"mesh.sequence needs model.input_scan False"):
    lra_core.load_config(CAUSAL["transformer_vq"], ["mesh.sequence=2", "model.input_scan=True"])


def test_a_config_saved_before_the_sequence_axis_upgrades_to_one_that_can_split():
  saved = json.loads(json.dumps(lra_core.load_config(CAUSAL["latte"]).to_dict()))
  del saved["mesh"]["sequence"]
  saved["sharding"]["rules"] = [
    [name, None if name == "length" else target] for name, target in saved["sharding"]["rules"]
  ]
  upgraded = saved_config.upgrade_config(saved)
  assert upgraded["mesh"]["sequence"] == 1
  assert dict(map(tuple, upgraded["sharding"]["rules"]))["length"] == "sequence"
  assert saved_config.resume_conflicts(saved, lra_core.load_config(CAUSAL["latte"])) == []


def test_batches_split_their_time_steps_over_the_sequence_axis():
  mesh = mesh_of(2, 4)
  batch = {"inputs": np.zeros((8, 64), np.int32), "segment_ids": np.ones((8, 64), np.int32), "targets": np.zeros(8)}
  placed = to_device(batch, mesh, DEFAULT_RULES)
  assert placed["inputs"].sharding.spec == placed["segment_ids"].sharding.spec
  assert tuple(placed["inputs"].sharding.spec)[:2] == ("data", "sequence")
  assert placed["inputs"].addressable_shards[0].data.shape == (4, 16)
  assert tuple(placed["targets"].sharding.spec) == ("data",)
