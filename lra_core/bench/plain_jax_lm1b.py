"""A plain JAX Transformer LM in the style of the Flax examples' lm1b `TransformerLM`: the yardstick for
our Transformer, Transformer+ and Transformer++ train steps (scripts/peer_bench.py).

Structure as lm1b builds it: token embedding plus a position table; pre-LayerNorm decoder blocks of
self-attention (query, key and value projections [D,H,Dh] without bias contracted against the 3-D
activations, scores by `...qhd,...khd->...hqk` on queries scaled by Dh^-1/2, a boolean causal mask
applied with `where`, a float32 softmax, `...hqk,...khd->...qhd`, an [H,Dh,D] output projection) and
an MLP of two Dense layers with biases; a final LayerNorm and a Dense output layer with bias; the mean
token cross-entropy. Plain functions over a dict of arrays, no framework.

So that both sides compute the same function, the peer takes from our config what our variant changes
(lm1b's own choices in brackets): the activation (ReLU), a GLU gate for Transformer++, the position
kind (a fixed sinusoid) and RoPE on queries and keys, and the sqrt(D) embedding scale (none). Inputs
arrive already shifted and unpadded (lm1b shifts them itself and masks token 0). With the weights of
one of our models (`params_from_ours`, MLP and output biases zero) it gives our loss.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lra_core.bench.side_by_side import Peer
from lra_core.errors import ConfigError
from lra_core.models.layers.attention import head_width

ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_tanh": jax.nn.gelu,
  "relu": jax.nn.relu,
  "silu": jax.nn.silu,
}


def _check(config) -> None:
  m = config.model
  unsupported = {
    "task": (config.task, "lm"),
    "model.name": (m.name, "transformer"),
    "model.norm": (m.norm, "layer"),
    "model.window": (m.window, 0),
    "model.tie_embeddings": (m.tie_embeddings, False),
    "model.parallel_residual": (m.get("parallel_residual", False), False),
    "model.use_bias": (m.use_bias, False),
    "model.dropout": (m.dropout, 0.0),
    "model.attention_dropout": (m.attention_dropout, 0.0),
    "model.rope_fraction": (m.rope_fraction, 1.0),
    "model.scan_layers": (m.scan_layers, False),
    "model.remat": (m.remat, "none"),
  }
  for key, (value, wanted) in unsupported.items():
    if value != wanted:
      raise ConfigError(f"the lm1b-style peer needs {key} = {wanted!r}, got {value!r}.")
  if m.num_kv_heads not in (0, m.num_heads):
    raise ConfigError(f"the lm1b-style peer is multi-head; model.num_kv_heads is {m.num_kv_heads}.")
  if m.activation not in ACTIVATIONS or m.mlp not in ("mlp", "glu") or m.position not in ("learned", "scaled_sinusoid"):
    raise ConfigError(
      f"the lm1b-style peer has no activation {m.activation!r}, mlp {m.mlp!r} or position "
      f"{m.position!r} (it mirrors transformer, transformer+ and transformer++)."
    )


def sinusoid_table(length: int, dim: int, max_wavelength: float = 1e4) -> np.ndarray:
  """[length, dim]: sin then cos of p * max_wavelength^(-i / (dim/2))."""
  half = dim // 2
  angles = np.arange(length)[:, None] * max_wavelength ** (-np.arange(half) / half)
  return np.concatenate([np.sin(angles), np.cos(angles)], -1).astype(np.float32)


def rope(x: jax.Array, max_wavelength: float) -> jax.Array:
  """Rotates dimension pairs (i, i + Dh/2) of x [B,T,H,Dh] by position * frequency_i."""
  t, d = x.shape[1], x.shape[-1]
  angles = jnp.asarray(sinusoid_table(t, d, max_wavelength))  # [T, Dh]: sin | cos
  sin, cos = angles[None, :, None, : d // 2], angles[None, :, None, d // 2 :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def make_peer(config) -> Peer:
  """The peer of our Transformer at `config` (an lm config of the transformer family)."""
  _check(config)
  m = config.model
  vocab, d, heads, ff, layers = m.vocab_size, m.d_model, m.num_heads, m.d_ff, m.num_layers
  head_dim = head_width(m)  # the config's reading, as our model takes it
  seq_len = config.train.seq_len
  act, glu = ACTIVATIONS[m.activation], m.mlp == "glu"
  dtype = jnp.dtype(m.dtype)

  def init(key):
    keys = iter(jax.random.split(key, 8 * layers + 4))
    xavier = jax.nn.initializers.xavier_uniform()
    dense = lambda shape, fan_in, fan_out: xavier(next(keys), (fan_in, fan_out)).reshape(shape)
    zeros, ones = jnp.zeros, jnp.ones
    params = {
      "embed": jax.random.normal(next(keys), (vocab, d)) * d**-0.5,
      "final_norm": {"scale": ones(d), "bias": zeros(d)},
      "logits": {"kernel": dense((d, vocab), d, vocab), "bias": zeros(vocab)},
      "blocks": [],
    }
    if m.position == "learned":
      params["position_table"] = jax.random.normal(next(keys), (seq_len, d)) * 0.02
    else:
      params["position_scale"] = jnp.asarray(d**-0.5)
    for _ in range(layers):
      block = {
        "attn_norm": {"scale": ones(d), "bias": zeros(d)},
        "mlp_norm": {"scale": ones(d), "bias": zeros(d)},
        **{name: dense((d, heads, head_dim), d, heads * head_dim) for name in ("query", "key", "value")},
        "out": dense((heads, head_dim, d), heads * head_dim, d),
        "wi": {"kernel": dense((d, ff), d, ff), "bias": zeros(ff)},
        "wo": {"kernel": dense((ff, d), ff, d), "bias": zeros(d)},
      }
      if glu:
        block["wg"] = {"kernel": dense((d, ff), d, ff), "bias": zeros(ff)}
      params["blocks"].append(block)
    return params, {}

  def attention(x, p):
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[name].astype(dtype)) for name in ("query", "key", "value"))
    if m.rope:
      q, k = rope(q, m.rope_max_wavelength).astype(dtype), rope(k, m.rope_max_wavelength).astype(dtype)
    t = x.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q / math.sqrt(head_dim), k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(dtype), v)
    return jnp.einsum("bqhd,hde->bqe", out, p["out"].astype(dtype))

  def mlp(x, p):
    h = act(x @ p["wi"]["kernel"].astype(dtype) + p["wi"]["bias"].astype(dtype))
    if glu:
      h = h * (x @ p["wg"]["kernel"].astype(dtype) + p["wg"]["bias"].astype(dtype))
    return h @ p["wo"]["kernel"].astype(dtype) + p["wo"]["bias"].astype(dtype)

  def logits_fn(params, inputs):
    t = inputs.shape[1]
    x = params["embed"][inputs] * math.sqrt(d)
    if m.position == "learned":
      x = x + params["position_table"][:t]
    else:
      x = x + jnp.asarray(sinusoid_table(t, d)) * params["position_scale"]
    x = x.astype(dtype)
    for p in params["blocks"]:
      x = x + attention(layer_norm(x.astype(jnp.float32), p["attn_norm"]).astype(dtype), p)
      x = x + mlp(layer_norm(x.astype(jnp.float32), p["mlp_norm"]).astype(dtype), p)
    x = layer_norm(x.astype(jnp.float32), params["final_norm"]).astype(dtype)
    return (x @ params["logits"]["kernel"].astype(dtype) + params["logits"]["bias"].astype(dtype)).astype(jnp.float32)

  def loss(params, state, batch, key):
    del key
    logits = logits_fn(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), state

  return Peer(name="lm1b-style Transformer LM (plain JAX)", init=init, loss=loss)


def params_from_ours(params: dict, config) -> dict:
  """The peer's parameters holding our model's weights (`nnx.to_pure_dict` of its Params, layers not
  scanned); the biases our model lacks are zero, so the peer computes our model's function."""
  m = config.model
  zeros = lambda n: jnp.zeros((n,), jnp.float32)
  out = {
    "embed": params["embed"]["embedding"],
    "final_norm": dict(params["final_norm"]),
    "logits": {"kernel": params["head"]["out"]["kernel"], "bias": zeros(m.vocab_size)},
    "blocks": [],
  }
  if m.position == "learned":
    out["position_table"] = params["positions"]["table"][: config.train.seq_len]
  else:
    out["position_scale"] = params["positions"]["scale"]
  for i in range(m.num_layers):
    ours = params["blocks"][i]
    block = {
      "attn_norm": dict(ours["attn_norm"]),
      "mlp_norm": dict(ours["mlp_norm"]),
      **{name: ours["attn"][name]["kernel"] for name in ("query", "key", "value", "out")},
      "wi": {"kernel": ours["mlp"]["up"]["kernel"], "bias": zeros(m.d_ff)},
      "wo": {"kernel": ours["mlp"]["down"]["kernel"], "bias": zeros(m.d_model)},
    }
    if m.mlp == "glu":
      block["wg"] = {"kernel": ours["mlp"]["gate"]["kernel"], "bias": zeros(m.d_ff)}
    out["blocks"].append(block)
  return out
