"""Transformer-VQ against its oracles: the quadratic definition of VQ-attention, one block vs many,
carried windows vs one long forward, token-by-token decoding vs the full forward, causality, and the
closed-form EMA k-means target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fixtures.enwik8
import fixtures.imagenet64
import fixtures.pg19
import lra_core
import oracles
import tiers
from lra_core import decoding, kernels, registry
from lra_core.errors import ConfigError
from lra_core.kernels import vq
from lra_core.kernels.vq import reference as vq_xla
from lra_core.models import transformer_vq as tvq
from lra_core.tasks.base import apply_model
from lra_core.train import train_and_evaluate

ATOL = 1e-5


def rand(key, shape, scale=1.0):
  return jax.random.normal(jax.random.PRNGKey(key), shape) * scale


def qkvc(b=2, t=24, h=2, hk=2, dk=8, dv=5, s=7):
  return rand(0, (b, t, h, dk)), rand(1, (b, t, hk, dk)), rand(2, (b, t, hk, dv)), rand(3, (hk, s, dk))


# -- the attention core -------------------------------------------------------------------------------


# Each reduction once with a different block length / head grouping (one block, many, MQA); all
# three also meet on long sequences below.
@pytest.mark.parametrize(
  "reduction,block_len,hk", [("serial", 4, 2), ("serial", 24, 2), ("matmul", 3, 1), ("assoc", 4, 1)]
)
def test_vq_attention_equals_quadratic_attention_over_quantized_keys(reduction, block_len, hk):
  q, k, v, c = qkvc(hk=hk)
  w = rand(4, (v.shape[-1],))
  fast = jax.jit(lambda *a: kernels.vq_attention(*a, block_len=block_len, reduction=reduction))
  np.testing.assert_allclose(fast(q, k, v, c), oracles.compiled(vq.vq_attention_reference, q, k, v, c), atol=ATOL)
  grads = [
    jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2, 3)))(q, k, v, c)
    for f in (fast, vq.vq_attention_reference)
  ]
  for name, a, b in zip("qkvc", *grads):
    np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"gradient w.r.t. {name}")
  assert not np.any(grads[0][2] == 0)  # values get real gradients


def quadratic_with_constant_cache(q, k, v, c, block_len, segments=None):
  """The oracle of grad_through_cache=False, from the definition (the authors' grad_thru_cache=0, which
  stops the gradient of the state one block passes to the next): causal softmax attention over the
  quantized keys, where a query in block n reads block n's keys and values as they are, block n - 1's
  keys and values through a stop-gradient, and every older value (what the compressive cache holds)
  through a stop-gradient, its key (a codeword, which the cache scores) as it is. `segments`: a query
  reads its own document only."""
  b, t, h, _ = q.shape
  hk = k.shape[2]
  sg = jax.lax.stop_gradient
  z, _ = vq.quantize(sg(k), sg(c))
  k_hat = vq.codewords(z, c)
  qg = q.reshape(b, t, hk, h // hk, -1)
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  previous = (j // block_len) == (i // block_len - 1)  # [T,T]: keys of the block before the query's
  old = j < (i // block_len - 1) * block_len  # keys in the cache
  scores = jnp.where(
    previous, jnp.einsum("bihgk,bjhk->bhgij", qg, sg(k_hat)), jnp.einsum("bihgk,bjhk->bhgij", qg, k_hat)
  )
  allowed = jnp.broadcast_to(j <= i, (b, 1, 1, t, t))
  if segments is not None:
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None, None]
  weights = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
  detached = previous | old
  out = jnp.einsum("bhgij,bjhv->bihgv", jnp.where(detached, 0.0, weights), v) + jnp.einsum(
    "bhgij,bjhv->bihgv", jnp.where(detached, weights, 0.0), sg(v)
  )
  return out.reshape(b, t, h, -1)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("impl,reduction", [("xla", "serial"), ("xla", "assoc"), ("pallas", "serial")])
def test_a_cache_held_constant_equals_quadratic_attention_with_constant_old_values(impl, reduction, documents):
  q, k, v, c = qkvc(t=32, hk=1)
  w = rand(4, (v.shape[-1],))
  block_len = 4
  # documents of 7, 9 and 16 tokens: boundaries inside blocks and on one
  segments = jnp.asarray(np.repeat([1, 2, 3], [7, 9, 16])[None].repeat(q.shape[0], 0), jnp.int32) if documents else None

  def blocks(q, k, v, c, through):
    z, _ = vq.quantize(jax.lax.stop_gradient(k), jax.lax.stop_gradient(c))
    return vq.vq_attention_blocks(
      q,
      vq.codewords(z, c),
      z,
      v,
      c,
      block_len=block_len,
      reduction=reduction,
      impl=impl,
      grad_through_cache=through,
      segments=segments,
    )[0]

  oracle = lambda q, k, v, c: quadratic_with_constant_cache(q, k, v, c, block_len, segments)
  held = lambda q, k, v, c: blocks(q, k, v, c, False)
  np.testing.assert_allclose(jax.jit(held)(q, k, v, c), oracles.compiled(oracle, q, k, v, c), atol=ATOL)
  grad = lambda f: jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 2, 3)))(q, k, v, c)
  held_grads = grad(held)
  for name, a, b in zip("qvc", held_grads, grad(oracle)):
    np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"gradient w.r.t. {name}")
  through = grad(lambda q, k, v, c: blocks(q, k, v, c, True))
  assert np.abs(through[1] - held_grads[1]).max() > 1e-2  # the switch changes the values' gradients
  assert np.abs(through[2] - held_grads[2]).max() > 1e-4  # and the codebook's (the previous block's keys)


def test_reductions_agree_on_long_sequences_with_large_scores():
  # Scores in the hundreds: exp would overflow without the max shift and the running means.
  q, k, v, c = qkvc(t=64, s=16)
  ref = oracles.compiled(vq.vq_attention_reference, q * 7, k * 7, v, c * 7)
  for r in vq.REDUCTIONS:
    out = jax.jit(lambda *a: vq.vq_attention(*a, block_len=8, reduction=r))(q * 7, k * 7, v, c * 7)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=2e-4)  # float32 rounding of scores ~ 400


@pytest.mark.parametrize("compressive", [True, False])
def test_windowed_core_equals_dense_attention_with_xl_biases(compressive):
  q, k, v, c = qkvc()
  z, _ = vq.quantize(k, c)
  k_hat = vq.codewords(z, c)
  rel = (rand(5, q.shape), rand(6, (q.shape[2], 5, q.shape[3])))  # window L = 4
  fast = jax.jit(
    lambda q, kh, v, rq: vq.vq_attention_blocks(q, kh, z, v, c, block_len=4, rel=(rq, rel[1]), compressive=compressive)[
      0
    ]
  )
  dense = jax.jit(
    lambda q, kh, v, rq: vq.dense_attention(q, kh, v, window=4, rel=(rq, rel[1]), sliding=not compressive)
  )
  np.testing.assert_allclose(fast(q, k_hat, v, rel[0]), dense(q, k_hat, v, rel[0]), atol=ATOL)
  w = rand(7, (v.shape[-1],))
  # Keys older than the previous block reach the output only through the (constant) codebook, so
  # their gradient is the dense one only in the sliding-window form.
  argnums = (0, 2, 3) if compressive else (0, 1, 2, 3)
  ga = jax.jit(jax.grad(lambda *a: (fast(*a) * w).sum(), argnums=argnums))(q, k_hat, v, rel[0])
  gb = jax.jit(jax.grad(lambda *a: (dense(*a) * w).sum(), argnums=argnums))(q, k_hat, v, rel[0])
  for a, b in zip(ga, gb):
    np.testing.assert_allclose(a, b, atol=ATOL)


def test_carry_and_decode_continue_the_blockwise_computation():
  q, k, v, c = qkvc()
  z, _ = vq.quantize(k, c)
  k_hat = vq.codewords(z, c)
  rq, table = rand(5, q.shape), rand(6, (q.shape[2], 5, q.shape[3]))
  full, _ = oracles.compiled(vq.vq_attention_blocks, q, k_hat, z, v, c, block_len=4, rel=(rq, table))
  parts, carry = [], None
  for sl in (slice(0, 8), slice(8, 12), slice(12, 24)):
    out, carry = jax.jit(vq.vq_attention_blocks, static_argnames="block_len")(
      q[:, sl], k_hat[:, sl], z[:, sl], v[:, sl], c, block_len=4, rel=(rq[:, sl], table), carry=carry
    )
    parts.append(out)
  np.testing.assert_allclose(jnp.concatenate(parts, 1), full, atol=ATOL)
  state = vq.init_decode_state(2, 4, 2, c.shape[1], q.shape[-1], v.shape[-1])
  step = jax.jit(lambda *a: vq.decode_step(*a[:6], rel=(a[6], table)))
  steps = []
  for t in range(q.shape[1]):
    sl = slice(t, t + 1)
    out, state = step(q[:, sl], k_hat[:, sl], z[:, sl], v[:, sl], c, state, rq[:, sl])
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=ATOL)


# Packed documents: several in one block, one over several blocks, a start on a block boundary
# (row 1 at 8 and 12), padding (0) at the end.
SEGMENTS = jnp.array([[1] * 3 + [2] * 2 + [3] * 11 + [4] * 5 + [0] * 3, [1] * 8 + [2] * 4 + [3] * 9 + [0] * 3])


@pytest.mark.parametrize(
  "reduction,compressive",
  tiers.quick(
    [("serial", True), ("matmul", True), ("assoc", True), ("serial", False)], keep=[0], ids=lambda c: f"{c[0]}-{c[1]}"
  ),
)
def test_documents_keep_the_linear_core_equal_to_masked_quadratic_attention(reduction, compressive):
  # The cache holds one document (restarting where one begins): each query sees exactly the keys
  # of its own document, as causal attention masked by segment ids, also through carried windows.
  q, k, v, c = qkvc(hk=1)
  z, _ = vq.quantize(k, c)
  k_hat = vq.codewords(z, c)
  table = rand(6, (q.shape[2], 5, q.shape[3]))  # window L = 4

  def windows(q, v, rq, cuts):
    parts, carry = [], None
    for sl in cuts:
      out, carry = vq.vq_attention_blocks(
        q[:, sl],
        k_hat[:, sl],
        z[:, sl],
        v[:, sl],
        c,
        block_len=4,
        reduction=reduction,
        carry=carry,
        rel=(rq[:, sl], table),
        compressive=compressive,
        segments=SEGMENTS[:, sl],
      )
      parts.append(out)
    return jnp.concatenate(parts, 1)

  one = jax.jit(lambda *a: windows(*a, [slice(0, 24)]))
  carried = jax.jit(lambda *a: windows(*a, [slice(0, 8), slice(8, 12), slice(12, 24)]))
  dense = jax.jit(
    lambda q, v, rq: vq.dense_attention(
      q, k_hat, v, window=4, rel=(rq, table), sliding=not compressive, segments=SEGMENTS
    )
  )
  args = (q, v, rand(5, q.shape))
  want = dense(*args)
  np.testing.assert_allclose(one(*args), want, atol=ATOL)
  np.testing.assert_allclose(carried(*args), want, atol=ATOL)
  w = rand(7, (v.shape[-1],))
  grads = [jax.jit(jax.grad(lambda *a, f=f: (f(*a) * w).sum(), argnums=(0, 1, 2)))(*args) for f in (one, dense)]
  for name, a, b in zip(("q", "v", "rel_q"), *grads):
    np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"gradient w.r.t. {name}")
  # Without segments the documents read each other.
  plain, _ = oracles.compiled(
    vq.vq_attention_blocks,
    q,
    k_hat,
    z,
    v,
    c,
    block_len=4,
    reduction=reduction,
    rel=(args[2], table),
    compressive=compressive,
  )
  assert not np.allclose(plain, want, atol=1e-2)


@pytest.mark.parametrize("grad_through_cache", [True, False])
def test_the_attention_scanned_a_few_blocks_at_a_time_equals_all_blocks_at_once(grad_through_cache):
  """chunk_blocks 1, 2, 3 of 6 blocks (documents, position terms, a carry in and out) against all at
  once and against masked quadratic attention: outputs, the carry after, and every gradient."""
  q, k, v, c = qkvc(hk=1)
  z, _ = vq.quantize(k, c)
  table, rel_q = rand(6, (q.shape[2], 5, q.shape[3])), rand(5, q.shape)

  def core(chunk_blocks, q, v, rq, c):
    first, carry = vq.vq_attention_blocks(
      q[:, :8],
      vq.codewords(z[:, :8], c),
      z[:, :8],
      v[:, :8],
      c,
      block_len=4,
      rel=(rq[:, :8], table),
      segments=SEGMENTS[:, :8],
    )
    out, carry = vq.vq_attention_blocks(
      q[:, 8:],
      vq.codewords(z[:, 8:], c),
      z[:, 8:],
      v[:, 8:],
      c,
      block_len=4,
      carry=carry,
      rel=(rq[:, 8:], table),
      segments=SEGMENTS[:, 8:],
      grad_through_cache=grad_through_cache,
      chunk_blocks=chunk_blocks,
    )
    return out, carry

  args = (q, v, rel_q, c)
  want_out, want_carry = jax.jit(lambda *a: core(0, *a))(*args)
  w = rand(7, (v.shape[-1],))
  want_grads = jax.jit(jax.grad(lambda *a: (core(0, *a)[0] * w).sum(), argnums=(0, 1, 2, 3)))(*args)
  if grad_through_cache:  # the second window continues the first: as one quadratic attention over both
    dense = oracles.compiled(
      vq.dense_attention, q, vq.codewords(z, c), v, window=4, rel=(rel_q, table), segments=SEGMENTS
    )
    np.testing.assert_allclose(want_out, dense[:, 8:], atol=ATOL)
  for chunk_blocks in (1, 2, 3):
    out, carry = jax.jit(lambda *a, n=chunk_blocks: core(n, *a))(*args)
    np.testing.assert_allclose(out, want_out, atol=ATOL)
    for name in want_carry:
      np.testing.assert_allclose(carry[name], want_carry[name], atol=ATOL, err_msg=f"carry {name}")
    grads = jax.jit(jax.grad(lambda *a, n=chunk_blocks: (core(n, *a)[0] * w).sum(), argnums=(0, 1, 2, 3)))(*args)
    for name, a, b in zip(("q", "v", "rel_q", "codebook"), grads, want_grads):
      np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"chunk_blocks {chunk_blocks}: gradient w.r.t. {name}")


def test_quantizing_a_chunk_at_a_time_gives_the_nearest_codewords_of_the_whole():
  _, k, _, c = qkvc(t=24, hk=2, s=7)
  z, d2 = oracles.compiled(vq.quantize, k, c)
  brute = jnp.sum(jnp.square(k[:, :, :, None] - c[None, None]), -1)  # [B,T,H,S]
  np.testing.assert_array_equal(z, jnp.argmin(brute, -1))
  for chunk in (4, 8, 12):
    zc, dc = jax.jit(lambda k, c, n=chunk: vq.quantize(k, c, chunk=n))(k, c)
    np.testing.assert_array_equal(zc, z, err_msg=f"chunk {chunk}")
    np.testing.assert_allclose(dc, jnp.min(brute, -1), atol=ATOL, err_msg=f"chunk {chunk}")


def test_code_statistics_by_scatter_equal_the_weighted_counts_and_key_sums():
  _, k, _, _ = qkvc(b=2, t=24, hk=2, dk=8)
  s = 7
  z = jax.random.randint(jax.random.PRNGKey(5), k.shape[:3], 0, s)
  weights = jnp.ones(k.shape[:2]).at[1, 17:].set(0.0).at[0, 3].set(0.0)  # padding and a masked token
  want_count = np.zeros((2, s))
  want_sum = np.zeros((2, s, 8))
  for b, t, h in np.ndindex(*z.shape):
    want_count[h, z[b, t, h]] += weights[b, t]
    want_sum[h, z[b, t, h]] += weights[b, t] * np.asarray(k[b, t, h])
  for scatter in (False, True):
    count, k_sum = jax.jit(lambda *a, f=scatter: vq.code_statistics(*a, s, scatter=f))(z, k, weights)
    np.testing.assert_allclose(count, want_count, atol=ATOL, err_msg=f"scatter={scatter}")
    np.testing.assert_allclose(k_sum, want_sum, atol=ATOL, err_msg=f"scatter={scatter}")


def test_public_vq_attention_takes_segments():
  q, k, v, c = qkvc(hk=1)
  got = jax.jit(lambda *a: kernels.vq_attention(*a, block_len=4, segments=SEGMENTS))(q, k, v, c)
  np.testing.assert_allclose(got, oracles.compiled(vq.vq_attention_reference, q, k, v, c, segments=SEGMENTS), atol=ATOL)
  with pytest.raises(ValueError, match="segments must be"):
    kernels.vq_attention(q, k, v, c, block_len=4, segments=SEGMENTS[:, :8])


def test_reset_prefix_merges_agree_across_reductions():
  # Element n with reset drops everything before it: each reduction == a merge restarted by hand.
  count = jnp.abs(rand(10, (2, 6, 1, 3))).round()
  mean = rand(9, (2, 6, 1, 3, 2)) * (count > 0)[..., None]  # summaries: mean 0 where count 0
  reset = jnp.array([[False, False, True, False, True, True], [False, True, False, False, False, False]])
  want_m, want_c = np.zeros(mean.shape), np.zeros(count.shape)
  for b in range(2):
    acc = (jnp.zeros(mean.shape[2:]), jnp.zeros(count.shape[2:]))
    for n in range(6):
      acc = oracles.compiled(
        vq_xla.merge,
        (jnp.zeros_like(acc[0]), jnp.zeros_like(acc[1])) if reset[b, n] else acc,
        (mean[b, n], count[b, n]),
      )
      want_m[b, n], want_c[b, n] = acc
  for reduction in vq.REDUCTIONS:
    m, c = oracles.compiled(vq_xla.prefix_summaries, mean, count, reduction=reduction, reset=reset)
    np.testing.assert_allclose(m, want_m, atol=1e-6, err_msg=reduction)
    np.testing.assert_allclose(c, want_c, atol=1e-6, err_msg=reduction)


def test_kernel_shape_errors_are_clear():
  q, k, v, c = qkvc()
  with pytest.raises(ValueError, match="not a multiple of block_len 5"):
    vq.vq_attention(q, k, v, c, block_len=5)
  with pytest.raises(ValueError, match="codebook must be"):
    vq.vq_attention(q, k, v, c[:, :, :3], block_len=4)
  with pytest.raises(ValueError, match="reduction 'scan'"):
    vq.vq_attention(q, k, v, c, block_len=4, reduction="scan")


# -- the model ---------------------------------------------------------------------------------------


def make_model(seq_len=32, seed=0, **model):
  overrides = [f"train.seq_len={seq_len}", "train.update_len=0"] + [f"model.{k}={v}" for k, v in model.items()]
  config = lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", overrides)
  return config, lra_core.build_model(config, seed=seed)


@nnx.jit
def fwd(model, x, carry=None, rngs=None):
  """The model's forward pass (jitted; what it sows is collected and dropped)."""
  return apply_model(model, x, carry=carry, rngs=rngs)[0]


@nnx.jit
def decode(model, token, state):
  return model.decode_step(token, state)


def tokens(b=2, t=32, seed=1):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, 256)


VARIANTS = [
  dict(),
  dict(reduction="matmul"),
  dict(reduction="assoc"),
  dict(input_scan=True),
  dict(compressive=False),
  dict(head_type="mqa", num_heads=2),
  dict(head_type="mha", num_heads=4),
  dict(abs_position=True, final_norm=True, tie_embeddings=True),
  dict(attention="full"),
]


def ids(v):
  return ",".join(f"{k}={x}" for k, x in v.items()) or "default"


@pytest.mark.parametrize("variant", VARIANTS, ids=ids)
def test_decode_equals_forward_and_no_future_leakage(variant):
  _, model = make_model(**variant)
  model.eval()
  x = tokens()
  logits = fwd(model, x)
  state = model.init_decode_state(2, 32)
  steps = []
  for t in range(32):
    out, state = decode(model, x[:, t : t + 1], state)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), logits, atol=1e-4)
  changed = x.at[:, 20:].set((x[:, 20:] + 7) % 256)
  np.testing.assert_allclose(fwd(model, changed)[:, :20], logits[:, :20], atol=1e-6)
  assert not np.allclose(fwd(model, changed)[:, 20:], logits[:, 20:])


def test_one_block_equals_many_blocks_with_the_same_parameters():
  # Without XL biases (whose window is the block) the result cannot depend on the block length.
  _, small = make_model(block_len=4, rel_bias=False)
  _, whole = make_model(block_len=32, rel_bias=False)
  nnx.update(whole, nnx.state(small))
  small.eval(), whole.eval()
  x = tokens()
  np.testing.assert_allclose(fwd(whole, x), fwd(small, x), atol=1e-5)


@pytest.mark.parametrize("variant", [dict(), dict(input_scan=True), dict(reduction="assoc")], ids=ids)
def test_carried_windows_equal_one_long_forward(variant):
  _, model = make_model(**variant)
  model.eval()
  x = tokens()
  full = fwd(model, x)
  carry, parts = model.init_carry(2), []
  for w in range(4):
    out, carry = fwd(model, x[:, 8 * w : 8 * w + 8], carry=carry)
    parts.append(out)
  np.testing.assert_allclose(jnp.concatenate(parts, 1), full, atol=1e-5)
  np.testing.assert_array_equal(carry["offset"], [32, 32])


def test_grad_through_cache_changes_the_gradients_and_not_the_loss():
  x = tokens()
  models = [make_model(grad_through_cache=flag)[1] for flag in (True, False)]

  def loss_and_grads(model):
    model.eval()
    loss = lambda m: jnp.mean(fwd(m, x) ** 2)
    return nnx.jit(nnx.value_and_grad(loss))(model)

  (loss_on, grads_on), (loss_off, grads_off) = (loss_and_grads(m) for m in models)
  np.testing.assert_allclose(loss_on, loss_off, rtol=1e-6)
  v_on, v_off = (
    g["units"][0]["v_proj"]["kernel"][...] for g in (nnx.to_pure_dict(grads_on), nnx.to_pure_dict(grads_off))
  )
  assert np.abs(v_on - v_off).max() > 1e-3 * np.abs(v_on).max()


def test_tied_classifier_is_the_authors_formula_at_the_pg19_setting():
  # configs/pg19/transformer_vq.py: tied, final RMSNorm, e_scale 0.005, a learned output bias; the
  # embedding table holds E itself. Oracle in float64 from the formula, with random norm and bias values.
  config = lra_core.load_config("configs/pg19/transformer_vq.py:tiny")
  assert (config.model.tie_embeddings, config.model.final_norm, config.model.output_scale, config.model.embedding) == (
    True,
    True,
    0.005,
    "plain",
  )
  model = lra_core.build_model(config, seed=0)
  rng = np.random.default_rng(0)
  d, v = config.model.d_model, config.model.vocab_size
  model.output_bias[...] = jnp.asarray(rng.normal(size=v), jnp.float32)
  model.final_norm.scale[...] = jnp.asarray(rng.normal(1.0, 0.1, size=d), jnp.float32)
  model.final_norm.bias[...] = jnp.asarray(rng.normal(0.0, 0.1, size=d), jnp.float32)
  x = rng.normal(size=(2, 5, d)).astype(np.float32)

  f64 = lambda a: np.asarray(a, np.float64)
  xn = x / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + 1e-6) * f64(model.final_norm.scale[...])
  xn = xn + f64(model.final_norm.bias[...])
  table = f64(model.embed.embedding[...])
  expected = xn @ table.T * 0.005 + f64(model.output_bias[...]) * 0.005
  np.testing.assert_allclose(oracles.forward(model, jnp.asarray(x), method="_logits"), expected, rtol=2e-5, atol=2e-6)
  # The lookups are the table's rows themselves (no sqrt(d) factor), at unit variance.
  np.testing.assert_array_equal(model.embed(jnp.array([3])), model.embed.embedding[...][3:4])
  assert 0.9 < float(np.std(table)) < 1.1


def test_input_scan_equals_parallel_blocks_in_training_too():
  """The stack run one block at a time computes what the whole window at once does: outputs,
  gradients (through the previous block and, with grad_through_cache, the compressive cache) and the
  same dropout (sinusoid, LayerDrop and residual masks) in training."""
  drops = dict(dropsin=0.2, dropres=0.5, droplyr=0.3)
  _, a = make_model(chunk_blocks=0, **drops)
  _, b = make_model(input_scan=True, **drops)
  with pytest.raises(ConfigError, match="model.input_scan needs impl 'xla'"):
    make_model(input_scan=True, impl="pallas")
  a.eval(), b.eval()
  np.testing.assert_allclose(fwd(a, tokens()), fwd(b, tokens()), atol=1e-5)
  # Gradients too: through the previous block and (grad_through_cache) the compressive cache.
  w = jax.random.normal(jax.random.key(4), (2, 32, 256))
  grad = nnx.jit(nnx.grad(lambda model: (apply_model(model, tokens())[0] * w).sum()))
  for through in (True, False):
    pair = [
      make_model(chunk_blocks=0, grad_through_cache=through)[1],
      make_model(input_scan=True, grad_through_cache=through)[1],
    ]
    for m in pair:
      m.eval()
    flat = [jax.tree.leaves(grad(m)) for m in pair]
    for x, y in zip(*flat):
      np.testing.assert_allclose(x, y, atol=2e-5, err_msg=f"grad_through_cache {through}")
  a.train(), b.train()
  other = nnx.clone(a)
  trained = [fwd(m, tokens(), rngs=nnx.Rngs(dropout=5)) for m in (a, b)]
  np.testing.assert_allclose(trained[0], trained[1], atol=1e-5)
  assert not np.allclose(trained[0], fwd(other, tokens(), rngs=nnx.Rngs(dropout=6)), atol=1e-3)  # dropout is on


# -- packed documents ---------------------------------------------------------------------------------


@nnx.jit
def fwd_docs(model, x, segment_ids=None, carry=None):
  return apply_model(model, x, carry=carry, segment_ids=segment_ids)[0]


def doc_pair(la, lb, seed=3):
  rng = np.random.default_rng(seed)
  return rng.integers(1, 256, la), rng.integers(1, 256, lb)


# Blocks of 4 in rows of 32: the second document starts mid-block (at 10) or on a boundary (at 12),
# and both span several blocks, so the compressive cache is read. Linear time == quadratic holds
# whatever the alignment (the XL biases go by distance, not by block), so the exact oracle holds
# for both starts; float32 rounding of the cache's running means stays below 1e-6 here.
DOC_VARIANTS = [
  dict(impl="xla"),
  dict(impl="pallas"),
  dict(input_scan=True, abs_position=True, reduction="serial"),
  dict(reduction="assoc", head_type="mqa", num_heads=2),
  dict(attention="full"),
]


@pytest.mark.parametrize("variant", tiers.quick(DOC_VARIANTS, keep=[1], ids=ids))
@pytest.mark.parametrize("la,lb", [(10, 18), (12, 16)], ids=["mid_block", "block_boundary"])
def test_packed_documents_give_each_document_its_own_outputs(variant, la, lb):
  _, model = make_model(block_len=4, **variant)
  if model.pos_scale is not None:
    model.pos_scale[...] = jnp.ones(())  # (starts at 0): absolute positions must restart per document
  model.eval()
  oracles.assert_documents_independent(lambda rows, segs: fwd_docs(model, rows, segs), *doc_pair(la, lb), 32, atol=1e-5)


def test_carried_windows_with_documents_equal_one_forward():
  # Packed rows cut into update windows: documents cross window and block boundaries; the carried
  # cache, segment ids and in-document positions continue them.
  _, model = make_model(block_len=4, abs_position=True)
  model.pos_scale[...] = jnp.ones(())
  model.eval()
  x = tokens()
  segs = jnp.array([[1] * 5 + [2] * 14 + [3] * 9 + [0] * 4, [1] * 16 + [2] * 16])
  full = fwd_docs(model, x, segs)
  carry, parts = model.init_carry(2), []
  for w in range(4):
    sl = slice(8 * w, 8 * w + 8)
    out, carry = fwd_docs(model, x[:, sl], segs[:, sl], carry)
    parts.append(out)
  np.testing.assert_allclose(jnp.concatenate(parts, 1), full, atol=1e-5)
  np.testing.assert_array_equal(carry["doc_position"], [4, 16])


def test_segment_ids_must_match_the_inputs():
  _, model = make_model()
  with pytest.raises(ValueError, match="segment_ids shape"):
    model(tokens(), segment_ids=jnp.ones((2, 16), jnp.int32))


@nnx.jit
def _train_forward(model, x, kwargs):
  return apply_model(model, x, rngs=nnx.Rngs(dropout=0), **kwargs)


def _train_step_statistics(x, **kwargs):
  """One training forward of a fresh 1-unit model: (c_sum, c_count, aux loss, metrics)."""
  _, model = make_model(num_layers=1)
  model.train()
  _, (loss, metrics) = _train_forward(model, x, kwargs)
  q = model.units[0].quantizer
  return q.c_sum[...], q.c_count[...], loss, metrics


def test_padding_stays_out_of_the_codebook_statistics_and_the_commitment_loss():
  x = tokens()
  real = jnp.arange(32)[None] < jnp.array([[32], [20]])  # row 1 padded from 20 on
  segs = real.astype(jnp.int32)
  other_pads = jnp.where(real, x, (x * 7 + 3) % 256)
  base = _train_step_statistics(x, segment_ids=segs)
  for name, got in (
    ("other pad tokens", _train_step_statistics(other_pads, segment_ids=segs)),
    ("padding mask", _train_step_statistics(other_pads, mask=real)),
  ):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
  changed = _train_step_statistics(x.at[1, 5].set((x[1, 5] + 1) % 256), segment_ids=segs)
  assert not np.allclose(changed[0], base[0], atol=1e-7)
  # The closed form over the real tokens only.
  _, model = make_model(num_layers=1)
  unit = model.units[0]
  codebook = unit.quantizer.codebook()
  _, k, _, _ = nnx.jit(lambda m, x: m.units[0].projections(m._embed(x, jnp.arange(32)[None])))(model, x)
  z, _ = oracles.compiled(vq.quantize, k, codebook)
  onehot = jax.nn.one_hot(z, codebook.shape[1]) * real[:, :, None, None]
  gamma = model.m.ema_rate
  np.testing.assert_allclose(base[1], gamma * unit.quantizer.c_count[...] + (1 - gamma) * onehot.sum((0, 1)), atol=1e-5)
  np.testing.assert_allclose(
    base[0], gamma * unit.quantizer.c_sum[...] + (1 - gamma) * jnp.einsum("bths,bthk->hsk", onehot, k), atol=1e-5
  )
  err = jnp.sum(jnp.square(k - vq.codewords(z, codebook)), axis=(-2, -1))
  np.testing.assert_allclose(base[3]["commit_loss"], (err * real).sum() / real.sum(), rtol=1e-5)
  perplexity, unused = oracles.compiled(tvq.codebook_usage, onehot.sum((0, 1)))
  np.testing.assert_allclose(base[3]["codebook_perplexity"], perplexity.mean(), rtol=1e-5)
  np.testing.assert_allclose(base[3]["codebook_unused"], unused.mean())


def test_ema_update_equals_closed_form_target():
  _, model = make_model(num_layers=1, dropres=0.0, dropsin=0.0, droplyr=0.0)
  model.train()
  unit = model.units[0]
  x = tokens()
  old_sum, old_count = unit.quantizer.c_sum[...], unit.quantizer.c_count[...]
  codebook = unit.quantizer.codebook()
  _, k, _, _ = nnx.jit(lambda m, x: m.units[0].projections(m._embed(x, jnp.arange(32)[None])))(model, x)
  z, _ = oracles.compiled(vq.quantize, k, codebook)
  onehot = jax.nn.one_hot(z, codebook.shape[1])  # [B,T,H,S]
  gamma = model.m.ema_rate
  want_count = gamma * old_count + (1 - gamma) * onehot.sum((0, 1))
  want_sum = gamma * old_sum + (1 - gamma) * jnp.einsum("bths,bthk->hsk", onehot, k)
  _, (loss, metrics) = nnx.jit(lambda m, x: apply_model(m, x, rngs=nnx.Rngs(dropout=0)))(model, x)
  np.testing.assert_allclose(unit.quantizer.c_count[...], want_count, atol=1e-5)
  np.testing.assert_allclose(unit.quantizer.c_sum[...], want_sum, atol=1e-5)
  perplexity, unused = oracles.compiled(tvq.codebook_usage, onehot.sum((0, 1)))
  np.testing.assert_allclose(metrics["codebook_perplexity"], perplexity.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["codebook_unused"], unused.mean())
  commit = jnp.sum(jnp.square(k - vq.codewords(z, codebook)), axis=(-2, -1)).mean()
  np.testing.assert_allclose(loss, model.m.commit_coef * commit, rtol=1e-5)
  # Evaluation leaves the codebook alone.
  model.eval()
  before = unit.quantizer.c_sum[...]
  fwd(model, x)
  np.testing.assert_array_equal(unit.quantizer.c_sum[...], before)


def test_ema_statistics_cover_every_window_block_in_input_scan_mode():
  _, parallel = make_model(num_layers=1)
  _, scanned = make_model(num_layers=1, input_scan=True)
  for m in (parallel, scanned):
    m.train()
    fwd(m, tokens(), rngs=nnx.Rngs(dropout=0))
  np.testing.assert_allclose(
    scanned.units[0].quantizer.c_count[...], parallel.units[0].quantizer.c_count[...], atol=1e-5
  )


def test_commitment_and_straight_through_gradients_reach_the_key_projection():
  _, model = make_model(num_layers=1, commit_coef=0.0)
  model.train()
  x = tokens()

  def loss(m):
    return apply_model(m, x, rngs=nnx.Rngs(dropout=0))[0].mean()

  grads = nnx.jit(nnx.grad(loss))(model)
  assert float(jnp.abs(grads.units[0].k_proj.kernel[...]).max()) > 0


def test_sequence_masks_are_reused_across_windows_and_redrawn_per_sequence():
  _, model = make_model(droplyr=0.5, dropsin=0.5, dropres=0.0)
  model.train()
  x = tokens()
  carry = model.init_carry(2)
  _, carry1 = fwd(model, x[:, :16], carry=carry, rngs=nnx.Rngs(dropout=1))
  _, carry2 = fwd(model, x[:, 16:], carry=carry1, rngs=nnx.Rngs(dropout=2))
  np.testing.assert_array_equal(carry1["seq_key"], carry2["seq_key"])
  _, carry3 = fwd(model, x[:, :16], carry=model.init_carry(2), rngs=nnx.Rngs(dropout=3))
  assert not np.array_equal(carry3["seq_key"], carry1["seq_key"])


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="not a multiple of model.block_len 8"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["train.update_len=12", "train.seq_len=48"])
  with pytest.raises(ConfigError, match="single-head"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.num_heads=2"])
  with pytest.raises(ConfigError, match="reduction"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.reduction=scan"])
  with pytest.raises(ConfigError, match="model.chunk_blocks 3 must be .* divide the 2 blocks"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.chunk_blocks=3"])


@pytest.mark.parametrize(
  "spec,paper",
  [
    ("configs/enwik8/transformer_vq.py", 190e6),
    pytest.param("configs/pg19/transformer_vq.py", 1.3e9, marks=pytest.mark.slow),
    pytest.param("configs/imagenet64/transformer_vq.py:large", 1.2e9, marks=pytest.mark.slow),
    pytest.param("configs/imagenet64/transformer_vq.py", 190e6, marks=pytest.mark.slow),
  ],
)
def test_paper_parameter_counts(spec, paper):
  counts = registry.parameter_counts(lra_core.load_config(spec))
  assert abs(counts["total"] - paper) / paper < 0.05, counts


def test_trainer_runs_update_windows_with_codebook_metrics(tmp_path):
  # Killed and resumed runs of this config: tests/test_kill_resume.py.
  data = fixtures.enwik8.build(tmp_path)
  overrides = data + [
    "train.seq_len=32",
    "train.update_len=16",
    "train.steps=6",
    "train.checkpoint_every=3",
    "train.log_every=1",
    "model.droplyr=0.2",
    "model.dropsin=0.1",
    "model.dropres=0.1",
  ]
  config = lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", overrides)
  whole = train_and_evaluate(config, tmp_path / "whole")
  assert np.isfinite(whole["val_bits_per_byte"])
  for key in ("val_codebook_perplexity", "val_codebook_unused", "val_commit_loss"):
    assert np.isfinite(whole[key]), key
  logged = (tmp_path / "whole" / "metrics.jsonl").read_text()
  assert "train_codebook_perplexity" in logged and "train_commit_loss" in logged


def test_greedy_and_nucleus_generation():
  _, model = make_model()
  model.eval()
  prompt = tokens(t=5)
  out = decoding.generate(model, prompt, max_new_tokens=12, key=jax.random.key(0), temperature=0.0)
  expected = prompt
  for _ in range(12):  # greedy = argmax of the full forward pass on the growing sequence
    nxt = jnp.argmax(fwd(model, jnp.pad(expected, ((0, 0), (0, 32 - expected.shape[1]))))[:, expected.shape[1] - 1], -1)
    expected = jnp.concatenate([expected, nxt[:, None].astype(expected.dtype)], 1)
  np.testing.assert_array_equal(out, expected)
  a = decoding.generate(model, prompt, max_new_tokens=12, key=jax.random.key(1), top_p=0.9)
  b = decoding.generate(model, prompt, max_new_tokens=12, key=jax.random.key(1), top_p=0.9)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (2, 17) and int(a.max()) < 256


@pytest.mark.parametrize("t,window", [(10, 4), (4, 8)])
def test_band_skew_places_each_distance_on_its_diagonal(t, window):
  by_distance = np.asarray(rand(8, (2, 3, t, window + 1)))
  distance = np.arange(t)[:, None] - np.arange(t)[None, :]
  gathered = np.take_along_axis(by_distance, np.broadcast_to(np.clip(distance, 0, window), (2, 3, t, t)), -1)
  want = np.where((distance >= 0) & (distance <= window), gathered, 0.0)
  np.testing.assert_array_equal(oracles.compiled(vq.band_to_matrix, jnp.asarray(by_distance)), want)


@pytest.mark.parametrize(
  "fixture,spec",
  [
    (fixtures.pg19, "configs/pg19/transformer_vq.py:tiny"),
    (fixtures.imagenet64, "configs/imagenet64/transformer_vq.py:tiny,large"),
  ],
)
@pytest.mark.slow
def test_tiny_configs_train_on_their_datasets(tmp_path, fixture, spec):
  config = lra_core.load_config(spec, fixture.build(tmp_path) + ["train.steps=2", "train.eval_batches=1"])
  summary = train_and_evaluate(config, tmp_path / "run")
  assert np.isfinite(summary["test_loss"]) and np.isfinite(summary["val_codebook_perplexity"])


def test_unknown_impl_is_refused_before_compiling():
  with pytest.raises(ConfigError, match="model.impl 'triton' is not one of"):
    lra_core.load_config("configs/enwik8/transformer_vq.py:tiny", ["model.impl=triton"])
  q, k, v, c = qkvc()
  with pytest.raises(ValueError, match="impl 'triton'"):
    vq.vq_attention(q, k, v, c, block_len=4, impl="triton")
