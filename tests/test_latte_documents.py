"""Latte with packed documents (segment_ids), latent dropout on p(l|t), and the RGLRU-SWA++ baseline.

Kernels with `segments` == the quadratic formulas with a per-document mask (values and gradients);
every variant, causal (lm) and bidirectional (mlm), under both impls: a packed document gets the
outputs it gets alone (tests/oracles.py); the mixers keep to their document.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_latte import make_config, make_model, tokens

import lra_core
import oracles
import tiers
from lra_core import kernels, registry
from lra_core.errors import ConfigError
from lra_core.kernels import latte as lk
from lra_core.kernels.softmax.reference import attention_mask
from lra_core.models import latte
from lra_core.models.layers.positions import apply_rope

O0 = {"xla_backend_optimization_level": 0}
# Three documents (one of 4 tokens, across chunk boundaries at chunk 3 and 4) and trailing padding
# (segment 0) in row 0; one document in row 1.
SEGMENTS = jnp.array([[1] * 4 + [2] * 6 + [3] * 2 + [0], [1] * 13])


def qkv(b=2, t=13, h=2, l=5, d=3):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.float32) for n in (l, l, d))


def keep_mask(shape, rate=0.4):
  """A latent-dropout scale: keep mask / keep rate."""
  return jnp.asarray(np.random.default_rng(5).random(shape) >= rate, jnp.float32) / (1 - rate)


def value_and_grads(fn, q, k, v):
  weights = jnp.cos(jnp.arange(v.shape[-1]) + jnp.arange(v.shape[1])[:, None, None])
  y, vjp = jax.vjp(fn, q, k, v)
  return y, vjp(weights * jnp.ones_like(y))


def assert_same(fn, reference, q, k, v):
  got, want = (
    jax.jit(lambda *a: (value_and_grads(fn, *a), value_and_grads(reference, *a))).lower(q, k, v).compile(O0)(q, k, v)
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


# -- kernels ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl,chunk", [("xla", 1), ("xla", 3), ("xla", 16), ("pallas", 4)])
def test_causal_kernel_with_segments_equals_masked_formula(impl, chunk):
  """The state restarts at each document: == the quadratic Def. 2 with a per-document mask, with
  large key logits (a document's max is its own) and a latent-dropout scale."""
  q, k, v = qkv()
  k = 30.0 * k
  scale = keep_mask(q.shape)
  fast = lambda q, k, v: kernels.causal_latte(q, k, v, chunk=chunk, impl=impl, segments=SEGMENTS, latent_scale=scale)
  reference = lambda q, k, v: lk.causal_latte_reference(q, k, v, segments=SEGMENTS, latent_scale=scale)
  assert_same(fast, reference, q, k, v)
  # The mask matters: without segments the second document reads the first.
  plain = oracles.compiled(lk.causal_latte_reference, q, k, v)
  assert not np.allclose(plain[0, 4:], oracles.compiled(reference, q, k, v)[0, 4:], atol=1e-3)


@pytest.mark.parametrize("impl,chunk", [("xla", 1), ("xla", 4), ("xla", 16), ("pallas", 4)])
def test_bidirectional_kernel_with_segments_equals_masked_formula(impl, chunk):
  """Each document has its own softmax over time (padding masked inside row 1's document too)."""
  q, k, v = qkv()
  k = 30.0 * k
  mask = jnp.arange(13)[None] < jnp.array([[12], [9]])
  scale = keep_mask(q.shape)
  fast = lambda q, k, v: kernels.bidirectional_latte(
    q, k, v, mask=mask, segments=SEGMENTS, latent_scale=scale, impl=impl, chunk=chunk
  )
  reference = lambda q, k, v: lk.bidirectional_latte_reference(
    q, k, v, mask=mask, segments=SEGMENTS, latent_scale=scale
  )
  assert_same(fast, reference, q, k, v)
  plain = oracles.compiled(lk.bidirectional_latte_reference, q, k, v, mask=mask)
  assert not np.allclose(plain[0, :10], oracles.compiled(reference, q, k, v)[0, :10], atol=1e-3)


def test_latent_scale_multiplies_p_of_l_given_t():
  """latent_scale = s gives sum_l s_tl p(l|t) (...): with s = 2 on every state, twice the output."""
  q, k, v = qkv()
  for core in (kernels.causal_latte, kernels.bidirectional_latte):
    scaled = oracles.compiled(core, q, k, v, latent_scale=jnp.full(q.shape, 2.0))
    np.testing.assert_allclose(scaled, 2 * oracles.compiled(core, q, k, v), atol=1e-5)


def test_segment_and_scale_shapes_are_checked():
  q, k, v = qkv()
  with pytest.raises(ValueError, match=r"segments must be int \[B,T\]"):
    kernels.causal_latte(q, k, v, segments=SEGMENTS[:, :5])
  with pytest.raises(ValueError, match=r"segments must be int \[B,T\]"):
    kernels.bidirectional_latte(q, k, v, segments=SEGMENTS.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"latent_scale must be \[B,T,H,L\]"):
    kernels.causal_latte(q, k, v, latent_scale=jnp.ones(q.shape[:3]))


# -- the model: packed documents --------------------------------------------------------------------------


def document_apply(model, task):
  """apply(rows, segment_ids) for the oracle, one compiled call per argument structure. The masked
  LM passes the padding mask along, as tasks/mlm.py does."""

  def apply(rows, segs):
    mask = (rows != 0) if task == "mlm" else None
    return model(rows, mask=mask, segment_ids=segs)

  compiled = {}

  def run(rows, segs):
    key = segs is None
    if key not in compiled:
      compiled[key] = jax.jit(apply).lower(rows, segs).compile(O0)
    return compiled[key](rows, segs)

  return run


# A 7-token document, then a 9-token one starting at 7: inside a chunk (3) and a window block (4).
DOC_A, DOC_B = np.arange(3, 10), (np.arange(9) * 5 + 1) % 22 + 1
# The impl switches the latent core only: under the kernel, the variants with VAPOR, conv + window
# and RG-LRU + window (the baseline has no latent core).
ORACLE_CASES = [(v, task, "xla") for v in sorted(latte.VARIANTS) for task in ("lm", "mlm")] + [
  (v, task, "pallas") for v in ("latte", "latte_conv_swa++", "latte_rglru_swa++") for task in ("lm", "mlm")
]


@pytest.mark.parametrize(
  "variant,task,impl",
  tiers.quick(
    ORACLE_CASES,
    keep=[
      ORACLE_CASES.index(c)
      for c in (("latte", "lm", "xla"), ("latte_conv_swa++", "mlm", "xla"), ("latte_rglru_swa++", "lm", "pallas"))
    ],
    ids=lambda c: "-".join(c),
  ),
)
def test_documents_are_independent(variant, task, impl):
  """The exact oracle at an unaligned boundary: no chunked form here depends on chunk alignment."""
  config = make_config(task=task, variant=variant, seq_len=20, num_layers=1, impl=impl)
  model = make_model(config)
  oracles.assert_documents_independent(document_apply(model, task), DOC_A, DOC_B, 20)


@pytest.mark.parametrize("causal", [True, False])
def test_mixers_keep_to_their_document(causal):
  """Conv taps and the RG-LRU state (both directions when bidirectional) do not cross a boundary:
  each document's outputs equal those of the document alone."""
  x = jax.random.normal(jax.random.key(3), (1, 11, 8))
  seg = jnp.array([[1] * 5 + [2] * 6])
  for mixer in (
    latte.Conv(8, 3, causal=causal, rngs=nnx.Rngs(params=0)),
    latte.RGLRU(8, 2, c=8.0, causal=causal, rngs=nnx.Rngs(params=0)),
  ):
    packed = oracles.forward(mixer, x, seg)
    np.testing.assert_allclose(packed[:, :5], oracles.forward(mixer, x[:, :5]), atol=1e-6)
    np.testing.assert_allclose(packed[:, 5:], oracles.forward(mixer, x[:, 5:]), atol=1e-6)
    assert not np.allclose(oracles.forward(mixer, x)[:, 5:], oracles.forward(mixer, x[:, 5:]), atol=1e-4)


# -- latent dropout -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,task", [("latte", "lm"), ("latte_rglru_swa++", "lm"), ("latte_conv++", "mlm")])
def test_latent_dropout_acts_in_training_only(variant, task):
  """latent_dropout > 0 changes training outputs (per dropout key), not eval outputs; rate 0 trains
  exactly as eval (no other dropout in these configs)."""
  x = tokens()
  dropped = make_model(make_config(task=task, variant=variant, latent_dropout=0.5))
  plain = make_model(make_config(task=task, variant=variant))
  evaluated = oracles.forward(plain, x)
  np.testing.assert_array_equal(oracles.forward(dropped, x), evaluated)  # eval: off (same parameters: dropout has none)
  dropped.train()
  plain.train()
  one = oracles.forward(dropped, x, rngs=nnx.Rngs(dropout=1))
  two = oracles.forward(dropped, x, rngs=nnx.Rngs(dropout=2))
  assert not np.allclose(one, evaluated, atol=1e-3) and not np.allclose(one, two, atol=1e-3)
  np.testing.assert_array_equal(oracles.forward(plain, x, rngs=nnx.Rngs(dropout=1)), evaluated)


def test_latent_dropout_config_is_checked_and_paper_configs_set_it():
  with pytest.raises(ConfigError, match=r"model.latent_dropout must be in \[0, 1\)"):
    make_config(latent_dropout=1.0)
  assert lra_core.load_config("configs/c4/latte.py:latte_rglru_swa++").model.latent_dropout == 0.0
  assert lra_core.load_config("configs/pg19/latte.py:latte_rglru_swa++").model.latent_dropout == 0.2


# -- the RGLRU-SWA++ baseline (Table 2) -----------------------------------------------------------------------


def quadratic_baseline(layer, x, causal):
  """The baseline's attention written out as a T x T matrix from the layer's own projections."""
  pos = jnp.arange(x.shape[1])
  z = layer.window_norm(layer.mixer(x))
  q, k, v = apply_rope(layer.window_query(z), pos), apply_rope(layer.window_key(z), pos), layer.value(x)
  m = attention_mask(pos, pos, causal=causal, window=layer.window)
  scores = jnp.where(m[:, None], jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5, -1e30)
  return layer.out(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v))


def test_rglru_swa_baseline_is_window_attention_over_normalised_rglru():
  """Q = Wq RMSNorm(RGLRU(X)), K = Wk RMSNorm(RGLRU(X)), V = Wv X, sliding-window softmax attention
  with RoPE, written out as a T x T matrix; causal and bidirectional."""
  for task, causal in (("lm", True), ("classify", False)):
    layer = make_model(make_config(task=task, variant="rglru_swa++", seq_len=12)).blocks[0].attn
    assert not hasattr(layer, "query") and not hasattr(layer, "key")
    x = jax.random.normal(jax.random.key(5), (2, 12, 32))
    want = oracles.compiled(quadratic_baseline, layer, x, causal=causal)
    np.testing.assert_allclose(oracles.forward(layer, x), want, atol=1e-5)


def test_rglru_swa_baseline_has_no_latent_parameters():
  """At Table 5's sizes: Latte-RGLRU-SWA++ minus the latent projections (D x (L + H) query logits, D x L
  key logits per layer) plus the RMSNorm scale (D per layer)."""
  count = lambda variant: registry.parameter_count(lra_core.load_config(f"configs/c4/latte.py:{variant}"))
  m = lra_core.load_config("configs/c4/latte.py:rglru_swa++").model
  per_layer = m.d_model * (m.num_latents + m.num_heads) + m.d_model * m.num_latents - m.d_model
  assert count("latte_rglru_swa++") - count("rglru_swa++") == m.num_layers * per_layer


def test_baseline_config_errors_are_clear():
  with pytest.raises(ConfigError, match="model.latent=False .* needs model.window > 0"):
    make_config(variant="rglru_swa++", window=0)
  with pytest.raises(ConfigError, match="model.latent=False .* needs model.window > 0 and model.vapor=False"):
    make_config(variant="rglru_swa++", vapor=True)
