"""Transformer-VQ in plain JAX, laid out as its authors' public code lays out the single-head GAU model:
the peer (lra_core/bench/side_by_side.py) that our `transformer_vq` train step is timed against.

Structure taken from the authors' code (transformer-vq/transformer_vq, attn.py / vq.py / qkv.py / pe.py):
- the residual stream is reshaped once into blocks [B,R,C,D] and stays so through the whole stack;
- a GAU: RMSNorm; q, k, v and gate projections; q and k RMS-normalised and scaled by d_k^-1/4; silu
  on v and the gate; the attention output times the gate, projected back and added to the stream;
- keys are quantized against an EMA codebook (sums / counts): squared distances by the expanded
  form, argmin, the straight-through keys sg(c_z) + k - sg(k), and the commitment loss read off
  the same distances (their minimum);
- attention as three score sets per block: the present block (causal), the previous block (the
  blocks shifted by one, block 0 masked) and the codebook with log-count biases; the XL position
  term as one [C, 2C] matrix against a flipped sinusoid table of 2C rows, relatively shifted,
  masked to the local window (distances 0..C) and split into its previous and present halves;
- the cache variables: per-block code counts and value means, merged by a lax.scan over blocks in
  the stable (count, mean) form, block r reading the merge of blocks <= r-2;
- one stop-gradient max over the three score sets, exponentials divided by their joint sum before
  they meet the values, three einsums;
- the codebook's EMA targets from per-code counts and key sums over the batch and all blocks. The
  authors apply them as an SGD step (lr 1) on a surrogate loss, which lands on the target; here the
  target is returned as the new state.

Where our model's math differs, this follows ours (models/transformer_vq/__init__.py), so both compute one
function: the GAU's input RMSNorm has a learned scale and bias; the embedding table is the authors'
plain one, or stores E / sqrt(d_model) and scales lookups back (model.embedding); the untied
classifier has a bias and runs in float32, the tied one is (x E^T + b) * model.output_scale (the
authors' e_scale and bias_out); the optional final RMSNorm has a scale and bias; the EMA statistics are
plain sums (the authors scale them by devices x blocks per update); the attention runs in float32
whatever model.dtype.

model.num_layers counts GAUs (a scanned layer of the authors' holds two). The layers run as a
lax.scan over stacked parameters (the authors' scanned stack) when model.scan_layers, else one
after another, and are rematerialised per model.remat (the authors always remat each layer), so
the two steps compile the same way. model.reduction, model.chunk_blocks, model.impl and
model.input_scan only choose how our model computes the same function; the peer always uses the
serial scan above.

What it does not mirror: the authors' code runs each GAU as a flax `nn.scan` over the blocks (the
projections, the quantizer and the attention of one block at a time, its cache carried), where
this peer computes every block's scores at once. That is a different cost at long lengths: on a
2-core CPU (docs/benchmarks.md, "Beside the authors' own code") their step's time per token stayed
flat from 2,048 to 32,768 tokens while an all-blocks-at-once step's grew 13% from 2,048 to 8,192
(its [C, 2C] scores for every block outgrow the CPU's cache). Time the authors' code itself for
that comparison; this peer checks the arithmetic and the per-token cost of the block layout.

  peer = make_peer(config)                          # config: an lra_core transformer_vq config
  params, state = params_from_ours(model, config)   # our weights and codebooks in the peer's layout
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lra_core.bench.side_by_side import Peer
from lra_core.layer_stacks import STACKED, unscan_params
from lra_core.models.layers.stack import POLICIES

Array = jax.Array
INFTY_APPROX = 1e30
EPS = 1e-6

sg = jax.lax.stop_gradient


class Sizes(NamedTuple):
  """What the peer reads from config.model and config.train."""

  vocab_size: int
  d_model: int
  d_k: int
  d_v: int
  num_layers: int
  n_code: int
  block_len: int
  seq_len: int
  commit_coef: float
  ema_rate: float
  rel_bias: bool
  abs_position: bool
  wavelength: float
  final_norm: bool
  tie_embeddings: bool
  embed_scale: float  # lookups multiply the table by this: sqrt(d_model) ("scaled") or 1 ("plain")
  output_scale: float | None  # tied: (x E^T + b) * output_scale; None: x E^T / d_model, no bias (older configs)
  dtype: Any
  scan_layers: bool
  remat: str


def sizes(config) -> Sizes:
  """The settings of `config`; a one-sentence ValueError for any the peer does not support."""
  m, t = config.model, config.train
  if m.name != "transformer_vq":
    raise ValueError(f"the VQ peer mirrors model transformer_vq, not {m.name!r}.")
  if m.head_type != "shga" or m.num_heads != 1:
    raise ValueError(f"the VQ peer supports head_type 'shga' with one head, not {m.head_type!r} with {m.num_heads}.")
  if m.attention != "vq":
    raise ValueError(f"the VQ peer supports attention 'vq', not {m.attention!r}.")
  if not m.compressive:
    raise ValueError("the VQ peer needs model.compressive=True (the sliding-window ablation is not mirrored).")
  if t.update_len not in (0, t.seq_len):
    raise ValueError(
      f"the VQ peer needs one update window per sequence (train.update_len 0 or {t.seq_len}), got {t.update_len}."
    )
  for key in ("dropsin", "dropres", "droplyr"):
    if m[key] != 0.0:
      raise ValueError(f"the VQ peer has no dropout; model.{key} is {m[key]}.")
  if t.seq_len % m.block_len:
    raise ValueError(f"train.seq_len {t.seq_len} is not a multiple of model.block_len {m.block_len}.")
  remat = m.remat
  if remat != "none" and remat not in POLICIES:
    raise ValueError(f"model.remat {remat!r} is not one of {['none', *POLICIES]}.")
  return Sizes(
    vocab_size=m.vocab_size,
    d_model=m.d_model,
    d_k=m.d_k,
    d_v=m.d_v,
    num_layers=m.num_layers,
    n_code=m.n_code,
    block_len=m.block_len,
    seq_len=t.seq_len,
    commit_coef=float(m.commit_coef),
    ema_rate=float(m.ema_rate),
    rel_bias=bool(m.rel_bias),
    abs_position=bool(m.abs_position),
    wavelength=float(m.wavelength),
    final_norm=bool(m.final_norm),
    tie_embeddings=bool(m.tie_embeddings),
    embed_scale=m.d_model**0.5 if m.get("embedding", "scaled") == "scaled" else 1.0,
    output_scale=float(m.output_scale) if m.tie_embeddings and "output_scale" in m else None,
    dtype=jnp.dtype(m.dtype),
    scan_layers=bool(m.scan_layers),
    remat=remat,
  )


# -- small pieces ----------------------------------------------------------------------------------


def rms_norm(x: Array, eps: float = EPS) -> Array:
  """x / rms(x) over the last axis, in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(eps + jnp.mean(jnp.square(x32), axis=-1, keepdims=True))).astype(x.dtype)


def affine_rms_norm(x: Array, p: dict) -> Array:
  """RMSNorm with a learned scale and bias (our model's input and final norms)."""
  y = rms_norm(x.astype(jnp.float32)) * p["scale"] + p["bias"]
  return y.astype(x.dtype)


def dense(x: Array, w: Array, dtype) -> Array:
  return jnp.einsum("...d,de->...e", x.astype(dtype), w.astype(dtype))


def sinusoid_embs(length: int, width: int, wavelength: float, *, flip: bool) -> Array:
  """[length, width] float32: concat(sin, cos) of positions 0..length-1 (reversed rows when `flip`)."""
  half = width // 2
  inv_lams = wavelength ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
  pre = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_lams[None]
  cat = jnp.concatenate([jnp.sin(pre), jnp.cos(pre)] + ([jnp.zeros((length, 1))] if width % 2 else []), axis=-1)
  return jnp.flip(cat, axis=0) if flip else cat


def rel_shift(x: Array) -> Array:
  """Transformer-XL's relative shift: [..., Q, K] scores against flipped positions -> row i moved
  left by Q - 1 - i, through one pad and two reshapes."""
  *prefix, q_len, k_len = x.shape
  x = jnp.pad(x, [(0, 0)] * len(prefix) + [(0, 0), (1, 0)])
  x = x.reshape(*prefix, k_len + 1, q_len)[..., 1:, :]
  return x.reshape(*prefix, q_len, k_len)


def causal_keep_mask(q_len: int, k_len: int, *, with_locality: bool) -> Array:
  """Queries are the last q_len of k_len positions: keep key j <= query i; with locality also j >= i
  (the local window of distances 0..k_len - q_len)."""
  i = jnp.arange(q_len)[:, None]
  j = jnp.arange(k_len)[None, :]
  keep = j - (k_len - q_len) <= i
  return keep & (j >= i) if with_locality else keep


# -- quantizer -------------------------------------------------------------------------------------


def get_codebook(c_sum: Array, c_count: Array) -> Array:
  return sg(c_sum / jnp.clip(c_count, 0.01)[..., None])


def get_shortcodes(vecs: Array, codebook: Array) -> tuple[Array, Array]:
  """Nearest code and squared distance: vecs [B,R,C,K], codebook [S,K] -> int32 [B,R,C], [B,R,C]."""
  diffs2 = (
    jnp.einsum("brck->brc", jnp.square(vecs))[..., None]
    - 2.0 * jnp.einsum("brck,sk->brcs", vecs, codebook)
    + jnp.einsum("sk->s", jnp.square(codebook))[None, None, None]
  )
  z = jnp.argmin(diffs2, axis=-1).astype(jnp.int32)
  return z, jax.nn.relu(jnp.min(diffs2, axis=-1))


def quantize(k: Array, c_sum: Array, c_count: Array, ema_rate: float):
  """-> straight-through keys, codes, commitment loss (mean over tokens), the codebook and its EMA
  targets (c_sum, c_count) from this window's keys."""
  codebook = get_codebook(c_sum, c_count)
  k32 = k.astype(jnp.float32)
  z, errs2 = get_shortcodes(k32, codebook)
  cz = jnp.take(codebook, z, axis=0).astype(k.dtype)
  k_hat = sg(cz) + (k - sg(k))
  r = jax.nn.one_hot(z, codebook.shape[0], dtype=jnp.float32)
  c_sum_hat = jnp.einsum("brcs,brck->sk", r, sg(k32))
  c_count_hat = jnp.einsum("brcs->s", r)
  targets = ((1 - ema_rate) * c_sum_hat + ema_rate * c_sum, (1 - ema_rate) * c_count_hat + ema_rate * c_count)
  return k_hat, z, jnp.mean(errs2), codebook, targets


# -- attention -------------------------------------------------------------------------------------


def cache_vars(z: Array, v: Array, n_code: int) -> tuple[Array, Array]:
  """Per block r: the value means and counts per code of blocks 0..r-2, [B,R,S,V] and [B,R,S].

  Block summaries, then a serial scan merging (count, mean) without ever forming sums of values.
  """
  delta = jax.nn.one_hot(z, n_code, dtype=jnp.float32)  # [B,R,C,S]
  delta1_by_block = jnp.einsum("brcs->brs", delta)
  deltav_by_block = jnp.einsum("brcs,brcv->brsv", delta, v)
  deltav_by_block_normalized = deltav_by_block / jnp.clip(delta1_by_block[..., None], 1.0)

  def body(carry, xs):
    lower, upper_div_lower = carry
    count, mean = xs
    new_lower = lower + count
    f1 = lower / jnp.clip(new_lower, 1.0)
    f2 = count / jnp.clip(new_lower, 1.0)
    new = (new_lower, f1[..., None] * upper_div_lower + f2[..., None] * mean)
    return new, new

  b, n_block = z.shape[:2]
  init = (jnp.zeros((b, n_code), jnp.float32), jnp.zeros((b, n_code, v.shape[-1]), jnp.float32))
  _, (lowers, upper_div_lowers) = jax.lax.scan(
    body, init, (delta1_by_block.transpose(1, 0, 2), deltav_by_block_normalized.transpose(1, 0, 2, 3))
  )
  # Block r reads the merge through block r - 2: shift by two blocks (blocks 0 and 1 read nothing).
  lower = jnp.pad(lowers, ((2, 0), (0, 0), (0, 0)))[:n_block].transpose(1, 0, 2)
  upper_div_lower = jnp.pad(upper_div_lowers, ((2, 0), (0, 0), (0, 0), (0, 0)))[:n_block].transpose(1, 0, 2, 3)
  return upper_div_lower, lower


def vq_attention(
  q: Array, k_hat: Array, z: Array, v: Array, codebook: Array, xl: tuple[Array, Array, Array] | None
) -> Array:
  """Causal softmax attention over quantized keys in blocks, in float32.

  q, k_hat [B,R,C,K]; z int32 [B,R,C]; v [B,R,C,V]; codebook [S,K]; xl = (xl_r [2C,K] rows for
  distances 2C-1..0, xl_u [K], xl_v [K]) or None. -> [B,R,C,V] float32.
  """
  block_len = q.shape[2]
  q, k_hat, v = (a.astype(jnp.float32) for a in (q, k_hat, v))
  q_plus_xlu = q if xl is None else q + xl[1]
  k_hat_prev = jnp.pad(k_hat[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
  v_prev = jnp.pad(v[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))

  scores_present = jnp.einsum("brik,brjk->brij", q_plus_xlu, k_hat)
  scores_prev = jnp.einsum("brik,brjk->brij", q_plus_xlu, k_hat_prev)
  scores_cache = jnp.einsum("brck,sk->brcs", q_plus_xlu, codebook.astype(jnp.float32))

  if xl is not None:
    xl_r, _, xl_v = xl
    scores_bd = jnp.einsum("brck,wk->brcw", q + xl_v, xl_r.astype(jnp.float32))
    scores_bd = rel_shift(scores_bd)
    scores_bd = jnp.where(causal_keep_mask(block_len, 2 * block_len, with_locality=True), scores_bd, 0.0)
    scores_bd_prev, scores_bd_present = jnp.split(scores_bd, 2, axis=-1)
    scores_present = scores_present + scores_bd_present
    scores_prev = scores_prev + scores_bd_prev

  scores_present = jnp.where(causal_keep_mask(block_len, block_len, with_locality=False), scores_present, -INFTY_APPROX)
  # Block 0 has no previous block: its zero padding must get no weight.
  scores_prev = jnp.pad(scores_prev[:, 1:], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-INFTY_APPROX)

  upper_div_lower, lower = cache_vars(z, v, codebook.shape[0])
  count_biases = jnp.where(lower == 0, -INFTY_APPROX, jnp.log(jnp.maximum(lower, 1.0)))
  scores_cache = scores_cache + count_biases[:, :, None, :]

  max_scores = jnp.maximum(jnp.maximum(scores_present.max(-1), scores_prev.max(-1)), scores_cache.max(-1))
  max_scores = sg(max_scores)[..., None]
  a_present = jnp.exp(scores_present - max_scores)
  a_prev = jnp.exp(scores_prev - max_scores)
  a_cache = jnp.exp(scores_cache - max_scores)
  d = (a_present.sum(-1) + a_prev.sum(-1) + a_cache.sum(-1))[..., None]
  wv = jnp.einsum("brij,brjv->briv", a_present / d, v)
  wv = wv + jnp.einsum("brij,brjv->briv", a_prev / d, v_prev)
  wv = wv + jnp.einsum("bris,brsv->briv", a_cache / d, upper_div_lower)
  return wv


# -- model -----------------------------------------------------------------------------------------


def xl_helpers(p: dict, s: Sizes) -> tuple[Array, Array, Array] | None:
  """(xl_r [2C,K], xl_u [K], xl_v [K]), all scaled by d_k^-1/4, or None without relative biases."""
  if not s.rel_bias:
    return None
  tau = s.d_k**-0.25
  table = sinusoid_embs(2 * s.block_len, s.d_model, s.wavelength, flip=True)
  xl_r = dense(table, p["r_proj"], s.dtype)
  return xl_r * tau, p["xl_u"] * tau, p["xl_v"] * tau


def gau(p: dict, c_sum: Array, c_count: Array, x: Array, s: Sizes):
  """One gated attention unit on x [B,R,C,D] -> (residual branch, commitment loss, EMA targets)."""
  tau = s.d_k**-0.25
  x_tilde = affine_rms_norm(x, p["norm"])
  q = rms_norm(dense(x_tilde, p["q_proj"], s.dtype)) * tau
  k = rms_norm(dense(x_tilde, p["k_proj"], s.dtype)) * tau
  v = jax.nn.silu(dense(x_tilde, p["v_proj"], s.dtype))
  k_hat, z, l_commit, codebook, targets = quantize(k, c_sum, c_count, s.ema_rate)
  wv = vq_attention(q, k_hat, z, v, codebook, xl_helpers(p, s)).astype(v.dtype)
  wv = wv * jax.nn.silu(dense(x_tilde, p["g_proj"], s.dtype))
  return dense(wv, p["res_proj"], s.dtype), l_commit, targets


def stack(layers: dict, state: dict, x: Array, s: Sizes):
  """All GAUs: -> x, summed commitment loss, new codebook state (stacked [N, ...])."""

  def layer(carry, xs):
    x, l_commit = carry
    p, c_sum, c_count = xs
    res, commit, targets = gau(p, c_sum, c_count, x, s)
    return (x + res, l_commit + commit), targets

  if s.remat != "none":
    layer = jax.checkpoint(layer, policy=POLICIES[s.remat])
  carry = (x, jnp.zeros((), jnp.float32))
  codebooks = (state["codebook_sum"], state["codebook_count"])
  if s.scan_layers:
    carry, (c_sum, c_count) = jax.lax.scan(layer, carry, (layers[STACKED], *codebooks))
  else:
    outs = []
    for i in range(s.num_layers):
      carry, out = layer(carry, (layers[i], codebooks[0][i], codebooks[1][i]))
      outs.append(out)
    c_sum, c_count = (jnp.stack(a) for a in zip(*outs))
  x, l_commit = carry
  return x, l_commit, {"codebook_sum": c_sum, "codebook_count": c_count}


def forward(params: dict, state: dict, inputs: Array, s: Sizes) -> tuple[Array, Array, dict]:
  """tokens int32 [B,T] -> logits float32 [B,T,V], summed commitment loss, new codebook state."""
  b, t = inputs.shape
  c = s.block_len
  x = (jnp.take(params["embed"]["embedding"], inputs, axis=0) * s.embed_scale).astype(s.dtype)
  if s.abs_position:
    x = x + (sinusoid_embs(t, s.d_model, s.wavelength, flip=False) * params["pos_scale"]).astype(s.dtype)
  x = x.reshape(b, t // c, c, s.d_model)
  x, l_commit, new_state = stack(params["layers"], state, x, s)
  x = x.reshape(b, t, s.d_model)
  if s.final_norm:
    x = affine_rms_norm(x, params["final_norm"])
  if s.tie_embeddings:
    logits = dense(x, params["embed"]["embedding"].T, s.dtype).astype(jnp.float32) * s.embed_scale
    if s.output_scale is None:
      logits = logits / s.d_model
    else:
      logits = (logits + params["output_bias"]) * s.output_scale
  else:
    logits = dense(x.astype(jnp.float32), params["classifier"]["kernel"], jnp.float32)
    logits = logits + params["classifier"]["bias"]
  return logits, l_commit, new_state


def make_peer(config) -> Peer:
  """The peer for an lra_core transformer_vq config (see the module docstring for what it supports)."""
  s = sizes(config)

  def loss(params, state, batch, key):
    del key  # no dropout
    logits, l_commit, new_state = forward(params, state, batch["inputs"], s)
    l_ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return l_ce + s.commit_coef * l_commit, new_state

  return Peer("transformer_vq", lambda key: init(key, s), loss)


# -- parameters ------------------------------------------------------------------------------------


def init(key: Array, s: Sizes) -> tuple[dict, dict]:
  """Parameters and codebook state, initialised as our model initialises its own."""
  w_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  keys = iter(jax.random.split(key, 3 + 7 * s.num_layers))
  d, dk, dv = s.d_model, s.d_k, s.d_v

  def unit():
    p = {
      "norm": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
      "q_proj": w_init(next(keys), (d, dk)),
      "k_proj": w_init(next(keys), (d, dk)),
      "v_proj": w_init(next(keys), (d, dv)),
      "g_proj": w_init(next(keys), (d, dv)),
      "res_proj": w_init(next(keys), (dv, d)),
    }
    r_key = next(keys)
    if s.rel_bias:
      p.update(r_proj=w_init(r_key, (d, dk)), xl_u=jnp.zeros((dk,)), xl_v=jnp.zeros((dk,)))
    return p, jax.random.normal(next(keys), (s.n_code, dk)) * dk**-0.25

  units = [unit() for _ in range(s.num_layers)]
  params = {
    "embed": {"embedding": jax.random.normal(next(keys), (s.vocab_size, d)) * s.embed_scale**-1},
    "layers": _layers([p for p, _ in units], s),
  }
  if s.abs_position:
    params["pos_scale"] = jnp.zeros(())
  if s.final_norm:
    params["final_norm"] = {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}
  if not s.tie_embeddings:
    params["classifier"] = {"kernel": w_init(next(keys), (d, s.vocab_size)), "bias": jnp.zeros((s.vocab_size,))}
  elif s.output_scale is not None:
    params["output_bias"] = jnp.zeros((s.vocab_size,))
  state = {"codebook_sum": jnp.stack([c for _, c in units]), "codebook_count": jnp.ones((s.num_layers, s.n_code))}
  return params, state


def _layers(units: list[dict], s: Sizes) -> dict:
  """Per-layer parameters as the peer keeps them: {STACKED: [N, ...]} when scanned, else {i: ...}."""
  if s.scan_layers:
    return {STACKED: jax.tree.map(lambda *xs: jnp.stack(xs), *units)}
  return dict(enumerate(units))


def params_from_ours(model_or_state, config) -> tuple[dict, dict]:
  """(params, state) of the peer holding our model's weights and codebooks.

  `model_or_state`: an nnx transformer_vq Model, or the pure dict of its state
  (nnx.to_pure_dict(nnx.state(model))), with or without scanned layers.
  """
  s = sizes(config)
  ours = model_or_state
  if not isinstance(ours, dict):
    ours = nnx.to_pure_dict(nnx.state(ours))
  ours = unscan_params(ours)
  as_array = lambda a: jnp.asarray(a, jnp.float32)
  units, c_sums, c_counts = [], [], []
  for i in range(s.num_layers):
    u = ours["units"][i]
    p = {
      "norm": {"scale": as_array(u["norm"]["scale"]), "bias": as_array(u["norm"]["bias"])},
      "q_proj": as_array(u["q_proj"]["kernel"]).reshape(s.d_model, s.d_k),
      "k_proj": as_array(u["k_proj"]["kernel"]).reshape(s.d_model, s.d_k),
      "v_proj": as_array(u["v_proj"]["kernel"]).reshape(s.d_model, s.d_v),
      "g_proj": as_array(u["g_proj"]["kernel"]).reshape(s.d_model, s.d_v),
      "res_proj": as_array(u["out_proj"]["kernel"]).reshape(s.d_v, s.d_model),
    }
    if s.rel_bias:
      p.update(
        r_proj=as_array(u["r_proj"]["kernel"]).reshape(s.d_model, s.d_k),
        xl_u=as_array(u["xl_u"]).reshape(s.d_k),
        xl_v=as_array(u["xl_v"]).reshape(s.d_k),
      )
    units.append(p)
    c_sums.append(as_array(u["quantizer"]["c_sum"]).reshape(s.n_code, s.d_k))
    c_counts.append(as_array(u["quantizer"]["c_count"]).reshape(s.n_code))
  params = {"embed": {"embedding": as_array(ours["embed"]["embedding"])}, "layers": _layers(units, s)}
  if s.abs_position:
    params["pos_scale"] = as_array(ours["pos_scale"])
  if s.final_norm:
    params["final_norm"] = {
      "scale": as_array(ours["final_norm"]["scale"]),
      "bias": as_array(ours["final_norm"]["bias"]),
    }
  if not s.tie_embeddings:
    params["classifier"] = {
      "kernel": as_array(ours["classifier"]["kernel"]),
      "bias": as_array(ours["classifier"]["bias"]),
    }
  elif s.output_scale is not None:
    params["output_bias"] = as_array(ours["output_bias"])
  return params, {"codebook_sum": jnp.stack(c_sums), "codebook_count": jnp.stack(c_counts)}
