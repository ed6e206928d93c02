"""kernels/softmax/library.py: softmax attention on jax's own flash kernels (splash for TPU, the Pallas
Triton kernel for GPU) equals the XLA reference in values and gradients (interpret mode on this host),
with causal, sliding-window, document and padding masks and grouped / multi-query heads; what a kernel
cannot take falls back to the reference with one log line; "auto" picks the target platform's kernel;
and inside the trainer's step of each family with softmax attention, compiled for a TPU slice (libtpu)
and an H100 (the CUDA plugin), the library kernel is in the program."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_hlo_cost import compiled_train_step

import lra_core
import oracles
import tiers
from lra_core.compilation import aot_targets, topologies
from lra_core.cost import hlo_cost
from lra_core.errors import ConfigError
from lra_core.kernels import toolkit
from lra_core.kernels.softmax import library

needs_libtpu = pytest.mark.skipif(not topologies.libtpu_installed(), reason="libtpu is not installed")
needs_plugin = pytest.mark.skipif(not topologies.cuda_plugin_installed(), reason="the CUDA plugin is not installed")

B, T, H, D = 2, 256, 4, 32
# float32: the kernels' online softmax against one softmax, rounding apart; bfloat16: its 8-bit mantissa.
TOLERANCE = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def inputs(kv_heads, dtype=jnp.float32, t=T):
  rng = np.random.default_rng(kv_heads)
  x = lambda heads: jnp.asarray(rng.normal(size=(B, t, heads, D)), dtype)
  # two documents in row 0 (a boundary off the 128-step blocks), trailing padding in row 1
  segments = jnp.asarray(np.stack([np.where(np.arange(t) < 100, 1, 2), np.ones(t)]), jnp.int32)
  valid = jnp.arange(t)[None] < jnp.array([[t], [t - 56]])
  return x(H), x(kv_heads), x(kv_heads), segments, valid


def value_and_grads(impl, q, k, v, valid, **masks):
  """Outputs at valid positions and the gradients of a loss over them (padded queries read other keys
  under the kernels, and nothing reads them: kernels/softmax/library.py)."""

  def loss(q, k, v):
    out = library.self_attention(q, k, v, k_valid=valid, impl=impl, **masks)
    out = jnp.where(valid[..., None, None], out, 0).astype(jnp.float32)
    return jnp.sum(out * jnp.cos(out)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def assert_equals_reference(impl, kv_heads, dtype=jnp.float32, t=T, **masks):
  q, k, v, segments, valid = inputs(kv_heads, dtype, t)
  masks.setdefault("segments", segments)
  got = value_and_grads(impl, q, k, v, valid, **masks)
  want = value_and_grads("xla", q, k, v, valid, **masks)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOLERANCE[dtype])


# Causal or not, windowed or not, with multi-head (H), grouped (2) and multi-query (1) heads.
SPLASH = [(True, 0, H), (True, 64, 2), (False, 0, 2), (False, 64, 1)]


@pytest.mark.parametrize("causal, window, kv_heads", tiers.quick(SPLASH, keep=[0, 3]))
def test_splash_equals_the_reference(causal, window, kv_heads):
  assert_equals_reference("splash", kv_heads, causal=causal, window=window)


@pytest.mark.parametrize("causal, kv_heads", tiers.quick([(True, H), (False, 2), (True, 1)], keep=[0]))
def test_the_gpu_kernel_equals_the_reference(causal, kv_heads):
  assert_equals_reference("triton", kv_heads, causal=causal)


def test_splash_caps_the_scores_as_the_reference_does():
  """Gemma 2's soft cap (splash's attn_logits_soft_cap) with a window, grouped heads, documents and
  padding; the cap of 2 bites on these unit-variance scores."""
  assert_equals_reference("splash", 2, causal=True, window=64, soft_cap=2.0)
  q, k, v, segments, valid = inputs(2)
  capped, plain = (value_and_grads("xla", q, k, v, valid, causal=True, soft_cap=c)[0] for c in (2.0, 0.0))
  assert np.abs(np.asarray(capped) - np.asarray(plain)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["splash", "triton"])
def test_bfloat16_equals_the_reference_within_its_rounding(impl):
  assert_equals_reference(impl, 2, jnp.bfloat16, causal=True)


@pytest.mark.parametrize("impl, causal", [("splash", False), ("triton", True)])
def test_a_length_off_the_blocks_is_padded_to_whole_blocks(impl, causal):
  assert_equals_reference(impl, 2, t=200, causal=causal)


@pytest.mark.parametrize("impl", ["splash", "triton"])
def test_one_document_without_padding_needs_no_segment_ids(impl):
  q, k, v, _, _ = inputs(H)
  attend = lambda impl: oracles.compiled(library.self_attention, q, k, v, causal=True, impl=impl)
  np.testing.assert_allclose(attend(impl), attend("xla"), **TOLERANCE[jnp.float32])


GROUPS = jnp.repeat(jnp.arange(T // 4), 4)  # FIT-AR's latents: a group's four see each other


@pytest.mark.parametrize(
  "impl, t, window, extra, why",
  [
    ("splash", 64, 0, {}, "the length 64 is shorter than the kernel's 128-step block"),
    ("triton", T, 64, {}, "the GPU kernel has no sliding window"),
    ("triton", T, 0, {"soft_cap": 2.0}, "the GPU kernel has no soft cap on the scores"),
    ("splash", T, 0, {"probs_fn": lambda p: p * 0.5}, "attention dropout acts on the probabilities"),
    ("splash", T, 0, {"positions": GROUPS}, "the mask follows given positions (FIT-AR's group-causal latents)"),
  ],
)
def test_what_a_kernel_cannot_take_falls_back_to_the_reference_with_one_log_line(impl, t, window, extra, why, caplog):
  q, k, v, segments, valid = inputs(H, t=t)
  library._NOTED.clear()
  masks = dict(causal=True, window=window, segments=segments, k_valid=valid, **extra)
  with caplog.at_level(logging.INFO, logger=library.__name__):
    got = [library.self_attention(q, k, v, impl=impl, **masks) for _ in range(2)]
  want = library.self_attention(q, k, v, impl="xla", **masks)
  for g in got:
    np.testing.assert_array_equal(g, want)
  lines = [r.getMessage() for r in caplog.records if r.name == library.__name__]
  assert len(lines) == 1 and lines[0].startswith(f"attention: {impl} falls back to xla: {why}")
  if "positions" in extra:  # the group-causal mask itself: a latent reads the later latents of its group
    assert not np.allclose(
      want, library.self_attention(q, k, v, impl="xla", causal=True, segments=segments, k_valid=valid)
    )


def cross_inputs(tq, tk, kv_heads, valid=True):
  """Queries of one stream over another's keys; row 1's keys all padding (its queries read every key alike)."""
  rng = np.random.default_rng(tq + tk)
  x = lambda t, heads: jnp.asarray(rng.normal(size=(B, t, heads, D)), jnp.float32)
  k_valid = (jnp.arange(tk)[None] < jnp.array([[tk - 40], [0]])) if valid else None
  return x(tq, H), x(tk, kv_heads), x(tk, kv_heads), k_valid


@pytest.mark.parametrize(
  "impl, tq, tk, kv_heads, valid", [("splash", 200, 300, 2, True), ("triton", 200, 256, H, False)]
)
def test_cross_attention_on_a_kernel_equals_the_reference(impl, tq, tk, kv_heads, valid):
  """Two streams of different lengths, neither a whole number of blocks for splash (padded to them)."""
  q, k, v, k_valid = cross_inputs(tq, tk, kv_heads, valid)

  def value_and_grads(impl):
    loss = lambda q, k, v: (lambda out: (jnp.sum(out * jnp.cos(out)), out))(
      library.cross_attention(q, k, v, k_valid=k_valid, impl=impl)
    )
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  got, want = value_and_grads(impl), value_and_grads("xla")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE[jnp.float32])


@pytest.mark.parametrize(
  "impl, tq, extra, why",
  [
    ("splash", 16, {}, "the 16 queries or 256 keys are fewer than the kernel's 128-step block"),
    ("splash", 128, {"mask": True}, "the keys each query reads are given query by query"),
    ("triton", 128, {"k_valid": True}, "the GPU kernel takes one id array for queries and keys"),
  ],
)
def test_what_a_kernel_cannot_take_in_cross_attention_falls_back_with_one_log_line(impl, tq, extra, why, caplog):
  q, k, v, k_valid = cross_inputs(tq, T, H)
  masks = {"k_valid": k_valid} if "k_valid" in extra else {}
  if "mask" in extra:  # FIT's x2l: each query its own keys
    masks["mask"] = jnp.arange(T)[None, None, :] <= jnp.arange(tq)[None, :, None] * 2
  library._NOTED.clear()
  with caplog.at_level(logging.INFO, logger=library.__name__):
    got = [library.cross_attention(q, k, v, impl=impl, **masks) for _ in range(2)]
  for g in got:
    np.testing.assert_array_equal(g, library.cross_attention(q, k, v, impl="xla", **masks))
  lines = [r.getMessage() for r in caplog.records if r.name == library.__name__]
  assert len(lines) == 1 and lines[0].startswith(f"attention: {impl} falls back to xla: {why}"), lines


def _vq_full(impl, rel_bias):
  config = lra_core.load_config(
    "configs/enwik8/transformer_vq.py:tiny,full",
    ["model.num_layers=1", "train.seq_len=128", f"model.attention_impl={impl}", f"model.rel_bias={rel_bias}"],
  )
  return config


@pytest.mark.slow
def test_transformer_vq_s_full_attention_goes_to_the_kernel_unless_it_adds_xl_s_bias(caplog):
  """`attention="full"` without Transformer-XL's position bias: loss and gradients on splash equal the
  reference's; with the bias (the papers' setting) it is the reference, said in one log line."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 256, size=(2, 128)), jnp.int32)
  segments = jnp.asarray(np.where(np.arange(128) < 77, 1, 2)[None].repeat(2, 0), jnp.int32)
  out = {}
  library._NOTED.clear()
  with caplog.at_level(logging.INFO, logger=library.__name__):
    for impl, rel_bias in (("xla", False), ("splash", False), ("splash", True)):
      model = lra_core.build_model(_vq_full(impl, rel_bias), seed=0)
      graph, params, rest = nnx.split(model, nnx.Param, ...)

      def loss(params):
        logits = nnx.merge(graph, params, rest)(tokens, segment_ids=segments)
        logits = logits[0] if isinstance(logits, tuple) else logits
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32)).max(-1))

      out[impl, rel_bias] = jax.value_and_grad(loss)(params)
  for a, b in zip(jax.tree.leaves(out["splash", False]), jax.tree.leaves(out["xla", False])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  lines = [r.getMessage() for r in caplog.records if r.name == library.__name__]
  assert lines == [
    "attention: splash falls back to xla: Transformer-XL's position bias is added to the scores, "
    "and the kernels take no bias."
  ], lines


def test_auto_picks_the_kernel_of_the_platform_traced_for():
  for platform, impl in (("tpu", "splash"), ("gpu", "triton"), ("cpu", "xla")):
    with toolkit.target(platform):
      assert library.resolve("auto") == impl
      assert library.resolve("xla") == "xla"
  assert [library.block(t) for t in (128, 384, 1024, 4096, 100, 64)] == [128, 128, 512, 512, 0, 0]
  with pytest.raises(ValueError, match=r"attention implementation 'cudnn' is not one of"):
    library.resolve("cudnn")
  with pytest.raises(ConfigError, match=r"model.attention_impl 'flash' is not one of \['auto', 'xla', 'splash'"):
    lra_core.load_config("configs/c4/transformer.py:tiny", ["model.attention_impl=flash"])


@pytest.mark.slow
def test_a_transformer_trains_the_same_on_splash():
  """The tiny Transformer++ LM's loss and every gradient, with documents, on splash (interpret mode)
  and on the reference."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 256, size=(2, 129)), jnp.int32)
  segments = jnp.asarray(np.where(np.arange(128) < 77, 1, 2)[None].repeat(2, 0), jnp.int32)
  out = {}
  for impl in ("xla", "splash"):
    config = lra_core.load_config(
      "configs/c4/transformer.py:tiny,plusplus",
      ["model.num_layers=1", "train.seq_len=128", f"model.attention_impl={impl}", "model.num_kv_heads=1"],
    )
    model = lra_core.build_model(config, seed=0)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
      m = nnx.merge(graph, params, rest)
      logits = m(tokens[:, :-1], segment_ids=segments)
      return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32)).max(-1))

    out[impl] = jax.value_and_grad(loss)(params)
  for a, b in zip(jax.tree.leaves(out["splash"]), jax.tree.leaves(out["xla"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@needs_libtpu
def test_splash_in_bfloat16_compiles_for_tpu_v3():
  """TPU v3's Mosaic takes no bfloat16 matmul: there the kernel runs in float32 (its inputs cast)."""
  mesh = jax.sharding.Mesh(np.array(topologies.tpu_devices("v3:2x2")), ("data",))
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, P("data")))
  loss = lambda q, k, v: library.self_attention(q, k, v, causal=True, impl="auto").astype(jnp.float32).sum()
  args = (shape(8, 256, H, 128), shape(8, 256, 2, 128), shape(8, 256, 2, 128))
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
  assert "splash_mha_fwd" in hlo and "splash_mha_dkv" in hlo


# -- inside the trainer's step, compiled for the accelerators -------------------------------------------------

# One config per family with softmax attention, at lengths the kernels' 128-step blocks divide.
FAMILIES = {
  "transformer++": ("configs/pg19/transformer.py:tiny,plusplus", ["train.seq_len=256", "model.max_len=256"]),
  "latte_macchiato": ("configs/c4/latte.py:tiny,latte_rglru_swa++", ["train.seq_len=512", "model.window=128"]),
  "block_transformer": (
    "configs/c4/block_transformer.py:tiny",
    ["train.seq_len=512", "model.num_layers=1", "model.token_num_layers=1"],
  ),
  # Transformer-VQ's full mode without Transformer-XL's bias (with it, the reference: the kernels take no
  # bias); one window of the whole row, and one head width for the GPU kernel
  "transformer_vq_full": (
    "configs/pg19/transformer_vq.py:tiny,full",
    ["train.seq_len=256", "train.update_len=256", "model.rel_bias=False", "model.d_k=64"],
  ),
  # FIT-AR: 4 groups of 8x8 pixels' channels (192 tokens, padded to 256 for the local layers); its global
  # layers' group-causal mask is the reference's (kernels/softmax/library.py)
  "fit": (
    "configs/imagenet64/fit_ar.py:tiny",
    ["data.image_size=16", "data.patch_size=8", "model.group_size=192", "train.seq_len=768"],
  ),
}


def _compiled_hlo(spec, overrides, topology):
  """The compiled train step's HLO text of `spec` on `topology`: the train step alone (`python -m lra_core.aot`
  also compiles the eval step; tests/test_aot.py runs that command whole)."""
  config = lra_core.load_config(spec, [*overrides, "mesh.data=-1", "train.batch_size=4"])
  compiled, _ = compiled_train_step(config, aot_targets.target_devices(topology))
  return compiled.as_text()


@needs_libtpu
@pytest.mark.parametrize("family", tiers.quick(list(FAMILIES), keep=[0]))
def test_each_family_trains_on_splash_in_a_step_compiled_for_tpu(family):
  hlo = _compiled_hlo(*FAMILIES[family], "v5e:2x2")
  for kernel in ("fwd", "dq", "dkv"):  # forward and both backward kernels, multi-head or multi-query
    assert re.search(rf"splash_m[hq]a_{kernel}", hlo), f"{family}: no splash {kernel} kernel in the compiled train step"


@needs_plugin
@pytest.mark.parametrize("family", tiers.quick([f for f in FAMILIES if f != "latte_macchiato"], keep=[0]))
def test_each_family_trains_on_the_triton_kernel_in_a_step_compiled_for_an_h100(family):
  hlo = _compiled_hlo(*FAMILIES[family], "h100")
  for kernel in ("mha_forward", "mha_backward"):
    assert kernel in hlo, f"{family}: no {kernel} in the compiled train step"


# -- the roofline's count of the kernels' work ----------------------------------------------------------------


def _matmul_flops(impl, devices, causal, grad, t=2048, d=128, window=0):
  """The roofline's matrix-product FLOPs (lra_core.cost.hlo_cost) of one attention over [1,t,H,d], compiled
  for `devices`' platform: the forward, or with `grad` the gradient of a loss that reads the output (so
  the reference's forward keeps both its products)."""
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
  shape = jax.ShapeDtypeStruct((1, t, H, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  attend = lambda q, k, v: library.self_attention(q, k, v, causal=causal, window=window, impl=impl)
  fn = (
    (lambda q, k, v, w: jax.grad(lambda *x: jnp.vdot(jnp.sin(attend(*x)), w).real, argnums=(0, 1, 2))(q, k, v))
    if grad
    else (lambda q, k, v, w: attend(q, k, v))
  )
  with jax.set_mesh(mesh):
    text = jax.jit(fn).lower(shape, shape, shape, shape).compile().as_text()
  return hlo_cost.step_flops(text)[0]


def _blocks_kept(t, size, causal, window):
  """Of the (t / size)^2 blocks, those where the dense mask keeps some (query, key): the blocks a flash
  kernel cannot skip."""
  offset = np.arange(t)[None, :] - np.arange(t)[:, None]  # key - query
  keep = (offset <= 0) if causal else np.ones((t, t), bool)
  if window:
    keep &= np.abs(offset) < window
  n = t // size
  return int(keep.reshape(n, size, n, size).any(axis=(1, 3)).sum())


# Per score entry and head dimension (q, k and v of one width): the reference's forward takes 2 products
# (scores, probabilities x values) and its backward 4 more; a flash kernel's forward the same 2, its
# backward 7 (scores recomputed twice and dprobs once more, as it keeps no probabilities).
@needs_libtpu
def test_the_roofline_counts_splash_as_the_reference_s_products_over_the_blocks_its_mask_keeps():
  """The reference computes every (query, key) pair; splash the blocks of 512 its mask keeps (4 per side:
  16 for a full mask, 10 causal, fewer for a window), counted here from the dense mask; a window shorter
  than 512 (Latte-Macchiato's 128) takes blocks of about its length, so each query block reads two."""
  devices = topologies.tpu_devices("v5e:1x1")
  every_pair = _matmul_flops("xla", devices, causal=False, grad=True) * 9 / 6
  assert every_pair > 0
  for causal, window, size in [(False, 0, 512), (True, 0, 512), (True, 600, 512), (False, 600, 512), (True, 128, 128)]:
    kept = _blocks_kept(2048, size, causal, window) * size**2 / 2048**2
    got = _matmul_flops("splash", devices, causal=causal, grad=True, window=window)
    assert got == pytest.approx(every_pair * kept), (causal, window)


@needs_plugin
def test_the_roofline_counts_the_triton_kernel_as_the_reference_s_products_over_its_blocks():
  """The GPU kernel's forward takes blocks of 128 (2 per side: causal keeps 3 of 4), its backward of 32
  (8 per side: causal keeps 36 of 64)."""
  devices = topologies.gpu_devices("h100")
  forward = _matmul_flops("xla", devices, causal=False, grad=False, t=256)
  backward = (_matmul_flops("xla", devices, causal=False, grad=True, t=256) - forward) * 7 / 4
  assert forward > 0
  assert _matmul_flops("triton", devices, causal=False, grad=False, t=256) == pytest.approx(forward)
  assert _matmul_flops("triton", devices, causal=False, grad=True, t=256) == pytest.approx(forward + backward)
  kept = forward * _blocks_kept(256, 128, True, 0) / 4 + backward * _blocks_kept(256, 32, True, 0) / 64
  assert _matmul_flops("triton", devices, causal=True, grad=True, t=256) == pytest.approx(kept)
