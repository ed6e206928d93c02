"""The Transformer-VQ peer (lra_core/bench/plain_jax_vq.py): its blockwise attention against a quadratic
oracle, its loss, gradients and codebook update against our model on the same weights, and its
train step's XLA FLOP count against ours."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lra_core
import oracles
import tiers
from lra_core.bench import plain_jax_vq
from lra_core.bench import train_step as bench
from lra_core.bench.common import cost_flops
from lra_core.run import optim
from lra_core.tasks.base import apply_model, token_nll

CONFIG = "configs/enwik8/transformer_vq.py"
SMALL = (
  "model.d_model=32",
  "model.d_k=16",
  "model.d_v=64",
  "model.num_layers=2",
  "model.n_code=16",
  "model.block_len=8",
  "model.vocab_size=256",
  "model.dropsin=0.0",
  "model.dropres=0.0",
  "model.droplyr=0.0",
  "train.seq_len=32",
  "train.update_len=0",
  "train.batch_size=2",
)
FAST = {"xla_backend_optimization_level": 0}


def small_config(*overrides):
  return lra_core.load_config(CONFIG, [*SMALL, *overrides])


def oracle_attention(q, k_hat, z, v, codebook, xl, block_len):
  """Quadratic causal softmax attention in float64 with the paper's split: a query of block r reads
  the keys of blocks r-1 and r exactly (k_hat, with the XL bias at distances 0..L), and every older
  key j as its codeword c_{z_j} (no position term). q, k_hat [B,T,K]; z [B,T]; v [B,T,V]."""
  q, k_hat, v, codebook = (np.asarray(a, np.float64) for a in (q, k_hat, v, codebook))
  z = np.asarray(z)
  b, t, _ = q.shape
  pos = np.arange(t)
  dist = pos[:, None] - pos[None, :]
  older = (pos[None, :] // block_len) <= (pos[:, None] // block_len) - 2  # [T,T]: in the cache
  out = np.zeros((b, t, v.shape[-1]))
  for bi in range(b):
    qu = q[bi] if xl is None else q[bi] + np.asarray(xl[1], np.float64)
    keys = np.where(older[..., None], codebook[z[bi]][None, :, :], k_hat[bi][None, :, :])  # [T(query),T,K]
    scores = np.einsum("ik,ijk->ij", qu, keys)
    if xl is not None:
      xl_r, _, xl_v = (np.asarray(a, np.float64) for a in xl)
      r = xl_r[::-1]  # r[d]: distance d
      bias = (q[bi] + xl_v) @ r.T  # [T, 2L]
      in_window = (dist >= 0) & (dist <= block_len)
      scores = scores + np.where(in_window, np.take_along_axis(bias, np.clip(dist, 0, 2 * block_len - 1), 1), 0.0)
    scores = np.where(dist >= 0, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out[bi] = (w / w.sum(-1, keepdims=True)) @ v[bi]
  return out


def attention_inputs(seq_len, block_len=8, rel_bias=True, quantized=True, seed=0):
  rng = np.random.default_rng(seed)
  b, d_k, d_v, n_code = 2, 16, 12, 16
  q = rng.normal(size=(b, seq_len, d_k)).astype(np.float32) * 0.5
  codebook = rng.normal(size=(n_code, d_k)).astype(np.float32) * 0.5
  z = rng.integers(0, n_code, (b, seq_len)).astype(np.int32)
  z[0, : seq_len // 2] = 3  # a popular code: counts above one in the cache
  k_hat = codebook[z] if quantized else rng.normal(size=(b, seq_len, d_k)).astype(np.float32) * 0.5
  v = rng.normal(size=(b, seq_len, d_v)).astype(np.float32)
  xl = None
  if rel_bias:
    xl = tuple(rng.normal(size=shape).astype(np.float32) * 0.5 for shape in ((2 * block_len, d_k), (d_k,), (d_k,)))
  return q, k_hat, z, v, codebook, xl


def peer_attention(q, k_hat, z, v, codebook, xl, block_len):
  """The peer's core on [B,T,...] inputs, reshaped into blocks and back."""
  b, t = z.shape
  blocks = lambda a: a.reshape((b, t // block_len, block_len) + a.shape[2:])
  out = plain_jax_vq.vq_attention(blocks(q), blocks(k_hat), blocks(z), blocks(v), codebook, xl)
  return out.reshape(b, t, -1)


@pytest.mark.parametrize("seq_len", [8, 16, 40])
@pytest.mark.parametrize("rel_bias", [True, False])
@pytest.mark.parametrize("quantized", [True, False])
def test_vq_attention_matches_quadratic_oracle(seq_len, rel_bias, quantized):
  """With quantized keys (k_hat = c_z, the model's case) the oracle is dense causal softmax attention
  over the quantized keys; with other keys it pins down which blocks are exact and which cached."""
  q, k_hat, z, v, codebook, xl = attention_inputs(seq_len, rel_bias=rel_bias, quantized=quantized)
  got = oracles.compiled(peer_attention, *map(jnp.asarray, (q, k_hat, z, v, codebook)), xl=xl, block_len=8)
  np.testing.assert_allclose(np.asarray(got), oracle_attention(q, k_hat, z, v, codebook, xl, 8), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_vq_attention_gradients_match_dense_attention():
  """Gradients w.r.t. q, v and the exact keys agree with dense attention over the quantized keys
  (through the cache's counts and means as well as the exact part)."""
  q, k_hat, z, v, codebook, xl = attention_inputs(32)
  w = np.random.default_rng(1).normal(size=(2, 32, v.shape[-1])).astype(np.float32)
  xl = tuple(map(jnp.asarray, xl))

  def dense(q, k_hat, v):
    b, t, _ = q.shape
    dist = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    r = xl[0][::-1]
    bias = jnp.einsum("bik,dk->bid", q + xl[2], r)
    bias = jnp.where((dist >= 0) & (dist <= 8), jnp.take_along_axis(bias, jnp.clip(dist, 0, 15)[None], 2), 0.0)
    scores = jnp.einsum("bik,bjk->bij", q + xl[1], k_hat) + bias
    probs = jax.nn.softmax(jnp.where(dist >= 0, scores, -jnp.inf), axis=-1)
    return jnp.sum(jnp.einsum("bij,bjv->biv", probs, v) * w)

  def peer(q, k_hat, v):
    return jnp.sum(peer_attention(q, k_hat, jnp.asarray(z), v, jnp.asarray(codebook), xl, 8) * w)

  args = tuple(map(jnp.asarray, (q, k_hat, v)))
  # Keys older than the previous block enter through the codebook, which has no gradient: compare
  # the key gradient on the exact window only, i.e. with the dense gradient of the last two blocks.
  got, want = jax.grad(peer, (0, 1, 2))(*args), jax.grad(dense, (0, 1, 2))(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[1][:, -16:], want[1][:, -16:], rtol=1e-4, atol=1e-5)


def deep_merge(a: dict, b: dict) -> dict:
  out = dict(a)
  for k, v in b.items():
    out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def ours_loss_grads_and_codebooks(model, inputs, targets):
  """Our model's mean token cross-entropy + sown commitment loss, its gradients (pure dict) and
  the codebook state after the training forward pass (pure dict of the whole model state)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

  def loss(params, rest):
    m = nnx.merge(graphdef, params, rest)
    logits, (aux_loss, _) = apply_model(m, inputs)
    _, _, new_rest = nnx.split(m, nnx.Param, ...)
    return token_nll(logits, targets).mean() + aux_loss, nnx.to_pure_dict(new_rest)

  (value, new_rest), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, rest)
  return value, grads, deep_merge(params, new_rest)


@pytest.mark.parametrize(
  "overrides",
  tiers.quick(
    [  # one-tuples: each case is one argument, a tuple
      ((),),
      (
        (
          "model.rel_bias=False",
          "model.tie_embeddings=True",
          "model.final_norm=True",
          "model.abs_position=True",
          "model.commit_coef=1.0",
        ),
      ),
      (("model.scan_layers=True", "model.remat=full", "model.num_layers=3"),),
    ],
    keep=[],
    ids=["paper", "tied_final_norm_abs_no_rel_commit1", "scanned_remat"],
  ),
)
def test_loss_gradients_and_codebooks_match_ours(overrides):
  config = small_config(*overrides)
  model = lra_core.build_model(config, seed=0)
  rng = np.random.default_rng(0)
  inputs, targets = (jnp.asarray(rng.integers(0, 256, (2, 32)), jnp.int32) for _ in range(2))
  params, state = plain_jax_vq.params_from_ours(model, config)
  ours_loss, ours_grads, ours_after = ours_loss_grads_and_codebooks(model, inputs, targets)

  peer = plain_jax_vq.make_peer(config)
  grad_fn = jax.jit(jax.value_and_grad(peer.loss, has_aux=True))
  (loss, new_state), grads = grad_fn(params, state, {"inputs": inputs, "targets": targets}, jax.random.key(0))
  np.testing.assert_allclose(loss, ours_loss, atol=1e-5)

  # Every parameter's gradient: ours mapped into the peer's layout (codebooks are no parameters).
  _, before = nnx.split(model)
  ours_grads, _ = plain_jax_vq.params_from_ours(deep_merge(nnx.to_pure_dict(before), ours_grads), config)
  assert jax.tree.structure(grads) == jax.tree.structure(ours_grads)
  for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ours_grads)):
    scale = float(jnp.abs(want).max()) + 1e-6
    np.testing.assert_allclose(g, want, atol=1e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path))

  # The EMA step: our model updates its codebooks in the forward pass, the peer returns the new state.
  _, ours_state = plain_jax_vq.params_from_ours(ours_after, config)
  assert not np.allclose(new_state["codebook_sum"], state["codebook_sum"])
  np.testing.assert_allclose(new_state["codebook_sum"], ours_state["codebook_sum"], atol=1e-6)
  np.testing.assert_allclose(new_state["codebook_count"], ours_state["codebook_count"], atol=1e-6)


def test_init_has_the_layout_of_our_weights():
  for overrides in [(), ("model.scan_layers=True", "model.tie_embeddings=True", "model.rel_bias=False")]:
    config = small_config(*overrides)
    peer = plain_jax_vq.make_peer(config)
    ours = jax.eval_shape(lambda: plain_jax_vq.params_from_ours(lra_core.build_model(config, seed=0), config))
    shapes = jax.eval_shape(peer.init, jax.random.key(0))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(lambda a: (a.shape, a.dtype), ours)


@pytest.mark.parametrize(
  "override",
  [
    "model.head_type=mqa",
    "model.attention=full",
    "train.update_len=16",
    "model.dropres=0.1",
    "model.compressive=False",
  ],
)
def test_unsupported_settings_raise(override):
  with pytest.raises(ValueError, match="VQ peer"):
    plain_jax_vq.make_peer(small_config(override))


@pytest.mark.slow
def test_train_step_runs_and_its_flops_are_within_15_percent_of_ours():
  """A jitted peer step (value_and_grad, the config's AdamW) at d 128, T 256 against our trainer's step."""
  overrides = [
    "model.d_model=128",
    "model.d_k=64",
    "model.d_v=256",
    "model.num_layers=2",
    "model.n_code=64",
    "model.block_len=64",
    "model.dropsin=0.0",
    "model.dropres=0.0",
    "model.droplyr=0.0",
  ]
  config = bench.bench_config(CONFIG, overrides, seq_len=256, batch_size=1)
  ours = bench.time_train_step(config, steps=1, warmup=0, compiler_options=FAST)

  peer = plain_jax_vq.make_peer(config)
  tx, _ = optim.make_optimizer(config)
  params, state = peer.init(jax.random.key(0))
  opt_state = tx.init(params)

  def step(params, opt_state, state, batch, key):
    (loss, state), grads = jax.value_and_grad(peer.loss, has_aux=True)(params, state, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state, loss

  rng = np.random.default_rng(0)
  batch = {name: jnp.asarray(rng.integers(0, 256, (1, 256)), jnp.int32) for name in ("inputs", "targets")}
  compiled = jax.jit(step).lower(params, opt_state, state, batch, jax.random.key(0)).compile(FAST)
  new_params, _, new_state, loss = compiled(params, opt_state, state, batch, jax.random.key(0))
  assert np.isfinite(float(loss)) and abs(float(loss) - np.log(256)) < 1.0
  assert not np.allclose(new_params["classifier"]["kernel"], params["classifier"]["kernel"])
  assert not np.allclose(new_state["codebook_count"], state["codebook_count"])

  peer_flops = cost_flops(compiled)
  print(
    f"matrix-product FLOPs per train step: peer {peer_flops:.4g}, ours {ours['flops_per_step']:.4g} "
    f"(ratio {peer_flops / ours['flops_per_step']:.3f})"
  )
  assert abs(peer_flops / ours["flops_per_step"] - 1.0) < 0.15
