"""lra_core/hf: a Hugging Face GPT-NeoX (Pythia) folder read into the transformer family gives the
logits of an independent numpy forward written from the architecture's definition (GPT-NeoX's fused
per-head query-key-value rows, half-split partial rotary embedding, parallel residual, exact GELU,
LayerNorm eps 1e-5, untied output); written back, the folder holds the same tensors bit for bit; bad
folders are one sentence."""

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

import lra_core
from lra_core import hf, layout
from lra_core.checkpoints.init_from import warm_start
from lra_core.errors import CheckpointError, ConfigError
from lra_core.hf import safetensors
from lra_core.models import block_transformer as bt
from lra_core.run import optim
from lra_core.run.state import make_state_spec

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
  with pytest.raises(
    CheckpointError, match=r"parameter embed.embedding has shape \[96, 32\] in the model and \[96, 40\]"
  ):
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
