"""Latte's Pallas kernels (interpret mode on CPU) == the quadratic formulas, per device under a mesh,
and in the trainer: values and gradients, both drivers, float32 and bfloat16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lra_core
import tiers
from lra_core import kernels, layout, sharding
from lra_core.data import DataInfo
from lra_core.errors import ConfigError
from lra_core.kernels import latte as lk
from lra_core.kernels import per_device, toolkit
from lra_core.kernels.latte import backward
from lra_core.kernels.latte import pallas as latte_pallas
from lra_core.run import optim
from lra_core.run.batches import to_device
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task
from oracles import products_outside_kernels

F32 = dict(atol=1e-5, rtol=1e-5)
# bf16 inputs and outputs: both sides compute in float32 and round once to bf16 (2^-8 relative), so
# an output may differ by an ulp; the gradients are bf16 too.
BF16 = dict(atol=2e-2, rtol=2e-2)
O0 = {"xla_backend_optimization_level": 0}  # these tests check numbers: -O0 halves CPU compile times


def run(fn, *args):
  """fn(*args), jitted and compiled at -O0."""
  return jax.jit(fn).lower(*args).compile(O0)(*args)


def qkv(b=2, t=13, h=2, l=5, d=4, dtype=np.float32):
  """Random q, k [B,T,H,L] and v [B,T,H,D] (numpy: no per-shape compiles for the test data)."""
  rng = np.random.default_rng(0)
  return tuple(rng.standard_normal((b, t, h, n)).astype(dtype) for n in (l, l, d))


def value_and_grads(fn, q, k, v):
  """fn(q, k, v) and the gradients of a position- and channel-weighted sum of it to q, k, v."""
  weights = jnp.cos(jnp.arange(v.shape[-1]) + jnp.arange(v.shape[1])[:, None, None])
  y, vjp = jax.vjp(fn, q, k, v)
  return y, vjp((weights * jnp.ones_like(y, jnp.float32)).astype(y.dtype))


def assert_same(got, want, dtype=np.float32):
  """Equal pytrees of arrays (same dtypes, finite), to the tolerance of `dtype` inputs."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and np.isfinite(np.asarray(a, np.float32)).all()
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), **(F32 if dtype == np.float32 else BF16)
    )


def assert_equals_reference(fn, reference, q, k, v, *, grads=True):
  """fn == reference on (q, k, v) in value (and gradients), in one compiled program."""
  check = value_and_grads if grads else (lambda f, *a: f(*a))
  got, want = run(lambda *a: (check(fn, *a), check(reference, *a)), q, k, v)
  assert_same(got, want, q.dtype)


# -- causal ---------------------------------------------------------------------------------------------

# T odd (padded to whole chunks), chunks of 1 to 16 (one longer than T), L per head 8 to 512. Gradients on
# the grid driver, whose backward is a kernel (the loop driver's is the XLA form's VJP), once per dtype.
CAUSAL_CASES = [  # t, chunk, l, driver, dtype, grads
  (13, 4, 64, "grid", np.float32, True),
  (37, 8, 64, "loop", np.float32, False),
  (13, 4, 512, "loop", np.float32, False),
  (7, 16, 64, "grid", np.float32, False),
  (13, 1, 8, "loop", jnp.bfloat16, False),
  (13, 8, 64, "grid", jnp.bfloat16, True),
]


@pytest.mark.parametrize("t,chunk,l,driver,dtype,grads", CAUSAL_CASES)
def test_causal_kernel_equals_quadratic_formula(t, chunk, l, driver, dtype, grads):
  fast = lambda q, k, v: latte_pallas.causal_latte(q, k, v, chunk=chunk, driver=driver)
  assert_equals_reference(fast, lk.causal_latte_reference, *qkv(t=t, l=l, dtype=dtype), grads=grads)


@pytest.mark.parametrize("driver", latte_pallas.DRIVERS)
def test_causal_kernel_is_stable_for_logits_spread_over_thousands(driver):
  """Key logits over [-1500, 1500] (e^1500 overflows float32 by far), 3 blocks: still the exact formula."""
  q, _, v = qkv(t=37)
  k = (3000.0 * (np.random.default_rng(4).random(q.shape) - 0.5)).astype(np.float32)
  fast = lambda q, k, v: latte_pallas.causal_latte(q, k, v, chunk=16, driver=driver)
  assert_equals_reference(fast, lk.causal_latte_reference, 300.0 * q, k, v, grads=driver == "grid")


def test_causal_kernel_continues_a_carried_state():
  def continued(q, k, v):
    state = lk.init_latte_state(2, 2, 5, 4)
    for i in range(5):
      _, state = lk.latte_step(q[:, i], k[:, i], v[:, i], state)
    return kernels.causal_latte(q[:, 5:], k[:, 5:], v[:, 5:], chunk=4, state=state, impl="pallas")

  got, want = run(lambda *a: (continued(*a), lk.causal_latte_reference(*a)[:, 5:]), *qkv(t=12))
  assert_same(got, want)


# Row 0: documents of 3, 5 and 3 tokens (blocks of 4: a document across a block edge, one starting on one);
# row 1: one document. The carried state continues each row's first document.
GRAD_SEGMENTS = np.array([[1] * 3 + [2] * 5 + [3] * 3, [1] * 11], np.int32)


# The loop driver (GPU) with 2 value tiles (the sums over D split over programs, added after the call) and
# 2 latent groups per program.
GRAD_DRIVERS = {"grid": {}, "loop": dict(value_block=2, latent_block=4)}


@pytest.mark.parametrize("driver", GRAD_DRIVERS)
@pytest.mark.parametrize("segments", [None, GRAD_SEGMENTS], ids=["plain", "documents"])
def test_causal_gradient_is_two_kernels_equal_to_the_reference_vjp(segments, driver):
  """The causal gradient is two Pallas kernels on either driver (kernels/latte/backward.py: the forward scan
  once more, then a reverse scan carrying the adjoints of num and den): the gradients to q, k, v,
  latent_scale and a carried state (num, den, max) equal the XLA form's VJP (the oracle), with and without
  packed documents, with key logits spread over hundreds and a last block running past T; the value and
  gradient trace to 3 pallas_calls and to no more matrix products outside them than the forward's plus 2."""
  q, k, v = qkv(b=2, t=11, l=8)
  k = 50 * k
  scale = (np.random.default_rng(3).random(q.shape) > 0.3).astype(np.float32) / 0.7
  rng = np.random.default_rng(5)
  state = {
    "num": rng.standard_normal((2, 2, 8, 4)).astype(np.float32),
    "den": (1 + rng.random((2, 2, 8))).astype(np.float32),
    "max": (20 * rng.standard_normal((2, 2, 8))).astype(np.float32),
  }
  weights = jnp.cos(jnp.arange(v.shape[-1]) + jnp.arange(v.shape[1])[:, None, None])

  def loss(fn):
    return lambda q, k, v, s, state: (
      fn(q, k, v, chunk=4, state=state, segments=segments, latent_scale=s) * weights
    ).sum()

  fast = loss(functools.partial(latte_pallas.causal_latte, driver=driver, **GRAD_DRIVERS[driver]))
  xla = loss(lk.causal_latte)
  grads = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))
  got, want = run(lambda *a: (grads(fast)(*a), grads(xla)(*a)), q, k, v, scale, state)
  assert_same(got, want)
  traced = jax.make_jaxpr(grads(fast))(q, k, v, scale, state).jaxpr
  forward = jax.make_jaxpr(fast)(q, k, v, scale, state).jaxpr
  assert str(traced).count("pallas_call") == 3
  assert products_outside_kernels(traced) <= products_outside_kernels(forward) + 2


# The "loop" driver's tiles (GPU): value columns per program and latents per group (causal, linear sums) or
# per program (bidirectional reduction), dividing D and L or not (then one tile covers all), with packed
# documents and a carried state.
TILE_CASES = [  # value_block, latent_block, segments
  (2, 4, False),
  (4, 2, True),
  (3, 8, False),
  (8, 3, True),
]


@pytest.mark.parametrize(
  "value_block,latent_block,segmented",
  tiers.quick(TILE_CASES, keep=[0, 1], ids=lambda c: f"v{c[0]}-l{c[1]}-seg{int(c[2])}"),
)
def test_loop_driver_tiles_equal_the_formulas(value_block, latent_block, segmented):
  """Both kernels on the "loop" driver with the given tiles == the formulas (causal: the XLA form with a
  carried state, or the quadratic one with documents), large key logits."""
  q, k, v = qkv(t=15, l=8, d=4)
  k = 30 * k
  segments = SEGMENTS if segmented else None
  state = lk.init_latte_state(2, 2, 8, 4)
  state = {**state, "num": state["num"] + 0.5, "den": state["den"] + 2.0, "max": state["max"] * 0 + 1.0}
  tiles = dict(driver="loop", value_block=value_block, latent_block=latent_block)

  def fast(q, k, v):
    causal = latte_pallas.causal_latte(q, k, v, chunk=4, state=None if segmented else state, segments=segments, **tiles)
    return causal, latte_pallas.bidirectional_latte(q, k, v, block=4, chunk=4, segments=segments, **tiles)

  def references(q, k, v):
    causal = (
      lk.causal_latte_reference(q, k, v, segments=segments)
      if segmented
      else lk.causal_latte(q, k, v, chunk=4, state=state, impl="xla")
    )
    return causal, lk.bidirectional_latte_reference(q, k, v, segments=segments)

  assert_same(run(fast, q, k, v), run(references, q, k, v))


def test_kernels_for_gpu_equal_the_formulas_in_interpret_mode():
  """The GPU layout as traced for a GPU target, run in interpret mode: default blocks and tiles from
  `toolkit.GPU_TILES` (two value tiles, two latent groups or tiles, time padded to whole blocks), with and
  without packed documents (the gradients are the XLA form's whatever the layout: checked above)."""
  causal, both = toolkit.gpu_tiles("causal_latte"), toolkit.gpu_tiles("bidirectional_latte")
  l, d = 2 * causal["latent_block"], 2 * causal["value_block"]
  assert (l, d) == (2 * both["latent_block"], 2 * both["value_block"])
  q, k, v = qkv(b=1, t=causal["chunk"] + 5, l=l, d=d)
  segments = np.array([[1] * 7 + [2] * (q.shape[1] - 7)], np.int32)
  for segs in (None, segments):

    def fast(q, k, v):
      return latte_pallas.causal_latte(q, k, v, segments=segs, interpret=True) + latte_pallas.bidirectional_latte(
        q, k, v, segments=segs, interpret=True
      )

    def reference(q, k, v):
      return lk.causal_latte_reference(q, k, v, segments=segs) + lk.bidirectional_latte_reference(
        q, k, v, segments=segs
      )

    with toolkit.target("gpu"):
      assert latte_pallas.default_chunk() == causal["chunk"]
      assert latte_pallas.default_block(segs is not None) == both["chunk" if segs is not None else "block"]
      jaxpr = str(jax.make_jaxpr(fast)(q, k, v))
      got = run(fast, q, 10 * k, v)
    # (batch, heads, value tiles, latent tiles): the latents in groups inside causal and the linear sums
    assert "grid=(1, 2, 2, 1)" in jaxpr and ("grid=(1, 2, 2, 2)" in jaxpr) == (segs is None)
    assert_same(got, run(reference, q, 10 * k, v))


@pytest.mark.parametrize("t", [10, 21])
def test_bidirectional_gradient_for_gpu_in_interpret_mode(t):
  """The backward kernel as traced for a GPU target (one head per program; blocks of 16, a power of two,
  past the end of a 10-step sequence and off the end of a 21-step one), run in interpret mode: the
  quadratic formula's gradients."""
  q, k, v = qkv(b=1, t=t, l=16, d=32)
  fast = lambda q, k, v: latte_pallas.bidirectional_latte(q, k, v, interpret=True)
  with toolkit.target("gpu"):
    assert backward.heads_per_program(2, 16, 32) == 1
    got = run(lambda *a: value_and_grads(fast, *a), q, 10 * k, v)
  assert_same(got, run(lambda *a: value_and_grads(lk.bidirectional_latte_reference, *a), q, 10 * k, v))


def test_value_widths_triton_cannot_take_are_padded_for_gpu():
  """For a GPU target D is padded to a power of two (c4's heads are 96 wide): run here in interpret
  mode with the loop driver, D = 6 (padded to 8), with a carried state, both kernels equal their
  references and the kernels see the padded width."""
  q, k, v = qkv(t=12, d=6)
  state = lk.init_latte_state(2, 2, 5, 6)
  state = {**state, "num": state["num"] + 0.5, "den": state["den"] + 2.0}

  def both(q, k, v):
    causal = latte_pallas.causal_latte(q, k, v, chunk=4, state=state, driver="loop", interpret=True)
    bidirectional = latte_pallas.bidirectional_latte(q, k, v, block=4, driver="loop", interpret=True)
    return causal, bidirectional

  def references(q, k, v):
    causal = lk.causal_latte(q, k, v, chunk=4, state=state, impl="xla")
    return causal, lk.bidirectional_latte_reference(q, k, v)

  with toolkit.target("gpu"):
    jaxpr = str(jax.make_jaxpr(both)(q, k, v))
    got = run(both, q, k, v)
  assert "f32[2,2,8,5]" in jaxpr  # the state [B,H,D,L] at D = 8
  assert_same(got, run(references, q, k, v))


# -- bidirectional -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", latte_pallas.DRIVERS)
def test_bidirectional_kernel_equals_quadratic_formula(driver):
  """Blocks of 4 over 11 steps (padded), large key logits; float32 with padding (some, and a whole
  row), bfloat16 without."""
  padded = np.arange(11)[None] < np.array([[11], [6], [0]])
  for mask, dtype in ((padded, np.float32), (None, jnp.bfloat16)):
    fast = lambda q, k, v: latte_pallas.bidirectional_latte(q, k, v, mask=mask, block=4, driver=driver)
    reference = lambda q, k, v: lk.bidirectional_latte_reference(q, k, v, mask=mask)
    q, k, v = qkv(b=3, t=11, l=8)
    assert_equals_reference(fast, reference, *(x.astype(dtype) for x in (q, 50 * k, v)))


# The forward's drivers; the backward kernel with one head per program (the GPU's) and with both heads
# side by side (a block-diagonal dS, as on TPU where a head's lanes do not fill a tile).
@pytest.mark.parametrize("driver, grad_heads", [("grid", 2), ("loop", 1)])
def test_bidirectional_gradient_is_a_kernel_equal_to_the_reference_vjp(driver, grad_heads):
  """Without documents the summary's gradient is a Pallas kernel (kernels/latte/backward.py) fed by the
  forward's max, normaliser and summary: the gradients to q, k, v and latent_scale equal the XLA form's VJP
  (the oracle), with padding (a whole row too), key logits spread over hundreds and a last time block
  running past T; the value and gradient trace to 2 pallas_calls (the reduction and its backward) and to no
  more matrix products outside them than the forward's plus 2 (the summary's and p(l|t)'s cotangents)."""
  q, k, v = qkv(b=3, t=11, l=8)
  k = 50 * k
  mask = np.arange(11)[None] < np.array([[11], [6], [0]])
  scale = (np.random.default_rng(3).random(q.shape) > 0.3).astype(np.float32) / 0.7
  weights = jnp.cos(jnp.arange(v.shape[-1]) + jnp.arange(v.shape[1])[:, None, None])

  def loss(fn):
    return lambda q, k, v, s: (fn(q, k, v, mask=mask, latent_scale=s) * weights).sum()

  fast = loss(functools.partial(latte_pallas.bidirectional_latte, block=4, driver=driver, grad_heads=grad_heads))
  xla = loss(lk.bidirectional_latte)
  grads = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3))
  got, want = run(lambda *a: (grads(fast)(*a), grads(xla)(*a)), q, k, v, scale)
  assert_same(got, want)
  traced = jax.make_jaxpr(grads(fast))(q, k, v, scale).jaxpr
  forward = jax.make_jaxpr(fast)(q, k, v, scale).jaxpr
  assert str(traced).count("pallas_call") == 2
  assert products_outside_kernels(traced) <= products_outside_kernels(forward) + 2


# -- packed documents ----------------------------------------------------------------------------------------

# Row 0: documents of 5, 6 and 3 tokens and one padding token (blocks of 4: boundaries inside blocks
# and one on a block edge); row 1: one document.
SEGMENTS = np.array([[1] * 5 + [2] * 6 + [3] * 3 + [0], [1] * 15], np.int32)


@pytest.mark.parametrize("driver", latte_pallas.DRIVERS)
def test_kernels_with_segments_equal_the_masked_formulas(driver):
  """Both kernels with packed documents == the quadratic formulas with a per-document mask, values
  and gradients, with large key logits, padding and a latent scale. The bidirectional gradient is the
  linear sums' own kernels (dr, de, dv: the forward's sums of other operands, each a forward and a
  reversed scan): its value and gradient trace to 8 pallas_calls."""
  q, k, v = qkv(t=15, l=8)
  k = 30 * k
  scale = (np.random.default_rng(3).random(q.shape) > 0.3).astype(np.float32) / 0.7
  mask = np.arange(15)[None] < np.array([[14], [10]])
  causal = lambda q, k, v: latte_pallas.causal_latte(
    q, k, v, chunk=4, segments=SEGMENTS, latent_scale=scale, driver=driver
  )
  assert_equals_reference(
    causal, lambda q, k, v: lk.causal_latte_reference(q, k, v, segments=SEGMENTS, latent_scale=scale), q, k, v
  )
  both = lambda q, k, v: latte_pallas.bidirectional_latte(
    q, k, v, mask=mask, segments=SEGMENTS, latent_scale=scale, chunk=4, driver=driver
  )
  assert str(jax.make_jaxpr(functools.partial(value_and_grads, both))(q, k, v)).count("pallas_call") == 8
  assert_equals_reference(
    both,
    lambda q, k, v: lk.bidirectional_latte_reference(q, k, v, mask=mask, segments=SEGMENTS, latent_scale=scale),
    q,
    k,
    v,
  )


def test_kernels_with_segments_run_per_device_under_a_mesh():
  """Batch over 'data' and 'fsdp' (as the trainer splits it under FSDP), heads over 'tensor': the document
  indices split with the batch; the values and the gradients (the backward kernels, per device too) equal
  the unsharded quadratic formulas'."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  segs = np.array([[1] * 3 + [2] * 6, [1] * 9, [1] * 7 + [0] * 2, [1, 2, 2, 3, 3, 3, 4, 4, 4]], np.int32)
  fns = (
    lambda q, k, v: kernels.causal_latte(q, k, v, chunk=4, impl="pallas", segments=segs),
    lambda q, k, v: kernels.bidirectional_latte(q, k, v, chunk=4, impl="pallas", segments=segs),
  )
  references = (
    lambda q, k, v: lk.causal_latte_reference(q, k, v, segments=segs),
    lambda q, k, v: lk.bidirectional_latte_reference(q, k, v, segments=segs),
  )

  def both(fns, q, k, v):
    return [value_and_grads(fn, q, k, v) for fn in fns]

  q, k, v = qkv(b=4, t=9, l=8)
  with per_device.per_device_mesh(mesh, batch=("data", "fsdp"), heads="tensor"):
    # causal: the kernel and its backward's two (2 shard_maps); bidirectional: the linear sums forward and
    # reversed, for the output and for each of its 3 gradients (8)
    assert str(jax.make_jaxpr(functools.partial(both, fns))(q, k, v)).count("shard_map") == 10
    sharded = run(functools.partial(both, fns), q, k, v)
  assert_same(sharded, run(functools.partial(both, references), q, k, v))


# -- per device under a mesh ---------------------------------------------------------------------------------


def test_kernels_run_per_device_under_a_mesh():
  """Batch 4 over 'data', heads 2 over 'tensor' through shard_map: the values and gradients of the
  unsharded formulas (which the unsharded kernels equal, above)."""
  assert jax.device_count() == 8
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  mask = np.arange(9)[None] < np.array([[9], [5], [9], [2]])
  causal = lambda q, k, v: kernels.causal_latte(q, k, v, chunk=4, impl="pallas")
  bidirectional = lambda q, k, v: kernels.bidirectional_latte(q, k, v, mask=mask, impl="pallas")
  references = (lk.causal_latte_reference, lambda q, k, v: lk.bidirectional_latte_reference(q, k, v, mask=mask))

  def both(fns, q, k, v):
    return [value_and_grads(fn, q, k, v) for fn in fns]

  q, k, v = qkv(b=4, t=9, l=8)
  with per_device.per_device_mesh(mesh, batch="data", heads="tensor"):
    # the causal kernel and its two backward kernels (one shard_map), the bidirectional reduction and its backward
    assert str(jax.make_jaxpr(functools.partial(both, (causal, bidirectional)))(q, k, v)).count("shard_map") == 4
    sharded = run(functools.partial(both, (causal, bidirectional)), q, k, v)
  assert_same(sharded, run(functools.partial(both, references), q, k, v))


# -- the model in the trainer ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_lm_trains_the_same_with_the_kernel():
  """Three trainer steps (lra_core.run.steps) of the tiny causal LM (one layer) on random bytes, once per impl."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, size=(3, 8, 65)).astype(np.int32)
  state, losses = None, {}
  for impl in ("xla", "pallas"):
    config = lra_core.load_config("configs/c4/latte.py:tiny", ["model.num_layers=1", f"model.impl={impl}"])
    mesh, rules = layout.make_mesh(config.mesh), config.sharding.rules
    tx, schedule = optim.make_optimizer(config)
    spec = make_state_spec(config, mesh, tx)
    task = make_task(config, DataInfo(vocab_size=config.model.vocab_size, unit="byte"))
    with sharding.activate(mesh, rules):
      state = spec.init.lower().compile(O0)() if state is None else state  # one initial state for both
      batches = [
        to_device(
          {"inputs": x[:, :-1], "targets": x[:, 1:], "weights": np.ones(x[:, 1:].shape, np.float32)}, mesh, rules
        )
        for x in tokens
      ]
      step = jax.jit(make_train_step(config, spec, task, tx, schedule)).lower(state, batches[0]).compile(O0)
      current, losses[impl] = state, []
      for batch in batches:
        current, metrics = step(current, batch)
        losses[impl].append(float(metrics["loss"][0] / metrics["loss"][1]))
  np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-4)
  assert losses["pallas"][0] != losses["pallas"][-1]  # the parameters moved


def test_bidirectional_classifier_with_padding_is_the_same_with_the_kernel():
  """The LRA Text tiny classifier (bidirectional Latte) on padded batches: equal logits per impl."""
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, 200, size=(2, 24)), jnp.int32)
  mask = jnp.arange(24)[None, :] < jnp.array([[24], [13]])
  logits = {}
  for impl in ("xla", "pallas"):
    config = lra_core.load_config("configs/lra/text/latte.py:tiny", ["model.num_layers=1", f"model.impl={impl}"])
    model = lra_core.build_model(config, seed=0)
    model.eval()
    logits[impl] = jax.jit(lambda x, m: model(x, mask=m), compiler_options=O0)(jnp.where(mask, tokens, 0), mask)
  np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=1e-5)


def test_bad_impl_is_a_clear_error():
  q, k, v = qkv()
  with pytest.raises(ValueError, match=r"impl 'triton' is not one of \('xla', 'pallas'\)"):
    kernels.causal_latte(q, k, v, impl="triton")
  with pytest.raises(ValueError, match=r"impl 'triton' is not one of \('xla', 'pallas'\)"):
    kernels.bidirectional_latte(q, k, v, impl="triton")
  with pytest.raises(ConfigError, match=r"model.impl 'triton' is not one of \['xla', 'pallas'\]"):
    lra_core.load_config("configs/c4/latte.py:tiny", ["model.impl=triton"])
