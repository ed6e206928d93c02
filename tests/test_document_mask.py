"""Document boundaries in packed rows (data.document_mask): the shared pieces and the baselines.

The oracle (tests/oracles.py, assert_documents_independent): a row packing two documents gives
each document the outputs it gets alone at the start of a row. Each family's own test file runs
it for its variants and kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_transformer import make_config

import oracles
import tiers
from lra_core import config as config_lib
from lra_core.data import document_mask
from lra_core.errors import ConfigError
from lra_core.kernels.packed_documents import segment_positions, segment_starts
from lra_core.kernels.softmax.reference import attention_mask, dot_product_attention, local_attention
from lra_core.models import transformer
from lra_core.protocol import RunInfo


def test_segment_positions_and_starts():
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(oracles.compiled(segment_positions, seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
  np.testing.assert_array_equal(oracles.compiled(segment_starts, seg)[0], [1, 0, 0, 1, 0, 1, 1, 0])


@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_with_segments_equals_masked_quadratic(causal):
  b, t, h, d, w = 2, 21, 2, 4, 4
  q, k, v = jax.random.normal(jax.random.key(0), (3, b, t, h, d))
  seg = jnp.array([[1] * 6 + [2] * 9 + [3] * 4 + [0] * 2, [1] * 3 + [2] * 18])
  valid = seg > 0
  got = oracles.compiled(local_attention, q, k, v, window=w, causal=causal, k_valid=valid, segments=seg)
  m = oracles.compiled(
    attention_mask, jnp.arange(t), jnp.arange(t), causal=causal, window=w, k_valid=valid, q_segments=seg, k_segments=seg
  )
  real = np.asarray(valid)  # padding queries read no key at all: their rows are arbitrary
  np.testing.assert_allclose(
    np.asarray(got)[real], np.asarray(oracles.compiled(dot_product_attention, q, k, v, mask=m))[real], atol=1e-5
  )


CASES = [
  dict(task="lm", variant="transformer"),
  dict(task="lm", variant="transformer++", num_kv_heads=1),
  dict(task="lm", variant="transformer+", window=4),
  dict(task="mlm", variant="transformer"),
  dict(task="mlm", variant="transformer++", window=3),
]


@pytest.mark.parametrize(
  "case", tiers.quick(CASES, keep=[1, 4], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
)
def test_transformer_documents_are_independent(case):
  config = make_config(seq_len=24, **case)
  model = transformer.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=0))
  model.eval()
  doc_a, doc_b = np.arange(3, 13) % 23, (np.arange(9) * 5 + 1) % 23
  apply = lambda rows, segs: oracles.forward(model, rows, segment_ids=segs)
  oracles.assert_documents_independent(apply, doc_a, doc_b, 24)


def test_bad_segment_ids_shape_is_one_sentence():
  config = make_config(seq_len=8)
  model = transformer.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match="segment_ids shape"):
    model(jnp.zeros((2, 8), jnp.int32), segment_ids=jnp.zeros((2, 7), jnp.int32))


@pytest.mark.parametrize(
  "packing, setting, expected",
  [("pack", "auto", True), ("concat", "auto", False), ("concat", "true", True), ("pack", "false", False)],
)
def test_document_mask_setting(packing, setting, expected):
  config = config_lib.load_config(
    "configs/c4/transformer.py:tiny", [f"data.packing={packing}", f"data.document_mask={setting}"]
  )
  assert document_mask(config) is expected


def test_document_mask_is_off_for_datasets_without_documents():
  assert not document_mask(config_lib.load_config("configs/lra/listops/transformer.py:tiny"))
  assert not document_mask(config_lib.load_config("configs/enwik8/transformer.py:tiny"))


def test_bad_document_mask_setting_is_rejected():
  from lra_core.data import text

  config = config_lib.load_config("configs/c4/transformer.py:tiny", ["data.document_mask=maybe"])
  with pytest.raises(ConfigError, match="data.document_mask 'maybe' is not one of"):
    text.check_settings(config)


def test_isolation_oracle_holds_for_the_transformer():
  config = make_config(seq_len=20, task="mlm")
  model = transformer.Model(config.model, RunInfo.of(config), rngs=nnx.Rngs(params=0))
  model.eval()
  oracles.assert_documents_isolated(
    lambda rows, segs: oracles.forward(model, rows, segment_ids=segs), np.arange(1, 8), np.arange(2, 13), 20, vocab=23
  )


@pytest.mark.slow  # two short training runs
def test_c4_mlm_run_masks_documents_and_says_so(tmp_path, caplog):
  """Packed C4 masked-LM rows reach the model with their segment ids: the log says the mask is on,
  and the run differs from one with the mask off (same data, seed and steps)."""
  import logging

  import lra_core
  from fixtures import c4_mlm
  from lra_core.train import train_and_evaluate

  (tmp_path / "c4").mkdir()
  overrides = c4_mlm.build(tmp_path / "c4") + ["train.steps=2", "train.eval_batches=1", "train.test_at_end=False"]
  caplog.set_level(logging.INFO)
  on = train_and_evaluate(lra_core.load_config(c4_mlm.SPEC, overrides), tmp_path / "on")
  assert "document mask on" in caplog.text
  off = train_and_evaluate(
    lra_core.load_config(c4_mlm.SPEC, overrides + ["data.document_mask=false"]), tmp_path / "off"
  )
  assert "document mask off" in caplog.text
  assert on["val_loss"] != off["val_loss"]
