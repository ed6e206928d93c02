"""State carried between update windows (the mechanism Transformer-VQ's cache uses).

A probe model predicts from the running mean of all token embeddings so far; its carry is the
running sum and count. Evaluating in windows with the carry must equal evaluating whole
sequences, and the trainer must reset the carry at the first window of each sequence batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lra_core
from lra_core import registry
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.evaluate import evaluate
from lra_core.protocol import Capabilities, Family, Smoke
from lra_core.train import train_and_evaluate


class CarryProbe(nnx.Module):
  def __init__(self, m, run, *, rngs):
    d, v = 16, m.vocab_size
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (v, d)))
    self.out = nnx.Param(jax.random.normal(rngs.params(), (d, v)) * 0.1)

  def init_carry(self, batch_size):
    return {"sum": jnp.zeros((batch_size, 16)), "count": jnp.zeros((batch_size,))}

  def __call__(self, inputs, *, carry=None, rngs=None):
    x = self.embed[...][inputs]
    start = self.init_carry(inputs.shape[0]) if carry is None else carry
    sums = start["sum"][:, None] + jnp.cumsum(x, axis=1)
    counts = start["count"][:, None] + jnp.arange(1, inputs.shape[1] + 1)
    logits = (sums / counts[..., None]) @ self.out[...]
    if carry is None:
      return logits
    return logits, {"sum": sums[:, -1], "count": counts[:, -1]}


PROBE = Family(
  name="carry_probe",
  model=CarryProbe,
  tasks=("lm",),
  capabilities=Capabilities(carry=True),
  smoke=Smoke(config="", data=""),
)


@pytest.fixture
def probe(monkeypatch):
  """Registers the probe as family `carry_probe` for the duration of a test."""
  real = registry.family
  monkeypatch.setattr(registry, "family", lambda name: PROBE if name == "carry_probe" else real(name))


@pytest.fixture
def text_file(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "corpus.txt"
  path.write_bytes(bytes(rng.integers(97, 105, size=8000).astype(np.uint8)))
  return str(path)


def probe_config(text_file, *overrides):
  return lra_core.load_config(
    "configs/enwik8/transformer.py:tiny",
    ["model.name=carry_probe", f"data.path={text_file}", "train.eval_batches=0", *overrides],
  )


def test_windowed_evaluation_with_carry_equals_whole_sequences(tmp_path, probe, text_file):
  train_and_evaluate(probe_config(text_file, "train.update_len=16"), tmp_path)
  windowed = evaluate(probe_config(text_file, "train.update_len=16"), tmp_path, "validation")
  whole = evaluate(probe_config(text_file), tmp_path, "validation")
  assert windowed["loss"] == pytest.approx(whole["loss"], rel=1e-6)
  # Sanity of the oracle: windows that start afresh (16-token sequences, the same bytes) see less
  # context and score differently, so equality above needs the carry.
  fresh = evaluate(probe_config(text_file, "train.seq_len=16"), tmp_path, "validation")
  assert abs(fresh["loss"] - whole["loss"]) > 1e-3, (fresh, whole)


def test_trainer_resets_the_carry_at_each_new_sequence(tmp_path, probe, text_file):
  config = probe_config(text_file, "train.update_len=16", "train.steps=8")  # 4 windows per sequence
  assert train_and_evaluate(config, tmp_path, stop_at_step=6) == {"stopped_at": 6}
  ckpt = Checkpointer(tmp_path)
  restored, _ = ckpt.restore(6, None)
  ckpt.close()
  # Step 6 ends window 2 of the second sequence batch: 2 windows * 16 tokens seen since the reset.
  np.testing.assert_array_equal(np.asarray(restored["carry"]["count"]), np.full(8, 32.0))
