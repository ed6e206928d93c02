"""Block Transformer: causality at every position in a block, decode == forward, fast generation ==
repeated full-forward argmax, padding behaviour, Table 3 sizes, the authors' optimizer and schedules,
uptraining, and the tiny configs (packed documents and pad masking: tests/test_block_documents.py)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import fixtures.c4
import lra_core
import oracles
from lra_core import decoding
from lra_core.errors import ConfigError, DecodingError
from lra_core.models import block_transformer as bt
from lra_core.models import transformer
from lra_core.models.layers import core as layers
from lra_core.protocol import RunInfo
from lra_core.registry import non_embedding_parameter_count
from lra_core.tasks.base import token_nll
from lra_core.tasks.lm import loss_by_block_position
from lra_core.train import train_and_evaluate
from oracles import assert_decode_matches_forward, assert_no_future_leakage

VOCAB, PAD, L = 17, 0, 4
SPEC = "configs/c4/block_transformer.py"


def make_config(seq_len=16, **model):
  c = ml_collections.ConfigDict()
  c.task = "lm"
  defaults = dict(
    vocab_size=VOCAB,
    pad_id=PAD,
    block_len=L,
    d_model=32,
    num_layers=2,
    num_heads=4,
    encoder_width=16,
    encoder_layers=1,
    encoder_heads=2,
  )
  c.model = bt.model_config(**{**defaults, **model})
  c.train = ml_collections.ConfigDict(dict(seq_len=seq_len))
  c.data = ml_collections.ConfigDict(dict(block_padding=0))
  bt.validate_config(c)
  return c


def make_model(config, seed=0):
  model = bt.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=seed))
  model.eval()
  return model


def tokens(b=2, t=14, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 1, VOCAB)  # no pad tokens


VARIANTS = [
  dict(),
  dict(token_decoder="summation", token_d_model=16, token_num_heads=2),  # MEGABYTE-like
  dict(token_decoder="cross"),
  dict(embedder="cls", prefix_len=3),
  dict(embedder="encoder", block_len=1),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "prefix")
def test_causal_at_every_position_in_a_block_and_decode_matches_forward(variant):
  model = make_model(make_config(**variant))
  x = tokens()
  logits = oracles.forward(model, x)
  assert logits.shape == (2, 14, VOCAB)
  # Every offset within a block, block ends (t = 3, 7, 11) and the partial last block.
  assert_no_future_leakage(model, x, logits, range(13), vocab=VOCAB, shift=3, changed_atol=1e-6)
  assert_decode_matches_forward(model, x, logits, atol=1e-4)


def test_each_block_reads_the_previous_blocks_context():
  """The first token of block 1 is predicted at position 3 (the end of block 0) from block 0's context;
  positions inside block 1 read the same context plus block 1's earlier tokens only."""
  model = make_model(make_config())
  x = tokens(t=12)
  logits = oracles.forward(model, x)
  changed = oracles.forward(model, x.at[:, 0].set(5 if int(x[0, 0]) != 5 else 6))
  assert not np.allclose(changed[:, 3:8], logits[:, 3:8], atol=1e-6)  # through the context embedding
  np.testing.assert_allclose(oracles.forward(model, x.at[:, 5].set(9))[:, 4:5], logits[:, 4:5], atol=1e-6)


# -- padding ----------------------------------------------------------------------------------------------------


def left_pad(x, n):
  return jnp.concatenate([jnp.full((x.shape[0], n), PAD, x.dtype), x], axis=1)


def test_whole_pad_blocks_are_absent_and_right_padding_changes_nothing():
  model = make_model(make_config())
  x = tokens(t=10)
  logits = oracles.forward(model, left_pad(x, 2))[:, 2:]
  for extra in (L, 3 * L):  # more whole blocks of padding on the left
    np.testing.assert_allclose(oracles.forward(model, left_pad(x, 2 + extra))[:, 2 + extra :], logits, atol=2e-5)
  right = jnp.concatenate([x, jnp.full((2, 5), PAD, x.dtype)], axis=1)
  np.testing.assert_allclose(oracles.forward(model, left_pad(right, 2))[:, 2:12], logits, atol=1e-5)


def test_padding_inside_a_block_is_a_token_so_alignment_matters():
  """Documented: the left pad modulo L_B sets the block alignment and changes the predictions (what
  random-length padding in training teaches the model to handle)."""
  model = make_model(make_config())
  x = tokens(t=10)
  a, b = oracles.forward(model, left_pad(x, 1))[:, 1:], oracles.forward(model, left_pad(x, 2))[:, 2:]
  assert not np.allclose(a, b, atol=1e-4)


# -- generation -------------------------------------------------------------------------------------------------


def greedy_by_forward(model, prompt, n):
  """Repeated full forward argmax over the prompt left-padded to a block boundary (the sequence is
  kept at its final length with right padding, which earlier positions never read)."""
  seq = left_pad(prompt, -prompt.shape[1] % L)
  start = seq.shape[1]
  seq = jnp.concatenate([seq, jnp.full((seq.shape[0], n), PAD, seq.dtype)], axis=1)
  for i in range(n):
    nxt = jnp.argmax(oracles.forward(model, seq)[:, start + i - 1], -1).astype(jnp.int32)
    seq = seq.at[:, start + i].set(nxt)
  return seq[:, start:]


@pytest.mark.parametrize(
  "variant",
  [dict(), dict(token_decoder="summation"), pytest.param(dict(token_decoder="cross"), marks=pytest.mark.slow)],
  ids=["prefix", "summation", "cross"],
)
def test_generate_greedy_equals_repeated_full_forward_argmax(variant):
  model = make_model(make_config(**variant))
  prompt = tokens(b=3, t=7, seed=2)
  lengths = np.array([7, 2, 5])
  out = bt.generate(model, prompt, prompt_lengths=lengths, max_new_tokens=10, key=jax.random.key(0), temperature=0.0)
  assert out.shape == (3, 10) and out.dtype == jnp.int32
  for row, n in enumerate(lengths):
    alone = greedy_by_forward(model, prompt[row : row + 1, :n], 10)
    np.testing.assert_array_equal(out[row], alone[0])
  # The one-token contract path over the same left-padded prompt agrees.
  aligned = left_pad(prompt, 1)
  slow = decoding.generate(model, aligned, max_new_tokens=10, key=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(out[0], slow[0, 8:])


def test_generate_eos_per_row_and_sampling_is_reproducible():
  model = make_model(make_config())
  prompt = tokens(b=2, t=6, seed=3)
  greedy = bt.generate(model, prompt, max_new_tokens=9, key=jax.random.key(0), temperature=0.0)
  eos = int(greedy[0, 2])
  stopped = bt.generate(model, prompt, max_new_tokens=9, key=jax.random.key(0), temperature=0.0, eos_id=eos)
  first = int(np.argmax(np.asarray(greedy[0]) == eos))
  np.testing.assert_array_equal(stopped[0, : first + 1], greedy[0, : first + 1])
  assert (np.asarray(stopped[0, first + 1 :]) == PAD).all()
  hits = np.flatnonzero(np.asarray(greedy[1]) == eos)
  end = hits[0] + 1 if hits.size else 9
  np.testing.assert_array_equal(stopped[1, :end], greedy[1, :end])
  one = bt.generate(model, prompt, max_new_tokens=9, key=jax.random.key(4), temperature=1.0, top_k=5)
  np.testing.assert_array_equal(
    one, bt.generate(model, prompt, max_new_tokens=9, key=jax.random.key(4), temperature=1.0, top_k=5)
  )


def test_generate_rejects_bad_input():
  model = make_model(make_config())
  with pytest.raises(DecodingError, match="prompt_lengths"):
    bt.generate(model, tokens(), prompt_lengths=[3, 20], max_new_tokens=2, key=jax.random.key(0))
  with pytest.raises(DecodingError, match="token ids must lie in"):
    bt.generate(model, tokens() + VOCAB, max_new_tokens=2, key=jax.random.key(0))


# -- loss by position in a block ------------------------------------------------------------------------------


def test_loss_by_block_position_splits_the_loss():
  logits = jax.random.normal(jax.random.key(0), (2, 8, VOCAB))
  batch = {"targets": tokens(t=8), "weights": jnp.ones((2, 8)).at[1, 5].set(0.0)}
  nll_by_token = oracles.compiled(token_nll, logits, batch["targets"])
  parts = oracles.compiled(loss_by_block_position, nll_by_token, batch, block_len=L)
  assert sorted(parts) == [f"block_pos{j}_loss" for j in range(1, L + 1)]
  nll = -jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(8), batch["targets"]] * batch["weights"]
  np.testing.assert_allclose(sum(float(s) for s, _ in parts.values()), float(nll.sum()), rtol=1e-6)
  # Input position 3 ends block 0: its target is token 4, the first of block 1.
  np.testing.assert_allclose(float(parts["block_pos1_loss"][0]), float(nll[:, [3, 7]].sum()), rtol=1e-6)
  assert float(parts["block_pos3_loss"][1]) == 3.0  # positions 1 and 5, one of them weighted 0


# -- sizes, configs, uptraining ---------------------------------------------------------------------------------

# Table 3 (block models); vanilla 5m is Table 2's "5M", 6 (12 D^2 + 13 D) = 4.74M at D 256.
TABLE_3 = {"5m": 4.7e6, "19m": 18.9e6, "85m": 85.1e6, "302m": 302e6, "805m": 805e6, "1.2b": 1.2e9}


@pytest.mark.parametrize(
  "arg,paper",
  [
    *TABLE_3.items(),
    ("5m,vanilla", 4.7e6),
    ("19m,vanilla", 19e6),
    ("85m,vanilla", 85e6),
    ("302m,vanilla", 302e6),
    ("5m,megabyte", 4.7e6),
    ("19m,megabyte", 18.9e6),
  ],
)
def test_non_embedding_parameters_match_the_papers_tables(arg, paper):
  count = non_embedding_parameter_count(lra_core.load_config(f"{SPEC}:{arg}"))
  assert abs(count / paper - 1) < 0.02, (arg, count)


def test_config_errors_are_clear():
  with pytest.raises(ConfigError, match="train.seq_len 18 is not a multiple of model.block_len 4"):
    make_config(seq_len=18)
  with pytest.raises(ConfigError, match="d_model 30 is not a multiple of model.block_len 4"):
    make_config(d_model=30, num_heads=3)
  with pytest.raises(ConfigError, match="token_decoder 'sum' is not one of"):
    make_config(token_decoder="sum")
  with pytest.raises(ConfigError, match="pad_id 17 is outside the vocabulary"):
    make_config(pad_id=17)
  with pytest.raises(ConfigError, match="give one model size of .*; got \\['19m', '5m'\\]"):
    lra_core.load_config(f"{SPEC}:5m,19m")
  with pytest.raises(ConfigError, match="no MEGABYTE model"):
    lra_core.load_config(f"{SPEC}:302m,megabyte")
  with pytest.raises(ConfigError, match="data.block_padding 2 differs from model.block_len 4"):
    lra_core.load_config(f"{SPEC}:tiny", ["data.block_padding=2"])


@pytest.mark.parametrize("arg", ["85m", "5m,vanilla", "19m,megabyte", "1.2b", "302m,uptrain", "805m,uptrain"])
def test_optimizer_and_schedule_are_the_authors(arg):
  """AdamW b2 .95, weight decay 0.1, cosine to 10%, clipping 1.0; 572,000 steps with 3,000 warm-up
  at batch 256 and 286,000 with 1,500 at batch 512; uptraining takes 10% of the steps, same warm-up."""
  config = lra_core.load_config(f"{SPEC}:{arg}")
  o = config.optim
  assert (o.name, o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm, o.schedule, o.min_lr_ratio, o.decay_steps) == (
    "adamw",
    0.9,
    0.95,
    1e-8,
    0.1,
    1.0,
    "cosine",
    0.1,
    0,
  )
  big = arg.split(",")[0] in ("805m", "1.2b")
  assert (config.train.batch_size, o.warmup_steps) == ((512, 1_500) if big else (256, 3_000))
  steps = 286_000 if big else 572_000
  assert config.train.steps == (steps // 10 if "uptrain" in arg else steps)


def test_every_layer_norm_has_pythias_epsilon_and_the_encoder_the_authors_heads():
  """GPT-NeoX's layer_norm_eps 1e-5 in every norm of both decoders and the encoder embedder, checked on
  the normalisation formula itself; the encoder embedder as the authors' (8 heads of 32 at width 256)."""
  model = make_model(make_config(embedder="encoder", encoder_width=64, encoder_heads=2))
  norms = [m for _, m in nnx.iter_graph(model) if isinstance(m, layers.LayerNorm)]
  assert len(norms) == 2 * (2 + 2 + 1) + 3  # two per layer (block, token, encoder stacks), three final
  for norm in norms:
    width = norm.scale.shape[0]
    x = 1e-3 * np.sin(np.arange(width, dtype=np.float32))[None]  # a variance near 5e-7: the epsilon weighs
    want = (x - x.mean()) / np.sqrt(x.var() + 1e-5)
    np.testing.assert_allclose(oracles.forward(norm, jnp.asarray(x)), want, rtol=1e-4, atol=1e-6)
  config = lra_core.load_config(SPEC, [])
  assert (config.model.encoder_width, config.model.encoder_heads) == (256, 8)


def test_uptraining_splits_the_vanilla_layers_and_averages_the_embeddings():
  config = make_config(embed_width=32)
  vanilla = transformer.Model(bt.vanilla_config(config), RunInfo("lm", seq_len=16), rngs=nnx.Rngs(params=3))
  model = make_model(config)
  params = bt.uptrain_params(
    nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(vanilla, nnx.Param)), config
  )
  nnx.update(model, params)
  v = nnx.to_pure_dict(nnx.state(vanilla, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, params["block_decoder"]["layers"][1], v["blocks"][1])
  # The vanilla final norm (here given other values than a fresh one's) goes to the token decoder only;
  # the block decoder's starts fresh, as in the authors' uptraining.
  trained = {"scale": v["final_norm"]["scale"] * 2.0, "bias": v["final_norm"]["bias"] + 0.5}
  again = bt.uptrain_params(
    nnx.to_pure_dict(nnx.state(make_model(config), nnx.Param)), {**v, "final_norm": trained}, config
  )
  jax.tree.map(np.testing.assert_array_equal, again["token_decoder"]["final_norm"], trained)
  np.testing.assert_array_equal(again["block_decoder"]["final_norm"]["scale"], np.ones(32))
  np.testing.assert_array_equal(again["block_decoder"]["final_norm"]["bias"], np.zeros(32))
  jax.tree.map(np.testing.assert_array_equal, params["token_decoder"]["layers"][0], v["blocks"][2])
  blocks = tokens(b=1, t=8).reshape(1, 2, L)
  np.testing.assert_allclose(
    oracles.forward(model.embedder, blocks), oracles.forward(vanilla.embed, blocks).mean(2), atol=1e-5
  )
  context = jax.random.normal(jax.random.key(1), (3, 32))
  prefix = oracles.forward(model.context_proj, context)
  np.testing.assert_allclose(prefix, jnp.stack([context, context], 1), atol=1e-6)
  with pytest.raises(ConfigError, match="does not split into 2 \\+ 2 layers"):
    bt.uptrain_params(params, {**v, "blocks": {0: v["blocks"][0]}}, config)


@pytest.mark.slow
def test_tiny_configs_train_and_uptrain(tmp_path, caplog):
  # Killed and resumed runs of this config: tests/test_kill_resume.py.
  # The vanilla source run, then the block model uptrained from it (its metrics: the loss at every
  # position of a block).
  overrides = fixtures.c4.build(tmp_path) + ["train.seq_len=32", "train.steps=2", "train.checkpoint_every=2"]
  vanilla = train_and_evaluate(lra_core.load_config(f"{SPEC}:tiny,vanilla", overrides), tmp_path / "vanilla")
  assert "test_block_pos1_loss" not in vanilla
  uptrained = lra_core.load_config(f"{SPEC}:tiny,uptrain", overrides + [f"train.init_from={tmp_path / 'vanilla'}"])
  with caplog.at_level("INFO"):
    up = train_and_evaluate(uptrained, tmp_path / "up")
  assert np.isfinite(up["test_loss"])
  assert all(np.isfinite(up[f"test_block_pos{j}_loss"]) for j in range(1, L + 1))
  assert f"parameters initialised from {tmp_path / 'vanilla'} (step 2)" in caplog.text
  with pytest.raises(ConfigError, match="not a vanilla transformer"):  # a block model is no source
    train_and_evaluate(
      lra_core.load_config(f"{SPEC}:tiny,uptrain", overrides + [f"train.init_from={tmp_path / 'up'}"]),
      tmp_path / "wrong",
    )


# -- the block_throughput table ---------------------------------------------------------------------------------


def test_throughput_table_has_megabyte_rows_beside_block_and_vanilla(tmp_path, monkeypatch):
  """Rows and ratios from stand-in timings (the table itself runs for minutes: docs/results.md)."""
  from lra_core.reproduce import block_transformer as table
  from lra_core.reproduce.common import Context

  speed = {"5m": 1.0, "19m": 0.5, "5m,megabyte": 0.8, "19m,megabyte": 0.4, "5m,vanilla": 0.1, "19m,vanilla": 0.05}
  seen = []

  def fake(config, *, batch_size, prompt_len, new_tokens, repeats, warmup):
    m = config.model
    kind = ",vanilla" if m.name == "transformer" else ",megabyte" if m.token_decoder == "summation" else ""
    arg = {256: "5m", 512: "19m"}[m.d_model] + kind
    seen.append(arg)
    return dict(tokens_per_s=1000 * speed[arg] * batch_size, state_mib=1.0, non_embedding=1, seconds=1.0)

  monkeypatch.setattr(table.generate, "time_generate", fake)
  result = table.block_throughput(Context(img_dir=tmp_path, log=lambda _: None))
  assert sorted(set(seen)) == sorted(speed)
  lines = [line for line in result.markdown.splitlines() if "| MEGABYTE-style |" in line]
  assert len(lines) == 8 and "| 800 | 8.0x | 1.2x |" in lines[0]  # prefill-heavy, batch 1, 5m
  assert "Block / MEGABYTE-style 1.2x-1.2x" in result.comparison and "Block / vanilla 10.0x-10.0x" in result.comparison
