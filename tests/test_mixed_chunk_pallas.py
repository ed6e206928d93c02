"""FLASH's mixed chunk attention kernel (interpret mode on CPU) == the XLA form and the quadratic
oracles, per device under a mesh, and in the trainer: values and gradients, both drivers (grid, the
TPU's; parallel, the GPU's), float32 and bfloat16; the GPU's default driver and tiles as traced for a
GPU (tests/test_gpu_kernels.py compiles them for an H100)."""

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
from lra_core.kernels import mixed_chunk as fk
from lra_core.kernels import per_device, toolkit
from lra_core.kernels.mixed_chunk import gpu_parallel as flash_parallel
from lra_core.kernels.mixed_chunk import pallas as flash_pallas
from lra_core.kernels.mixed_chunk import tpu_grid as flash_grid
from lra_core.run import optim
from lra_core.run.batches import to_device
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task
from oracles import kernel_calls, products_outside_kernels

# Tolerances relative to the largest magnitude of the reference (at least 1).
# float32: both sides accumulate in float32 in another order. bfloat16: inputs and outputs in bf16,
# sums in float32, one rounding to bf16 (2^-8 relative) at the end, so an output may differ by an ulp.
F32, BF16 = 1e-5, 1e-2
O0 = {"xla_backend_optimization_level": 0}  # these tests check numbers: -O0 halves CPU compile times


def run(fn, *args):
  """fn(*args), jitted and compiled at -O0."""
  return jax.jit(fn, compiler_options=O0)(*args)


def inputs(b=2, t=37, h=2, s=8, e=6, chunk=8, dtype=jnp.float32):
  """quad_q, quad_k, lin_q, lin_k [B,T,H,S], v [B,T,H,E], bias [C,C], and a padding mask whose second
  row keeps about half of the positions (a padded tail of whole and partial chunks). numpy draws
  them: no compilation outside the functions under test."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(dtype))
  qk = [normal(b, t, h, s) for _ in range(4)]
  v, bias = normal(b, t, h, e), jnp.asarray((0.3 * rng.standard_normal((chunk, chunk))).astype(dtype))
  lengths = np.array([t, t // 2 + 1] + [t] * (b - 2))
  return qk, v, bias, jnp.asarray(np.arange(t)[None] < lengths[:, None])


def value_and_grads(fn, *args):
  """fn(*args) and the gradients of a position- and channel-weighted sum of it to every argument."""
  y, vjp = jax.vjp(fn, *args)
  weights = jnp.cos(jnp.arange(y.shape[-1]) + jnp.arange(y.shape[1])[:, None, None])
  return y, vjp((weights * jnp.ones_like(y, jnp.float32)).astype(y.dtype))


def assert_close(got, want, tolerance):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=tolerance * max(1.0, np.abs(b).max()))


# -- the kernel against the XLA form ------------------------------------------------------------------------

# (causal, kernel, T, C, parts, bias, mask, driver, dtype, value tile, (query tile, key tile)): odd T and multiples
# of C, C 4 to 16, local-only and global-only, E = 6 whole or in tiles of 3 and 2 (a causal KV carried per tile, a
# non-causal total read per tile). The parallel driver (the GPU's) takes every case with query and key tiles
# smaller than C, key tiles narrower and wider than query tiles (the causal bound at the diagonal), and once the
# defaults (the whole chunk here). linear_attention below adds the non-causal global-only form.
CASES = tiers.quick(
  [
    (True, "relu2", 37, 8, "both", True, True, "grid", jnp.float32, 3, None),
    (True, "linear", 37, 16, "global", False, True, "grid", jnp.float32, None, None),
    (False, "softmax", 37, 16, "both", True, True, "grid", jnp.float32, 2, None),
    (False, "softmax", 32, 16, "both", False, True, "grid", jnp.bfloat16, None, None),
    (True, "relu2", 37, 8, "both", True, True, "parallel", jnp.float32, 3, (4, 2)),
    (True, "softmax", 32, 4, "both", False, True, "parallel", jnp.float32, 2, (2, 4)),
    (True, "linear", 37, 16, "global", False, True, "parallel", jnp.float32, None, (8, 4)),
    (False, "relu2", 32, 8, "local", True, False, "parallel", jnp.float32, None, (4, 4)),
    (False, "softmax", 37, 16, "both", True, True, "parallel", jnp.float32, 2, (4, 8)),
    (True, "relu2", 37, 8, "both", True, True, "parallel", jnp.bfloat16, None, None),
    (False, "softmax", 32, 16, "both", False, True, "parallel", jnp.bfloat16, None, (8, 4)),
  ],
  keep=[0, 3, 4, 5, 8],
  ids=lambda c: "-".join(map(str, c[:8] + (jnp.dtype(c[8]).name,) + c[9:])),
)


@pytest.mark.parametrize("causal,kernel,t,chunk,parts,with_bias,with_mask,driver,dtype,tile,tiles", CASES)
def test_kernel_equals_xla_values_and_gradients(
  causal, kernel, t, chunk, parts, with_bias, with_mask, driver, dtype, tile, tiles
):
  (qq, qk, lq, lk), v, bias, mask = inputs(t=t, chunk=chunk, dtype=dtype)
  kw = dict(
    chunk=chunk,
    causal=causal,
    quad_scale=8**-0.5 if kernel == "softmax" else 1 / chunk,
    lin_scale=1 / chunk,
    mask=mask if with_mask else None,
    kernel=kernel,
  )
  query_tile, key_tile = tiles or (None, None)

  def attention(impl):
    def fn(qq, qk, lq, lk, v, bias):
      if parts == "local":
        lq = lk = None
      if parts == "global":
        qq = None
      if impl == "xla":
        return fk.mixed_chunk_attention(qq, qk, lq, lk, v, bias=bias, **kw)
      return flash_pallas.mixed_chunk_attention(
        qq, qk, lq, lk, v, bias=bias, driver=driver, value_tile=tile, query_tile=query_tile, key_tile=key_tile, **kw
      )

    return fn

  args = (qq, qk, lq, lk, v, bias if with_bias else None)
  got, want = run(lambda *a: (value_and_grads(attention("pallas"), *a), value_and_grads(attention("xla"), *a)), *args)
  assert got[0].dtype == dtype
  assert_close(got, want, F32 if dtype == jnp.float32 else BF16)


# Packed documents: a boundary inside a chunk, one on a chunk boundary, a document inside one chunk,
# padding (segment 0) after; the second row one document and a padded tail.
DOCUMENTS = np.array([[1] * 5 + [2] * 11 + [3] * 3 + [4] * 12 + [0] * 6, [1] * 30 + [0] * 7])


# The parallel driver with documents: a chunk's own keys of the query's document (non-causal) in a second loop,
# after the local part's online softmax too; query tiles of 4, key tiles of 2.
@pytest.mark.parametrize(
  "causal,kernel,global_norm,parts,driver,tile",
  tiers.quick(
    [
      (True, "relu2", "sum", "both", "grid", 3),
      (False, "relu2", "mean", "both", "grid", None),
      (True, "linear", "mean", "global", "grid", None),
      (True, "relu2", "sum", "both", "parallel", 3),
      (True, "relu2", "mean", "both", "parallel", None),
      (False, "relu2", "sum", "both", "parallel", 2),
      (False, "relu2", "mean", "both", "parallel", None),
      (False, "softmax", "mean", "global", "parallel", None),
      (True, "linear", "mean", "global", "parallel", None),
      (False, "softmax", "sum", "both", "parallel", 2),
    ],
    keep=[0, 1, 5, 9],
    ids=lambda c: "-".join(map(str, c)),
  ),
)
def test_kernel_with_documents_equals_xla_values_and_gradients(causal, kernel, global_norm, parts, driver, tile):
  (qq, qk, lq, lk), v, bias, _ = inputs(t=37, chunk=8)
  segments = jnp.asarray(DOCUMENTS)
  kw = dict(
    chunk=8,
    causal=causal,
    quad_scale=0.125,
    lin_scale=0.125,
    mask=segments > 0,
    segments=segments,
    global_norm=global_norm,
    kernel=kernel,
  )
  tiles = dict(query_tile=4, key_tile=2) if driver == "parallel" else {}

  def attention(impl):
    def fn(qq, qk, lq, lk, v, bias):
      qq = None if parts == "global" else qq
      if impl == "xla":
        return fk.mixed_chunk_attention(qq, qk, lq, lk, v, bias=bias, **kw)
      return flash_pallas.mixed_chunk_attention(
        qq, qk, lq, lk, v, bias=bias, driver=driver, value_tile=tile, **tiles, **kw
      )

    return fn

  args = (qq, qk, lq, lk, v, bias)
  got, want = run(lambda *a: (value_and_grads(attention("pallas"), *a), value_and_grads(attention("xla"), *a)), *args)
  real = DOCUMENTS > 0  # padded queries read nothing: their rows are arbitrary
  assert_close(np.asarray(got[0])[real], np.asarray(want[0])[real], F32)
  assert_close(got[1], want[1], F32)


# (causal, global_norm, documents) -> the backward's calls on each driver: the grid driver's walks (forward and
# reverse; one, carrying nothing, non-causal without documents), the parallel driver's dq, dk and dv.
BACKWARD_CALLS = {
  (True, "sum", False): {"grid": 2, "parallel": 3},
  (False, "sum", False): {"grid": 1, "parallel": 3},
  (True, "mean", True): {"grid": 2, "parallel": 3},
  (False, "sum", True): {"grid": 2, "parallel": 3},
}


@pytest.mark.parametrize("driver", ["grid", "parallel"])
@pytest.mark.parametrize("causal,global_norm,documents", list(BACKWARD_CALLS), ids=lambda c: str(c))
def test_the_gradient_is_kernels(driver, causal, global_norm, documents):
  """Traced, the value and gradient hold the forward's calls and the backward's (no VJP of the XLA form), and
  no more matrix products outside kernels than the forward's plus 2: the parallel driver's per-chunk states
  and their adjoints (one product for all of each), the non-causal total's adjoint."""
  (qq, qk, lq, lk), v, bias, mask = inputs(t=37, chunk=8)
  segments = jnp.asarray(DOCUMENTS) if documents else None
  kw = dict(chunk=8, causal=causal, quad_scale=0.125, lin_scale=0.125, mask=mask, segments=segments)
  fn = lambda *a: flash_pallas.mixed_chunk_attention(*a[:5], bias=a[5], global_norm=global_norm, driver=driver, **kw)
  loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
  args = (qq, qk, lq, lk, v, bias)
  forward = jax.make_jaxpr(loss)(*args).jaxpr
  traced = jax.make_jaxpr(jax.value_and_grad(loss, argnums=tuple(range(6))))(*args).jaxpr
  assert kernel_calls(traced) == kernel_calls(forward) + BACKWARD_CALLS[causal, global_norm, documents][driver]
  assert products_outside_kernels(traced) <= products_outside_kernels(forward) + 2


def test_one_chunk_without_the_global_part_is_quadratic_attention():
  """C >= T: the local part alone is relu2_attention (relu2 causal, softmax bidirectional; bias, padding)."""
  (qq, qk, _, _), v, bias, mask = inputs(t=13, chunk=16)

  def both(qq, qk, v, bias):
    out = []
    for causal, kernel, driver in (
      (True, "relu2", "parallel"),
      (False, "softmax", "grid"),
      (False, "softmax", "parallel"),
    ):
      kw = dict(causal=causal, mask=mask, kernel=kernel)
      fast = lambda qq, qk, v, bias: flash_pallas.mixed_chunk_attention(
        qq, qk, None, None, v, chunk=16, quad_scale=0.25, lin_scale=1.0, bias=bias, driver=driver, **kw
      )
      oracle = lambda qq, qk, v, bias: fk.relu2_attention(qq, qk, v, scale=0.25, bias=bias[:13, :13], **kw)
      out.append((value_and_grads(fast, qq, qk, v, bias), value_and_grads(oracle, qq, qk, v, bias)))
    return out

  for got, want in run(both, qq, qk, v, bias):
    assert_close(got, want, F32)


def with_driver(monkeypatch, driver):
  """kernels.mixed_chunk's impl="pallas" (which names no driver) on `driver`, in interpret mode as on the CPU."""
  monkeypatch.setattr(
    flash_pallas, "mixed_chunk_attention", functools.partial(flash_pallas.mixed_chunk_attention, driver=driver)
  )


@pytest.mark.parametrize("driver", ["grid", "parallel"])
def test_linear_attention_kernel_equals_quadratic_form(monkeypatch, driver):
  with_driver(monkeypatch, driver)
  (q, k, _, _), v, _, mask = inputs(t=13)

  def both(q, k, v):
    return [
      (
        value_and_grads(
          lambda *a: kernels.linear_attention(*a, causal=causal, chunk=4, mask=mask, impl="pallas"), q, k, v
        ),
        value_and_grads(lambda *a: fk.linear_attention_reference(*a, causal=causal, mask=mask), q, k, v),
      )
      for causal in (True, False)
    ]

  for got, want in run(both, q, k, v):
    assert_close(got, want, F32)


# -- per device under a mesh ---------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["grid", "parallel"])
def test_kernel_runs_per_device_under_a_mesh(monkeypatch, driver):
  """Batch 4 over 'data', heads 2 over 'tensor' through shard_map: the unsharded values and gradients (the
  parallel driver's per-chunk states computed outside the kernel, sharded as its operands), the backward's
  kernels per device too."""
  assert jax.device_count() == 8
  with_driver(monkeypatch, driver)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  (qq, qk, lq, lk), v, bias, mask = inputs(b=4, t=13, chunk=4)

  def both(*args):
    return [
      value_and_grads(
        lambda *a: kernels.mixed_chunk_attention(
          *a[:5], bias=a[5], chunk=4, causal=causal, quad_scale=0.25, lin_scale=0.25, mask=mask, impl="pallas"
        ),
        *args,
      )
      for causal in (True, False)
    ]

  args = (qq, qk, lq, lk, v, bias)
  plain = run(both, *args)
  with per_device.per_device_mesh(mesh, batch="data", heads="tensor"):
    fn = lambda *a: both(*a)  # a new function: traced (and sharded) inside the context
    # the forwards' calls, and the backwards': on the grid driver two walks causal, one non-causal; on the
    # parallel driver one shard_map of three calls each
    assert str(jax.make_jaxpr(fn)(*args)).count("shard_map") == 2 + (3 if driver == "grid" else 2)
    sharded = run(fn, *args)
  assert_close(sharded, plain, F32)


@pytest.mark.parametrize("driver", ["grid", "parallel"])
def test_kernel_with_documents_under_a_data_fsdp_tensor_mesh_equals_the_unsharded_kernel(monkeypatch, driver):
  """Batch over 'data' and 'fsdp' (as the trainer splits it under FSDP), heads over 'tensor', non-causal with
  packed documents and "mean" (both carried sums, the own-chunk term): the document ids split with the batch;
  values and gradients (the backward's kernels per device too) equal the unsharded kernel's."""
  with_driver(monkeypatch, driver)
  (qq, qk, lq, lk), v, bias, _ = inputs(b=4, t=16, chunk=4)
  segments = jnp.array(
    [[1] * 5 + [2] * 11, [1] * 16, [1] * 9 + [0] * 7, [1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]]
  )
  kw = dict(chunk=4, causal=False, quad_scale=0.25, lin_scale=0.25, mask=segments > 0, segments=segments)
  fn = lambda *a: kernels.mixed_chunk_attention(*a[:5], bias=a[5], global_norm="mean", impl="pallas", **kw)
  args = (qq, qk, lq, lk, v, bias)
  want = run(lambda *a: value_and_grads(fn, *a), *args)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with per_device.per_device_mesh(mesh, batch=("data", "fsdp"), heads="tensor"):
    sharded = lambda *a: value_and_grads(fn, *a)  # a new function: traced (and sharded) inside the context
    # per device: the grid driver's two forward walks and two backward ones; the parallel driver's one call
    # and its backward's three under one shard_map
    assert str(jax.make_jaxpr(sharded)(*args)).count("shard_map") == (4 if driver == "grid" else 2)
    got = run(sharded, *args)
  assert_close(got, want, F32)


# -- the model in the trainer ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_flash_trains_the_same_with_the_kernel():
  """Three trainer steps (lra_core.run.steps) of FLASH's tiny PG-19 config on random bytes, per impl."""
  losses = {}
  state = None
  for impl in ("xla", "pallas"):
    config = lra_core.load_config("configs/pg19/flash.py:tiny", [f"model.impl={impl}"])
    mesh = layout.make_mesh(config.mesh)
    tx, schedule = optim.make_optimizer(config)
    spec = make_state_spec(config, mesh, tx)
    task = make_task(config, DataInfo(vocab_size=config.model.vocab_size))
    rng = np.random.default_rng(0)
    b, t = config.train.batch_size, config.train.seq_len
    with sharding.activate(mesh, config.sharding.rules):
      step = jax.jit(make_train_step(config, spec, task, tx, schedule), compiler_options=O0)
      state = spec.init.lower().compile(O0)() if state is None else state  # impl changes no parameter
      losses[impl] = []
      impl_state = state
      for _ in range(3):
        tokens = rng.integers(1, config.model.vocab_size, size=(b, t + 1)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((b, t), np.float32)}
        impl_state, metrics = step(impl_state, to_device(batch, mesh, config.sharding.rules))
        losses[impl].append(float(metrics["loss"][0] / metrics["loss"][1]))
  np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-4)
  assert losses["pallas"][-1] != losses["pallas"][0]  # the parameters moved


def test_bad_impl_is_a_clear_error():
  (q, k, _, _), v, _, _ = inputs(t=8)
  with pytest.raises(ValueError, match=r"impl 'triton' is not one of \('xla', 'pallas'\)"):
    kernels.mixed_chunk_attention(
      q, k, None, None, v, chunk=4, causal=True, quad_scale=1.0, lin_scale=1.0, impl="triton"
    )
  with pytest.raises(ValueError, match=r"impl 'triton' is not one of \('xla', 'pallas'\)"):
    kernels.linear_attention(q, k, v, causal=True, impl="triton")
  with pytest.raises(ConfigError, match=r"model.impl 'triton' is not one of \['xla', 'pallas'\]"):
    lra_core.load_config("configs/pg19/flash.py:tiny", ["model.impl=triton"])


def test_on_a_gpu_the_kernel_is_the_parallel_driver_with_the_gpu_tiles():
  """Traced for a GPU (no compile): FLASH's C4 sizes (T 2048, C 256, s 128, e 1536) run the parallel
  driver over (B, H, G, C / query_block, e / value_block) programs with GPU_TILES' launch parameters,
  the per-chunk states [B,H,G,S,E] built by XLA; its cost counts the causal key tiles only."""
  t, c, s, e = 2048, 256, 128, 1536
  x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  fn = lambda q, k, v: flash_pallas.mixed_chunk_attention(
    q, k, q, k, v, chunk=c, causal=True, quad_scale=1.0, lin_scale=1.0
  )
  with toolkit.target("gpu"):
    text = str(jax.make_jaxpr(fn)(x(1, t, 1, s), x(1, t, 1, s), x(1, t, 1, e)))
  tiles = toolkit.gpu_tiles("mixed_chunk_attention")
  nq, nj = c // tiles["query_block"], e // tiles["value_block"]
  assert f"grid=(1, 1, {t // c}, {nq}, {nj})" in text
  assert f"CompilerParams(num_warps={tiles['num_warps']}, num_stages={tiles['num_stages']})" in text
  assert f"f32[1,1,{t // c},{s},{e}]" in text and "f32[1,1,2048,2048]" not in text
  kw = dict(batch=1, heads=1, seq_len=t, chunk=c, s=s, e=e, value_tile=128, itemsize=2, tiles=(64, 64), states=1)
  causal, full = flash_parallel.cost(causal=True, **kw), flash_parallel.cost(causal=False, **kw)
  assert full.flops == (t // c) * (2 * c * c * (nj * s + e) + 2 * c * s * e)
  assert causal.flops - 2 * t * s * e == (full.flops - 2 * t * s * e) * 10 // 16  # 1 + 2 + 3 + 4 of 4 x 4 tiles


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_parallel_driver_at_the_c4_sizes_equals_the_xla_form(causal):
  """The GPU's driver with its own tiles (64 x 64 of the chunk, 128 value columns) at FLASH's C4 GAU, the
  sizes it compiles at for the H100 (chunk 256, s 128, e 1536, the [C,C] bias; two chunks, so the second
  reads the state), in interpret mode: values and gradients equal the XLA reference."""
  t, c, s, e = 512, 256, 128, 1536
  ks = jax.random.split(jax.random.key(3), 6)
  qq, qk, lq, lk = (jax.random.normal(k, (1, t, 1, s)) * 0.3 for k in ks[:4])
  v = jax.random.normal(ks[4], (1, t, 1, e))
  bias = jax.random.normal(ks[5], (c, c)) * 0.1
  kw = dict(chunk=c, causal=causal, quad_scale=s**-0.5, lin_scale=1.0 / c, bias=bias)

  def attend(pallas, qq, lq, v):
    if pallas:
      return flash_pallas.mixed_chunk_attention(qq, qk, lq, lk, v, driver="parallel", value_tile=128, **kw)
    return fk.mixed_chunk_attention(qq, qk, lq, lk, v, impl="xla", **kw)

  args = (qq, lq, v)
  got, want = (jax.jit(lambda *a, p=p: attend(p, *a))(*args) for p in (True, False))
  scale = max(1.0, float(jnp.abs(want).max()))
  np.testing.assert_allclose(got, want, atol=1e-5 * scale)
  grads = [
    jax.jit(jax.grad(lambda *a, p=p: jnp.sum(jnp.sin(attend(p, *a))), argnums=(0, 1, 2)))(*args) for p in (True, False)
  ]
  for g_got, g_want in zip(*grads):
    np.testing.assert_allclose(g_got, g_want, atol=1e-5 * max(1.0, float(jnp.abs(g_want).max())))


def test_value_tiles_fit_the_target_vmem():
  """pg19's FLASH (C 512, S 128, e 2048) in bfloat16: TPU v3 and v4 (16 MiB) take 512-wide tiles, v5e the
  whole width; GPU 128 (a power of two for Triton); a width TPU blocks cannot split is whole; a tile
  that does not divide E is refused."""
  pick = lambda kind: flash_grid.value_block(2048, chunk=512, s=128, itemsize=2, budget=toolkit.vmem_budget(kind))
  assert pick("TPU v3") == pick("TPU v4") == 512 and pick("TPU v5 lite") == 2048
  assert flash_grid.vmem_bytes(chunk=512, s=128, value_block=512, itemsize=2) <= toolkit.vmem_budget("TPU v3")
  assert flash_grid.vmem_bytes(chunk=512, s=128, value_block=1024, itemsize=2) > toolkit.vmem_budget("TPU v3")
  assert flash_parallel.tile(1536, toolkit.gpu_tiles("mixed_chunk_attention")["value_block"]) == 128
  assert flash_grid.value_block(96, chunk=256, s=128, itemsize=2, budget=2**20) == 96
  (qq, qk, lq, lk), v, _, _ = inputs()
  with pytest.raises(ValueError, match="value tile 4 does not divide E 6"):
    flash_pallas.mixed_chunk_attention(
      qq, qk, lq, lk, v, chunk=8, causal=True, quad_scale=1.0, lin_scale=1.0, value_tile=4
    )
  with pytest.raises(ValueError, match="key tile 3 does not divide the chunk 8"):
    flash_pallas.mixed_chunk_attention(
      qq, qk, lq, lk, v, chunk=8, causal=True, quad_scale=1.0, lin_scale=1.0, driver="parallel", key_tile=3
    )
