"""Gemma 2 in the transformer family: its config.json as our `config.model`, its tensors as our
parameters, and back.

The architecture, as the transformer family states it: a token table read as is (`embedding="plain"`)
whose lookups are multiplied by sqrt(hidden_size) (`embed_normaliser`) and whose transpose gives the
logits unscaled (`tie_embeddings`, `tied_scale=False`); rotary embedding on whole heads; RMSNorm with
the gain stored as its offset from 1 (`norm="rms_offset"`) before and after each branch
(`post_norms`); grouped-query attention with its own head width (`head_dim`), scores scaled by
query_pre_attn_scalar^-1/2 (`score_scale_dim`) and soft-capped (`attn_soft_cap`), a sliding window on
every other layer starting with the first (`window`, `global_every=2`); a GeGLU MLP (tanh GELU); the
final logits soft-capped (`logit_soft_cap`). No biases.

Hugging Face stores a linear map as [out, in]; ours keep [in, out] with the heads as axes of their
own. Its MLP activates gate_proj and multiplies by up_proj; ours activates `up` and multiplies by
`gate`, so gate_proj is our `up` and up_proj our `gate`.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from lra_core.errors import CheckpointError, ConfigError
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width

ARCHITECTURE = "Gemma2ForCausalLM"
_LAYER = "model.layers.{i}."
_NORMS = {
  "input_layernorm": "attn_norm",
  "post_attention_layernorm": "attn_post_norm",
  "pre_feedforward_layernorm": "mlp_norm",
  "post_feedforward_layernorm": "mlp_post_norm",
}
# HF name: (our path, heads axis of ours: "in" a head projection [D,H,hd], "out" the output [H,hd,D], None)
_LINEAR = {
  "self_attn.q_proj": (("attn", "query"), "in"),
  "self_attn.k_proj": (("attn", "key"), "in"),
  "self_attn.v_proj": (("attn", "value"), "in"),
  "self_attn.o_proj": (("attn", "out"), "out"),
  "mlp.gate_proj": (("mlp", "up"), None),
  "mlp.up_proj": (("mlp", "gate"), None),
  "mlp.down_proj": (("mlp", "down"), None),
}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
SLIDING, FULL = "sliding_attention", "full_attention"
BUFFERS = ("self_attn.rotary_emb.inv_freq",)


def describes(m) -> bool:
  """Whether our `config.model` is one this module writes (Gemma 2's settings), not GPT-NeoX's."""
  return m.norm == "rms_offset" and m.post_norms


def model_section(hf: dict) -> ml_collections.ConfigDict:
  """Our `config.model` for a Gemma 2 config.json (a dict); one sentence for what we cannot express."""
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in _ACTIVATIONS:
    raise ConfigError(f"Gemma 2 hidden_activation {act!r} is not one of {sorted(_ACTIVATIONS)}.")
  if hf.get("rope_scaling"):
    raise ConfigError(f"Gemma 2 rope_scaling {hf['rope_scaling']!r} is not supported; only plain rotary embedding.")
  if hf.get("attention_bias", False):
    raise ConfigError("Gemma 2 with attention_bias true is not supported (Gemma's projections have no bias).")
  if not hf.get("tie_word_embeddings", True):
    raise ConfigError("Gemma 2 without tie_word_embeddings is not supported (its output reads the token table).")
  layers = int(hf["num_hidden_layers"])
  # Layer 0 slides, layer 1 reads everything, and so on (the layer_types newer configs list).
  expected = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
  if hf.get("layer_types", expected) != expected:
    raise ConfigError(
      f"Gemma 2 layer_types {hf['layer_types']!r} is not the alternation {SLIDING}, {FULL}, ... this mapping reads."
    )
  heads = int(hf["num_attention_heads"])
  m = transformer.model_config("transformer")
  m.update(
    vocab_size=int(hf["vocab_size"]),
    d_model=int(hf["hidden_size"]),
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=int(hf.get("num_key_value_heads", heads)),
    head_dim=int(hf.get("head_dim", 256)),
    d_ff=int(hf["intermediate_size"]),
    max_len=int(hf.get("max_position_embeddings", 8192)),
    position="none",
    rope=True,
    rope_fraction=1.0,
    rope_max_wavelength=float(hf.get("rope_theta", 10000.0)),
    mlp="glu",
    activation=_ACTIVATIONS[act],
    norm="rms_offset",
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    parallel_residual=False,
    post_norms=True,
    attn_soft_cap=float(hf.get("attn_logit_softcapping") or 0.0),
    logit_soft_cap=float(hf.get("final_logit_softcapping") or 0.0),
    score_scale_dim=int(hf.get("query_pre_attn_scalar", 256)),
    window=int(hf.get("sliding_window") or 4096),
    global_every=2,
    embed_normaliser=True,
    tie_embeddings=True,
    tied_scale=False,
    embedding="plain",
    use_bias=False,
    scan_layers=False,  # the layers alternate windows: one scanned layer cannot hold both
  )
  return m


def _shape(kernel: np.ndarray, heads_axis: str | None, m) -> np.ndarray:
  """An [in, out] kernel with its heads as an axis of their own (a projection's out, the output's in)."""
  width = head_width(m)
  if heads_axis == "in":
    return kernel.reshape(kernel.shape[0], -1, width)
  if heads_axis == "out":
    return kernel.reshape(-1, width, kernel.shape[-1])
  return kernel


def to_params(tensors: dict[str, np.ndarray], m) -> dict[tuple[str, ...], np.ndarray]:
  """Our parameters {path: array} from a Gemma 2 checkpoint's tensors {name: array}."""
  out = {("embed", "embedding"): tensors["model.embed_tokens.weight"]}
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, norm in _NORMS.items():
      out[(*ours, norm, "scale")] = tensors[f"{at}{name}.weight"]
    for name, (path, heads_axis) in _LINEAR.items():
      out[(*ours, *path, "kernel")] = _shape(tensors[f"{at}{name}.weight"].T, heads_axis, m)
  out[("final_norm", "scale")] = tensors["model.norm.weight"]
  # Some exports write the tied matrix out as well: it must be the table (reading it accounts for it).
  if "lm_head.weight" in tensors and not np.array_equal(tensors["lm_head.weight"], out[("embed", "embedding")]):
    raise CheckpointError("the checkpoint's lm_head.weight differs from its token table, which Gemma 2 ties it to.")
  return out


def to_tensors(params: dict[tuple[str, ...], np.ndarray], m) -> dict[str, np.ndarray]:
  """The Gemma 2 tensors {name: array} of our parameters {path: array}: `to_params` inverted."""
  out = {"model.embed_tokens.weight": params[("embed", "embedding")]}
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, norm in _NORMS.items():
      out[f"{at}{name}.weight"] = params[(*ours, norm, "scale")]
    for name, (path, heads_axis) in _LINEAR.items():
      kernel = params[(*ours, *path, "kernel")]
      flat = kernel.reshape(-1, kernel.shape[-1]) if heads_axis == "out" else kernel.reshape(kernel.shape[0], -1)
      out[f"{at}{name}.weight"] = flat.T
  out["model.norm.weight"] = params[("final_norm", "scale")]
  return out


def config_json(m) -> dict:
  """A Gemma 2 config.json for our `config.model` (the settings `model_section` reads)."""
  act = {ours: theirs for theirs, ours in reversed(_ACTIVATIONS.items())}[m.activation]
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "gemma2",
    "vocab_size": m.vocab_size,
    "hidden_size": m.d_model,
    "intermediate_size": m.d_ff,
    "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads,
    "num_key_value_heads": m.num_kv_heads or m.num_heads,
    "head_dim": head_width(m),
    "hidden_activation": act,
    "max_position_embeddings": m.max_len,
    "rms_norm_eps": m.norm_eps,
    "rope_theta": m.rope_max_wavelength,
    "attention_bias": False,
    "query_pre_attn_scalar": m.score_scale_dim,
    "sliding_window": m.window,
    "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(m.num_layers)],
    "attn_logit_softcapping": m.attn_soft_cap or None,
    "final_logit_softcapping": m.logit_soft_cap or None,
    "tie_word_embeddings": True,
  }
