"""The kernels follow their target devices: under `jax.set_mesh` of TPU devices (a v5e slice described
by libtpu on this CPU host) every kernel's forward and training gradient lower to a Mosaic kernel and
compile with the real TPU compiler; under a mesh of CPU devices they run in interpret mode and equal
the references; the VQ kernel at its paper model's value width fits TPU v3's VMEM.
scripts/check_lowering.py runs the same compile at the papers' T = 8192 and widths."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core import kernels
from lra_core.compilation import topologies
from lra_core.kernels import catalog, per_device, toolkit
from lra_core.kernels import latte as latte_xla
from lra_core.kernels import mixed_chunk as flash_xla
from lra_core.kernels import vq as vq_xla

needs_libtpu = pytest.mark.skipif(
  not topologies.libtpu_installed(), reason="libtpu is not installed (pip install -e \".[test]\" brings it)"
)
SIZES = dict(seq_len=512, width=128, latents=128, block=256, codes=256, chunk=0, flash_chunk=256)
KERNELS = tuple(catalog.kernels_at(**SIZES))


@pytest.fixture(scope="module")
def tpu_mesh():
  return jax.sharding.Mesh(np.array(topologies.tpu_devices("v5e:2x2")), ("data",))


def _abstract(args, mesh, spec=P()):
  return tuple(
    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec if a.ndim == 4 else P())) for a in args
  )


@needs_libtpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=pytest.mark.slow) if n == "vq_attention" else n for n in KERNELS]
)
def test_forward_and_gradient_compile_for_a_tpu_mesh(tpu_mesh, name, dtype):
  fn, args = catalog.kernels_at(**SIZES, dtype=dtype)[name]
  for f in (fn, catalog.gradient(fn)):
    with jax.set_mesh(tpu_mesh):
      lowered = jax.jit(f).lower(*_abstract(args, tpu_mesh))
      compiled = lowered.compile()
    assert "tpu_custom_call" in lowered.as_text()  # the Mosaic kernel, not interpret mode
    assert "tpu_custom_call" in compiled.as_text()


@needs_libtpu
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=pytest.mark.slow) if n == "vq_attention" else n for n in KERNELS]
)
def test_kernels_with_packed_documents_compile_for_a_tpu_mesh(tpu_mesh, name):
  """The document-masked forms (segment ids as an extra operand) are Mosaic kernels too, forward and
  gradient, not a fallback to the XLA form."""
  fn, args = catalog.kernels_at(**SIZES, dtype="float32", segments=True)[name]
  assert args[-1].dtype == jnp.int32
  for f in (fn, catalog.gradient(fn)):
    with jax.set_mesh(tpu_mesh):
      lowered = jax.jit(f).lower(*_abstract(args, tpu_mesh))
      compiled = lowered.compile()
    assert "tpu_custom_call" in lowered.as_text()
    assert "tpu_custom_call" in compiled.as_text()


@needs_libtpu
@pytest.mark.slow
def test_bfloat16_kernels_compile_for_tpu_v3_without_bfloat16_matmuls():
  """The chip generation comes from the mesh: v3 multiplies float32 only, v5e takes bfloat16."""
  mesh = jax.sharding.Mesh(np.array(topologies.tpu_devices("v3:2x2")), ("data",))
  with jax.set_mesh(mesh):
    assert not toolkit.bf16_matmuls()
  for name, (fn, args) in catalog.kernels_at(**SIZES, dtype="bfloat16").items():
    with jax.set_mesh(mesh):
      lowered = jax.jit(fn).lower(*_abstract(args, mesh))
      lowered.compile()
    assert "tpu_custom_call" in lowered.as_text(), name


@needs_libtpu
@pytest.mark.slow
def test_vq_kernel_at_the_paper_value_width_fits_tpu_v3_vmem():
  """Transformer-VQ's head (Dk 128, Dv 1536, S = L = 512, XL biases) in bfloat16 on TPU v3, the smallest
  VMEM (16 MiB per core): whole-width blocks (Dt 1536, Lq 512) need 56 MiB, which the compiler refuses; the
  value tiles and query sub-blocks chosen for v3 compile (the VMEM use does not depend on T), and so do the
  gradient's two kernels (its scores kernel, which keeps the whole cache, at the shorter query sub-block
  `grid_backward.query_block` gives: at the forward's 256 rows Mosaic asked for 22.25 MiB)."""
  name, sizes = catalog.PAPER["enwik8_vq"]
  fn, args = catalog.kernels_at(**dict(SIZES, **sizes, seq_len=1024), dtype="bfloat16")[name]
  mesh = jax.sharding.Mesh(np.array(topologies.tpu_devices("v3:2x2")), ("data",))
  with jax.set_mesh(mesh):
    assert toolkit.vmem_budget() == 16 * 2**20 and toolkit.vmem_limit() is None
    lowered = jax.jit(catalog.gradient(fn)).lower(*_abstract(args, mesh))
    compiled = lowered.compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3  # the forward and both backward


@needs_libtpu
@pytest.mark.slow
def test_flash_gradient_at_the_c4_width_fits_tpu_v3_vmem():
  """C4 FLASH's GAU (S 128, e 1536, chunk 256), non-causal (the paper's masked LM) with packed documents, in
  bfloat16 on TPU v3: the backward's two walks each carry a sum and the other sum's adjoint beside dW and the
  key gradients, and the value tile `grid_backward.value_block` picks fits 16 MiB (Et 768 asked Mosaic for
  16.2 MiB before the count held the upcast tiles). 4 Mosaic calls: two walks forward, two backward."""
  b, t, s, e, c = 2, 1024, 128, 1536, 256
  x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  args = (x(b, t, 1, s), x(b, t, 1, s), x(b, t, 1, e), x(c, c), jax.ShapeDtypeStruct((b, t), jnp.int32))
  core = lambda q, k, v, bias, seg: kernels.mixed_chunk_attention(
    q, k, q, k, v, chunk=c, causal=False, quad_scale=s**-0.5, lin_scale=1 / c, bias=bias, segments=seg, impl="pallas"
  )
  grad = jax.value_and_grad(lambda *a: core(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
  mesh = jax.sharding.Mesh(np.array(topologies.tpu_devices("v3:2x2")), ("data",))
  with jax.set_mesh(mesh):
    compiled = jax.jit(grad).lower(*_abstract(args, mesh)).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 4


@needs_libtpu
def test_the_mesh_sets_the_target_and_an_explicit_target_wins(tpu_mesh):
  cpu_mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2])
  assert toolkit.current() == toolkit.Target("cpu", jax.devices()[0].device_kind)
  with jax.set_mesh(tpu_mesh):
    assert toolkit.current() == toolkit.Target("tpu", "TPU v5 lite")
    assert (toolkit.driver(), toolkit.interpret_default(), toolkit.bf16_matmuls()) == ("grid", False, True)
    with toolkit.target("tpu"):  # the platform named, the device kind still the mesh's
      assert toolkit.current() == toolkit.Target("tpu", "TPU v5 lite")
    with toolkit.target("gpu"):
      assert (toolkit.driver(), toolkit.interpret_default()) == ("loop", False)
    with per_device.per_device_mesh(cpu_mesh, batch="data", heads=None):  # the kernel mesh before the context mesh
      assert toolkit.current().platform == "cpu" and toolkit.interpret_default()


@needs_libtpu
def test_batch_sharded_by_type_runs_one_slice_per_device(tpu_mesh):
  """Under explicit axes the kernel splits batch as the argument's type says, not replicated."""
  mesh = jax.sharding.Mesh(tpu_mesh.devices, ("data",), axis_types=(AxisType.Explicit,))
  fn, args = catalog.kernels_at(**dict(SIZES, seq_len=256), batch=4)["causal_latte"]
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(fn)(*_abstract(args, mesh, P("data"))))
  assert "shard_map" in jaxpr and "f32[1,1,256,128]" in jaxpr and "f32[4,1,256,128]" not in jaxpr


@needs_libtpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_flash_s_document_layout_is_computed_at_run_time_not_folded(tpu_mesh, impl):
  """With no documents given, FLASH's document layout ("mean" normalization, as on PG-19) would be a
  function of constants alone: XLA's TPU compiler folded it with its slow evaluator into row-sized
  constants, and a 64 x 65,536-token step took 39 minutes to compile. No constant in the compiled
  program may be as large as a row."""
  b, t, h, d = 4, 2048, 1, 64
  x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(tpu_mesh, P("data")))

  def fn(q, k, v):
    return flash_xla.mixed_chunk_attention(
      q, k, q, k, v, chunk=256, causal=True, quad_scale=d**-0.5, lin_scale=1 / 256, global_norm="mean", impl=impl
    )

  with jax.set_mesh(tpu_mesh):
    text = jax.jit(catalog.gradient(fn)).lower(x(b, t, h, d), x(b, t, h, d), x(b, t, h, d)).compile().as_text()
  shapes = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} constant\(", text)
  assert shapes and max(math.prod(int(n) for n in s.split(",") if n) for s in shapes) < t


def test_lowering_for_tpu_asks_nothing_of_the_host_device():
  """Nothing in the kernels depends on the chip generation Pallas would read from the local (CPU)
  device: exported for TPU without a TPU mesh, every kernel lowers."""
  for name, (fn, args) in catalog.kernels_at(**dict(SIZES, seq_len=512)).items():
    with toolkit.target("tpu"):
      text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text, name


def _cases(b, t, h, d, rng):
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = x(b, t, h, d), x(b, t, h, d), x(b, t, h, d)
  codebook, bias = x(h, 8, d), 0.1 * x(4, 4)
  mixed = dict(chunk=4, causal=True, quad_scale=d**-0.5, lin_scale=0.25)
  return {
    "vq_attention": (
      (q, k, v, codebook),
      lambda q, k, v, c: kernels.vq_attention(q, k, v, c, block_len=4, impl="pallas"),
      lambda q, k, v, c: vq_xla.vq_attention_reference(q, k, v, c),
    ),
    "causal_latte": (
      (q, k, v),
      lambda q, k, v: kernels.causal_latte(q, k, v, impl="pallas"),
      latte_xla.causal_latte_reference,
    ),
    "bidirectional_latte": (
      (q, k, v),
      lambda q, k, v: kernels.bidirectional_latte(q, k, v, impl="pallas"),
      latte_xla.bidirectional_latte_reference,
    ),
    "mixed_chunk": (
      (q, k, v, bias),
      lambda q, k, v, bias: kernels.mixed_chunk_attention(q, k, q, k, v, bias=bias, impl="pallas", **mixed),
      lambda q, k, v, bias: flash_xla.mixed_chunk_attention(q, k, q, k, v, bias=bias, **mixed),
    ),
  }


@pytest.mark.parametrize("name", KERNELS)
def test_a_cpu_mesh_runs_interpret_mode_equal_to_the_reference(name):
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:4])
  args, fast, reference = _cases(4, 16, 2, 8, np.random.default_rng(0))[name]
  loss = lambda f: jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 2))
  with jax.set_mesh(mesh):
    assert toolkit.current().platform == "cpu" and toolkit.interpret_default()
    sharded = tuple(jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim == 4 else P())) for a in args)
    jaxpr = str(jax.make_jaxpr(loss(fast))(*sharded))
    text = jax.jit(loss(fast)).lower(*sharded).as_text()
    got = jax.jit(loss(fast))(*sharded)
  want = jax.jit(loss(reference))(*args)
  assert "pallas_call" in jaxpr and "shard_map" in jaxpr and "tpu_custom_call" not in text
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5 * max(1.0, float(np.abs(b).max())))
