"""Every registered family keeps the protocol its record declares (lra_core/protocol.py).

The records are the framework's only source of what a model can do, so each capability is checked
against the model the family really builds, and the families that decode pass the causal oracles:
changing later tokens leaves earlier logits unchanged, and decode_step one token at a time gives
the full forward pass. A new family is covered by adding its record; nothing here names one.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import family_configs
import lra_core
import oracles
import tiers
from lra_core import protocol, registry
from lra_core.tasks.base import apply_model

FAMILIES = registry.families()


def quick_tier(families, keep=("transformer",)):
  """One param per family; only `keep` stays in the quick tier (the rest compile a model each)."""
  return [pytest.param(f, id=f.name, marks=() if f.name in keep else pytest.mark.slow) for f in families]


def test_every_family_module_has_its_record():
  assert (
    {f.name for f in FAMILIES}
    == set(registry.family_names())
    >= {"transformer", "transformer_vq", "latte", "flash", "fit", "fit_denoiser", "block_transformer"}
  )
  with pytest.raises(lra_core.ConfigError, match="is not a module in models/"):
    registry.family("transformr")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_record_matches_the_model_it_builds(family):
  smoke = family.smoke
  config = lra_core.load_config(smoke.config, smoke.overrides)
  assert config.model.name == family.name and config.task in family.tasks
  model = nnx.eval_shape(lambda: registry.build_model(config))
  caps = family.capabilities
  assert isinstance(model, protocol.Denoiser) == (config.task == "diffusion")
  if caps.self_condition:
    assert isinstance(model, protocol.Denoiser)
  if caps.carry:
    assert family.keeps_carry(config) and callable(model.init_carry)
  if caps.block_losses:
    assert config.model.block_len > 0
  if caps.decode:
    causal = lra_core.load_config(smoke.causal)
    assert causal.task in ("lm", "image_ar") and causal.model.name == family.name
    decoder = nnx.eval_shape(lambda: registry.build_model(causal))
    assert isinstance(decoder, protocol.Decoder)
    assert (isinstance(decoder, protocol.Prefiller) and decoder.can_prefill) == caps.prefill
  names = {str(path[0]) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert set(family.embedding_params) & names or family.embedding_params == protocol.Family.embedding_params


@pytest.mark.parametrize("family", quick_tier([f for f in FAMILIES if f.capabilities.decode]))
def test_decoding_families_are_causal_and_decode_like_the_forward_pass(family):
  config = lra_core.load_config(family.smoke.causal)
  model = registry.build_model(config, seed=1)
  model.eval()
  length = min(config.train.seq_len, 32)
  tokens = jax.random.randint(jax.random.key(0), (2, length), 1, config.model.vocab_size)
  jitted = nnx.jit(lambda m, x: apply_model(m, x)[0])  # logits; what the model sows is dropped
  forward = lambda x: jitted(model, x)
  logits = forward(tokens)
  oracles.assert_no_future_leakage(
    forward, tokens, logits, (0, length // 2, length - 2), vocab=config.model.vocab_size, shift=5, changed_atol=1e-6
  )
  oracles.assert_decode_matches_forward(model, tokens, logits)


PAPER_ROWS = [(f.name, row) for f in FAMILIES for row in f.paper_rows]
FIRST_ROW_OF_EACH_FAMILY = [i for i, (name, _) in enumerate(PAPER_ROWS) if i == 0 or PAPER_ROWS[i - 1][0] != name]


@pytest.mark.parametrize(
  "row", tiers.quick([(row,) for _, row in PAPER_ROWS], keep=FIRST_ROW_OF_EACH_FAMILY, ids=lambda case: case[0].config)
)
def test_paper_rows_build_their_family_at_the_papers_size(row):
  config = lra_core.load_config(row.config)
  count = (
    registry.non_embedding_parameter_count(config)
    if row.counts == "non_embedding"
    else registry.parameter_counts(config)["total"]
  )
  assert abs(count - row.count) / row.count <= row.tolerance or row.gap_reason, (row, count)


def test_keeps_carry_follows_the_config():
  vq = registry.family("transformer_vq")
  config = lra_core.load_config(vq.smoke.config)
  assert vq.keeps_carry(config)
  assert not vq.keeps_carry(lra_core.load_config(vq.smoke.config, ["model.attention=full"]))
  assert not registry.family("transformer").keeps_carry(lra_core.load_config("configs/enwik8/transformer.py:tiny"))


def test_records_reject_inconsistent_capabilities():
  smoke = protocol.Smoke(config="configs/enwik8/transformer.py:tiny", data="enwik8")
  for capability, message in (("uptrain", "uptrain"), ("decode", "causal spec")):
    with pytest.raises(ValueError, match=message):
      protocol.Family(
        name="x", model=object, tasks=("lm",), smoke=smoke, capabilities=protocol.Capabilities(**{capability: True})
      )


@pytest.mark.parametrize("family", quick_tier([f for f in FAMILIES if f.capabilities.decode]))
def test_every_language_model_keeps_packed_documents_apart(family):
  """Each family's causal model takes segment_ids and no document of a packed row reads another
  (the isolation oracle, which holds at any boundary; each family's own tests run the exact oracle
  at the boundaries where it holds)."""
  config = lra_core.load_config(family.smoke.causal)
  model = registry.build_model(config, seed=1)
  model.eval()
  length = min(config.train.seq_len, 32)
  jitted = nnx.jit(lambda m, x, s: apply_model(m, x, segment_ids=s)[0] if s is not None else apply_model(m, x)[0])
  vocab = config.model.vocab_size
  doc_a, doc_b = np.arange(1, length // 2 + 2) % vocab, (np.arange(length // 2 - 3) * 3 + 2) % vocab
  oracles.assert_documents_isolated(lambda rows, segs: jitted(model, rows, segs), doc_a, doc_b, length, vocab=vocab)


# Head projections' starting standard deviation: 1/sqrt(fan-in), the fan-in being every input feature
# (d_model into the heads, heads x head_dim out of them), as the authors' initializers give it
# (Transformer-VQ: variance_scaling(1, fan_in, normal) over its DenseGeneral's input axis; the
# others: LeCun's truncated normal, with the truncation's variance corrected). Not H x head_dim.
HEADS_AXES = ("heads", "kv_heads")


def _head_kernels(params: nnx.State):
  """(path, kernel, number of leading input axes) of every projection into or out of attention heads."""
  for path, variable in nnx.to_flat_state(params):
    axes = getattr(variable, "logical_axes", None) or variable.get_metadata().get("logical_axes", ())
    if path[-1] != "kernel" or not set(axes) & set(HEADS_AXES):
      continue
    yield "/".join(map(str, path)), np.asarray(variable[...]), 2 if axes[0] in HEADS_AXES else 1


# Transformer-VQ's paper configs have one head (SHGA), where H x head_dim = head_dim: Table 6's MHA.
# FLASH's own GAU has no heads: its Performer baseline.
MULTI_HEAD = {"transformer_vq": ["model.head_type=mha", "model.num_heads=8"]}
HEADED_SPEC = {"flash": "configs/c4/flash.py:performer"}


@pytest.mark.parametrize("family", quick_tier(FAMILIES, keep=("transformer_vq",)), ids=lambda f: f.name)
def test_head_projections_start_from_their_true_fan_in(family):
  spec = HEADED_SPEC.get(family.name) or family_configs.specs(family)[0]
  config = family_configs.one_layer(family, spec, MULTI_HEAD.get(family.name, ()))
  kernels = list(_head_kernels(nnx.state(registry.build_model(config, seed=0), nnx.Param)))
  assert kernels, f"{family.name}: no head projection found"
  for path, kernel, n_in in kernels:
    fan_in = int(np.prod(kernel.shape[:n_in]))
    assert kernel.std() == pytest.approx(fan_in**-0.5, rel=0.03), (spec, path, kernel.shape)
