"""kernels/softmax/library.py `_split_splash`: softmax attention over a sequence split over chips on
splash (interpret mode on this host), every chip's queries against the gathered keys. Split == the
whole sequence's reference in values and gradients: causal in the plain and the zig-zag order and
bidirectional, grouped and multi-query heads, documents on and off the chips' edges, padding, a soft cap;
the step holds one all-gather and no ring; each chip's block lists are its own rows' (a causal chip
skips the key blocks after its queries); what it cannot take falls back to ring attention with one line."""

import gzip
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

import lra_core
import tiers
from lra_core import aot, layout, sharding
from lra_core.compilation import topologies
from lra_core.config import DEFAULT_RULES
from lra_core.kernels import context_parallel
from lra_core.kernels.softmax import library, splash_lists

B, T, H, D = 2, 1024, 4, 32  # 8 chips hold 128 steps each: one block
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # the kernel's online softmax against one softmax


def inputs(kv_heads):
  rng = np.random.default_rng(kv_heads)
  x = lambda heads, scale=1.0: jnp.asarray(scale * rng.normal(size=(B, T, heads, D)), jnp.float32)
  steps = np.arange(T)
  # row 0: documents changing at 256 (a chip's edge for 2, 4 and 8 chips) and at 700 (inside a chip);
  # row 1: one document, its last 300 steps padding
  segments = jnp.asarray(np.stack([1 + (steps >= 256) + (steps >= 700), np.ones(T)]), jnp.int32)
  valid = jnp.arange(T)[None] < jnp.array([[T], [T - 300]])
  return x(H), x(kv_heads, 3.0), x(kv_heads), segments, valid


def step(impl, causal, zigzag, segments, valid, **kw):
  """Loss, valid outputs and gradients of attention over the (whole or split) sequence; in the zig-zag
  order the rows go there and back around it (context_parallel.to_zigzag)."""

  def loss(q, k, v):
    args, order = (q, k, v, valid, segments), dict(batch=B, length=T)
    if zigzag:
      q_, k_, v_, ok, ids = context_parallel.to_zigzag(args, **order)
      with context_parallel.zigzag_order():
        out = library.self_attention(q_, k_, v_, causal=causal, k_valid=ok, segments=ids, impl=impl, **kw)
      out = context_parallel.from_zigzag(out, **order)
    else:
      out = library.self_attention(q, k, v, causal=causal, k_valid=valid, segments=segments, impl=impl, **kw)
    out = jnp.where(valid[..., None, None], out, 0)  # padded queries read other keys under the kernels
    return jnp.sum(out * jnp.cos(out)), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def mesh_of(data, sequence):
  return layout.make_mesh(dict(data=data, fsdp=1, sequence=sequence, tensor=1))


CASES = [
  # causal, zig-zag, key-value heads, soft cap, (data, sequence)
  (True, True, 2, 0.0, (2, 4)),
  (False, False, H, 0.0, (2, 4)),
  (True, False, H, 0.0, (1, 8)),
  (True, True, 1, 0.0, (1, 8)),
  (True, True, 2, 2.0, (1, 2)),
  (False, False, 1, 0.0, (1, 8)),
]


@pytest.mark.parametrize("causal, zigzag, kv_heads, soft_cap, mesh", tiers.quick(CASES, keep=[0, 1]))
def test_splash_over_a_split_sequence_equals_the_whole_reference(causal, zigzag, kv_heads, soft_cap, mesh):
  q, k, v, segments, valid = inputs(kv_heads)
  (l0, o0), g0 = step("xla", causal, False, segments, valid, soft_cap=soft_cap)(q, k, v)
  with sharding.activate(mesh_of(*mesh), DEFAULT_RULES):
    run = step("splash", causal, zigzag, segments, valid, soft_cap=soft_cap)
    program = str(jax.make_jaxpr(run)(q, k, v))
    (l1, o1), g1 = run(q, k, v)
  assert "pallas_call" in program and "all_gather" in program
  assert zigzag or "ppermute" not in program  # no ring (the zig-zag order's own moves apart)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for a, b in zip((o1, *g1), (o0, *g0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)


def block_sizes(bq, bkv):
  return splash.BlockSizes(
    **dict.fromkeys(("block_q", "block_q_dkv", "block_q_dq"), bq),
    **dict.fromkeys(("block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute", "block_kv_dq"), bkv),
  )


def assert_same_kernel(got, want, **settings):
  """Every block list of the forward, dq and dk/dv kernels equal in shape, type and value; the same
  settings (the mask function apart)."""
  for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
    for field, a in getattr(want, name)._asdict().items():
      b = getattr(getattr(got, name), field)
      assert (a is None) == (b is None), (name, field)
      if a is not None and field != "is_dynamic_mask":
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), (name, field)
  settings_of = lambda kernel: {k: v for k, v in kernel.kwargs.items() if k != "mask_function"}
  assert settings_of(got) == settings_of(want) | settings
  assert (got.kwargs["mask_function"] is None) == (want.kwargs["mask_function"] is None)


@pytest.mark.parametrize(
  "t, chips, zigzag, bq, bkv",
  [(1024, 1, False, 128, 128), (1024, 4, True, 128, 128), (1024, 4, False, 256, 256), (2048, 8, True, 128, 128)]
  + [(1024, 2, False, 128, 256), (2048, 4, True, 128, 256), (2048, 2, True, 256, 128)],
)
def test_the_block_lists_built_in_numpy_are_splash_s_own(t, chips, zigzag, bq, bkv):
  """kernels/softmax/splash_lists.py against splash's make_splash_mha (its block-by-block loop) for the causal
  mask over the steps the chips' rows hold, and for one chip's rows of the full mask."""
  steps = context_parallel.held_steps(chips, t // chips, zigzag)
  causal = masks.CausalMask((t, t))
  causal.q_sequence = steps
  sizes = block_sizes(bq, bkv)
  want = splash.make_splash_mha(masks.MultiHeadMask([causal] * H), block_sizes=sizes, head_shards=1, q_seq_shards=chips)
  got = splash_lists.causal_kernel(
    steps, t, shards=chips, block_sizes=sizes, is_mqa=False, soft_cap=None, interpret=True
  )
  assert_same_kernel(got, want, interpret=True)
  rows, cols = np.arange(8)[:, None], np.arange(8)[None, :]
  assert (got.kwargs["mask_function"](rows, cols) == want.kwargs["mask_function"](rows, cols)).all()
  # the bidirectional form: one chip's rows against every key, no mask in the kernel
  full = masks.MultiHeadMask([masks.FullMask((t // chips, t))] * H)
  want = splash.make_splash_mha(full, block_sizes=sizes, head_shards=1, q_seq_shards=1)
  got = splash_lists.full_kernel(t // chips, t, block_sizes=sizes, is_mqa=False, soft_cap=None, interpret=False)
  assert_same_kernel(got, want)


@pytest.mark.parametrize("zigzag", [False, True])
def test_each_chip_holds_the_block_lists_of_its_own_rows(zigzag):
  """The causal mask's block lists, split over 4 chips like the queries: in the plain order chip c reads
  c + 1 of the 4 key blocks of its 256 steps; in the zig-zag order, in blocks of a piece (128 steps),
  every chip reads 9 (pieces c and 7 - c: c + 1 and 8 - c)."""
  kernel, live = library._whole_sequence_kernel(T, 4, 2, True, zigzag, 0.0, True)
  blocks = np.asarray(kernel.fwd_mask_info.block_mask)[0]
  per_chip = [int((rows != 0).sum()) for rows in np.split(blocks, 4)]
  size = 128 if zigzag else 256
  assert per_chip == ([9] * 4 if zigzag else [1, 2, 3, 4])
  assert live == max(per_chip) * size * size
  steps = np.asarray(kernel.fwd_mask_info.q_sequence)  # the steps the rows hold, chip after chip
  assert sorted(steps) == list(range(T))
  assert (steps[128:256] == (np.arange(896, 1024) if zigzag else np.arange(128, 256))).all()


@pytest.mark.parametrize(
  "impl, window, length, why",
  [
    ("triton", 0, T, "the GPU kernel takes no offset between queries and keys"),
    ("splash", 64, T, "a sliding window over a split sequence reads only its neighbours' steps"),
    ("splash", 0, T // 2, "a chip's slice of 64 steps is not whole 128-step blocks"),
    # a chip's one query block of 128 steps against 8 key blocks: 8 x (1 + 1) bytes, over a budget of 15
    ("splash", 0, T, "splash's block lists for 1,024 steps over 8 chips would take 0.0 MiB of a chip's scalar memory"),
  ],
)
def test_what_the_split_kernel_cannot_take_runs_as_ring_attention_with_one_line(
  impl, window, length, why, caplog, monkeypatch
):
  if why.startswith("splash's block lists"):  # a scalar memory too small for 16 bytes of lists
    monkeypatch.setattr(library, "SCALAR_MEMORY_BUDGET", 15)
    assert library._split_lists_bytes(T, 8, True) == 16
  q, k, v, segments, valid = (x[:, :length] for x in inputs(2))
  masks = dict(causal=True, window=window, segments=segments, k_valid=valid)
  library._NOTED.clear()
  with caplog.at_level(logging.INFO, logger=library.__name__), sharding.activate(mesh_of(1, 8), DEFAULT_RULES):
    got = jax.jit(lambda q, k, v: library.self_attention(q, k, v, impl=impl, **masks))(q, k, v)
    want = jax.jit(lambda q, k, v: library.self_attention(q, k, v, impl="xla", **masks))(q, k, v)
  np.testing.assert_array_equal(got, want)
  lines = [r.getMessage() for r in caplog.records if r.name == library.__name__]
  assert len(lines) == 1 and lines[0].startswith(f"attention: {impl} falls back to xla: {why}"), lines


@pytest.mark.skipif(not topologies.libtpu_installed(), reason="libtpu is not installed")
def test_the_split_train_step_compiles_for_tpu_with_splash_over_the_gathered_keys(tmp_path):
  """Transformer++ with its 1,024 steps split over the 4 chips of a v5e slice, compiled by libtpu: the
  step holds splash's forward and both backward kernels (Mosaic, each chip's block lists an argument
  split with its rows) and the keys' all-gather."""
  config = lra_core.load_config(
    "configs/pg19/transformer.py:tiny,plusplus",
    ["train.seq_len=1024", "model.max_len=1024", "mesh.data=1", "mesh.sequence=4", "train.batch_size=2"],
  )
  path = tmp_path / "step.hlo.gz"
  aot.compile_config(config, "v5e:2x2", hlo_path=path)
  hlo = gzip.open(path, "rt").read()
  for kernel in ("fwd", "dq", "dkv"):
    assert re.search(rf"splash_m[hq]a_{kernel}", hlo), f"no splash {kernel} kernel in the compiled train step"
  assert re.search(r"all-gather(-start)?\(", hlo)
