"""lra_core/hf: a Hugging Face GPT-NeoX (Pythia) folder read into the transformer family gives the
logits of an independent numpy forward written from the architecture's definition (GPT-NeoX's fused
per-head query-key-value rows, half-split partial rotary embedding, parallel residual, exact GELU,
LayerNorm eps 1e-5, untied output); written back, the folder holds the same tensors bit for bit; bad
folders are one sentence."""

import importlib.metadata
import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx, traverse_util
from test_train import own_lines, run_cli

import lra_core
from lra_core import hf, layout
from lra_core.checkpoints.init_from import warm_start
from lra_core.errors import CheckpointError, ConfigError
from lra_core.hf import fields, safetensors
from lra_core.models import block_transformer as bt
from lra_core.models import transformer
from lra_core.protocol import RunInfo
from lra_core.run import optim
from lra_core.run.state import make_state_spec
from lra_core.runtime.exit_codes import EXIT_USER_ERROR

CONFIG = {
  "architectures": ["GPTNeoXForCausalLM"],
  "model_type": "gpt_neox",
  "vocab_size": 96,
  "hidden_size": 32,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "intermediate_size": 80,
  "max_position_embeddings": 64,
  "rotary_pct": 0.25,
  "rotary_emb_base": 10000,
  "hidden_act": "gelu",
  "layer_norm_eps": 1e-5,
  "use_parallel_residual": True,
  "tie_word_embeddings": False,
}


def random_tensors(c, seed=0):
  """A GPT-NeoX checkpoint's tensors under Hugging Face's names, random (norms too, so that a swapped
  scale and bias shows)."""
  rng = np.random.default_rng(seed)
  d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  w = lambda *shape: rng.normal(scale=0.3, size=shape).astype(np.float32)
  out = {"gpt_neox.embed_in.weight": w(v, d), "embed_out.weight": w(v, d)}
  out["gpt_neox.final_layer_norm.weight"], out["gpt_neox.final_layer_norm.bias"] = 1 + w(d), w(d)
  for i in range(c["num_hidden_layers"]):
    at = f"gpt_neox.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[f"{at}{norm}.weight"], out[f"{at}{norm}.bias"] = 1 + w(d), w(d)
    out[f"{at}attention.query_key_value.weight"], out[f"{at}attention.query_key_value.bias"] = w(3 * d, d), w(3 * d)
    out[f"{at}attention.dense.weight"], out[f"{at}attention.dense.bias"] = w(d, d), w(d)
    out[f"{at}mlp.dense_h_to_4h.weight"], out[f"{at}mlp.dense_h_to_4h.bias"] = w(f, d), w(f)
    out[f"{at}mlp.dense_4h_to_h.weight"], out[f"{at}mlp.dense_4h_to_h.bias"] = w(d, f), w(d)
  return out


def save(folder, config, tensors):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config))
  safetensors.write(folder / "model.safetensors", tensors)
  return folder


# -- the oracle: GPT-NeoX in numpy, float64, from its definition -------------------------------------------


def layer_norm(x, w, b, eps):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gelu(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def rotary(x, c):
  """x [T,H,hd]: the first rotary_pct of each head rotated; pairs (j, j + rot/2), angle t / base^(2j/rot)."""
  t, hd = x.shape[0], x.shape[-1]
  rot = int(hd * c["rotary_pct"])
  inv = 1.0 / c["rotary_emb_base"] ** (np.arange(0, rot, 2) / rot)
  angle = np.arange(t)[:, None] * inv[None]  # [T, rot/2]
  cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None]
  sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None]
  part, rest = x[..., :rot], x[..., rot:]
  half = rot // 2
  rotate_half = np.concatenate([-part[..., half:], part[..., :half]], -1)
  return np.concatenate([part * cos + rotate_half * sin, rest], -1)


def neox_logits(tensors, c, ids):
  """Logits [T,V] of one sequence of token ids."""
  g = lambda name: tensors[name].astype(np.float64)
  d, h = c["hidden_size"], c["num_attention_heads"]
  hd, t, eps = d // h, len(ids), c["layer_norm_eps"]
  x = g("gpt_neox.embed_in.weight")[ids]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(c["num_hidden_layers"]):
    at = f"gpt_neox.layers.{i}."
    a = layer_norm(x, g(f"{at}input_layernorm.weight"), g(f"{at}input_layernorm.bias"), eps)
    qkv = (a @ g(f"{at}attention.query_key_value.weight").T + g(f"{at}attention.query_key_value.bias")).reshape(
      t, h, 3 * hd
    )
    q, k, v = rotary(qkv[..., :hd], c), rotary(qkv[..., hd : 2 * hd], c), qkv[..., 2 * hd :]
    scores = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hij,jhd->ihd", p, v).reshape(t, d) @ g(f"{at}attention.dense.weight").T
    attn = attn + g(f"{at}attention.dense.bias")
    m = layer_norm(x, g(f"{at}post_attention_layernorm.weight"), g(f"{at}post_attention_layernorm.bias"), eps)
    mlp = gelu(m @ g(f"{at}mlp.dense_h_to_4h.weight").T + g(f"{at}mlp.dense_h_to_4h.bias"))
    mlp = mlp @ g(f"{at}mlp.dense_4h_to_h.weight").T + g(f"{at}mlp.dense_4h_to_h.bias")
    x = x + attn + mlp  # use_parallel_residual
  x = layer_norm(x, g("gpt_neox.final_layer_norm.weight"), g("gpt_neox.final_layer_norm.bias"), eps)
  return x @ g("embed_out.weight").T


# -- the tests ---------------------------------------------------------------------------------------------------


def test_a_pythia_folder_gives_the_reference_logits_over_the_whole_vocabulary(tmp_path):
  """Two sequences, the second right-padded (its padding masked): every logit at three positions of each
  real part equals the numpy forward's, to float32 rounding."""
  tensors = random_tensors(CONFIG)
  section, model = hf.load_model(save(tmp_path / "pythia", CONFIG, tensors))
  assert section.rope_fraction == 0.25 and section.parallel_residual and section.embedding == "plain"
  rng = np.random.default_rng(1)
  ids = rng.integers(0, CONFIG["vocab_size"], size=(2, 12))
  lengths = [12, 7]
  mask = np.arange(12)[None] < np.array(lengths)[:, None]
  ours = np.asarray(model(jnp.asarray(ids, jnp.int32), mask=jnp.asarray(mask)))
  for row, n in enumerate(lengths):
    want = neox_logits(tensors, CONFIG, ids[row, :n])
    for t in (0, n // 2, n - 1):
      np.testing.assert_allclose(ours[row, t], want[t], rtol=2e-4, atol=2e-4)


def test_written_back_the_folder_holds_the_same_tensors_bit_for_bit(tmp_path):
  tensors = random_tensors(CONFIG, seed=3)
  section, model = hf.load_model(save(tmp_path / "in", CONFIG, tensors))
  hf.save_folder(tmp_path / "out", section, model)
  back, again = hf.read_folder(tmp_path / "out")
  assert sorted(again) == sorted(tensors)
  for name, value in tensors.items():
    assert again[name].dtype == value.dtype and np.array_equal(again[name], value), name
  _, model2 = hf.load_model(tmp_path / "out")
  assert all(np.array_equal(a, b) for a, b in zip(hf.get_params(model).values(), hf.get_params(model2).values()))
  assert {k: back[k] for k in CONFIG if k in back} == {k: CONFIG[k] for k in back if k in CONFIG}


def test_safetensors_round_trip_every_dtype_and_a_damaged_file_is_one_sentence(tmp_path):
  arrays = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([1.5, -2.0], ml_dtypes.bfloat16),
    "c": np.arange(4, dtype=np.int64),
    "d": np.array([True, False]),
  }
  path = tmp_path / "x.safetensors"
  safetensors.write(path, arrays)
  back = safetensors.read(path)
  for name, value in arrays.items():
    assert back[name].dtype == value.dtype and np.array_equal(back[name], value)
  path.write_bytes(path.read_bytes()[:-4])
  with pytest.raises(CheckpointError, match=r"tensor 'c' .* does not fit bytes .* cut short or damaged"):
    safetensors.read(path)
  path.write_bytes(b"\x00" * 3)
  with pytest.raises(CheckpointError, match=r"is not a safetensors file"):
    safetensors.read(path)


def test_what_cannot_be_read_is_one_sentence(tmp_path):
  with pytest.raises(ConfigError, match=r"is not a Hugging Face model folder: it has no config.json"):
    hf.read(tmp_path)
  llama = dict(CONFIG, architectures=["LlamaForCausalLM"])
  with pytest.raises(ConfigError, match=r"architecture 'LlamaForCausalLM' cannot be read; the ones that can"):
    hf.read(save(tmp_path / "llama", llama, random_tensors(CONFIG)))
  tensors = random_tensors(dict(CONFIG, num_hidden_layers=3))
  with pytest.raises(CheckpointError, match=r"holds 12 tensor\(s\) its config.json does not account for"):
    hf.read(save(tmp_path / "deeper", CONFIG, tensors))
  tensors = random_tensors(CONFIG)
  del tensors["embed_out.weight"]
  with pytest.raises(CheckpointError, match=r"lacks tensor 'embed_out.weight'"):
    hf.read(save(tmp_path / "headless", CONFIG, tensors))
  wide = random_tensors(CONFIG)
  wide["gpt_neox.embed_in.weight"] = np.zeros((96, 40), np.float32)
  with pytest.raises(CheckpointError, match=r"'gpt_neox.embed_in.weight' has shape \[96, 40\], not the \[96, 32\]"):
    hf.load_model(save(tmp_path / "wide", CONFIG, wide))
  with pytest.raises(ConfigError, match=r"hidden_act 'relu' is not one of"):
    hf.read(save(tmp_path / "relu", dict(CONFIG, hidden_act="relu"), random_tensors(CONFIG)))


# The tiny config above as our transformer's settings (what train.init_from=hf: asks a run to share)
AS_OURS = [
  "model.vocab_size=96",
  "model.d_model=32",
  "model.num_layers=2",
  "model.num_heads=4",
  "model.d_ff=80",
  "model.position=none",
  "model.rope=True",
  "model.rope_fraction=0.25",
  "model.mlp=mlp",
  "model.activation=gelu",
  "model.norm=layer",
  "model.norm_eps=1e-5",
  "model.parallel_residual=True",
  "model.embedding=plain",
  "model.use_bias=True",
  "model.tie_embeddings=False",
  "train.seq_len=64",
]


@pytest.mark.parametrize("scan", [False, True])
def test_a_run_starts_from_a_folder_s_weights(tmp_path, scan):
  """train.init_from=hf:<folder>: the run's parameters (scanned layers stacked) are the folder's; a
  setting the folder's model does not share is one sentence naming it."""
  tensors = random_tensors(CONFIG, seed=5)
  folder = save(tmp_path / "pythia", CONFIG, tensors)
  config = lra_core.load_config("configs/c4/transformer.py:tiny", [*AS_OURS, f"model.scan_layers={scan}"])
  spec = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0])
  state = warm_start(config, spec, spec.init(), f"hf:{folder}", None)
  _, model = hf.load_model(folder)
  want = hf.get_params(model)
  got = traverse_util.flatten_dict(jax.device_get(state["params"]))
  for key, value in got.items():
    names = tuple(str(k) for k in key)
    if scan:
      expected = (
        np.stack([want[("blocks", str(i), *names[2:])] for i in range(2)]) if names[0] == "blocks" else want[names]
      )
    else:
      expected = want[names]
    np.testing.assert_array_equal(value, expected, err_msg=str(names))
  # A run whose table stores E / sqrt(D) ("scaled") holds the folder's table so: the same lookups.
  scaled = lra_core.load_config("configs/c4/transformer.py:tiny", [*AS_OURS, "model.embedding=scaled"])
  spec = make_state_spec(scaled, layout.make_mesh(scaled.mesh), optim.make_optimizer(scaled)[0])
  table = warm_start(scaled, spec, spec.init(), f"hf:{folder}", None)["params"]["embed"]["embedding"]
  np.testing.assert_allclose(np.asarray(table) * np.sqrt(32), tensors["gpt_neox.embed_in.weight"], rtol=1e-6)
  other = lra_core.load_config("configs/c4/transformer.py:tiny", [*AS_OURS, "model.norm_eps=1e-6"])
  spec = make_state_spec(other, layout.make_mesh(other.mesh), optim.make_optimizer(other)[0])
  with pytest.raises(
    ConfigError, match=r"model.norm_eps is 1e-06 here and 1e-05 in the checkpoint; set --config.model.norm_eps=1e-05"
  ):
    warm_start(other, spec, spec.init(), f"hf:{folder}", None)


def test_a_block_transformer_uptrains_from_a_pythia_folder_by_appendix_n(tmp_path):
  """train.init_from=hf:<Pythia folder> for a Block Transformer: (1) the lower half of the layers
  becomes the block decoder, the upper half the token decoder; (2) the lookup embedder reads the
  Pythia table and its projection averages a block's embeddings; (3) the prefix map copies the
  context embedding into every prefix vector."""
  pythia = dict(CONFIG, vocab_size=258, hidden_size=64, num_hidden_layers=4, intermediate_size=256)
  folder = save(tmp_path / "pythia", pythia, random_tensors(pythia, seed=7))
  config = lra_core.load_config("configs/c4/block_transformer.py:tiny,uptrain", ["train.seq_len=32"])
  m = config.model
  spec = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0])
  params = jax.device_get(warm_start(config, spec, spec.init(), f"hf:{folder}", None)["params"])
  source = hf.source_params(bt.vanilla_config(config), str(folder))
  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  for i in range(m.num_layers):  # (1)
    same(params["block_decoder"]["layers"][i], source["blocks"][i])
  for j in range(2):
    same(params["token_decoder"]["layers"][j], source["blocks"][m.num_layers + j])
  same(params["embedder"]["table"], source["embed"])  # (2)
  average = np.tile(np.eye(64), (m.block_len, 1)) / m.block_len
  np.testing.assert_allclose(params["embedder"]["proj"]["kernel"], average, rtol=1e-6)
  copies = np.broadcast_to(np.eye(64)[:, None, :], (64, m.prefix_len, 64))  # (3)
  np.testing.assert_array_equal(params["context_proj"]["kernel"], copies)
  same(params["head"], source["head"])


# The released Pythia models the Block Transformer uptrains from (Table 2's vanilla 85M and 302M; Figure 18)
PYTHIA = {
  "160m": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12),
  "410m": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24),
}


@pytest.mark.parametrize("pythia, size", [("160m", "85m"), ("410m", "302m")])
def test_the_block_transformer_uptrain_configs_take_the_released_pythia_models(pythia, size):
  """configs/c4/block_transformer.py:<size>,uptrain with train.init_from=hf:<pythia-160m or -410m>:
  the vanilla model it maps from has every setting of the released config.json."""
  released = dict(CONFIG, vocab_size=50304, max_position_embeddings=2048, **PYTHIA[pythia])
  config = lra_core.load_config(f"configs/c4/block_transformer.py:{size},uptrain")
  hf.check_settings(bt.vanilla_config(config), hf.gpt_neox.model_section(released), f"pythia-{pythia}")


# -- the two layouts of the rotary settings (transformers 4 and 5), one-sentence refusals, honest exports ------

# The tiny model with rotary embedding on half of each head at base 500, as transformers 5 writes it: every
# rotary setting in rope_parameters, none at the top level.
V5 = {
  **{k: v for k, v in CONFIG.items() if k not in ("rotary_pct", "rotary_emb_base")},
  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
}
V4 = dict(CONFIG, rotary_pct=0.5, rotary_emb_base=500)  # the same model as transformers 4 writes it
# Each scaling type with every key it reads away from its default
SCALINGS = {
  "none": {},
  "linear": {"factor": 2.0},
  "dynamic": {"factor": 3.0},
  "yarn": {"factor": 4.0, "original_max_len": 16, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.5},
  "llama3": {"factor": 8.0, "original_max_len": 16, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
}
OLD_ROTARY_KEYS = {"rotary_pct", "rotary_emb_base", "rope_theta", "partial_rotary_factor", "rope_scaling"}


def one_sentence(kind, says, read, *args, **kwargs):
  """`read(*args, **kwargs)` raises `kind` with a message matching `says`, on one line."""
  with pytest.raises(kind, match=says) as caught:
    read(*args, **kwargs)
  assert "\n" not in str(caught.value), str(caught.value)


def logits_of(model, ids):
  return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def test_a_transformers_5_folder_reads_as_its_transformers_4_twin(tmp_path):
  """The same model saved the transformers 5 way (rope_parameters) and the 4 way (rotary_pct,
  rotary_emb_base): equal sections, half of each head rotated at base 500 (not the defaults 0.25 and
  10000), equal logits, the numpy forward's; our v5 writer gives back the hand-written config.json."""
  tensors = random_tensors(CONFIG, seed=2)
  new, new_model = hf.load_model(save(tmp_path / "v5", V5, tensors))
  old, old_model = hf.load_model(save(tmp_path / "v4", V4, tensors))
  assert new.to_dict() == old.to_dict()
  assert (new.rope_fraction, new.rope_max_wavelength, new.rope_scaling.type) == (0.5, 500.0, "none")
  ids = np.arange(12)[None] * 7 % 96
  np.testing.assert_array_equal(logits_of(new_model, ids), logits_of(old_model, ids))
  np.testing.assert_allclose(logits_of(new_model, ids)[0], neox_logits(tensors, V4, ids[0]), rtol=2e-4, atol=2e-4)
  written = hf.gpt_neox.config_json(new, "v5")
  assert {k: written[k] for k in V5} == V5 and not OLD_ROTARY_KEYS & set(written)
  assert {k: v for k, v in hf.gpt_neox.config_json(new, "v4").items() if k in V4} == V4


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_both_layouts_write_and_read_back_every_scaling(tmp_path, layout, kind):
  """Written in either layout, with or without each scaling type, a folder reads back to the section and
  the tensors written; a rotary fraction that is no whole number of dimensions stays exact."""
  tensors = random_tensors(CONFIG, seed=4)
  section, model = hf.load_model(save(tmp_path / "in", CONFIG, tensors))
  section.rope_fraction = 0.2  # 1.6 of each head's 8 dimensions
  section.rope_scaling.update(type=kind, **SCALINGS[kind])
  hf.save_folder(tmp_path / "out", section, model, layout=layout)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  if layout == "v5":
    assert not OLD_ROTARY_KEYS & set(written)
    assert written["rope_parameters"]["rope_type"] == ("default" if kind == "none" else kind)
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.2
  else:
    assert "rope_parameters" not in written and written["rotary_pct"] == 0.2
    assert ("rope_scaling" in written) == (kind != "none")
  back, _ = hf.read(tmp_path / "out")
  assert back.to_dict() == section.to_dict()
  _, again = hf.read_folder(tmp_path / "out")
  assert sorted(again) == sorted(tensors)
  assert all(np.array_equal(again[name], value) for name, value in tensors.items())


def test_llama3_s_original_length_is_written_as_the_model_s_where_it_is_left_to_it():
  """transformers refuses llama3 scaling without original_max_position_embeddings: an original_max_len of 0
  (the model's max_len) is written as that length."""
  section = hf.gpt_neox.model_section(CONFIG)
  section.rope_scaling.update(type="llama3", factor=8.0)
  for written_as, at in (("v5", "rope_parameters"), ("v4", "rope_scaling")):
    written = hf.gpt_neox.config_json(section, written_as)[at]
    assert written["original_max_position_embeddings"] == CONFIG["max_position_embeddings"]
    assert written["low_freq_factor"] == 1.0 and written["high_freq_factor"] == 4.0


def test_the_default_layout_is_the_one_the_installed_transformers_reads(monkeypatch):
  def installed(version):
    def read(name):
      if version is None:
        raise importlib.metadata.PackageNotFoundError(name)
      return version

    monkeypatch.setattr(importlib.metadata, "version", read)

  for version, expected in (("4.46.3", "v4"), ("5.0.0", "v5"), ("5.1.0.dev0", "v5"), (None, "v5")):
    installed(version)
    assert fields.default_layout() == expected, version
    written = hf.gpt_neox.config_json(hf.gpt_neox.model_section(CONFIG))
    assert ("rope_parameters" in written) == (expected == "v5"), version


@pytest.mark.parametrize(
  "change, says",
  [
    ({"rope_parameters": {"rope_theta": 500}}, r"gives rope_parameters.rope_theta 500.0 and rotary_emb_base 10000.0"),
    (
      {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_scaling": {"type": "linear", "factor": 4.0}},
      r"gives rope_parameters.factor 2.0 and rope_scaling.factor 4.0: keep one of the two layouts",
    ),
    (
      {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
      r"rope_parameters.rope_type 'default' and rope_scaling.type 'dynamic'",
    ),
    (
      {"rope_parameters": {"rope_type": "longrope"}},
      r"rope_type 'longrope' is not supported; the types read are \['default', 'dynamic', 'linear', 'llama3', 'yarn'\]",
    ),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 0.707}}, r"rope_scaling.mscale 0.707 is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "truncate": False}}, r"rope_parameters.truncate false is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "short_factor": [1.0]}}, r"short_factor \[1.0\] is not supported"),
    ({"rope_parameters": {"rope_theta": "big"}}, r"GPT-NeoX rope_parameters.rope_theta is 'big', not a number"),
    ({"rope_scaling": "linear"}, r"GPT-NeoX rope_scaling is a JSON string, not an object of settings"),
    ({"hidden_size": "32"}, r"GPT-NeoX hidden_size is '32', not a number"),
    ({"num_hidden_layers": 2.5}, r"GPT-NeoX num_hidden_layers is 2.5, not a whole number"),
    ({"use_parallel_residual": "yes"}, r"GPT-NeoX use_parallel_residual is 'yes', not true or false"),
    ({"hidden_act": ["gelu"]}, r"GPT-NeoX hidden_act \['gelu'\] is not one of"),
  ],
)
def test_what_a_config_json_cannot_say_is_one_sentence(tmp_path, change, says):
  one_sentence(ConfigError, says, hf.read, save(tmp_path / "bad", {**CONFIG, **change}, random_tensors(CONFIG)))


def test_a_config_json_that_is_no_object_or_lacks_a_setting_is_one_sentence(tmp_path):
  folder = save(tmp_path / "list", CONFIG, random_tensors(CONFIG))
  (folder / "config.json").write_text("[1, 2]")
  one_sentence(ConfigError, r"config.json is a JSON array, not an object of settings", hf.read, folder)
  for key in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"):
    lacking = {k: v for k, v in CONFIG.items() if k != key}
    folder = save(tmp_path / key, lacking, random_tensors(CONFIG))
    one_sentence(ConfigError, rf"the GPT-NeoX config.json gives no '{key}', which the model needs", hf.read, folder)


@pytest.mark.parametrize(
  "name, shape",
  [
    ("gpt_neox.layers.1.attention.query_key_value.weight", (96, 31)),
    ("gpt_neox.layers.0.attention.query_key_value.weight", (90, 32)),
    ("gpt_neox.layers.0.attention.query_key_value.bias", (95,)),
    ("gpt_neox.layers.1.attention.dense.weight", (32, 30)),
    ("gpt_neox.layers.0.mlp.dense_h_to_4h.weight", (81, 32)),
  ],
)
def test_a_tensor_of_the_wrong_shape_is_one_sentence(tmp_path, name, shape):
  tensors = random_tensors(CONFIG)
  tensors[name] = np.zeros(shape, np.float32)
  says = re.escape(f"tensor '{name}' has shape {list(shape)}, not the [")
  one_sentence(CheckpointError, says, hf.read, save(tmp_path / "bad", CONFIG, tensors))


def test_a_sharded_folder_reads_and_a_broken_index_is_one_sentence(tmp_path):
  tensors = random_tensors(CONFIG, seed=6)
  folder = tmp_path / "sharded"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(V5))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  for shard, held in shards.items():
    safetensors.write(folder / shard, {n: tensors[n] for n in held})
  index = {"metadata": {}, "weight_map": {n: shard for shard, held in shards.items() for n in held}}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))
  _, again = hf.read_folder(folder)
  assert sorted(again) == names and all(np.array_equal(again[n], tensors[n]) for n in names)
  (folder / "model-00002-of-00002.safetensors").unlink()
  one_sentence(CheckpointError, r"names the shard 'model-00002-of-00002.safetensors', which .* lacks", hf.read, folder)
  (folder / "model.safetensors.index.json").write_text("{not json")
  one_sentence(CheckpointError, r"model.safetensors.index.json cannot be read as JSON", hf.read, folder)
  (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
  one_sentence(CheckpointError, r"has no weight_map of tensor names to shard files", hf.read, folder)


def test_an_export_writes_the_epsilon_and_the_length_the_model_uses(tmp_path):
  """configs/c4/block_transformer.py:tiny,vanilla leaves the norms' epsilon and the length to the model
  (norm_eps 0, max_len 0): the folder has the LayerNorm's epsilon and the run's train.seq_len, and its
  table as the lookups read it (the run's stores E / sqrt(D)), so it gives the run's logits. Without a
  length, or with a setting GPT-NeoX cannot hold, nothing is written."""
  config = lra_core.load_config("configs/c4/block_transformer.py:tiny,vanilla")
  section, seq_len = config.model, config.train.seq_len
  assert section.norm_eps == 0 and section.max_len == 0 and section.embedding == "scaled"
  model = transformer.Model(section, RunInfo(task="lm", seq_len=seq_len), rngs=nnx.Rngs(params=0))
  lengthless = r"model.max_len is 0 .* no seq_len was given"
  one_sentence(ConfigError, lengthless, hf.save_folder, tmp_path / "x", section, model)
  rms = lra_core.load_config("configs/c4/block_transformer.py:tiny,vanilla", ["model.norm=rms"]).model
  one_sentence(
    ConfigError,
    r"model.norm 'rms' cannot be written in a GPT-NeoX config.json, which would read 'layer'",
    hf.save_folder,
    tmp_path / "x",
    rms,
    model,
    seq_len=seq_len,
  )
  assert not (tmp_path / "x").exists()
  hf.save_folder(tmp_path / "out", section, model, seq_len=seq_len)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["layer_norm_eps"] == model.final_norm.eps > 0
  assert written["max_position_embeddings"] == seq_len
  back, again = hf.load_model(tmp_path / "out")
  assert back.max_len == seq_len and back.norm_eps == model.final_norm.eps
  ids = np.arange(seq_len)[None] * 5 % section.vocab_size
  np.testing.assert_allclose(logits_of(again, ids), logits_of(model, ids), rtol=1e-4, atol=1e-4)
  # The same weights in a scanned model (its layers stacked, layer first) write the same folder.
  scan = lra_core.load_config("configs/c4/block_transformer.py:tiny,vanilla", ["model.scan_layers=True"]).model
  scanned = transformer.Model(scan, RunInfo(task="lm", seq_len=seq_len), rngs=nnx.Rngs(params=1))
  own = hf.get_params(model)
  stacked = {k: v for k, v in own.items() if k[0] != "blocks"}
  for key in hf.get_params(scanned):
    if key[0] == "blocks":
      stacked[key] = np.stack([own[("blocks", str(i), *key[2:])] for i in range(section.num_layers)])
  hf.set_params(scanned, stacked)
  hf.save_folder(tmp_path / "scanned", scan, scanned, seq_len=seq_len)
  want, got = hf.read_folder(tmp_path / "out")[1], hf.read_folder(tmp_path / "scanned")[1]
  assert sorted(got) == sorted(want) and all(np.array_equal(got[n], want[n]) for n in want)


def test_the_trainer_says_what_is_wrong_with_a_folder_in_one_line(tmp_path):
  """python -m lra_core.train with train.init_from=hf:<folder whose config.json is a list>: the
  sentence and the config-error status, no traceback."""
  folder = save(tmp_path / "bad", CONFIG, random_tensors(CONFIG))
  (folder / "config.json").write_text("[1, 2]")
  proc = run_cli(
    "lra_core.train",
    "--config=configs/c4/transformer.py:tiny",
    f"--config.train.init_from=hf:{folder}",
    f"--workdir={tmp_path / 'run'}",
  )
  assert proc.returncode == EXIT_USER_ERROR and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert re.fullmatch(r"error: .*config.json is a JSON array, not an object of settings\.", own_lines(proc.stderr)[-1])


@pytest.mark.parametrize("layout", ["v5", "v4"])
def test_dynamic_scaling_writes_its_trained_length_where_transformers_reads_it(layout):
  """transformers' dynamic NTK reads max_position_embeddings as the trained length and rescales at each
  call's length: a model trained at 32 that runs at 128 is written as 32, with no original length key."""
  section = hf.gpt_neox.model_section(dict(CONFIG, max_position_embeddings=128))
  section.rope_scaling.update(type="dynamic", factor=3.0, original_max_len=32)
  written = hf.gpt_neox.config_json(section, layout)
  assert written["max_position_embeddings"] == 32
  assert "original_max_position_embeddings" not in json.dumps(written)
  back = hf.gpt_neox.model_section(written)
  assert (back.max_len, back.rope_scaling.type, back.rope_scaling.factor) == (32, "dynamic", 3.0)
