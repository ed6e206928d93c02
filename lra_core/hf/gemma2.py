"""Gemma 2 in the transformer family: its config.json as our `config.model`, its tensors as our
parameters, and back.

The architecture, as the transformer family states it: a token table read as is (`embedding="plain"`)
whose lookups are multiplied by sqrt(hidden_size) (`embed_normaliser`) and whose transpose gives the
logits unscaled (`tie_embeddings`, `tied_scale=False`); rotary embedding on whole heads (or the
`partial_rotary_factor` a config.json gives) scaled as its `rope_scaling` says (`model.rope_scaling`);
RMSNorm with the gain stored as its offset from 1 (`norm="rms_offset"`) before and after each branch
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
from lra_core.hf import fields
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width

ARCHITECTURE, NAME = "Gemma2ForCausalLM", "Gemma 2"
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
  """Our `config.model` for a Gemma 2 config.json (a dict, of either rotary layout: lra_core/hf/fields.py);
  one sentence for what we cannot express."""
  hf = fields.check_object(hf, f"a {NAME} config.json")
  act = fields.word(hf, ("hidden_activation", "hidden_act"), "gelu_pytorch_tanh", _ACTIVATIONS, NAME)
  if fields.flag(hf, "attention_bias", False, NAME):
    raise ConfigError("Gemma 2 with attention_bias true is not supported (Gemma's projections have no bias).")
  if not fields.flag(hf, "tie_word_embeddings", True, NAME):
    raise ConfigError("Gemma 2 without tie_word_embeddings is not supported (its output reads the token table).")
  whole = lambda key, default=None: fields.number(hf, key, default, NAME, int)
  real = lambda key, default: fields.number(hf, key, default, NAME)
  layers = whole("num_hidden_layers")
  # Layer 0 slides, layer 1 reads everything, and so on (the layer_types newer configs list).
  expected = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
  if hf.get("layer_types", expected) != expected:
    raise ConfigError(
      f"Gemma 2 layer_types {hf['layer_types']!r} is not the alternation {SLIDING}, {FULL}, ... this mapping reads."
    )
  heads = whole("num_attention_heads")
  fraction, theta, scaling = fields.rotary(
    hf, NAME, fraction_keys=(fields.FRACTION,), theta_keys=(fields.THETA,), fraction=1.0, theta=10000.0
  )
  m = transformer.model_config("transformer")
  m.update(
    vocab_size=whole("vocab_size"),
    d_model=whole("hidden_size"),
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=whole("num_key_value_heads", heads),
    head_dim=whole("head_dim", 256),
    d_ff=whole("intermediate_size"),
    max_len=whole("max_position_embeddings", 8192),
    position="none",
    rope=True,
    rope_fraction=fraction,
    rope_max_wavelength=theta,
    mlp="glu",
    activation=_ACTIVATIONS[act],
    norm="rms_offset",
    norm_eps=real("rms_norm_eps", 1e-6),
    parallel_residual=False,
    post_norms=True,
    attn_soft_cap=real("attn_logit_softcapping", 0.0),
    logit_soft_cap=real("final_logit_softcapping", 0.0),
    score_scale_dim=whole("query_pre_attn_scalar", 256),
    window=whole("sliding_window", 4096) or 4096,
    global_every=2,
    embed_normaliser=True,
    tie_embeddings=True,
    tied_scale=False,
    embedding="plain",
    use_bias=False,
    scan_layers=False,  # the layers alternate windows: one scanned layer cannot hold both
  )
  m.rope_scaling.update(scaling)
  return m


def _shapes(m) -> dict[str, tuple[int, int]]:
  """The [out, in] shape of each of a layer's linear maps (_LINEAR's names) Hugging Face stores."""
  d, f, width = m.d_model, m.d_ff, head_width(m)
  q, kv = m.num_heads * width, (m.num_kv_heads or m.num_heads) * width
  attention = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d)}
  mlp = {"mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
  return {**attention, "self_attn.o_proj": (d, q), **mlp}


def _shape(kernel: np.ndarray, heads_axis: str | None, m) -> np.ndarray:
  """An [in, out] kernel with its heads as an axis of their own (a projection's out, the output's in)."""
  width = head_width(m)
  if heads_axis == "in":
    return kernel.reshape(kernel.shape[0], -1, width)
  if heads_axis == "out":
    return kernel.reshape(-1, width, kernel.shape[-1])
  return kernel


def to_params(tensors: dict[str, np.ndarray], m) -> dict[tuple[str, ...], np.ndarray]:
  """Our parameters {path: array} from a Gemma 2 checkpoint's tensors {name: array}, each of the shape
  `m` implies (else one sentence naming it)."""
  d, v = m.d_model, m.vocab_size
  take = lambda name, *shape: fields.tensor(tensors, name, shape)
  out = {("embed", "embedding"): take("model.embed_tokens.weight", v, d)}
  shapes = _shapes(m)
  for i in range(m.num_layers):
    at, ours = _LAYER.format(i=i), ("blocks", str(i))
    for name, norm in _NORMS.items():
      out[(*ours, norm, "scale")] = take(f"{at}{name}.weight", d)
    for name, (path, heads_axis) in _LINEAR.items():
      out[(*ours, *path, "kernel")] = _shape(take(f"{at}{name}.weight", *shapes[name]).T, heads_axis, m)
  out[("final_norm", "scale")] = take("model.norm.weight", d)
  # Some exports write the tied matrix out as well: it must be the table (reading it accounts for it).
  if "lm_head.weight" in tensors and not np.array_equal(take("lm_head.weight", v, d), out[("embed", "embedding")]):
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


def config_json(m, layout: str | None = None, seq_len: int = 0) -> dict:
  """A Gemma 2 config.json for our `config.model` (the settings `model_section` reads, which reads it
  back), its rotary settings in `layout` ("v5" or "v4"; None: the one the installed transformers
  reads). A norm_eps of 0 is written as the epsilon the model uses, a max_len of 0 as `seq_len`."""
  layout = fields.layout_of(layout)
  length = fields.max_len(m, seq_len)
  act = fields.written_activation(m, _ACTIVATIONS, NAME)
  # Gemma 2 rotates whole heads: a fraction is written only where it is not 1
  rotary = fields.rotary_json(
    m,
    layout,
    fraction_key=fields.FRACTION,
    theta_key=fields.THETA,
    with_fraction=m.rope_fraction != 1.0,
    length=length,
  )
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
    "max_position_embeddings": length,
    "rms_norm_eps": fields.norm_eps(m),
    **rotary,
    "attention_bias": False,
    "query_pre_attn_scalar": m.score_scale_dim,
    "sliding_window": m.window,
    "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(m.num_layers)],
    "attn_logit_softcapping": m.attn_soft_cap or None,
    "final_logit_softcapping": m.logit_soft_cap or None,
    "tie_word_embeddings": True,
  }
