"""The EMA of the weights (optim.ema_decay): kept in the train state, updated after every step
without changing training, checkpointed and resumed exactly, and used (beside the raw weights)
for evaluation and sampling."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lra_core
from fixtures import imagenet64 as fx
from lra_core import layout, sample
from lra_core.checkpoints.checkpointer import Checkpointer
from lra_core.data import DataInfo
from lra_core.evaluate import evaluate
from lra_core.run import optim
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task
from lra_core.train import train_and_evaluate

# The family whose runs keep an EMA (a diffusion model samples with it), for the whole run below.
SPEC = "configs/imagenet64/fit_denoiser.py:tiny"
SMALL = ("model.d_model=32", "model.d_latent=32", "model.d_ff=64", "model.latent_d_ff=64", "model.layers=L(1)G(1)L(1)")
# The recurrence is the optimizer's, the same for every family: a one-layer language model's train steps
# compile in a third of the denoiser's time.
STEPS_SPEC = "configs/enwik8/transformer.py:tiny"
pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # the whole, split and resumed runs compile once


def _steps(decay: float, n: int = 3, warmup: bool = False):
  """(states after each of n train steps, config) of a tiny language model on a fixed batch."""
  overrides = ["model.num_layers=1", f"optim.ema_decay={decay}", f"optim.ema_warmup={warmup}"]
  config = lra_core.load_config(STEPS_SPEC, overrides)
  mesh = layout.make_mesh(config.mesh)
  tx, schedule = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  task = make_task(config, DataInfo(vocab_size=256, unit="byte"))
  rng, shape = np.random.default_rng(0), (8, config.train.seq_len)
  batch = {
    "inputs": jnp.asarray(rng.integers(0, 256, shape), jnp.int32),
    "targets": jnp.asarray(rng.integers(0, 256, shape), jnp.int32),
    "weights": jnp.ones(shape, jnp.float32),
  }
  step = jax.jit(make_train_step(config, spec, task, tx, schedule))
  states = [spec.init()]
  for _ in range(n):
    states.append(step(states[-1], batch)[0])
  return states, config


@pytest.mark.slow  # trains; the full suite runs it
def test_ema_follows_its_recurrence_and_leaves_training_unchanged():
  with_ema, _ = _steps(0.5)
  without, _ = _steps(0.0)
  assert "ema" not in without[0] and "ema" in with_ema[0]
  jax.tree.map(np.testing.assert_array_equal, with_ema[0]["ema"], with_ema[0]["params"])  # starts at init
  for a, b in zip(with_ema, without):  # the raw weights train exactly as without an EMA
    jax.tree.map(np.testing.assert_array_equal, a["params"], b["params"])
  for prev, cur in zip(with_ema, with_ema[1:]):
    expected = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, prev["ema"], cur["params"])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), cur["ema"], expected)
  moved = jax.tree.leaves(
    jax.tree.map(lambda e, p: float(jnp.abs(e - p).max()), with_ema[-1]["ema"], with_ema[-1]["params"])
  )
  assert max(moved) > 1e-5  # the average lags the weights


@pytest.mark.slow
def test_ema_warmup_decays_by_min_of_d_and_1_plus_n_over_10_plus_n():
  """TensorFlow's ExponentialMovingAverage with num_updates: the update after n updates uses
  min(d, (1 + n) / (10 + n)), so at d 0.9999 the first three use 0.1, 2/11 and 3/12."""
  states, config = _steps(0.9999, warmup=True)
  assert lra_core.load_config(SPEC, []).optim.ema_warmup  # the tiny config's: runs of a few hundred steps
  for n, (prev, cur) in enumerate(zip(states, states[1:])):
    d = min(0.9999, (1 + n) / (10 + n))
    expected = jax.tree.map(lambda e, p: d * e + (1 - d) * p, prev["ema"], cur["params"])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), cur["ema"], expected)
  assert float(optim.ema_rate(config, 10**6)) == pytest.approx(0.9999)


@pytest.mark.slow
def test_ema_is_checkpointed_resumed_exactly_and_used_to_evaluate_and_sample(tmp_path):
  data = fx.build(tmp_path)
  config = lra_core.load_config(SPEC, [*data, *SMALL, "optim.ema_decay=0.5"])
  whole = train_and_evaluate(config, tmp_path / "whole")
  # Both weights are evaluated, and they differ.
  assert np.isfinite(whole["val_loss"]) and np.isfinite(whole["val_loss_raw"])
  assert whole["val_loss"] != whole["val_loss_raw"] and whole["test_loss"] != whole["test_loss_raw"]
  logged = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
  assert any("val_loss_raw" in r for r in logged)

  # Interrupted at step 2 and resumed: the same EMA and the same metrics as the run in one go.
  assert train_and_evaluate(config, tmp_path / "split", stop_at_step=2) == {"stopped_at": 2}
  split = train_and_evaluate(config, tmp_path / "split")
  for key in ("val_loss", "val_loss_raw", "test_loss", "test_loss_raw", "param_checksum"):
    assert split[key] == whole[key], key

  # The checkpoint holds the EMA; evaluate and sample restore it and use it.
  ckpt = Checkpointer(tmp_path / "whole")
  saved, _ = ckpt.restore(ckpt.latest_step(), None)
  ckpt.close()
  again = evaluate(config, tmp_path / "whole", "test")
  assert again["loss"] == pytest.approx(whole["test_loss"], rel=1e-6)
  assert again["loss_raw"] == pytest.approx(whole["test_loss_raw"], rel=1e-6)
  model, _ = sample.load_model(config, tmp_path / "whole")
  _, params, _ = nnx.split(model, nnx.Param, ...)
  mine, theirs = jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(saved["ema"])  # (int vs str keys)
  assert len(mine) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(mine, theirs))
  raw = jax.tree.leaves(saved["params"])
  assert not all(np.array_equal(a, b) for a, b in zip(mine, raw))
