"""GPT-NeoX (Pythia) in the transformer family: its config.json as our `config.model`, its tensors as
our parameters, and back.

The architecture, as the transformer family states it: a learned token table read as is
(`embedding="plain"`), no absolute positions, rotary embedding on the first `rotary_pct` of each head
(`rope_parameters.partial_rotary_factor` in transformers 5's layout; GPT-NeoX's half-split pairs,
`rope_fraction`) scaled as its `rope_scaling` says (`model.rope_scaling`), LayerNorm with biases (eps
`layer_norm_eps`), attention and MLP side by side on the block input (`parallel_residual`), biases on
every projection, an exact-erf GELU MLP, a final LayerNorm and an untied output matrix without bias.

Hugging Face stores a linear map as [out, in]; ours keep [in, out] with the heads as axes of their
own. The fused query-key-value matrix holds, per head, its query, key and value rows one after another
([H, 3, head_dim, D] when reshaped).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from lra_core.errors import ConfigError
from lra_core.hf import fields
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width

ARCHITECTURE, NAME = "GPTNeoXForCausalLM", "GPT-NeoX"
_LAYER = "gpt_neox.layers.{i}."
# HF's per-layer norm and linear names, and ours
_NORMS = {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("mlp_norm",)}
_LINEAR = {"attention.dense": ("attn", "out"), "mlp.dense_h_to_4h": ("mlp", "up"), "mlp.dense_4h_to_h": ("mlp", "down")}
_QKV = ("query", "key", "value")
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# The old layout's top-level rotary keys, the one written first (transformers 4 wrote rotary_pct and
# rotary_emb_base; its later versions rope_theta and partial_rotary_factor as well), and the defaults
_FRACTION, _THETA = ("rotary_pct", fields.FRACTION), ("rotary_emb_base", fields.THETA)
_DEFAULT_FRACTION, _DEFAULT_THETA = 0.25, 10000.0
# Buffers older exports keep beside the weights; the model computes them.
BUFFERS = ("attention.rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def model_section(hf: dict) -> ml_collections.ConfigDict:
  """Our `config.model` for a GPT-NeoX config.json (a dict, of either rotary layout: lra_core/hf/fields.py);
  one sentence for what we cannot express."""
  hf = fields.check_object(hf, f"a {NAME} config.json")
  act = fields.word(hf, ("hidden_act",), "gelu", _ACTIVATIONS, NAME)
  if fields.flag(hf, "tie_word_embeddings", False, NAME):
    raise ConfigError("GPT-NeoX with tie_word_embeddings is not supported (Pythia's output matrix is its own).")
  if not fields.flag(hf, "attention_bias", True, NAME):
    raise ConfigError("GPT-NeoX with attention_bias false is not supported (every Pythia projection has a bias).")
  whole = lambda key, default=None: fields.number(hf, key, default, NAME, int)
  d, heads = whole("hidden_size"), whole("num_attention_heads")
  if heads <= 0 or d % heads:
    raise ConfigError(f"GPT-NeoX hidden_size {d} is not a multiple of num_attention_heads {heads}.")
  fraction, theta, scaling = fields.rotary(
    hf, NAME, fraction_keys=_FRACTION, theta_keys=_THETA, fraction=_DEFAULT_FRACTION, theta=_DEFAULT_THETA
  )
  m = transformer.model_config("transformer")
  m.update(
    vocab_size=whole("vocab_size"),
    d_model=d,
    num_layers=whole("num_hidden_layers"),
    num_heads=heads,
    d_ff=whole("intermediate_size"),
    max_len=whole("max_position_embeddings", 2048),
    position="none",
    rope=True,
    rope_fraction=fraction,
    rope_max_wavelength=theta,
    mlp="mlp",
    activation=_ACTIVATIONS[act],
    norm="layer",
    norm_eps=fields.number(hf, "layer_norm_eps", 1e-5, NAME),
    parallel_residual=fields.flag(hf, "use_parallel_residual", True, NAME),
    tie_embeddings=False,
    embedding="plain",
    use_bias=True,
  )
  m.rope_scaling.update(scaling)
  return m


def to_params(tensors: dict[str, np.ndarray], m) -> dict[tuple[str, ...], np.ndarray]:
  """Our parameters {path: array} from a GPT-NeoX checkpoint's tensors {name: array}, each of the shape
  `m` implies (else one sentence naming it)."""
  heads, width, d, f, v = m.num_heads, head_width(m), m.d_model, m.d_ff, m.vocab_size
  take = lambda name, *shape: fields.tensor(tensors, name, shape)
  linear = {"attention.dense": (d, heads * width), "mlp.dense_h_to_4h": (f, d), "mlp.dense_4h_to_h": (d, f)}
  out = {("embed", "embedding"): take("gpt_neox.embed_in.weight", v, d)}
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, path in _NORMS.items():
      out[(*ours, *path, "scale")] = take(f"{at}{name}.weight", d)
      out[(*ours, *path, "bias")] = take(f"{at}{name}.bias", d)
    qkv = take(f"{at}attention.query_key_value.weight", 3 * heads * width, d).reshape(heads, 3, width, d)
    qkv_bias = take(f"{at}attention.query_key_value.bias", 3 * heads * width).reshape(heads, 3, width)
    for j, name in enumerate(_QKV):
      out[(*ours, "attn", name, "kernel")] = qkv[:, j].transpose(2, 0, 1)  # [D, H, head_dim]
      out[(*ours, "attn", name, "bias")] = qkv_bias[:, j]
    for name, path in _LINEAR.items():
      out[(*ours, *path, "kernel")] = take(f"{at}{name}.weight", *linear[name]).T  # [in, out]; heads split below
      out[(*ours, *path, "bias")] = take(f"{at}{name}.bias", linear[name][0])
    out[(*ours, "attn", "out", "kernel")] = out[(*ours, "attn", "out", "kernel")].reshape(heads, width, d)
  out[("final_norm", "scale")] = take("gpt_neox.final_layer_norm.weight", d)
  out[("final_norm", "bias")] = take("gpt_neox.final_layer_norm.bias", d)
  out[("head", "out", "kernel")] = take("embed_out.weight", v, d).T
  return out


def to_tensors(params: dict[tuple[str, ...], np.ndarray], m) -> dict[str, np.ndarray]:
  """The GPT-NeoX tensors {name: array} of our parameters {path: array}: `to_params` inverted."""
  out = {"gpt_neox.embed_in.weight": params[("embed", "embedding")]}
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, path in _NORMS.items():
      out[f"{at}{name}.weight"] = params[(*ours, *path, "scale")]
      out[f"{at}{name}.bias"] = params[(*ours, *path, "bias")]
    kernels = [params[(*ours, "attn", name, "kernel")].transpose(1, 2, 0) for name in _QKV]  # [H, head_dim, D]
    out[f"{at}attention.query_key_value.weight"] = np.stack(kernels, axis=1).reshape(-1, m.d_model)
    biases = [params[(*ours, "attn", name, "bias")] for name in _QKV]
    out[f"{at}attention.query_key_value.bias"] = np.stack(biases, axis=1).reshape(-1)
    for name, path in _LINEAR.items():
      kernel = params[(*ours, *path, "kernel")]
      out[f"{at}{name}.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
      out[f"{at}{name}.bias"] = params[(*ours, *path, "bias")]
  out["gpt_neox.final_layer_norm.weight"] = params[("final_norm", "scale")]
  out["gpt_neox.final_layer_norm.bias"] = params[("final_norm", "bias")]
  out["embed_out.weight"] = params[("head", "out", "kernel")].T
  return out


def config_json(m, layout: str | None = None, seq_len: int = 0) -> dict:
  """A GPT-NeoX config.json for our `config.model` (the settings `model_section` reads, which reads it
  back), its rotary settings in `layout` ("v5" or "v4"; None: the one the installed transformers
  reads). A norm_eps of 0 is written as the epsilon the model uses, a max_len of 0 as `seq_len`."""
  layout = fields.layout_of(layout)
  length = fields.max_len(m, seq_len)
  act = fields.written_activation(m, _ACTIVATIONS, NAME)
  rotary = fields.rotary_json(
    m, layout, fraction_key=_FRACTION[0], theta_key=_THETA[0], with_fraction=True, length=length
  )
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "gpt_neox",
    "vocab_size": m.vocab_size,
    "hidden_size": m.d_model,
    "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads,
    "intermediate_size": m.d_ff,
    "max_position_embeddings": length,
    **rotary,
    "hidden_act": act,
    "layer_norm_eps": fields.norm_eps(m),
    "use_parallel_residual": m.parallel_residual,
    "tie_word_embeddings": False,
    "attention_bias": True,
  }
