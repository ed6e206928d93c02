"""The VQ-attention Pallas kernel (interpret mode on CPU) against the XLA forms and the quadratic
definition: values, gradients, the carried cache, both drivers (grid; parallel, the GPU's), bf16, tiles, a
sharded mesh, and the
trainer end to end."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fixtures.enwik8
import lra_core
import tiers
from lra_core import kernels
from lra_core.errors import ConfigError
from lra_core.kernels import per_device, toolkit, vq
from lra_core.kernels.vq import gpu_parallel as vq_parallel
from lra_core.kernels.vq import pallas as vq_pallas
from lra_core.kernels.vq import tpu_grid as vq_grid
from lra_core.train import train_and_evaluate
from oracles import products_outside_kernels

O0 = {"xla_backend_optimization_level": 0}  # these tests check numbers: -O0 halves CPU compile times


def jit(fn):
  return jax.jit(fn, compiler_options=O0)


def inputs(b, t, h, hk, dk, dv, s, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, dk)).astype(dtype)
  k = jax.random.normal(ks[1], (b, t, hk, dk)).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, hk, dv)).astype(dtype)
  codebook = jax.random.normal(ks[3], (hk, s, dk)).astype(dtype)
  return q, k, v, codebook


def loss_of(fn):
  """A scalar whose gradient weights every output element differently."""
  return lambda *args: jnp.sum(jnp.sin(fn(*args).astype(jnp.float32) * 3.0))


# (T, L, S, H, Hk, driver, dtype, atol): odd T, several block lengths, S in {64, 512}, MQA and MHA.
CASES = [
  (15, 5, 64, 2, 1, "grid", jnp.float32, 1e-5),
  (15, 5, 64, 2, 1, "parallel", jnp.float32, 1e-5),
  (24, 8, 512, 2, 2, "parallel", jnp.float32, 1e-5),
  (16, 4, 64, 4, 2, "grid", jnp.bfloat16, 3e-2),
  (16, 4, 64, 4, 2, "parallel", jnp.bfloat16, 3e-2),
]


@pytest.mark.parametrize("t,block_len,s,h,hk,driver,dtype,atol", CASES)
def test_kernel_equals_quadratic_definition_values_and_gradients(t, block_len, s, h, hk, driver, dtype, atol):
  q, k, v, codebook = inputs(2, t, h, hk, 8, 6, s, dtype)
  z, _ = vq.quantize(k, codebook)

  def kernel(q, v, codebook):
    carry = vq.init_carry(2, block_len, hk, s, 8, 6, dtype)
    out, _ = vq_pallas.vq_attention_blocks(
      q, vq.codewords(z, codebook), z, v, codebook, block_len=block_len, carry=carry, driver=driver
    )
    return out

  def reference(q, v, codebook):
    return vq.dense_attention(q, vq.codewords(z, codebook), v)

  got, want = jit(kernel)(q, v, codebook), jit(reference)(q, v, codebook)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=atol)
  # Gradients: the grid driver's backward kernels, the parallel driver's XLA VJP; the reference is quadratic.
  for g_got, g_want in zip(
    jit(jax.grad(loss_of(kernel), argnums=(0, 1, 2)))(q, v, codebook),
    jit(jax.grad(loss_of(reference), argnums=(0, 1, 2)))(q, v, codebook),
  ):
    scale = float(jnp.abs(g_want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.float32(g_got), np.float32(g_want), atol=atol * max(scale, 1.0) * 3)


# Each driver's backward (kernels/vq/grid_backward.py, kernels/vq/gpu_backward.py) against the XLA form's
# VJP: (case id, options). Every case carries a cache and a previous block in (random keys, values, codes,
# counts and means), so the carried state's gradient is held too; the tiles make the kernels loop (the
# grid driver's (Dt, Lq), the parallel driver's (Dt, Lq, Lk, Sc), its backward's the same).
GRAD_CASES = [
  ("plain", dict()),
  ("documents-bias", dict(documents=True, bias=True)),
  ("no-grad-through-cache", dict(documents=True, bias=True, grad_through_cache=False)),
  ("window", dict(compressive=False, documents=True, bias=True)),
  ("gqa-tiles", dict(h=4, hk=2, tiles=(2, 2), documents=True)),
  ("bfloat16", dict(dtype=jnp.bfloat16, bias=True, tiles=(3, 2))),
]
PARALLEL_TILES = {"gqa-tiles": (2, 2, 4, 8), "bfloat16": (3, 4, 2, 4)}
KERNEL_CALLS = {"grid": 3, "parallel": 4}  # the forward's call and the backward's


class _BackwardTiles:
  """The parallel backward's tiles for one test, in `toolkit.GPU_TILES` (which `gpu_parallel.tiles` reads)."""

  def __init__(self, tiles):
    self.tiles, self.saved = tiles, None

  def __enter__(self):
    self.saved = dict(toolkit.GPU_TILES["vq_attention_backward"])
    if self.tiles is not None:
      names = ("value_block", "query_block", "key_block", "code_block")
      toolkit.GPU_TILES["vq_attention_backward"].update(zip(names, self.tiles))

  def __exit__(self, *exc):
    toolkit.GPU_TILES["vq_attention_backward"] = self.saved


def gradient_case(driver, h=2, hk=1, dtype=jnp.float32, documents=False, bias=False, **options):
  """(loss of the kernel, loss of the XLA form, their arguments): T 16, blocks of 4, 16 codes, Dk 8, Dv 6."""
  b, t, l, s, dk, dv = 2, 16, 4, 16, 8, 6
  q, k, v, codebook = inputs(b, t, h, hk, dk, dv, s, dtype)
  z, _ = vq.quantize(k, codebook)
  keys = jax.random.split(jax.random.key(11), 6)
  carry = {
    "k": jax.random.normal(keys[0], (b, l, hk, dk)).astype(dtype),
    "v": jax.random.normal(keys[1], (b, l, hk, dv)).astype(dtype),
    "mean": jax.random.normal(keys[2], (b, hk, s, dv)),
    "count": jax.random.randint(keys[3], (b, hk, s), 0, 3).astype(jnp.float32),
  }
  ints = {"z": jax.random.randint(keys[4], (b, l, hk), 0, s), "seg": jnp.full((b, l), 1 if documents else -1)}
  segments = SEGMENTS[:, :t] if documents else None
  position = jax.random.normal(keys[5], (b, t // l, hk, h // hk, l, 2 * l)) if bias else None

  def loss(core):
    def f(q, k_hat, v, codebook, carry, position):
      out, _ = core(q, k_hat, z, v, codebook, dict(carry, **ints), position, segments)
      return jnp.sum(jnp.sin(out.astype(jnp.float32) * 3.0))

    return f

  kernel = lambda *a: vq_pallas.vq_attention_blocks(
    *a[:5], carry=a[5], bias=a[6], segments=a[7], block_len=l, driver=driver, **options
  )
  cache_options = dict(compressive=options.get("compressive", True))
  cache_options.update(grad_through_cache=options.get("grad_through_cache", True))
  xla = lambda *a: vq.cached_attention(*a[:7], segments=a[7], block_len=l, reduction="serial", **cache_options)
  return loss(kernel), loss(xla), (q, vq.codewords(z, codebook), v, codebook, carry, position)


@pytest.mark.parametrize(
  "driver,name",
  tiers.quick(
    [(d, n) for d in ("grid", "parallel") for n, _ in GRAD_CASES],
    keep=[1, 4, 7, 10],
    ids=lambda c: f"{c[0]}-{c[1]}",
  ),
)
def test_gradient_is_kernels_equal_to_the_reference_vjp(driver, name):
  """Each driver's gradient is Pallas kernels: on the grid driver two (the blocks in order for dq, dk, the
  codebook's and the position term's gradients; then backwards for dv and the cache's adjoint), on the
  parallel one three (dq and the position term's; dk and the codebook's; dv and each block's cache's, which
  XLA's prefix takes back to the values). The gradients to q, k_hat, v, the codebook, the position term and
  the carried block and cache (keys, values, means; the counts, of integer codes, have none) equal the XLA
  form's VJP, float32 within 1e-4 and bfloat16 within 5e-2 of the largest; the value and gradient trace to
  the forward's call and the backward's and to no more matrix products outside them than the forward's
  plus 2."""
  options = dict(dict(GRAD_CASES)[name])
  if driver == "parallel" and "tiles" in options:
    options["tiles"] = PARALLEL_TILES[name]
  with _BackwardTiles(options.get("tiles") if driver == "parallel" else None):
    fast, xla, args = gradient_case(driver, **options)
    argnums = (0, 1, 2, 3, 4) + ((5,) if args[5] is not None else ())
    grads = lambda f: jax.grad(f, argnums=argnums)
    got, want = jit(lambda *a: (grads(fast)(*a), grads(xla)(*a)))(*args)
    traced = jax.make_jaxpr(jax.value_and_grad(fast, argnums=argnums))(*args).jaxpr
    forward = jax.make_jaxpr(fast)(*args).jaxpr
  tolerance = 5e-2 if args[0].dtype == jnp.bfloat16 else 1e-4
  for (path, g_want), g_got in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    g_want, g_got = np.float32(g_want), np.float32(g_got)
    scale = max(float(np.abs(g_want).max()), 1e-6)
    np.testing.assert_allclose(g_got, g_want, atol=tolerance * scale, err_msg=jax.tree_util.keystr(path))
  assert not np.any(np.float32(got[4]["count"])) and not np.any(np.float32(want[4]["count"]))
  assert str(traced).count("pallas_call") == KERNEL_CALLS[driver]
  assert products_outside_kernels(traced) <= products_outside_kernels(forward) + 2


WINDOW, BLOCK = 12, 4


def two_window_inputs():
  """Two windows of WINDOW tokens with MQA (2 query heads, 1 key head), their codes and XL biases:
  q, k_hat, z, v, codebook, rel_q, table."""
  b, h, hk, dk, dv, s = 2, 2, 1, 8, 6, 16
  q, k, v, codebook = inputs(b, 2 * WINDOW, h, hk, dk, dv, s)
  z, _ = vq.quantize(k, codebook)
  rel_q = jax.random.normal(jax.random.key(7), q.shape)
  table = jax.random.normal(jax.random.key(8), (h, BLOCK + 1, dk))
  return q, vq.codewords(z, codebook), z, v, codebook, rel_q, table


@pytest.mark.parametrize(
  "driver,compressive",
  tiers.quick(
    [("grid", True), ("parallel", True), ("parallel", False)], keep=[0, 2], ids=["grid", "parallel", "parallel-window"]
  ),
)
def test_kernel_continues_the_carried_cache_with_xl_biases(driver, compressive):
  """Two windows, the second continuing from the first's carry, with XL biases and MQA."""
  t, l = WINDOW, BLOCK
  q, k_hat, z, v, codebook, rel_q, table = two_window_inputs()

  def two_windows(impl, q, v, codebook, rel_q, table):
    carry, outs = None, []
    for w in (slice(0, t), slice(t, 2 * t)):
      out, carry = vq.vq_attention_blocks(
        q[:, w],
        k_hat[:, w],
        z[:, w],
        v[:, w],
        codebook,
        block_len=l,
        carry=carry,
        rel=(rel_q[:, w], table),
        compressive=compressive,
        impl=impl,
      )
      outs.append(out)
    return jnp.concatenate(outs, 1), carry

  args = (q, v, codebook, rel_q, table)
  run = {impl: jit(lambda *a, impl=impl: two_windows(impl, *a)) for impl in ("xla", "pallas")}
  with _force_driver(driver):
    (got, got_carry), (want, want_carry) = run["pallas"](*args), run["xla"](*args)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for key in want_carry:
      np.testing.assert_allclose(got_carry[key], want_carry[key], atol=1e-5, err_msg=key)
    grad = {
      impl: jit(jax.grad(loss_of(lambda *a, impl=impl: two_windows(impl, *a)[0]), argnums=(0, 1, 2, 3, 4)))
      for impl in ("xla", "pallas")
    }
    for g_got, g_want in zip(grad["pallas"](*args), grad["xla"](*args)):
      np.testing.assert_allclose(g_got, g_want, atol=2e-5)


# Packed documents in two windows of 12 (blocks of 4): several in one block, one starting inside the
# block carried across the windows (row 0 at 10) and reading the cache after them, starts on a
# block boundary (row 1 at 8 and 16), padding (0) at the end.
SEGMENTS = jnp.array([[1] * 3 + [2] * 2 + [3] * 5 + [4] * 11 + [0] * 3, [1] * 8 + [2] * 8 + [3] * 5 + [0] * 3])


@pytest.mark.parametrize("driver", tiers.quick(["grid", "parallel"], keep=[0, 1], ids=["grid", "parallel"]))
def test_kernel_with_documents_equals_masked_quadratic_attention_and_the_xla_form(driver):
  """With segment ids: one window against the quadratic definition masked by segments (values and
  gradients w.r.t. q, v, the codebook and the XL queries), and two carried windows against the XLA
  form (values, carry, gradients)."""
  t, l = WINDOW, BLOCK
  q, _, z, v, codebook, rel_q, table = two_window_inputs()

  def blocks(impl, cuts, q, v, codebook, rel_q):
    k_hat = vq.codewords(z, codebook)
    carry, outs = None, []
    for w in cuts:
      out, carry = vq.vq_attention_blocks(
        q[:, w],
        k_hat[:, w],
        z[:, w],
        v[:, w],
        codebook,
        block_len=l,
        carry=carry,
        rel=(rel_q[:, w], table),
        segments=SEGMENTS[:, w],
        impl=impl,
      )
      outs.append(out)
    return jnp.concatenate(outs, 1), carry

  def reference(q, v, codebook, rel_q):
    return vq.dense_attention(q, vq.codewords(z, codebook), v, window=l, rel=(rel_q, table), segments=SEGMENTS)

  one = lambda *a: blocks("pallas", [slice(0, 2 * t)], *a)[0]
  args = (q, v, codebook, rel_q)
  with _force_driver(driver):
    np.testing.assert_allclose(jit(one)(*args), jit(reference)(*args), atol=1e-5)
    for g_got, g_want in zip(
      jit(jax.grad(loss_of(one), argnums=(0, 1, 2, 3)))(*args),
      jit(jax.grad(loss_of(reference), argnums=(0, 1, 2, 3)))(*args),
    ):
      np.testing.assert_allclose(g_got, g_want, atol=2e-5)
    cuts = [slice(0, t), slice(t, 2 * t)]
    run = {impl: jit(lambda *a, impl=impl: blocks(impl, cuts, *a)) for impl in ("xla", "pallas")}
    (got, got_carry), (want, want_carry) = run["pallas"](*args), run["xla"](*args)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got, jit(reference)(*args), atol=1e-5)
    for key in want_carry:
      np.testing.assert_allclose(got_carry[key], want_carry[key], atol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got_carry["seg"], SEGMENTS[:, -l:])
    grad = {
      impl: jit(jax.grad(loss_of(lambda *a, impl=impl: blocks(impl, cuts, *a)[0]), argnums=(0, 1, 3)))
      for impl in ("xla", "pallas")
    }
    for g_got, g_want in zip(grad["pallas"](*args), grad["xla"](*args)):
      np.testing.assert_allclose(g_got, g_want, atol=2e-5)


@pytest.mark.parametrize(
  "driver,tiles",
  tiers.quick(
    [("grid", (3, 2)), ("parallel", (3, 2, 2, 4)), ("parallel", (2, 2, 4, 8)), ("parallel", (6, 4, 2, 16))],
    keep=[0, 2],
    ids=["grid", "parallel-narrow-keys", "parallel-wide-keys", "parallel-whole"],
  ),
)
def test_value_tiles_and_query_sub_blocks_equal_the_xla_form(driver, tiles):
  """Dv read in tiles (each program its own slice of the cache), the grid driver's queries in sub-blocks
  (the fold after the last one), the parallel driver's query, key and code tiles (key tiles wider or
  narrower than the query tile: the causal bound at the diagonal): two carried windows with XL biases and MQA,
  against `vq.cached_attention` on the same biases: values, carry and gradients."""
  t, l = WINDOW, BLOCK
  q, k_hat, z, v, codebook, rel_q, table = two_window_inputs()
  b, hk, s, dk, dv = q.shape[0], k_hat.shape[2], codebook.shape[1], q.shape[-1], v.shape[-1]

  def two_windows(pallas, q, v, codebook, rel_q):
    carry, outs = vq.init_carry(b, l, hk, s, dk, dv), []
    for w in (slice(0, t), slice(t, 2 * t)):
      bias = vq.xl_bias_blocks((rel_q[:, w], table), hk, l)
      if pallas:
        out, carry = vq_pallas.vq_attention_blocks(
          q[:, w],
          k_hat[:, w],
          z[:, w],
          v[:, w],
          codebook,
          block_len=l,
          carry=carry,
          bias=bias,
          driver=driver,
          tiles=tiles,
        )
      else:
        out, carry = vq.cached_attention(
          q[:, w],
          k_hat[:, w],
          z[:, w],
          v[:, w],
          codebook,
          carry,
          bias,
          block_len=l,
          reduction="serial",
          compressive=True,
        )
      outs.append(out)
    return jnp.concatenate(outs, 1), carry

  args = (q, v, codebook, rel_q)
  (got, got_carry), (want, want_carry) = (jit(lambda *a, p=p: two_windows(p, *a))(*args) for p in (True, False))
  np.testing.assert_allclose(got, want, atol=1e-5)
  for key in want_carry:
    np.testing.assert_allclose(got_carry[key], want_carry[key], atol=1e-5, err_msg=key)
  grads = [
    jit(jax.grad(loss_of(lambda *a, p=p: two_windows(p, *a)[0]), argnums=(0, 1, 2, 3)))(*args) for p in (True, False)
  ]
  for g_got, g_want in zip(*grads):
    np.testing.assert_allclose(g_got, g_want, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_parallel_driver_at_the_enwik8_heads_sizes_equals_the_xla_form(dtype):
  """The GPU's driver with its own tiles (`vq_parallel.tiles`: 64 x 64 score tiles, 128 value columns; its
  backward's 32-row tiles) at Transformer-VQ's enwik8 head, the sizes it compiles at for the H100 (block 512,
  512 codes, Dk 128, Dv 1536, XL biases; two blocks, so the second reads a cache), in interpret mode: values
  equal `vq.cached_attention`'s in both types, gradients in float32 (bfloat16 gradients: the small cases of
  `test_gradient_is_kernels_equal_to_the_reference_vjp`; here they took 20 s of interpreted bfloat16 matmuls)."""
  b, t, l, s, dk, dv = 1, 1024, 512, 512, 128, 1536
  q, k, v, codebook = inputs(b, t, 1, 1, dk, dv, s, dtype)
  z, _ = vq.quantize(k, codebook)
  k_hat = vq.codewords(z, codebook)
  rel_q = jax.random.normal(jax.random.key(7), q.shape).astype(dtype)
  table = jax.random.normal(jax.random.key(8), (1, l + 1, dk)).astype(dtype)
  carry = vq.init_carry(b, l, 1, s, dk, dv, dtype)

  def attend(pallas, q, v, rel_q):
    bias = vq.xl_bias_blocks((rel_q, table), 1, l)
    if pallas:
      return vq_pallas.vq_attention_blocks(
        q, k_hat, z, v, codebook, block_len=l, carry=carry, bias=bias, driver="parallel"
      )[0]
    return vq.cached_attention(
      q, k_hat, z, v, codebook, carry, bias, block_len=l, reduction="serial", compressive=True
    )[0]

  assert vq_parallel.tiles(dv, block_len=l, n_code=s)[:2] == (128, 64)
  args = (q, v, rel_q)
  got, want = (jit(lambda *a, p=p: attend(p, *a))(*args) for p in (True, False))
  atol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=atol)
  if dtype == jnp.float32:
    grads = [jit(jax.grad(loss_of(lambda *a, p=p: attend(p, *a)), argnums=(0, 1, 2)))(*args) for p in (True, False)]
    for g_got, g_want in zip(*grads):  # the tolerances of the quadratic-definition test, scaled by the gradient
      scale = max(1.0, float(jnp.abs(g_want.astype(jnp.float32)).max()))
      np.testing.assert_allclose(np.float32(g_got), np.float32(g_want), atol=3 * atol * scale)


def test_block_sizes_fit_the_target_vmem():
  """The paper's enwik8 head (Dk 128, Dv 1536, S = L = 512, XL biases): TPU v3's 16 MiB takes 128-wide
  value tiles; v5e's limit the whole width; each choice divides the shapes and fits its budget, and the
  estimate grows with both tiles."""
  paper = dict(block_len=512, n_code=512, d_k=128, has_bias=True)
  for kind, itemsize in (("TPU v3", 2), ("TPU v3", 4), ("TPU v4", 2), ("TPU v5", 2), ("TPU v5 lite", 2)):
    budget = toolkit.vmem_budget(kind)
    dt, lq = vq_grid.block_sizes(1536, itemsize=itemsize, budget=budget, **paper)
    assert 1536 % dt == 0 and dt % 128 == 0 and 512 % lq == 0 and lq % 128 == 0, (kind, dt, lq)
    assert vq_grid.vmem_bytes(value_block=dt, query_block=lq, itemsize=itemsize, **paper) <= budget, kind
  assert vq_grid.vmem_bytes(value_block=1536, query_block=512, itemsize=2, **paper) > toolkit.vmem_budget("TPU v3")
  assert vq_grid.block_sizes(1536, itemsize=2, budget=toolkit.vmem_budget("TPU v3"), **paper)[0] == 128
  assert vq_grid.block_sizes(1536, itemsize=2, budget=toolkit.vmem_budget("TPU v5 lite"), **paper) == (1536, 512)
  size = lambda dt, lq: vq_grid.vmem_bytes(value_block=dt, query_block=lq, itemsize=2, **paper)
  assert size(128, 128) < size(256, 128) < size(256, 256)
  # widths a TPU block cannot split are taken whole; interpret mode whole; the GPU's tiles from GPU_TILES
  assert vq_grid.block_sizes(96, itemsize=4, budget=2**20, **dict(paper, block_len=100)) == (96, 100)
  assert vq_grid.block_sizes(1536, itemsize=2, budget=None, platform="cpu", **paper) == (1536, 512)
  gpu = toolkit.gpu_tiles("vq_attention")
  assert vq_parallel.tiles(1536, block_len=512, n_code=512) == tuple(
    gpu[k] for k in ("value_block", "query_block", "key_block", "code_block")
  )
  assert vq_parallel.tiles(6, block_len=4, n_code=16) == (6, 4, 4, 16)  # small dimensions whole
  assert toolkit.vmem_limit("TPU v3") is None and toolkit.vmem_limit("TPU v5 lite") == 96 * 2**20


class _force_driver:
  """Makes vq_pallas use one driver whatever the backend (the public path takes no driver argument)."""

  def __init__(self, name):
    self.name = name

  def __enter__(self):
    self.saved = toolkit.driver
    toolkit.driver = lambda name=None, **kw: self.name

  def __exit__(self, *exc):
    toolkit.driver = self.saved


def test_kernel_under_an_8_device_mesh_equals_the_unsharded_kernel():
  q, k, v, codebook = inputs(4, 16, 2, 2, 8, 6, 64)

  def run():  # fresh functions per call: the mesh context is read while tracing
    f = lambda q, k, v, codebook: kernels.vq_attention(q, k, v, codebook, block_len=4, impl="pallas")
    grads = jit(jax.grad(loss_of(f), argnums=(0, 2, 3)))(q, k, v, codebook)
    return str(jax.make_jaxpr(f)(q, k, v, codebook)), jit(f)(q, k, v, codebook), grads

  jaxpr, want, want_grads = run()
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with per_device.per_device_mesh(mesh, batch="data", heads="tensor"):
    sharded_jaxpr, got, got_grads = run()
  assert "shard_map" in sharded_jaxpr and "shard_map" not in jaxpr
  assert "f32[1,1,16,6]" in sharded_jaxpr  # one batch row and one head per device
  np.testing.assert_allclose(got, want, atol=1e-6)
  for g_got, g_want in zip(got_grads, want_grads):
    np.testing.assert_allclose(g_got, g_want, atol=1e-5)


def test_kernel_with_documents_under_a_data_fsdp_tensor_mesh_equals_the_unsharded_kernel():
  """Batch over 'data' and 'fsdp' (as the trainer splits it under FSDP), heads over 'tensor': the document ids
  split with the batch; values and gradients (the backward kernels, per device too) equal the unsharded
  kernel's."""
  q, k, v, codebook = inputs(4, 16, 2, 2, 8, 6, 64)
  segments = jnp.array(
    [[1] * 5 + [2] * 11, [1] * 16, [1] * 9 + [0] * 7, [1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]]
  )

  def run():  # fresh functions per call: the mesh context is read while tracing
    f = lambda q, k, v, codebook: kernels.vq_attention(q, k, v, codebook, block_len=4, impl="pallas", segments=segments)
    grads = jit(jax.grad(loss_of(f), argnums=(0, 2, 3)))(q, k, v, codebook)
    return (
      str(jax.make_jaxpr(jax.grad(loss_of(f), argnums=(0, 2, 3)))(q, k, v, codebook)),
      jit(f)(q, k, v, codebook),
      grads,
    )

  _, want, want_grads = run()
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with per_device.per_device_mesh(mesh, batch=("data", "fsdp"), heads="tensor"):
    sharded_jaxpr, got, got_grads = run()
  assert sharded_jaxpr.count("shard_map") == 2  # the forward kernel and the backward's, each per device
  np.testing.assert_allclose(got, want, atol=1e-6)
  for g_got, g_want in zip(got_grads, want_grads):
    np.testing.assert_allclose(g_got, g_want, atol=1e-5)


@pytest.mark.slow
def test_model_trains_with_the_kernel_as_with_xla(tmp_path):
  """enwik8 tiny with update windows (a carried cache): the kernel data-parallel over 2 devices
  (per device through shard_map) gives the single-device XLA run's losses."""
  data = fixtures.enwik8.build(tmp_path)
  losses = {}
  for impl, devices in (("xla", 1), ("pallas", 2)):
    overrides = data + [
      "train.seq_len=32",
      "train.update_len=16",
      "train.steps=4",
      "train.log_every=1",
      "train.eval_every=0",
      f"model.impl={impl}",
      f"mesh.data={devices}",
    ]
    config = lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", overrides)
    assert train_and_evaluate(config, tmp_path / impl, stop_at_step=3) == {"stopped_at": 3}  # no evaluation
    rows = [json.loads(line) for line in (tmp_path / impl / "metrics.jsonl").read_text().splitlines()]
    losses[impl] = [r["train_loss"] for r in rows if "train_loss" in r]
  assert len(losses["xla"]) == 3
  np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-5)


def test_kernel_settings_are_checked():
  q, k, v, codebook = inputs(1, 8, 1, 1, 4, 4, 8)
  carry = vq.init_carry(1, 4, 1, 8, 4, 4)
  z, _ = vq.quantize(k, codebook)
  with pytest.raises(ValueError, match="value tile 3 does not divide d_v 4"):
    vq_pallas.vq_attention_blocks(q, k, z, v, codebook, block_len=4, carry=carry, tiles=(3, 4))
  with pytest.raises(ValueError, match="query sub-block 3 does not divide block_len 4"):
    vq_pallas.vq_attention_blocks(q, k, z, v, codebook, block_len=4, carry=carry, tiles=(4, 3))
  with pytest.raises(ValueError, match="code tile 3 does not divide n_code 8"):
    vq_pallas.vq_attention_blocks(q, k, z, v, codebook, block_len=4, carry=carry, tiles=(4, 4, 2, 3), driver="parallel")
  with pytest.raises(ValueError, match="the parallel driver takes 4"):
    vq_pallas.vq_attention_blocks(q, k, z, v, codebook, block_len=4, carry=carry, tiles=(4, 4), driver="parallel")
  with pytest.raises(ValueError, match="driver 'loop' is not one of"):
    vq_pallas.vq_attention_blocks(q, k, z, v, codebook, block_len=4, carry=carry, driver="loop")
  with pytest.raises(ValueError, match="reduction must be 'serial'"):
    kernels.vq_attention(q, k, v, codebook, block_len=4, reduction="assoc", impl="pallas")
  with pytest.raises(ConfigError, match="model.impl 'pallas' is the VQ kernel"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.impl=pallas", "model.reduction=matmul"])
