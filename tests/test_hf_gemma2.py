"""lra_core/hf: a Hugging Face Gemma 2 folder read into the transformer family gives the logits of an
independent numpy forward written from the architecture's definition (embedding normaliser, RMSNorm
with 1 + w before and after each branch, grouped-query attention with its own head width, scores
scaled by query_pre_attn_scalar and soft-capped, a sliding window on every other layer, GeGLU, tied and
soft-capped logits); written back, the folder holds the same tensors bit for bit."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import lra_core
import oracles
from lra_core import hf, layout, registry
from lra_core.checkpoints.init_from import warm_start
from lra_core.errors import CheckpointError, ConfigError
from lra_core.hf import safetensors
from lra_core.run import optim
from lra_core.run.state import make_state_spec

# Small enough to test, with every feature biting: the window (4) shorter than the rows (12), two query
# heads per key-value head, a head width (8) that is not hidden_size / heads, a query scale of its own,
# and caps low enough that random weights reach them.
CONFIG = {
  "architectures": ["Gemma2ForCausalLM"],
  "model_type": "gemma2",
  "vocab_size": 96,
  "hidden_size": 24,
  "intermediate_size": 40,
  "num_hidden_layers": 3,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 8,
  "hidden_activation": "gelu_pytorch_tanh",
  "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "attention_bias": False,
  "query_pre_attn_scalar": 12,
  "sliding_window": 4,
  "attn_logit_softcapping": 2.0,
  "final_logit_softcapping": 3.0,
  "tie_word_embeddings": True,
}
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def random_tensors(c, seed=0):
  """A Gemma 2 checkpoint's tensors under Hugging Face's names, random (norm offsets too)."""
  rng = np.random.default_rng(seed)
  d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
  h, kv = c["num_attention_heads"], c["num_key_value_heads"]
  w = lambda *shape: rng.normal(scale=0.3, size=shape).astype(np.float32)
  out = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": w(d)}
  for i in range(c["num_hidden_layers"]):
    at = f"model.layers.{i}."
    out.update({f"{at}{norm}.weight": w(d) for norm in NORMS})
    out[f"{at}self_attn.q_proj.weight"], out[f"{at}self_attn.o_proj.weight"] = w(h * hd, d), w(d, h * hd)
    out[f"{at}self_attn.k_proj.weight"], out[f"{at}self_attn.v_proj.weight"] = w(kv * hd, d), w(kv * hd, d)
    out[f"{at}mlp.gate_proj.weight"], out[f"{at}mlp.up_proj.weight"] = w(f, d), w(f, d)
    out[f"{at}mlp.down_proj.weight"] = w(d, f)
  return out


def save(folder, config, tensors):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config))
  safetensors.write(folder / "model.safetensors", tensors)
  return folder


# -- the oracle: Gemma 2 in numpy, float64, from its definition --------------------------------------------------


def rms_norm(x, w, eps):
  return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * (1 + w)


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def rotary(x, base):
  """x [T,N,hd], every pair (j, j + hd/2) rotated by angle t / base^(2j/hd)."""
  t, hd = x.shape[0], x.shape[-1]
  angle = np.arange(t)[:, None] / base ** (np.arange(0, hd, 2) / hd)[None]
  cos, sin = (np.concatenate([f(angle)] * 2, -1)[:, None] for f in (np.cos, np.sin))
  half = hd // 2
  return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def gemma2_logits(tensors, c, ids):
  """Logits [T,V] of one sequence of token ids."""
  g = lambda name: tensors[name].astype(np.float64)
  d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  t, eps, window = len(ids), c["rms_norm_eps"], c["sliding_window"]
  soft = lambda s, cap: cap * np.tanh(s / cap)
  x = g("model.embed_tokens.weight")[ids] * math.sqrt(d)
  q_pos, k_pos = np.arange(t)[:, None], np.arange(t)[None]
  for i in range(c["num_hidden_layers"]):
    at = f"model.layers.{i}."
    a = rms_norm(x, g(f"{at}input_layernorm.weight"), eps)
    q = rotary((a @ g(f"{at}self_attn.q_proj.weight").T).reshape(t, h, hd), c["rope_theta"])
    k = rotary((a @ g(f"{at}self_attn.k_proj.weight").T).reshape(t, kv, hd), c["rope_theta"])
    v = (a @ g(f"{at}self_attn.v_proj.weight").T).reshape(t, kv, hd)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # query head n reads kv head n // 2
    scores = soft(np.einsum("ihd,jhd->hij", q, k) * c["query_pre_attn_scalar"] ** -0.5, c["attn_logit_softcapping"])
    allowed = k_pos <= q_pos
    if i % 2 == 0:  # the even layers slide: the `window` most recent keys
      allowed &= q_pos - k_pos < window
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hij,jhd->ihd", p, v).reshape(t, h * hd) @ g(f"{at}self_attn.o_proj.weight").T
    x = x + rms_norm(attn, g(f"{at}post_attention_layernorm.weight"), eps)
    m = rms_norm(x, g(f"{at}pre_feedforward_layernorm.weight"), eps)
    m = (gelu_tanh(m @ g(f"{at}mlp.gate_proj.weight").T) * (m @ g(f"{at}mlp.up_proj.weight").T)) @ g(
      f"{at}mlp.down_proj.weight"
    ).T
    x = x + rms_norm(m, g(f"{at}post_feedforward_layernorm.weight"), eps)
  x = rms_norm(x, g("model.norm.weight"), eps)
  return soft(x @ g("model.embed_tokens.weight").T, c["final_logit_softcapping"])


# -- the tests ---------------------------------------------------------------------------------------------------


def test_a_gemma2_folder_gives_the_reference_logits_over_the_whole_vocabulary(tmp_path):
  """Two sequences, the second right-padded (its padding masked): every logit at three positions of each
  real part equals the numpy forward's, to float32 rounding."""
  tensors = random_tensors(CONFIG)
  section, model = hf.load_model(save(tmp_path / "gemma", CONFIG, tensors))
  assert section.window == 4 and section.global_every == 2 and section.norm == "rms_offset"
  rng = np.random.default_rng(1)
  ids = rng.integers(0, CONFIG["vocab_size"], size=(2, 12))
  lengths = [12, 7]
  mask = np.arange(12)[None] < np.array(lengths)[:, None]
  ours = np.asarray(oracles.forward(model, jnp.asarray(ids, jnp.int32), mask=jnp.asarray(mask)))
  for row, n in enumerate(lengths):
    want = gemma2_logits(tensors, CONFIG, ids[row, :n])
    assert np.abs(want).max() > 2.0  # the final cap (3) bites
    for t in (0, n // 2, n - 1):
      np.testing.assert_allclose(ours[row, t], want[t], rtol=2e-4, atol=2e-4)


def test_each_gemma2_feature_changes_the_logits():
  """The oracle is not blind to any of the settings the test above checks: dropping one of them from
  the numpy forward moves the logits."""
  tensors, ids = random_tensors(CONFIG), np.arange(12) % CONFIG["vocab_size"]
  base = gemma2_logits(tensors, CONFIG, ids)
  for key, value in (
    ("sliding_window", 64),
    ("attn_logit_softcapping", 1e6),
    ("final_logit_softcapping", 1e6),
    ("query_pre_attn_scalar", 8),
  ):
    assert np.abs(gemma2_logits(tensors, {**CONFIG, key: value}, ids) - base).max() > 1e-3, key


def test_written_back_the_gemma2_folder_holds_the_same_tensors_bit_for_bit(tmp_path):
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


def test_a_written_out_tied_head_is_read_and_must_be_the_table(tmp_path):
  tensors = random_tensors(CONFIG)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  hf.read(save(tmp_path / "tied", CONFIG, tensors))  # accounted for, no "extra tensor" refusal
  tensors["lm_head.weight"][0, 0] += 1
  with pytest.raises(CheckpointError, match="lm_head.weight differs from its token table"):
    hf.read(save(tmp_path / "untied", CONFIG, tensors))


@pytest.mark.parametrize(
  "change, says",
  [
    ({"layer_types": ["full_attention"] * 3}, "is not the alternation"),
    ({"tie_word_embeddings": False}, "without tie_word_embeddings"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"attention_bias": True}, "attention_bias true"),
  ],
)
def test_what_gemma2_settings_cannot_be_read_is_one_sentence(tmp_path, change, says):
  with pytest.raises(ConfigError, match=says):
    hf.read(save(tmp_path / "bad", {**CONFIG, **change}, random_tensors(CONFIG)))


# -- Gemma 2 -> Latte-Macchiato (Latte, Section 4.5) -------------------------------------------------------------


def macchiato_run(tmp_path, overrides=()):
  """(a Gemma 2 folder of configs/c4/gemma2.py's tiny model, its config.model as read, its parameters,
  the tiny Gemma-Macchiato config, its state spec, its initial params, the params started from the folder)."""
  from configs.c4 import gemma2 as experiment

  folder = save(
    tmp_path / "gemma",
    experiment.GEMMA2_2B | experiment.TINY,
    random_tensors(experiment.GEMMA2_2B | experiment.TINY, seed=11),
  )
  section, theirs = hf.read(folder)
  config = lra_core.load_config("configs/c4/gemma2.py:tiny", list(overrides))
  spec = make_state_spec(config, layout.make_mesh(config.mesh), optim.make_optimizer(config)[0])
  init = spec.init()
  started = warm_start(config, spec, init, f"hf:{folder}", None)
  flat = lambda state: {
    tuple(str(k) for k in key): np.asarray(v) for key, v in traverse_util.flatten_dict(jax.device_get(state)).items()
  }
  return folder, section, theirs, config, flat(init["params"]), flat(started["params"])


@pytest.mark.parametrize("scan", [False, True])
def test_gemma2_to_macchiato_keeps_every_non_attention_weight_bit_for_bit(tmp_path, scan):
  """train.init_from=hf:<Gemma 2 folder> on a Latte-Macchiato run: every weight outside attention is the
  folder's, bit for bit; the window attention's query, key, value and output are the Gemma attention's
  (its 2 key-value heads repeated to the 4 query heads); the latent query and key are the run's own."""
  _, section, theirs, config, init, started = macchiato_run(tmp_path, [f"model.scan_layers={scan}"])
  layers = config.model.num_layers
  layer = lambda path, i: ("blocks", str(i), *path[2:]) if scan else path
  at = lambda path, i: started[path][i] if scan else started[path]
  renamed = {"window_query": ("query", 1), "window_key": ("key", 2), "value": ("value", 2), "out": ("out", 1)}
  seen = set()
  for path in started:
    for i in range(layers) if path[0] == "blocks" else [None]:
      if path[0] == "blocks" and not scan and path[1] != str(i):
        continue
      ours = at(path, i) if path[0] == "blocks" else started[path]
      key = layer(path, i) if path[0] == "blocks" else path
      if key[2:3] == ("attn",) and key[3] in ("query", "key"):  # Latte's own: as the run initialised it
        np.testing.assert_array_equal(ours, init[path][i] if scan else init[path])
        seen.add("latent")
      elif key[2:3] == ("attn",):
        name, repeat = renamed[key[3]]
        want = (
          np.repeat(theirs[(*key[:3], name, *key[4:])], repeat, axis=1)
          if repeat > 1
          else theirs[(*key[:3], name, *key[4:])]
        )
        assert ours.dtype == want.dtype and np.array_equal(ours, want), key
        seen.add(key[3])
      else:
        assert ours.dtype == theirs[key].dtype and np.array_equal(ours, theirs[key]), key
        seen.add(key[2] if key[0] == "blocks" else key[0])
  assert {"latent", "window_query", "window_key", "value", "out", "attn_post_norm", "mlp_post_norm", "embed"} <= seen


def test_gemma_macchiato_trains_only_the_latent_logits(tmp_path):
  """configs/c4/gemma2.py's optimizer groups: an update moves a layer's attn/query and attn/key (the latent
  logits) and nothing else."""
  _, _, _, config, init, started = macchiato_run(tmp_path)
  tx = optim.make_optimizer(config)[0]
  params = traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in started.items()})
  grads, state = jax.tree.map(jnp.ones_like, params), tx.init(params)
  for _ in range(2):  # the first step's learning rate is warmup's 0
    updates, state = tx.update(grads, state, params)
  moved = {k for k, v in traverse_util.flatten_dict(jax.device_get(updates)).items() if np.abs(v).max() > 0}
  moved = {tuple(str(p) for p in k) for k in moved}
  assert moved and all(k[2] == "attn" and k[3] in ("query", "key") for k in moved), sorted(moved)


def test_the_gemma2_config_builds_the_released_2b_model():
  """configs/c4/gemma2.py:gemma (Gemma 2 2B's config.json read by lra_core/hf/gemma2.py) has the released
  checkpoint's 2,614,341,888 parameters; its Macchiato 2,752,839,936 (key-value heads repeated to the 8
  query heads, and the latent logits: 26 x (2 x 2304 x 1024 + 2304 x 8 x (17 + 16)))."""
  count = lambda spec: registry.parameter_counts(lra_core.load_config(spec))["total"]
  assert count("configs/c4/gemma2.py:gemma") == 2_614_341_888
  assert count("configs/c4/gemma2.py") == 2_614_341_888 + 26 * (2 * 2304 * 1024 + 2304 * 8 * (17 + 16))


def test_a_latte_run_without_a_window_cannot_start_from_gemma2(tmp_path):
  with pytest.raises(ConfigError, match="as Latte-Macchiato: set model.window"):
    macchiato_run(tmp_path, ["model.window=0", "model.variant=latte_conv++"])


def test_frozen_weights_pass_no_gradient_and_the_trained_ones_move_as_before(monkeypatch):
  """configs/c4/gemma2.py's frozen Gemma weights (optimizer 'none'): the train step stops their
  gradient, so its compiled program forms no weight gradient for them (fewer matrix-product FLOPs
  than the same step with every gradient formed) and the latent logits' update is the same."""
  from test_remat_scan import random_batch

  from lra_core import sharding
  from lra_core.cost import hlo_cost
  from lra_core.run.data_setup import config_data_info
  from lra_core.run.steps import make_train_step
  from lra_core.tasks import make_task

  config = lra_core.load_config("configs/c4/gemma2.py:tiny")
  mesh = layout.make_mesh(config.mesh, jax.devices()[:1])
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  task = make_task(config, config_data_info(config))
  batch = random_batch(config, config.train.batch_size)

  def two_steps():
    step = jax.jit(make_train_step(config, spec, task, tx, schedule))
    state = spec.init()
    with sharding.activate(mesh, config.sharding.rules):
      flops = hlo_cost.step_flops(step.lower(state, batch).compile().as_text())[0]
      for _ in range(2):  # the first step's learning rate is warmup's 0
        state, out = step(state, batch)
    return flops, jax.device_get(state["params"]), out

  flops, params, out = two_steps()
  every = lambda config, params: jax.tree.map(lambda _: False, params)
  monkeypatch.setattr(optim, "frozen", every)  # every gradient formed, as before the stop
  flops_all, params_all, out_all = two_steps()
  assert flops < 0.8 * flops_all, (flops, flops_all)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_all)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert float(out["grad_norm"]) < float(out_all["grad_norm"])  # the norm of the trained gradients alone


# -- the two layouts of the rotary settings (transformers 4 and 5), one-sentence refusals ----------------------

# CONFIG as transformers 5 writes it: the rotary base in rope_parameters, no rope_theta at the top level.
V5 = {
  **{k: v for k, v in CONFIG.items() if k != "rope_theta"},
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
SCALINGS = {
  "none": {},
  "linear": {"factor": 2.0},
  "dynamic": {"factor": 3.0},
  "yarn": {"factor": 4.0, "original_max_len": 16, "beta_fast": 8.0, "attention_factor": 1.25},
  "llama3": {"factor": 8.0, "original_max_len": 16, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
}


def one_sentence(kind, says, read, *args):
  """`read(*args)` raises `kind` with a message matching `says`, on one line."""
  with pytest.raises(kind, match=says) as caught:
    read(*args)
  assert "\n" not in str(caught.value), str(caught.value)


def test_a_transformers_5_gemma2_folder_reads_as_its_transformers_4_twin(tmp_path):
  """V5 (hand-written), CONFIG and V5 with rope_parameters per layer type: equal sections; V5 and CONFIG
  equal logits, the numpy forward's; our v5 writer gives back the hand-written config.json."""
  tensors = random_tensors(CONFIG, seed=2)
  new, new_model = hf.load_model(save(tmp_path / "v5", V5, tensors))
  old, old_model = hf.load_model(save(tmp_path / "v4", CONFIG, tensors))
  per_type = {**V5, "rope_parameters": {kind: V5["rope_parameters"] for kind in (hf.gemma2.FULL, hf.gemma2.SLIDING)}}
  assert new.to_dict() == old.to_dict() == hf.read(save(tmp_path / "per_type", per_type, tensors))[0].to_dict()
  ids = jnp.asarray(np.arange(12)[None] * 5 % 96, jnp.int32)
  ours = np.asarray(oracles.forward(new_model, ids))
  np.testing.assert_array_equal(ours, np.asarray(oracles.forward(old_model, ids)))
  np.testing.assert_allclose(ours[0], gemma2_logits(tensors, CONFIG, np.asarray(ids[0])), rtol=2e-4, atol=2e-4)
  written = hf.gemma2.config_json(new, "v5")
  assert {k: written[k] for k in V5} == V5 and "rope_theta" not in written
  assert {k: v for k, v in hf.gemma2.config_json(new, "v4").items() if k in CONFIG} == CONFIG


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_both_gemma2_layouts_write_and_read_back_every_scaling(tmp_path, layout, kind):
  """Either layout, each scaling type, whole heads rotated and part of them: the section and tensors back."""
  tensors = random_tensors(CONFIG, seed=4)
  section, model = hf.load_model(save(tmp_path / "in", CONFIG, tensors))
  for fraction in (1.0, 0.75):
    section.rope_fraction = fraction
    section.rope_scaling.update(type=kind, **SCALINGS[kind])
    hf.save_folder(tmp_path / "out", section, model, layout=layout)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    rotary = written["rope_parameters"] if layout == "v5" else written
    assert rotary["rope_theta"] == 10000.0 and rotary.get("partial_rotary_factor", 1.0) == fraction
    assert ("rope_parameters" in written) != ("rope_theta" in written)
    assert (layout == "v4" and kind != "none") == ("rope_scaling" in written)
    assert hf.read(tmp_path / "out")[0].to_dict() == section.to_dict()
    again = hf.read_folder(tmp_path / "out")[1]
    assert sorted(again) == sorted(tensors) and all(np.array_equal(again[n], v) for n, v in tensors.items())


@pytest.mark.parametrize(
  "change, says",
  [
    ({"rope_parameters": {"rope_theta": 500.0}}, r"gives rope_parameters.rope_theta 500.0 and rope_theta 10000.0"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"partial_rotary_factor": 0.25}}, r"factor 0.25 and partial"),
    ({"rope_parameters": {"rope_type": "su", "factor": 2.0}}, r"rope_parameters.rope_type 'su' is not supported"),
    ({"rope_scaling": {"factor": 2.0}}, r"Gemma 2 rope_scaling gives \['factor'\] but no rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "mscale_all_dim": 1.0}}, r"mscale_all_dim 1.0 is not supported"),
    (
      {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}},
      r"rope_parameters differs between the layer types \['full_attention', 'sliding_attention'\]",
    ),
    ({"head_dim": "eight"}, r"Gemma 2 head_dim is 'eight', not a number"),
    ({"rms_norm_eps": [1e-6]}, r"Gemma 2 rms_norm_eps is \[1e-06\], not a number"),
  ],
)
def test_what_a_gemma2_config_json_cannot_say_is_one_sentence(tmp_path, change, says):
  one_sentence(ConfigError, says, hf.read, save(tmp_path / "bad", {**CONFIG, **change}, random_tensors(CONFIG)))


def test_a_gemma2_config_json_that_is_no_object_or_lacks_a_setting_is_one_sentence(tmp_path):
  for text in ('"gemma2"', "null"):
    folder = save(tmp_path / "text", CONFIG, random_tensors(CONFIG))
    (folder / "config.json").write_text(text)
    one_sentence(ConfigError, r"config.json is a JSON (string|null), not an object of settings", hf.read, folder)
  one_sentence(ConfigError, r"Gemma 2 config.json is a JSON array", hf.gemma2.model_section, [CONFIG])
  for key in ("hidden_size", "num_hidden_layers", "intermediate_size"):
    folder = save(tmp_path / key, {k: v for k, v in CONFIG.items() if k != key}, random_tensors(CONFIG))
    one_sentence(ConfigError, rf"the Gemma 2 config.json gives no '{key}', which the model needs", hf.read, folder)


@pytest.mark.parametrize(
  "name, shape",
  [
    ("model.layers.0.self_attn.q_proj.weight", (24, 24)),
    ("model.layers.2.self_attn.k_proj.weight", (32, 24)),
    ("model.layers.1.self_attn.o_proj.weight", (24, 30)),
    ("model.layers.0.mlp.down_proj.weight", (24, 41)),
    ("model.norm.weight", (23,)),
  ],
)
def test_a_gemma2_tensor_of_the_wrong_shape_is_one_sentence(tmp_path, name, shape):
  tensors = random_tensors(CONFIG)
  tensors[name] = np.zeros(shape, np.float32)
  says = re.escape(f"tensor '{name}' has shape {list(shape)}, not the [")
  one_sentence(CheckpointError, says, hf.read, save(tmp_path / "bad", CONFIG, tensors))
