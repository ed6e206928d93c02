"""RoPE scaling (linear, dynamic NTK, YaRN, Llama 3) and transformers' rotary rounding: the frequencies
against a float64 reference written here from the definitions, cached decoding == the full forward pass
under each type, plain RoPE unchanged, and the config checks."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_transformer import make_config as transformer_config
from test_transformer import make_model

import lra_core
import oracles
from lra_core.errors import ConfigError
from lra_core.models import transformer
from lra_core.models.layers import attention
from lra_core.models.layers.positions import (
  ROPE_SCALING_DEFAULTS,
  ROPE_SCALING_TYPES,
  apply_rope,
  rope_attention_factor,
  rope_dims,
  rope_inv_freq,
)

SCALED = tuple(t for t in ROPE_SCALING_TYPES if t != "none")
TRAINED = 32  # L0 of the frequency tests; positions run to 4 L0


# -- the reference: one dimension pair at a time, float64, from the definitions -------------------------


def reference_inv_freq(dim, base, s, length):
  """Inverse frequency of each pair i < ceil(dim/2) under settings `s` (every ROPE_SCALING_DEFAULTS key)."""
  kind, factor = s["type"], s["factor"]
  trained = s["original_max_len"] or length
  if kind == "dynamic" and length > trained:
    base = base * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
  if kind == "yarn":
    # The pair index at which a frequency turns `beta` times over the trained length.
    turning = lambda beta: dim * math.log(trained / (beta * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(turning(s["beta_fast"])), 0)
    high = min(math.ceil(turning(s["beta_slow"])), dim - 1)
    if high == low:
      high += 0.001
  out = []
  for i in range((dim + 1) // 2):
    w = base ** (-(2 * i) / dim)
    if kind == "linear":
      w = w / factor
    elif kind == "yarn":
      ramp = min(max((i - low) / (high - low), 0.0), 1.0)
      extrapolation = 1.0 - ramp
      w = (w / factor) * (1.0 - extrapolation) + w * extrapolation
    elif kind == "llama3":
      wavelength = 2 * math.pi / w
      low_ff, high_ff = s["low_freq_factor"], s["high_freq_factor"]
      if wavelength > trained / low_ff:
        w = w / factor
      elif wavelength >= trained / high_ff:
        smooth = (trained / wavelength - low_ff) / (high_ff - low_ff)
        w = (1.0 - smooth) * w / factor + smooth * w
    out.append(w)
  return np.array(out)


def reference_factor(s):
  if s["type"] != "yarn":
    return 1.0
  return s["attention_factor"] if s["attention_factor"] else 0.1 * math.log(s["factor"]) + 1.0


def reference_rope(x, positions, dim, base, s, length):
  """x [1,T,H,D] float64 rotated pair by pair: (i, i + n), n = ceil(dim/2), by p w_i, times the factor."""
  inv, f = reference_inv_freq(dim, base, s, length), reference_factor(s)
  n = len(inv)
  out = np.array(x, np.float64)
  for t, p in enumerate(positions):
    for i in range(n):
      c, sn = math.cos(p * inv[i]), math.sin(p * inv[i])
      a, b = x[0, t, :, i], x[0, t, :, i + n]
      out[0, t, :, i] = f * (a * c - b * sn)
      out[0, t, :, i + n] = f * (b * c + a * sn)
  return out


def settings(kind, **kw):
  return {**ROPE_SCALING_DEFAULTS, "type": kind, "original_max_len": TRAINED, **kw}


CASES = [
  *((kind, width, fraction) for kind in ROPE_SCALING_TYPES for width in (8, 16, 64) for fraction in (1.0, 0.5)),
  *((kind, 16, 0.2) for kind in ROPE_SCALING_TYPES),  # dim 3: an odd RoPE dimension
]
SETTINGS = {
  "factor": dict(factor=4.0),
  "fractional": dict(factor=2.5, beta_fast=16.0, beta_slow=2.0, low_freq_factor=2.0, high_freq_factor=8.0),
  "attention_factor": dict(factor=3.0, attention_factor=1.3),
}


@pytest.mark.parametrize("base", [1e4, 500.0])
@pytest.mark.parametrize("extra", list(SETTINGS), ids=str)
@pytest.mark.parametrize("kind,width,fraction", CASES)
def test_frequencies_match_the_reference_past_the_trained_length(kind, width, fraction, extra, base):
  dim, _ = rope_dims(width, fraction)
  s = settings(kind, **SETTINGS[extra])
  length = 4 * TRAINED
  inv = rope_inv_freq(dim, max_wavelength=base, scaling=s, length=length)
  expected = reference_inv_freq(dim, base, s, length)
  assert inv.shape == expected.shape == ((dim + 1) // 2,)
  np.testing.assert_allclose(inv, expected, rtol=1e-12)
  assert rope_attention_factor(s) == pytest.approx(reference_factor(s), abs=1e-12)
  # Positions past the trained length: the angles and the factor they are rotated with.
  p = np.arange(length, dtype=np.float64)[:, None]
  f = rope_attention_factor(s)
  for got, want in ((np.cos(p * inv) * f, np.cos(p * expected)), (np.sin(p * inv) * f, np.sin(p * expected))):
    np.testing.assert_allclose(got, want * reference_factor(s), atol=1e-6)


@pytest.mark.parametrize("kind,width,fraction", [c for c in CASES if c[1] != 64])
def test_apply_rope_matches_the_reference_rotation(kind, width, fraction):
  """The float32 rotation of q [1,T,H,D] at positions up to 4 L0, against the float64 reference."""
  rng = np.random.default_rng(0)
  length = 4 * TRAINED
  x = rng.normal(size=(1, length, 2, width))
  s = settings(kind, factor=4.0)
  rope = jax.jit(functools.partial(apply_rope, fraction=fraction, scaling=s, length=length))
  got = rope(jnp.asarray(x, jnp.float32), jnp.arange(length))
  dim, rot = rope_dims(width, fraction)
  np.testing.assert_allclose(got, reference_rope(x, range(length), dim, 1e4, s, length), atol=5e-5)
  np.testing.assert_array_equal(got[..., rot:], jnp.asarray(x, jnp.float32)[..., rot:])


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_the_cases_reach_every_part_of_the_blend(kind):
  """At width 64, L0 32: some pairs kept, some divided by factor, some strictly between."""
  plain = rope_inv_freq(64)
  ratio = rope_inv_freq(64, scaling=settings(kind, factor=4.0), length=4 * TRAINED) / plain
  assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 0.25).any()
  assert ((ratio > 0.26) & (ratio < 0.99)).any()


def test_dynamic_scaling_leaves_the_trained_length_alone():
  s = settings("dynamic", factor=4.0)
  plain = rope_inv_freq(16, scaling=None)
  np.testing.assert_array_equal(rope_inv_freq(16, scaling=s, length=TRAINED), plain)
  np.testing.assert_array_equal(rope_inv_freq(16, scaling=s, length=TRAINED // 2), plain)
  # Past it the base grows: the highest frequency stays 1, the lowest shrinks.
  longer = rope_inv_freq(16, scaling=s, length=4 * TRAINED)
  assert longer[0] == 1.0 and longer[-1] < plain[-1]


def test_a_missing_length_is_refused():
  with pytest.raises(ValueError, match="original_max_len"):
    rope_inv_freq(16, scaling=dict(type="yarn", factor=2.0))
  with pytest.raises(ValueError, match="dynamic"):
    rope_inv_freq(16, scaling=dict(type="dynamic", factor=2.0, original_max_len=8))
  with pytest.raises(ValueError, match="not among"):
    rope_inv_freq(16, scaling=dict(type="linear", scale=2.0))


# -- transformers' rotary rounding ------------------------------------------------------------------------


def test_a_fifth_of_sixteen_rotates_four_dimensions_with_exponents_of_thirds():
  assert rope_dims(16, 0.2) == (3, 4)
  np.testing.assert_allclose(rope_inv_freq(3, max_wavelength=100.0), [1.0, 100.0 ** (-2 / 3)], rtol=1e-15)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(1, 5, 1, 16)), jnp.float32)
  positions = jnp.arange(5) * 3
  got = np.asarray(apply_rope(x, positions, max_wavelength=100.0, fraction=0.2))
  np.testing.assert_array_equal(got[..., 4:], x[..., 4:])
  assert not np.allclose(got[..., :4], x[..., :4])
  # Pairs (0, 2) and (1, 3), by angles p and p 100^(-2/3).
  xs = np.asarray(x, np.float64)
  for i, w in enumerate([1.0, 100.0 ** (-2 / 3)]):
    angle = np.asarray(positions, np.float64)[None, :, None] * w
    a, b = xs[..., i], xs[..., i + 2]
    np.testing.assert_allclose(got[..., i], a * np.cos(angle) - b * np.sin(angle), atol=1e-5)
    np.testing.assert_allclose(got[..., i + 2], b * np.cos(angle) + a * np.sin(angle), atol=1e-5)


def old_apply_rope(x, positions, *, max_wavelength=1e4, fraction=1.0):
  """apply_rope as it was before scaling: the fraction rounded down to an even count of dimensions."""
  d = x.shape[-1]
  rot = int(d * fraction) // 2 * 2
  if rot == 0:
    return x
  inv_freq = max_wavelength ** (-jnp.arange(rot // 2, dtype=jnp.float32) / (rot // 2))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = (angles[None] if positions.ndim == 1 else angles)[:, :, None, :]
  x1, x2 = jnp.split(x[..., :rot].astype(jnp.float32), 2, axis=-1)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1) if rot < d else rotated


@pytest.mark.parametrize("width,fraction", [(16, 1.0), (16, 0.5), (64, 0.25), (32, 0.75), (128, 1.0), (10, 0.4)])
@pytest.mark.parametrize("scaling", [None, dict(type="none"), ROPE_SCALING_DEFAULTS], ids=["None", "none", "defaults"])
def test_plain_rope_of_an_even_dimension_is_bit_for_bit_the_old_one(width, fraction, scaling):
  assert rope_dims(width, fraction)[0] % 2 == 0
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 40, 3, width)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 5000, size=(2, 40)))
  for base in (1e4, 5e5):
    new = jax.jit(functools.partial(apply_rope, max_wavelength=base, fraction=fraction, scaling=scaling))
    old = jax.jit(functools.partial(old_apply_rope, max_wavelength=base, fraction=fraction))
    np.testing.assert_array_equal(new(x, positions), old(x, positions))
    np.testing.assert_array_equal(new(x, positions[0]), old(x, positions[0]))


def test_a_rotation_wider_than_the_head_is_refused():
  with pytest.raises(ValueError, match="more than the 3"):
    apply_rope(jnp.ones((1, 2, 1, 3)), jnp.arange(2))


# -- the transformer: cached decoding == the full forward pass ---------------------------------------------


def make_config(seq_len=24, variant="transformer++", **model):
  """test_transformer's tiny config with two heads of 16 (the fractions below are of a 16-wide head)."""
  return transformer_config(variant=variant, seq_len=seq_len, **{"num_heads": 2, **model})


DECODE_CASES = [
  *(dict(type=kind, factor=3.0, original_max_len=8) for kind in SCALED),
  dict(type="dynamic", factor=2.0, original_max_len=6, fraction=0.5),
  dict(type="yarn", factor=4.0, original_max_len=0, fraction=0.2),  # L0 = the model's length; dim 3
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_cached_decoding_equals_the_forward_pass_past_the_trained_length(case):
  case = dict(case)
  fraction = case.pop("fraction", 1.0)
  config = make_config(rope_fraction=fraction)
  config.model.rope_scaling.update(case)
  transformer.validate_config(config)
  model = make_model(config)
  assert model.blocks[0].attn.rope_len == 24  # max_len 0: the run's length
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 23)
  logits = oracles.forward(model, tokens)
  oracles.assert_decode_matches_forward(model, tokens, logits, atol=1e-5)
  # The prompt in one pass leaves what the steps leave.
  last, _ = oracles.forward(model, tokens, model.init_decode_state(2, 24), method="prefill")
  np.testing.assert_allclose(last, logits[:, -1:], atol=1e-5)
  # The scaling is in effect: the same weights without it give other logits.
  plain = make_model(make_config(rope_fraction=fraction))
  assert not np.allclose(oracles.forward(plain, tokens), logits, atol=1e-4)


def test_the_model_length_is_max_len_when_set():
  config = make_config(max_len=40)
  config.model.rope_scaling.update(dict(type="dynamic", factor=2.0, original_max_len=8))
  assert make_model(config).blocks[0].attn.rope_len == 40


def test_type_none_gives_the_model_the_old_rope(monkeypatch):
  """A transformer++ with the default section gives bit for bit the logits it gave with the old apply_rope."""
  model = make_model(make_config())
  assert model.blocks[0].attn.rope_scaling is None
  tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, 23)
  new = nnx.jit(lambda m, t: m(t))(model, tokens)

  def old(x, positions, *, scaling, length, **kw):
    assert scaling is None
    return old_apply_rope(x, positions, **kw)

  monkeypatch.setattr(attention, "apply_rope", old)
  np.testing.assert_array_equal(nnx.jit(lambda m, t: m(t))(model, tokens), new)


# -- the config checks -----------------------------------------------------------------------------------


def scaled_config(variant="transformer++", **scaling):
  config = make_config(variant=variant)
  config.model.rope_scaling.update(scaling)
  return config


@pytest.mark.parametrize("kind", ROPE_SCALING_TYPES)
def test_each_type_with_its_defaults_is_accepted(kind):
  transformer.validate_config(scaled_config(type=kind, factor=2.0))


@pytest.mark.parametrize(
  "config,message",
  [
    (
      scaled_config(type="foo"),
      "model.rope_scaling.type 'foo' is not one of ['none', 'linear', 'dynamic', 'yarn', 'llama3'].",
    ),
    (scaled_config(type="linear", factor=0.5), "model.rope_scaling.factor must be >= 1 for type 'linear', got 0.5."),
    (scaled_config(type="yarn", factor=0.9), "model.rope_scaling.factor must be >= 1"),
    (scaled_config("transformer", type="linear", factor=2.0), "which model.rope=False turns off"),
    (scaled_config(type="llama3", factor=8.0, low_freq_factor=4.0), "model.rope_scaling.high_freq_factor 4.0 must"),
    (scaled_config(type="yarn", factor=8.0, beta_fast=1.0), "model.rope_scaling.beta_fast 1.0 must exceed"),
    (scaled_config(type="yarn", factor=8.0, beta_slow=0.0), "model.rope_scaling.beta_fast 32.0 must exceed"),
    (scaled_config(type="yarn", factor=2.0, attention_factor=-1.0), "model.rope_scaling.attention_factor must"),
    (scaled_config(type="dynamic", factor=2.0, original_max_len=-1), "model.rope_scaling.original_max_len must"),
  ],
)
def test_validate_config_names_the_bad_key(config, message):
  with pytest.raises(ConfigError) as e:
    transformer.validate_config(config)
  assert message in str(e.value)
  assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")  # one sentence


def test_unknown_keys_dynamic_on_two_dimensions_and_other_families_are_refused():
  config = make_config()
  with config.model.rope_scaling.unlocked():
    config.model.rope_scaling.scale = 2.0
  with pytest.raises(ConfigError, match=r"model.rope_scaling has unknown keys \['scale'\]"):
    transformer.validate_config(config)
  with pytest.raises(ConfigError, match="'dynamic' needs over 2 RoPE dimensions"):
    config = make_config(rope_fraction=0.125)  # 16 x 0.125 = 2
    config.model.rope_scaling.update(dict(type="dynamic", factor=2.0))
    transformer.validate_config(config)
  config = scaled_config(type="linear", factor=2.0)
  config.model.name = "combiner"
  with pytest.raises(ConfigError, match="is for the transformer family, not model 'combiner'"):
    transformer.validate_config(config)


def test_command_line_overrides_reach_the_section():
  spec, rope = "configs/enwik8/transformer.py:tiny,plusplus", ["model.rope=True"]
  config = lra_core.load_config(
    spec, rope + ["--config.model.rope_scaling.type=yarn", "--config.model.rope_scaling.factor=4"]
  )
  assert config.model.rope_scaling.type == "yarn" and config.model.rope_scaling.factor == 4.0
  assert isinstance(config.model.rope_scaling.factor, float)
  config = lra_core.load_config(spec, ["model.rope_scaling.type=llama3", "model.rope_scaling.original_max_len=16"])
  assert config.model.rope_scaling.original_max_len == 16
  with pytest.raises(ConfigError, match="model.rope_scaling.type 'foo' is not one of"):
    lra_core.load_config(spec, ["--config.model.rope_scaling.type=foo"])
  with pytest.raises(ConfigError, match="unknown config key 'model.rope_scaling.scale'"):
    lra_core.load_config(spec, ["--config.model.rope_scaling.scale=2"])
  with pytest.raises(ConfigError, match="model.rope_scaling.factor must be >= 1"):
    lra_core.load_config(spec, ["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"])


# -- against transformers, where it is installed ------------------------------------------------------------


@pytest.mark.parametrize("kind", ROPE_SCALING_TYPES)
@pytest.mark.parametrize(
  "width,fraction,base,trained",
  [(16, 1.0, 1e4, 32), (64, 0.5, 1e4, 32), (128, 1.0, 5e5, 8192), (8, 1.0, 100.0, 4096)],
)
def test_frequencies_match_transformers(kind, width, fraction, base, trained):
  """inv_freq and the attention factor of transformers' ROPE_INIT_FUNCTIONS (4.x layout: rope_scaling on
  the config, the trained length as max_position_embeddings). (8, 100, 4096) puts YaRN's ramp end past
  the last pair, where the clamp to dim - 1 matters."""
  pytest.importorskip("torch")
  hf = pytest.importorskip("transformers")
  rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
  if int(hf.__version__.split(".")[0]) >= 5:
    pytest.skip("transformers 5 keeps RoPE settings in rope_parameters; this compares against the 4.x layout")
  s = settings(kind, factor=4.0, original_max_len=trained)
  hf_scaling = {"rope_type": "default" if kind == "none" else kind, "factor": s["factor"]}
  if kind == "llama3":
    hf_scaling |= dict(original_max_position_embeddings=trained)
    hf_scaling |= dict(low_freq_factor=s["low_freq_factor"], high_freq_factor=s["high_freq_factor"])
  if kind == "yarn":
    hf_scaling |= dict(beta_fast=s["beta_fast"], beta_slow=s["beta_slow"])
  config = hf.LlamaConfig(
    hidden_size=2 * width,
    num_attention_heads=2,
    head_dim=width,
    rope_theta=base,
    max_position_embeddings=trained,
    rope_scaling=None if kind == "none" else hf_scaling,
  )
  config.partial_rotary_factor = fraction
  length = 4 * trained
  inv, factor = rope_utils.ROPE_INIT_FUNCTIONS[hf_scaling["rope_type"]](config, "cpu", seq_len=length)
  dim, _ = rope_dims(width, fraction)
  np.testing.assert_allclose(rope_inv_freq(dim, max_wavelength=base, scaling=s, length=length), inv.numpy(), rtol=1e-6)
  assert rope_attention_factor(s) == pytest.approx(factor, rel=1e-6)
