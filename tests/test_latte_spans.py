"""Latte's chunk-parallel passes (kernels/latte/spans.py) == the unsplit scans: causal Latte over spans on
either impl and driver, and the bidirectional reduction and linear sums over spans, values and gradients,
with packed documents and a carried state, per device under a mesh; and for a GPU target the spans are
programs of their own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_core import kernels, layout, sharding
from lra_core.config import DEFAULT_RULES
from lra_core.kernels import context_parallel, per_device, toolkit
from lra_core.kernels import latte as lk
from lra_core.kernels.latte import pallas as latte_pallas
from lra_core.kernels.latte import spans
from oracles import products_outside_kernels

F32 = dict(atol=2e-5, rtol=2e-5)
O0 = {"xla_backend_optimization_level": 0}  # these tests check numbers: -O0 halves CPU compile times
T, SPAN = 29, 8  # four spans, the last one padded
# Row 0: documents starting inside the first span, on the second span's first token (8) and inside the
# third; row 1: one document through every span.
SEGMENTS = np.array([[1] * 5 + [2] * 3 + [3] * 11 + [4] * 10, [7] * T], np.int32)
LOOP = dict(driver="loop", value_block=2, latent_block=4)  # two value tiles, two latent groups


def run(fn, *args):
  """fn(*args), jitted and compiled at -O0."""
  return jax.jit(fn).lower(*args).compile(O0)(*args)


def inputs(b=2, t=T, h=2, l=8, d=4):
  """q, k (logits spread over tens), v, a latent scale and a carried state, numpy."""
  rng = np.random.default_rng(0)
  q, k = (rng.standard_normal((b, t, h, l)).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((b, t, h, d)).astype(np.float32)
  scale = (rng.random((b, t, h, l)) > 0.3).astype(np.float32) / 0.7
  state = {
    "num": rng.standard_normal((b, h, l, d)).astype(np.float32),
    "den": (1 + rng.random((b, h, l))).astype(np.float32),
    "max": (10 * rng.standard_normal((b, h, l))).astype(np.float32),
  }
  return q, 20 * k, v, scale, state


def value_and_grads(fn, *args):
  """fn(*args) and the gradients of a position- and channel-weighted sum of it to every argument."""
  y, vjp = jax.vjp(fn, *args)
  weights = jnp.cos(jnp.arange(y.shape[-1]) + jnp.arange(y.shape[1])[:, None, None])
  return y, vjp(weights * jnp.ones_like(y))


def assert_same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **F32)


CAUSAL = {
  "xla": functools.partial(lk.causal_latte, impl="xla", chunk=4, span=SPAN),
  "grid": functools.partial(lk.causal_latte, impl="pallas", chunk=4, span=SPAN),
  # the loop driver (GPU) in interpret mode, through the spans' own entry
  "loop": lambda q, k, v, **kw: spans.causal(
    functools.partial(latte_pallas.causal_latte, chunk=4, interpret=True, **LOOP), q, k, v, span=SPAN, **kw
  ),
}


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["plain", "documents"])
@pytest.mark.parametrize("form", CAUSAL)
def test_causal_spans_equal_the_unsplit_scan(form, segments):
  """Causal Latte over spans of 8 tokens (T 29: the last span padded; documents starting inside a span
  and on a span's first token) == the XLA form's unsplit scan, from a carried state, with a latent scale:
  the output and the gradients to q, k, v, the scale and the state (through the kernels' VJP of each
  span's starting state and JAX's of the fold)."""
  q, k, v, scale, state = inputs()

  def split(q, k, v, scale, state):
    return CAUSAL[form](q, k, v, state=state, segments=segments, latent_scale=scale)

  def whole(q, k, v, scale, state):
    return lk.causal_latte(q, k, v, impl="xla", chunk=4, state=state, segments=segments, latent_scale=scale)

  both = lambda *a: (value_and_grads(split, *a), value_and_grads(whole, *a))
  got, want = run(both, q, k, v, scale, state)
  assert_same(got, want)


@pytest.mark.parametrize("driver", [{"driver": "grid"}, LOOP], ids=["grid", "loop"])
@pytest.mark.parametrize("documents", [False, True], ids=["mask", "documents"])
def test_bidirectional_spans_equal_the_unsplit_kernels(driver, documents):
  """The bidirectional reduction (its spans' states merged after the kernel) and the linear sums of packed
  documents (each span started from the sums before it, both directions) over spans of 8 == the same kernels
  unsplit, values and gradients, with padding masked or documents."""
  q, k, v, scale, _ = inputs()
  kw = dict(block=4, chunk=4, latent_scale=scale, interpret=True, **driver)
  kw |= dict(segments=SEGMENTS) if documents else dict(mask=np.arange(T)[None] < np.array([[T], [19]]))
  split = functools.partial(latte_pallas.bidirectional_latte, span=SPAN, **kw)
  whole = functools.partial(latte_pallas.bidirectional_latte, span=None, **kw)
  got, want = run(lambda *a: (value_and_grads(split, *a), value_and_grads(whole, *a)), q, k, v)
  assert_same(got, want)


def test_spans_are_programs_of_their_own_on_gpu():
  """Traced for a GPU target at T = 2 spans (`toolkit.GPU_TILES`'s 256): the causal kernel and its two
  backward kernels, and the bidirectional reduction, launch twice the programs along the batch or head axis
  of the grid; the causal value and gradient hold 3 pallas_calls and no more matrix products outside them
  than the forward's plus 2 (the spans' own states and their VJP)."""
  span = toolkit.gpu_tiles("causal_latte")["span"]
  assert span == toolkit.gpu_tiles("bidirectional_latte")["span"]
  q, k, v, _, _ = inputs(b=1, t=2 * span, h=2, l=32, d=64)
  causal = lambda q, k, v: lk.causal_latte(q, k, v, impl="pallas")
  with toolkit.target("gpu"):
    assert latte_pallas.default_span() == span
    forward = jax.make_jaxpr(causal)(q, k, v).jaxpr
    traced = jax.make_jaxpr(functools.partial(value_and_grads, causal))(q, k, v).jaxpr
    reduction = str(jax.make_jaxpr(lambda q, k, v: lk.bidirectional_latte(q, k, v, impl="pallas"))(q, k, v))
  assert str(traced).count("pallas_call") == 3 and str(traced).count("grid=(2, 2, 2, 1)") == 3
  assert products_outside_kernels(traced) <= products_outside_kernels(forward) + 2
  assert "grid=(1, 4, 2, 2)" in reduction  # heads x spans, value tiles, latent tiles
  with toolkit.target("tpu"):
    assert latte_pallas.default_span() is None


def test_spans_run_per_device_under_a_mesh():
  """Batch over 'data' and 'fsdp' (as the trainer splits it under FSDP), heads over 'tensor': causal Latte
  over spans (the spans' rows split with their batch rows) and the bidirectional linear sums over spans, with
  packed documents, equal the unsplit XLA forms, values and gradients."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  segments = np.concatenate([SEGMENTS, SEGMENTS[::-1]])
  q, k, v, _, _ = inputs(b=4)
  fns = (
    lambda q, k, v: kernels.causal_latte(q, k, v, chunk=4, impl="pallas", span=SPAN, segments=segments),
    lambda q, k, v: latte_pallas.bidirectional_latte(q, k, v, chunk=4, span=SPAN, segments=segments),
  )
  references = (
    lambda q, k, v: lk.causal_latte(q, k, v, chunk=4, segments=segments),
    lambda q, k, v: lk.bidirectional_latte(q, k, v, chunk=4, segments=segments),
  )
  both = lambda fns, *a: [value_and_grads(fn, *a) for fn in fns]
  with per_device.per_device_mesh(mesh, batch=("data", "fsdp"), heads="tensor"):
    sharded = run(functools.partial(both, fns), q, k, v)
  assert_same(sharded, run(functools.partial(both, references), q, k, v))


@pytest.mark.parametrize("impl", lk.IMPLS)
def test_spans_inside_each_chip_of_a_split_sequence_equal_the_whole(impl):
  """Time over 2 chips (kernels/context_parallel.py) and each chip's 16 tokens over spans of 8 (T 32; a
  document starting on the second chip's first token, others inside spans): the output and gradients equal
  the unsplit XLA form's on one device."""
  q, k, v, scale, state = inputs(t=32)
  segments = np.array([[1] * 5 + [2] * 11 + [3] * 10 + [4] * 6, [7] * 32], np.int32)
  split = lambda q, k, v, state: lk.causal_latte(q, k, v, impl=impl, chunk=4, span=SPAN, state=state, segments=segments)
  whole = lambda q, k, v, state: lk.causal_latte(q, k, v, chunk=4, state=state, segments=segments)
  want = run(functools.partial(value_and_grads, whole), q, k, v, state)
  with sharding.activate(layout.make_mesh(dict(data=1, fsdp=1, sequence=2, tensor=1)), DEFAULT_RULES):
    assert context_parallel.split(32)
    got = run(functools.partial(value_and_grads, split), q, k, v, state)
  assert_same(got, want)


def test_a_span_below_one_is_a_clear_error():
  q, k, v, _, _ = inputs(t=8)
  with pytest.raises(ValueError, match="span must be >= 1"):
    lk.causal_latte(q, k, v, span=0)
