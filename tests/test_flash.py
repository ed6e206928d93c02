"""FLASH (models/flash.py, kernels/mixed_chunk/__init__.py) against quadratic oracles, causality, decoding, padding."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import fixtures.c4
import fixtures.c4_mlm
import fixtures.pg19
import lra_core
import oracles
import tiers
from lra_core import kernels, registry
from lra_core.bench import param_counts
from lra_core.errors import ConfigError
from lra_core.kernels import mixed_chunk as fk
from lra_core.models import flash
from lra_core.models.layers.positions import RelativePositionBias
from lra_core.protocol import RunInfo
from lra_core.train import train_and_evaluate


def rand(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def qkv(t, heads=1, s=6, e=5, b=2):
  return [rand(i, (b, t, heads, s)) for i in range(4)] + [rand(4, (b, t, heads, e))]


def mixed_chunk_oracle(qq, qk, lq, lk, v, *, chunk, causal, bias, segments=None, mask=None, global_norm="sum"):
  """Eqs. 7-8 as one T x T matrix: relu^2 inside a chunk, lin_q lin_k^T / C to other chunks (to all
  chunks, the own one included, when not causal); with segments only within a document, and with
  "mean" each row's cross-chunk part divided by the number of chunks it reads keys from."""
  b, t = v.shape[:2]
  pos = np.arange(t)
  seg = np.ones((b, t), int) if segments is None else np.asarray(segments)
  valid = np.ones((b, t), bool) if mask is None else np.asarray(mask)
  readable = (seg[:, :, None] == seg[:, None, :]) & valid[:, None, :]  # [B,T,T]
  g, i = pos // chunk, pos % chunk
  local = jnp.square(jax.nn.relu(jnp.einsum("bihs,bjhs->bhij", qq, qk) / chunk + bias[i[:, None], i[None, :]]))
  local = local * (g[:, None] == g[None, :]) * ((pos[:, None] >= pos[None, :]) if causal else 1)
  reach = readable & ((g[:, None] > g[None, :]) if causal else True)  # keys of the global part
  glob = jnp.einsum("bihs,bjhs->bhij", lq, lk) / chunk * reach[:, None]
  if causal:
    glob = glob * (g[:, None] > g[None, :])
  if global_norm == "mean":
    count = np.array([[len(set(g[reach[bb, q]])) for q in range(t)] for bb in range(b)])
    glob = glob / np.maximum(count, 1)[:, None, :, None]
  return jnp.einsum("bhij,bjhe->bihe", local * readable[:, None] + glob, v)


# -- kernels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,chunk", [(16, 4), (13, 4), (7, 1), (12, 5), (9, 9)])
def test_mixed_chunk_equals_quadratic_matrix(t, chunk, causal):
  args = qkv(t)
  bias = rand(9, (chunk, chunk), 0.3)
  got = oracles.compiled(
    kernels.mixed_chunk_attention,
    *args,
    chunk=chunk,
    causal=causal,
    quad_scale=1 / chunk,
    lin_scale=1 / chunk,
    bias=bias,
  )
  np.testing.assert_allclose(got, mixed_chunk_oracle(*args, chunk=chunk, causal=causal, bias=bias), atol=2e-5)


# Two rows of packed documents: a boundary inside a chunk, one on a chunk boundary, a one-chunk
# document, padding (segment 0) at the end.
SEGMENTS = np.array([[1] * 5 + [2] * 3 + [3] * 6 + [0] * 2, [1] * 8 + [2] * 2 + [3] * 6])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("global_norm", ["sum", "mean"])
def test_mixed_chunk_with_documents_equals_masked_quadratic_matrix(causal, global_norm):
  args = qkv(16)
  bias = rand(9, (4, 4), 0.3)
  mask = jnp.asarray(SEGMENTS > 0)
  got = oracles.compiled(
    kernels.mixed_chunk_attention,
    *args,
    chunk=4,
    causal=causal,
    quad_scale=0.25,
    lin_scale=0.25,
    bias=bias,
    mask=mask,
    segments=jnp.asarray(SEGMENTS),
    global_norm=global_norm,
  )
  want = mixed_chunk_oracle(
    *args, chunk=4, causal=causal, bias=bias, segments=SEGMENTS, mask=mask, global_norm=global_norm
  )
  real = SEGMENTS > 0  # padded rows read nothing: arbitrary
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_global_norm_mean_divides_by_the_chunks_summed(causal):
  """Without documents: "mean" divides chunk g's cross-chunk sum by g (causal) or by the number of
  chunks holding real keys (non-causal; padding chunks do not count); "sum" does not divide."""
  qq, qk, lq, lk, v = qkv(16)
  mask = jnp.broadcast_to(jnp.arange(16) < 11, (2, 16))  # chunks 0-2 hold real keys, chunk 3 none
  kw = dict(chunk=4, causal=causal, quad_scale=0.25, lin_scale=0.25, mask=mask)
  glob = lambda norm: oracles.compiled(kernels.mixed_chunk_attention, None, None, lq, lk, v, global_norm=norm, **kw)
  total, mean = glob("sum"), glob("mean")
  count = np.maximum(np.arange(16) // 4, 1) if causal else np.full(16, 3)
  np.testing.assert_allclose(mean[:, :11], total[:, :11] / count[None, :11, None, None], atol=1e-5)
  assert not np.allclose(mean[:, 8:11], total[:, 8:11], atol=1e-3)
  want = mixed_chunk_oracle(
    jnp.zeros_like(qq), qk, lq, lk, v, chunk=4, causal=causal, bias=jnp.zeros((4, 4)), mask=mask, global_norm="mean"
  )  # relu(0)^2: the global part alone
  np.testing.assert_allclose(mean[:, :11], want[:, :11], atol=1e-5)


@pytest.mark.parametrize("global_norm", ["sum", "mean"])
def test_one_document_per_row_is_no_segments(global_norm):
  args = qkv(13)
  for causal in (True, False):
    kw = dict(chunk=4, causal=causal, quad_scale=0.25, lin_scale=0.25, global_norm=global_norm)
    np.testing.assert_allclose(
      oracles.compiled(kernels.mixed_chunk_attention, *args, segments=jnp.ones((2, 13), jnp.int32), **kw),
      oracles.compiled(kernels.mixed_chunk_attention, *args, **kw),
      atol=1e-5,
    )


def test_one_chunk_reduces_to_quadratic_gau_values_and_gradients():
  """chunk = T, causal: no earlier chunk, so FLASH's attention is FLASH-Quad's relu^2(q k / n + b) v."""
  qq, qk, lq, lk, v = qkv(12)
  bias = rand(9, (12, 12), 0.3)
  w = rand(7, v.shape)  # a loss that weighs every output differently
  mixed = lambda qq, qk, v: (
    w
    * kernels.mixed_chunk_attention(
      qq, qk, lq, lk, v, chunk=12, causal=True, quad_scale=1 / 12, lin_scale=1 / 12, bias=bias
    )
  ).sum()
  quad = lambda qq, qk, v: (w * kernels.relu2_attention(qq, qk, v, scale=1 / 12, bias=bias, causal=True)).sum()
  np.testing.assert_allclose(oracles.compiled(mixed, qq, qk, v), oracles.compiled(quad, qq, qk, v), rtol=1e-6)
  value_grads = lambda f: oracles.compiled(jax.grad(f, argnums=(0, 1, 2)), qq, qk, v)
  for a, b in zip(value_grads(mixed), value_grads(quad)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kernel", ["relu2", "softmax"])
def test_padding_keys_contribute_nothing(kernel):
  qq, qk, lq, lk, v = qkv(13)
  kw = dict(chunk=4, causal=False, quad_scale=0.25, lin_scale=0.25, kernel=kernel)
  mask = jnp.broadcast_to(jnp.arange(13) < 9, (2, 13))
  padded = oracles.compiled(kernels.mixed_chunk_attention, qq, qk, lq, lk, v, mask=mask, **kw)
  cut = oracles.compiled(kernels.mixed_chunk_attention, *(x[:, :9] for x in (qq, qk, lq, lk, v)), **kw)
  np.testing.assert_allclose(padded[:, :9], cut, atol=1e-6)


@pytest.mark.parametrize("kernel,global_norm", [("relu2", "sum"), ("softmax", "sum"), ("relu2", "mean")])
def test_chunk_step_equals_forward(kernel, global_norm):
  qq, qk, lq, lk, v = qkv(11, heads=2)
  bias = rand(9, (4, 4), 0.3)
  kw = dict(quad_scale=0.25, lin_scale=0.25, kernel=kernel, global_norm=global_norm)
  full = oracles.compiled(kernels.mixed_chunk_attention, qq, qk, lq, lk, v, chunk=4, causal=True, bias=bias, **kw)
  state = fk.init_chunk_state(2, 2, 4, 6, 5)
  for t in range(11):
    y, state = oracles.compiled(
      fk.chunk_step,
      qq[:, t],
      qk[:, t],
      lq[:, t],
      lk[:, t],
      v[:, t],
      state,
      jnp.int32(t),
      chunk=4,
      bias_row=bias[t % 4],
      **kw,
    )
    np.testing.assert_allclose(y, full[:, t], atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_equals_quadratic_form_and_steps(causal):
  q, k, _, _, v = qkv(13, heads=2)
  mask = jnp.broadcast_to(jnp.arange(13) < 10, (2, 13))
  for m in (None, mask):
    np.testing.assert_allclose(
      oracles.compiled(kernels.linear_attention, q, k, v, causal=causal, chunk=4, mask=m),
      oracles.compiled(fk.linear_attention_reference, q, k, v, causal=causal, mask=m),
      atol=1e-5,
    )
  # documents: each the linear attention of its own tokens alone
  seg = jnp.array([[1] * 6 + [2] * 7, [1] * 4 + [2] * 9])
  got = oracles.compiled(kernels.linear_attention, q, k, v, causal=causal, chunk=4, segments=seg)
  for row, cut in ((0, 6), (1, 4)):
    for lo, hi in ((0, cut), (cut, 13)):
      alone = oracles.compiled(
        fk.linear_attention_reference, *(x[row : row + 1, lo:hi] for x in (q, k, v)), causal=causal
      )
      np.testing.assert_allclose(got[row : row + 1, lo:hi], alone, atol=1e-5)
  if causal:
    full = oracles.compiled(kernels.linear_attention, q, k, v, causal=True, chunk=4)
    state = fk.init_chunk_state(2, 2, 4, 6, 6)
    for t in range(13):
      y, state = oracles.compiled(fk.linear_step, q[:, t], k[:, t], v[:, t], state, jnp.int32(t), chunk=4)
      np.testing.assert_allclose(y, full[:, t], atol=1e-5)


@pytest.mark.parametrize("kind,n", [("toeplitz", 8), ("rope", 8)])
def test_relative_bias_depends_on_distance_only(kind, n):
  bias = RelativePositionBias(n, kind=kind, rngs=nnx.Rngs(params=0))
  pos = jnp.arange(n)
  b = bias(pos, pos)
  np.testing.assert_allclose(bias(pos + 5, pos + 5), b, atol=1e-5)
  np.testing.assert_allclose(b[1:, 1:], b[:-1, :-1], atol=1e-5)  # Toeplitz
  assert RelativePositionBias(511, rngs=nnx.Rngs(params=0)).kind == "toeplitz"
  assert RelativePositionBias(512, rngs=nnx.Rngs(params=0)).kind == "rope"


# -- the model -----------------------------------------------------------------------------------------------

CAUSAL_VARIANTS = sorted(flash.VARIANTS)


def make_config(task="lm", variant="flash", seq_len=16, **model):
  c = ml_collections.ConfigDict()
  c.task = task
  defaults = dict(
    vocab_size=23,
    d_model=32,
    num_layers=2,
    num_heads=2,
    d_ff=48,
    qk_dim=8,
    chunk=4,
    num_classes=3 if task == "classify" else 0,
    norm="layer",
  )
  c.model = flash.model_config(variant, **{**defaults, **model})
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  flash.validate_config(c)
  return c


def make_model(config, seed=0):
  model = flash.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))
  model.eval()
  return model


def tokens(b=2, t=16, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 23)


@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_decoder_is_causal_and_decode_matches_forward(variant):
  model = make_model(make_config(variant=variant))
  x = tokens()
  logits = oracles.forward(model, x)
  assert logits.shape == (2, 16, 23)
  # inside and at the ends of chunks (4)
  oracles.assert_no_future_leakage(model, x, logits, (0, 3, 6, 13), vocab=23, shift=5, changed_atol=1e-4)
  oracles.assert_decode_matches_forward(model, x, logits)


# Packed documents (tests/oracles.py), C = 4, T = 16: the exact oracle with the second document on
# a chunk boundary (8); FLASH-Quad (one chunk) at any boundary; the isolation oracle at 6.
DOC_A, DOC_B = np.arange(3, 11) % 23, (np.arange(6) * 5 + 1) % 23
DOC_A_UNALIGNED, DOC_B_UNALIGNED = np.arange(3, 9) % 23, (np.arange(7) * 5 + 1) % 23


def documents_apply(model):
  return lambda rows, segs: oracles.forward(model, rows, segment_ids=segs)


FLASH_DOCUMENT_CASES = [(v, t, i) for v in ("flash_quad", "flash") for t in ("lm", "mlm") for i in ("xla", "pallas")]


@pytest.mark.parametrize(
  "variant,task,impl",
  tiers.quick(
    FLASH_DOCUMENT_CASES,
    keep=[FLASH_DOCUMENT_CASES.index(c) for c in (("flash", "lm", "pallas"), ("flash_quad", "mlm", "xla"))],
    ids=lambda c: "-".join(c),
  ),
)
def test_packed_documents_are_independent(variant, task, impl):
  model = make_model(make_config(task=task, variant=variant, num_layers=1, impl=impl))
  apply = documents_apply(model)
  oracles.assert_documents_independent(apply, DOC_A, DOC_B, 16)
  if variant == "flash_quad":  # no chunks: any boundary
    oracles.assert_documents_independent(apply, DOC_A_UNALIGNED, DOC_B_UNALIGNED, 16)
  oracles.assert_documents_isolated(apply, DOC_A_UNALIGNED, DOC_B_UNALIGNED, 16, vocab=23)


OTHER_DOCUMENT_CASES = [
  (v, t) for v in ("flash_local", "flash_global", "mc_transformer++", "performer") for t in ("lm", "mlm")
]


@pytest.mark.parametrize("variant,task", tiers.quick(OTHER_DOCUMENT_CASES, keep=[3], ids=lambda c: "-".join(c)))
def test_packed_documents_in_the_other_variants(variant, task):
  model = make_model(make_config(task=task, variant=variant, num_layers=1, chunk=4))
  oracles.assert_documents_independent(documents_apply(model), DOC_A, DOC_B, 16)
  oracles.assert_documents_isolated(documents_apply(model), DOC_A_UNALIGNED, DOC_B_UNALIGNED, 16, vocab=23)


@pytest.mark.parametrize("task", ["lm", "mlm"])
def test_global_norm_config_changes_the_model(task):
  """The same weights: "sum" and "mean" differ once a query reads two or more chunks."""
  x = tokens()

  def logits(norm):
    model = make_model(make_config(task=task, global_norm=norm))
    params = nnx.state(model, nnx.Param)
    for _, variable in nnx.to_flat_state(params):  # weights of N(0, .02) hide the global part
      variable.set_value(variable.get_value() * 10)
    nnx.update(model, params)
    return oracles.forward(model, x)

  mean, total = logits("mean"), logits("sum")
  if task == "lm":  # chunks 0 and 1 read at most one earlier chunk: the mean is the sum
    np.testing.assert_allclose(mean[:, :8], total[:, :8], atol=1e-6)
  assert not np.allclose(mean[:, 8:], total[:, 8:], atol=1e-4)
  with pytest.raises(ConfigError, match="model.global_norm 'max' is not one of"):
    make_config(global_norm="max")


def test_global_only_ablation_uses_chunks_of_64():
  """Figure 7: FLASH (Global Only) reduces the chunk from 256 to 64 (Section 4.4)."""
  assert flash.model_config("flash_global").chunk == 64 and flash.model_config("flash").chunk == 256
  for spec in (
    "configs/c4/flash.py:flash_global",
    "configs/c4/flash.py:flash_global,lm",
    "configs/pg19/flash.py:flash_global",
  ):
    assert lra_core.load_config(spec).model.chunk == 64, spec
  assert lra_core.load_config("configs/c4/flash.py:flash_local").model.chunk == 256


def test_decode_state_has_constant_size_and_quad_is_bounded():
  model = make_model(make_config(variant="flash"))
  size = lambda st: sum(x.size for x in jax.tree.leaves(st))
  assert size(model.init_decode_state(2, 16)) == size(model.init_decode_state(2, 4096))
  with pytest.raises(ValueError, match="exceeds the model's max_len 16"):
    make_model(make_config(variant="flash_quad")).init_decode_state(2, 17)


@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_bidirectional_padding_does_not_change_real_tokens(variant):
  model = make_model(make_config(task="classify", variant=variant))
  x = tokens()
  pooled = oracles.forward(model, x[:, :10], mask=jnp.ones((2, 10), bool))
  padded = jnp.concatenate([x[:, :10], x[:, 10:] * 0 + 7], 1)
  mask = jnp.broadcast_to(jnp.arange(16) < 10, (2, 16))
  np.testing.assert_allclose(oracles.forward(model, padded, mask=mask), pooled, atol=1e-5)
  features, _ = oracles.forward(model, padded, mask=mask, method="encode")
  np.testing.assert_allclose(features[:, :10], oracles.forward(model, x[:, :10], method="encode")[0], atol=1e-5)


@pytest.mark.parametrize("task", ["lm", "mlm"])
def test_flash_with_one_chunk_and_no_global_part_is_flash_quad(task):
  """FLASH with C = T and lin_q = lin_k = 0 computes FLASH-Quad exactly (same other weights)."""
  quad = make_model(make_config(task=task, variant="flash_quad"))
  model = make_model(make_config(task=task, variant="flash", chunk=16), seed=3)
  source = dict(nnx.to_flat_state(nnx.state(quad, nnx.Param)))
  target = nnx.state(model, nnx.Param)
  for path, variable in nnx.to_flat_state(target):
    value = source[path].get_value()
    if path[-1] in ("gamma", "beta"):  # rows quad_q, quad_k from FLASH-Quad; lin_q, lin_k zero
      value = jnp.concatenate([value, jnp.zeros_like(value)])
    variable.set_value(value)
  nnx.update(model, target)
  x = tokens()
  np.testing.assert_allclose(oracles.forward(model, x), oracles.forward(quad, x), atol=1e-5)


def test_gau_follows_the_papers_shapes_and_init():
  config = make_config(variant="flash", d_model=32, expansion=2, qk_dim=8)
  gau = make_model(config).blocks[0].attn
  assert gau.proj.kernel.shape == (32, 2 * 64 + 8) and gau.out.kernel.shape == (64, 32)
  assert gau.gamma.shape == (4, 8) and not np.any(gau.beta[...])
  assert make_model(make_config(variant="flash_quad")).blocks[0].attn.gamma.shape == (2, 8)
  assert make_model(config).blocks[0].mlp is None  # a GAU is attention and MLP in one


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="flash variant 'flashy' is not one of"):
    flash.model_config("flashy")
  with pytest.raises(ConfigError, match="model.chunk must be positive"):
    make_config(chunk=0)
  with pytest.raises(ConfigError, match="model.mlp must be 'none'"):
    make_config(mlp="glu")
  with pytest.raises(ConfigError, match="qk_dim positive and even"):
    make_config(qk_dim=7)
  with pytest.raises(ConfigError, match="different FLASH variants"):
    lra_core.load_config("configs/c4/flash.py:flash,performer")


@pytest.mark.parametrize(
  "spec,paper",
  [
    ("configs/c4/flash.py", 112e6),
    ("configs/c4/flash_quad.py", 112e6),
    ("configs/c4/flash.py:performer", 110e6),
    pytest.param("configs/pg19/flash.py", 496e6, marks=pytest.mark.slow),
    pytest.param("configs/pg19/flash.py:flash_quad", 496e6, marks=pytest.mark.slow),
  ],
)
def test_paper_parameter_counts_within_three_percent(spec, paper):
  count = registry.parameter_count(lra_core.load_config(spec))
  assert abs(count - paper) / paper < 0.03, (spec, count)
  assert any(row.config == spec for row in param_counts.PAPER)


@pytest.mark.slow
def test_tiny_mlm_config_trains(tmp_path):
  # Killed and resumed runs of this config: tests/test_kill_resume.py.
  overrides = fixtures.c4_mlm.build(tmp_path) + ["train.steps=4", "train.checkpoint_every=2"]
  config = lra_core.load_config("configs/c4/flash.py:tiny", overrides)
  whole = train_and_evaluate(config, tmp_path / "whole")
  assert np.isfinite(whole["test_loss"])


@pytest.mark.parametrize(
  "fixture,spec",
  [
    (fixtures.c4, "configs/c4/flash_quad.py:tiny,lm"),
    pytest.param(fixtures.pg19, "configs/pg19/flash.py:tiny,mc_transformer++", marks=pytest.mark.slow),
    pytest.param(fixtures.pg19, "configs/pg19/flash.py:tiny,performer", marks=pytest.mark.slow),
  ],
)
def test_tiny_lm_configs_train(tmp_path, fixture, spec):
  summary = train_and_evaluate(lra_core.load_config(spec, fixture.build(tmp_path)), tmp_path / "run")
  assert np.isfinite(summary["test_loss"])
