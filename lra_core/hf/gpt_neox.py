"""GPT-NeoX (Pythia) in the transformer family: its config.json as our `config.model`, its tensors as
our parameters, and back.

The architecture, as the transformer family states it: a learned token table read as is
(`embedding="plain"`), no absolute positions, rotary embedding on the first `rotary_pct` of each head
(GPT-NeoX's half-split pairs, `rope_fraction`), LayerNorm with biases (eps `layer_norm_eps`),
attention and MLP side by side on the block input (`parallel_residual`), biases on every projection,
an exact-erf GELU MLP, a final LayerNorm and an untied output matrix without bias.

Hugging Face stores a linear map as [out, in]; ours keep [in, out] with the heads as axes of their
own. The fused query-key-value matrix holds, per head, its query, key and value rows one after another
([H, 3, head_dim, D] when reshaped).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from lra_core.errors import ConfigError
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width

ARCHITECTURE = "GPTNeoXForCausalLM"
_LAYER = "gpt_neox.layers.{i}."
# HF's per-layer norm and linear names, and ours
_NORMS = {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("mlp_norm",)}
_LINEAR = {"attention.dense": ("attn", "out"), "mlp.dense_h_to_4h": ("mlp", "up"), "mlp.dense_4h_to_h": ("mlp", "down")}
_QKV = ("query", "key", "value")
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# Buffers older exports keep beside the weights; the model computes them.
BUFFERS = ("attention.rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def model_section(hf: dict) -> ml_collections.ConfigDict:
  """Our `config.model` for a GPT-NeoX config.json (a dict); one sentence for what we cannot express."""
  act = hf.get("hidden_act", "gelu")
  if act not in _ACTIVATIONS:
    raise ConfigError(f"GPT-NeoX hidden_act {act!r} is not one of {sorted(_ACTIVATIONS)}.")
  if hf.get("rope_scaling"):
    raise ConfigError(f"GPT-NeoX rope_scaling {hf['rope_scaling']!r} is not supported; only plain rotary embedding.")
  if hf.get("tie_word_embeddings", False):
    raise ConfigError("GPT-NeoX with tie_word_embeddings is not supported (Pythia's output matrix is its own).")
  if not hf.get("attention_bias", True):
    raise ConfigError("GPT-NeoX with attention_bias false is not supported (every Pythia projection has a bias).")
  d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  if d % heads:
    raise ConfigError(f"GPT-NeoX hidden_size {d} is not a multiple of num_attention_heads {heads}.")
  m = transformer.model_config("transformer")
  m.update(
    vocab_size=int(hf["vocab_size"]),
    d_model=d,
    num_layers=int(hf["num_hidden_layers"]),
    num_heads=heads,
    d_ff=int(hf["intermediate_size"]),
    max_len=int(hf.get("max_position_embeddings", 2048)),
    position="none",
    rope=True,
    rope_fraction=float(hf.get("rotary_pct", 0.25)),
    rope_max_wavelength=float(hf.get("rotary_emb_base", 10000)),
    mlp="mlp",
    activation=_ACTIVATIONS[act],
    norm="layer",
    norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
    parallel_residual=bool(hf.get("use_parallel_residual", True)),
    tie_embeddings=False,
    embedding="plain",
    use_bias=True,
  )
  return m


def to_params(tensors: dict[str, np.ndarray], m) -> dict[tuple[str, ...], np.ndarray]:
  """Our parameters {path: array} from a GPT-NeoX checkpoint's tensors {name: array}."""
  heads, width = m.num_heads, head_width(m)
  out = {("embed", "embedding"): tensors["gpt_neox.embed_in.weight"]}
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, path in _NORMS.items():
      out[(*ours, *path, "scale")] = tensors[f"{at}{name}.weight"]
      out[(*ours, *path, "bias")] = tensors[f"{at}{name}.bias"]
    qkv = tensors[f"{at}attention.query_key_value.weight"].reshape(heads, 3, width, m.d_model)
    qkv_bias = tensors[f"{at}attention.query_key_value.bias"].reshape(heads, 3, width)
    for j, name in enumerate(_QKV):
      out[(*ours, "attn", name, "kernel")] = qkv[:, j].transpose(2, 0, 1)  # [D, H, head_dim]
      out[(*ours, "attn", name, "bias")] = qkv_bias[:, j]
    for name, path in _LINEAR.items():
      out[(*ours, *path, "kernel")] = tensors[f"{at}{name}.weight"].T  # [in, out]; the heads split below
      out[(*ours, *path, "bias")] = tensors[f"{at}{name}.bias"]
    out[(*ours, "attn", "out", "kernel")] = out[(*ours, "attn", "out", "kernel")].reshape(heads, width, m.d_model)
  out[("final_norm", "scale")] = tensors["gpt_neox.final_layer_norm.weight"]
  out[("final_norm", "bias")] = tensors["gpt_neox.final_layer_norm.bias"]
  out[("head", "out", "kernel")] = tensors["embed_out.weight"].T
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


def config_json(m) -> dict:
  """A GPT-NeoX config.json for our `config.model` (the settings `model_section` reads)."""
  act = {ours: theirs for theirs, ours in reversed(_ACTIVATIONS.items())}[m.activation]
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "gpt_neox",
    "vocab_size": m.vocab_size,
    "hidden_size": m.d_model,
    "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads,
    "intermediate_size": m.d_ff,
    "max_position_embeddings": m.max_len,
    "rotary_pct": m.rope_fraction,
    "rotary_emb_base": m.rope_max_wavelength,
    "hidden_act": act,
    "layer_norm_eps": m.norm_eps,
    "use_parallel_residual": m.parallel_residual,
    "tie_word_embeddings": False,
    "attention_bias": True,
  }
