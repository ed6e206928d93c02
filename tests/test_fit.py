"""FIT and FIT-AR (models/fit/__init__.py): grouping, causality, decoding, special cases, configs."""

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import ml_collections
import numpy as np
import pytest
from flax import nnx

import fixtures.cifar10
import fixtures.imagenet64
import fixtures.listops
import lra_core
import oracles
import tiers
from lra_core import registry
from lra_core.bench import param_counts
from lra_core.errors import ConfigError
from lra_core.kernels.packed_documents import segment_positions
from lra_core.models import fit, transformer
from lra_core.protocol import RunInfo
from lra_core.run.image_samples import save_grid
from lra_core.sample import sample_images
from lra_core.train import train_and_evaluate

VOCAB = 13


def make_config(task="lm", seq_len=16, **model):
  c = ml_collections.ConfigDict()
  c.task = task
  defaults = dict(
    vocab_size=VOCAB,
    layers="L(1)G(1)L(1)G(1)L(1)",
    group_size=4,
    latents_per_group=2,
    d_model=16,
    num_heads=2,
    d_ff=32,
    d_latent=24,
    latent_heads=3,
    latent_d_ff=40,
    num_classes=3 if task == "classify" else 0,
  )
  c.model = fit.model_config(**{**defaults, **model})
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  fit.validate_config(c)
  return c


def make_model(config, seed=0):
  model = fit.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))
  model.eval()
  return model


def tokens(b=2, t=14, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, VOCAB)


# -- pure functions ------------------------------------------------------------------------------------------


def test_layer_strings():
  assert fit.parse_layers("L(8)G(2)L(8)G(2)L(8)G(2)L(8)") == [(8, 2)] * 3 + [(8, 0)]
  assert fit.parse_layers("L(4)") == [(4, 0)]
  for bad in ("L(4)L(4)", "G(2)L(4)", "L4G2", "L(4)G(2)X", ""):
    with pytest.raises(ConfigError, match="model.layers"):
      fit.parse_layers(bad)


def test_2d_grouping_keeps_neighbours_together_and_round_trips():
  side, channels, g = 8, 3, 4
  rows, cols, chans = np.meshgrid(np.arange(side), np.arange(side), np.arange(channels), indexing="ij")
  coords = np.stack([rows, cols, chans], -1).reshape(1, side * side * channels, 3)  # raster order
  grouped = np.asarray(oracles.compiled(fit.group_2d, jnp.asarray(coords), side=side, channels=channels, group_side=g))
  assert grouped.shape == (1, (side // g) ** 2, g * g * channels, 3)
  for index, group in enumerate(grouped[0]):
    r, c = divmod(index, side // g)  # groups in raster order of blocks
    assert set(map(tuple, group[:, :2])) == {(r * g + i, c * g + j) for i in range(g) for j in range(g)}
    assert len({tuple(x) for x in group}) == g * g * channels  # every pixel value once
  back = oracles.compiled(fit.ungroup_2d, jnp.asarray(grouped), side=side, channels=channels, group_side=g)
  np.testing.assert_array_equal(back, coords)


def test_1d_grouping_pads_the_end_and_prefixes_the_previous_groups_tail():
  x = jnp.arange(1, 11)[None]  # 10 tokens, groups of 4, overlap 2
  groups, valid = oracles.compiled(fit.group_1d, x, group_size=4, overlap=2)
  np.testing.assert_array_equal(groups[0], [[0, 0, 1, 2, 3, 4], [3, 4, 5, 6, 7, 8], [7, 8, 9, 10, 0, 0]])
  np.testing.assert_array_equal(valid[0], [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def test_shift_latents_moves_each_group_one_right():
  lat = jnp.arange(1, 4, dtype=jnp.float32).reshape(1, 3, 1, 1) * jnp.ones((1, 3, 2, 2))
  np.testing.assert_array_equal(oracles.compiled(fit.shift_latents, lat)[0, :, 0, 0], [0, 1, 2])


# -- FIT-AR ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_fit_ar_is_causal_and_decode_matches_forward(overlap):
  """Groups of 4: cuts inside groups, at their ends and right after; 14 tokens (a partial group)."""
  model = make_model(make_config(overlap=overlap))
  x = tokens()
  logits = oracles.forward(model, x)
  assert logits.shape == (2, 14, VOCAB)
  oracles.assert_no_future_leakage(
    model, x, logits, (0, 2, 3, 4, 7, 8, 11, 12), vocab=VOCAB, shift=5, changed_atol=1e-5
  )
  oracles.assert_decode_matches_forward(model, x, logits)


def test_fit_ar_data_reads_the_previous_groups_latents():
  """The next group's first token depends on every token of the group before (through latents)."""
  model = make_model(make_config())
  x = tokens()
  base = oracles.forward(model, x)
  for t in range(4):  # any token of group 0 changes the prediction at position 4 (group 1)
    out = oracles.forward(model, x.at[:, t].set((x[:, t] + 1) % VOCAB))
    assert not np.allclose(out[:, 4], base[:, 4], atol=1e-6), t


def test_decode_state_per_token_work_is_bounded_by_the_group():
  model = make_model(make_config(seq_len=64))
  short, long = model.init_decode_state(1, 16), model.init_decode_state(1, 64)
  sizes = lambda st, key: sum(x.size for x in jax.tree.leaves(st[key]))
  for key in ("local", "group_x", "prev_kv"):  # what every token touches: one group and m latents
    assert sizes(short, key) == sizes(long, key)
  assert sizes(long, "global") == 4 * sizes(short, "global")  # one slot of m latents per group
  with pytest.raises(ValueError, match="exceeds the latent table"):
    model.init_decode_state(1, 65)


# -- special cases and the encoder -----------------------------------------------------------------------------


def copy_params(source, target):
  nnx.update(target, nnx.state(source, nnx.Param))


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_one_group_with_only_local_layers_is_a_transformer(task):
  """FIT with a single group of all T tokens and layers L(N) (no global layers, so no latents) is the
  plain pre-LN transformer stack: same weights, same outputs. (One group per token instead leaves each
  token alone in its group, with all mixing through latents; that is a different network.)"""
  t, n = 16, 3
  cfg = make_config(task, layers=f"L({n})", group_size=t, pooling="mean", output_bias=False)  # as the transformer
  model = make_model(cfg)
  tc = transformer.model_config(
    "transformer",
    vocab_size=VOCAB,
    d_model=16,
    num_layers=n,
    num_heads=2,
    d_ff=32,
    use_bias=True,
    position="learned",
    pooling="mean",
    tie_embeddings=task == "lm",
    num_classes=cfg.model.num_classes,
  )
  base = transformer.Model(tc, RunInfo(task, seq_len=t), rngs=nnx.Rngs(params=1))
  base.eval()
  copy_params(model.embed, base.embed)
  base.positions.table.set_value(model.data_positions[...])
  for mine, theirs in zip(model.blocks[0].local, base.blocks):
    copy_params(mine, theirs)
  copy_params(model.final_norm, base.final_norm)
  copy_params(model.head, base.head)
  x = tokens(t=t)
  if task == "lm":
    np.testing.assert_allclose(oracles.forward(model, x), oracles.forward(base, x), atol=1e-5)
  else:
    mask = jnp.broadcast_to(jnp.arange(t) < 11, (2, t))
    np.testing.assert_allclose(oracles.forward(model, x, mask=mask), oracles.forward(base, x, mask=mask), atol=1e-5)


@pytest.mark.slow
def test_encoder_ignores_padding_even_whole_padded_groups():
  model = make_model(make_config("classify", seq_len=20))
  x = tokens(t=20)
  real = oracles.forward(model, x[:, :10])  # 3 groups, the last partial
  mask = jnp.broadcast_to(jnp.arange(20) < 10, (2, 20))
  np.testing.assert_allclose(oracles.forward(model, x.at[:, 10:].set(7), mask=mask), real, atol=1e-5)


def test_2d_encoder_is_the_1d_encoder_on_grouped_pixels():
  cfg2d = make_config("classify", seq_len=64, grouping="2d", image_channels=1, group_side=4)
  cfg1d = make_config("classify", seq_len=64, group_size=16)
  model2d, model1d = make_model(cfg2d), make_model(cfg1d)
  copy_params(model2d, model1d)
  x = tokens(t=64)
  flat = fit.group_2d(x, 8, 1, 4).reshape(2, 64)
  np.testing.assert_allclose(oracles.forward(model2d, x), oracles.forward(model1d, flat), atol=1e-6)
  assert not np.allclose(oracles.forward(model2d, x), oracles.forward(model1d, x), atol=1e-4)


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="every block but the last needs global layers"):
    make_config(layers="L(2)L(2)")
  with pytest.raises(ConfigError, match="overlap 2 must be in .* FIT-AR only"):
    make_config("classify", overlap=2)
  with pytest.raises(ConfigError, match="not a square image"):
    make_config("classify", seq_len=48, grouping="2d", group_side=2)
  with pytest.raises(ConfigError, match="group_side 3 does not divide the image side 8"):
    make_config("classify", seq_len=64, grouping="2d", group_side=3)
  with pytest.raises(ConfigError, match="FIT-AR groups a 1-D sequence"):
    make_config("lm", seq_len=64, grouping="2d", group_side=4)
  with pytest.raises(ConfigError, match="d_latent 24 is not a multiple of model.latent_heads 5"):
    make_config(latent_heads=5)


# -- packed documents (segment_ids) ---------------------------------------------------------------------------


def document_apply(model):
  """(rows, segment_ids) -> per-token outputs: logits (FIT-AR) or the encoder's final features."""
  if model.causal:
    return lambda rows, segs: oracles.forward(model, rows, segment_ids=segs)
  return lambda rows, segs: oracles.forward(model, rows, segment_ids=segs, method="encode")[0]


DOCUMENT_CASES = [("lm", 0), ("lm", 2), ("classify", 0)]


def test_latent_documents_and_their_first_groups():
  seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 0]])  # groups of 4: [1 1 1 1] [1 2 2 2] [2 2 3 0]
  groups, real = seg.reshape(1, 3, 4), (seg != 0).reshape(1, 3, 4)
  positions = segment_positions(seg).reshape(1, 3, 4)
  last, last_at = oracles.compiled(fit.latent_documents, groups, real, last=True)
  first, first_at = oracles.compiled(fit.latent_documents, groups, real, last=False)
  np.testing.assert_array_equal(last, [[1, 2, 3]])  # padding (0) serves no latents when a document is there
  np.testing.assert_array_equal(last_at, [[3, 3, 2]])
  np.testing.assert_array_equal(first, [[1, 1, 2]])
  document_groups = lambda offsets: oracles.compiled(fit.document_groups, positions, offsets)
  np.testing.assert_array_equal(document_groups(last_at), [[0, 0, 0]])  # doc 2 starts in group 1
  np.testing.assert_array_equal(document_groups(first_at), [[0, 1, 1]])


@pytest.mark.parametrize("task,overlap", tiers.quick(DOCUMENT_CASES, keep=[1], ids=lambda c: f"{c[0]}-{c[1]}"))
def test_documents_starting_on_group_boundaries_are_independent(task, overlap):
  """The second document starts on a group boundary (8 = 2 groups of 4) and ends inside one: each
  document gets exactly its outputs alone (the latent table's rows and the group-0 zero latents
  restart with it), causal and bidirectional, with and without prefix tokens."""
  model = make_model(make_config(task, seq_len=16, overlap=overlap))
  oracles.assert_documents_independent(
    document_apply(model), np.arange(3, 11) % VOCAB, (np.arange(7) * 5 + 1) % VOCAB, 16
  )


@pytest.mark.parametrize("task,overlap", tiers.quick(DOCUMENT_CASES, keep=[], ids=lambda c: f"{c[0]}-{c[1]}"))
def test_documents_inside_groups_are_isolated(task, overlap):
  """Boundaries inside groups (and a document shorter than a group): neither document reads the
  other, and the first one, which starts on a group boundary, still gets its outputs alone."""
  model = make_model(make_config(task, seq_len=16, overlap=overlap))
  apply = document_apply(model)
  for la, lb in ((6, 7), (3, 9), (1, 14)):
    doc_a, doc_b = np.arange(la) % VOCAB + 1, (np.arange(lb) * 3 + 2) % VOCAB
    oracles.assert_documents_isolated(apply, doc_a, doc_b, 16, vocab=VOCAB)
    rows, segs = oracles.packed_pair(doc_a, doc_b, 16)
    out = np.asarray(apply(rows, segs))
    np.testing.assert_allclose(out[0, :la], out[1, :la], atol=1e-5)


def test_fit_ar_document_starting_inside_a_group_reaches_its_later_groups():
  """A group's latents serve its last document, so the head of a document that starts inside
  group 1 (positions 6, 7) reaches the next group's tokens through them."""
  model = make_model(make_config(seq_len=16))
  rows, segs = oracles.packed_pair(np.arange(1, 7), np.arange(2, 11), 16)
  base = oracles.forward(model, rows[:1], segment_ids=segs[:1])
  for t in (6, 7):
    out = oracles.forward(model, rows[:1].at[0, t].set((rows[0, t] + 1) % VOCAB), segment_ids=segs[:1])
    assert not np.allclose(out[0, 8], base[0, 8], atol=1e-6), t


def test_segment_ids_errors_are_one_sentence():
  model = make_model(make_config(seq_len=16))
  with pytest.raises(ValueError, match="segment_ids shape"):
    model(tokens(t=16), segment_ids=jnp.ones((2, 15), jnp.int32))
  image = make_model(make_config("classify", seq_len=64, grouping="2d", group_side=4))
  with pytest.raises(ValueError, match="need model.grouping '1d'"):
    image(tokens(t=64), segment_ids=jnp.ones((2, 64), jnp.int32))
  towers = make_model(make_config("retrieval", seq_len=8, num_classes=2))
  with pytest.raises(ValueError, match="do not apply to two-tower retrieval"):
    towers(tokens(t=16).reshape(2, 2, 8), segment_ids=jnp.ones((2, 2, 8), jnp.int32))


# -- configs ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_imagenet64_fit_ar_has_table_4s_153m_parameters():
  count = registry.parameter_count(lra_core.load_config("configs/imagenet64/fit_ar.py"))
  assert abs(count - 153e6) / 153e6 < 0.05, count
  assert any(row.config == "configs/imagenet64/fit_ar.py" for row in param_counts.PAPER)


@pytest.mark.parametrize("arg", ["tiny", "tiny,overlap"])
@pytest.mark.slow
def test_tiny_fit_ar_trains_and_samples(tmp_path, arg):
  # Killed and resumed runs of this config: tests/test_kill_resume.py.
  overrides = fixtures.imagenet64.build(tmp_path) + ["train.steps=4", "train.checkpoint_every=2"]
  config = lra_core.load_config(f"configs/imagenet64/fit_ar.py:{arg}", overrides)
  whole = train_and_evaluate(config, tmp_path / "whole")
  assert np.isfinite(whole["test_bits_per_dim"])
  if arg == "tiny":  # pixel-by-pixel sampling through decode_step, written as a PNG grid
    images = sample_images(config, tmp_path / "whole", num_samples=3, seed=1)
    assert images.shape == (3, 8, 8, 3) and images.dtype == np.uint8
    save_grid(images, str(tmp_path / "grid.png"), columns=3, scale=2)
    assert plt.imread(tmp_path / "grid.png").shape[:2] == (18, 52)


# The ListOps FIT encoder is traced under random configs in tests/test_config_fuzz.py.
@pytest.mark.parametrize("fixture,spec", [(fixtures.cifar10, "configs/lra/image/fit.py:tiny")])
@pytest.mark.slow
def test_tiny_lra_configs_train(tmp_path, fixture, spec):
  summary = train_and_evaluate(lra_core.load_config(spec, fixture.build(tmp_path)), tmp_path / "run")
  assert np.isfinite(summary["test_loss"])


def test_fit_ar_logits_add_a_learned_bias_to_the_tied_output_as_pix2seq():
  """pix2seq's FIT-AR defaults to output_bias=True: logits = x E^T / D + b, b learned (zeros at first)."""
  assert lra_core.load_config("configs/imagenet64/fit_ar.py", []).model.output_bias
  model = make_model(make_config())
  x = jax.random.normal(jax.random.key(2), (2, 3, 16))
  tied = oracles.forward(model.embed, x, method="attend") / 16  # x E^T / D, E what the embedding's lookups return
  np.testing.assert_allclose(oracles.forward(model.head, x), tied, atol=1e-5)  # b starts at zero
  inputs = tokens()
  before = oracles.forward(model, inputs)
  b = jnp.arange(VOCAB, dtype=jnp.float32) / 7.0
  model.head.bias[...] = b
  np.testing.assert_allclose(oracles.forward(model.head, x), tied + b, atol=1e-5)
  np.testing.assert_allclose(oracles.forward(model, inputs) - before, jnp.broadcast_to(b, before.shape), atol=1e-5)
  assert make_model(make_config(output_bias=False)).head.bias is None
