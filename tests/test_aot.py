"""Ahead-of-time compilation: the memory estimate and the refusal of a step that cannot fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lra_core
from lra_core import aot
from lra_core.errors import ResourceError
from lra_core.train import train_and_evaluate
from fixtures import listops


def _step():
  return jax.jit(lambda w, x: (w - 0.1 * x.T @ jnp.tanh(x @ w), jnp.sum(x @ w)), donate_argnums=0)


ARGS = (jax.ShapeDtypeStruct((256, 256), jnp.float32), jax.ShapeDtypeStruct((64, 256), jnp.float32))


def test_estimate_counts_arguments_outputs_and_donation():
  compiled = aot.compile_step(_step(), *ARGS, name="step")
  estimate = aot.MemoryEstimate.of(compiled)
  assert estimate.arguments == (256 * 256 + 64 * 256) * 4
  assert estimate.outputs >= 256 * 256 * 4 and estimate.aliased == 256 * 256 * 4
  assert estimate.peak >= estimate.arguments
  w, x = jnp.ones((256, 256)), jnp.full((64, 256), 0.01)
  expected = _step()(jnp.ones((256, 256)), x)
  np.testing.assert_allclose(compiled(w, x)[1], expected[1], rtol=1e-6)


def test_a_step_over_the_budget_is_refused_with_the_estimate():
  with pytest.raises(ResourceError, match=r"needs about 0\.\d+ MiB per device .* more than the 0\.00 MiB available "
                                          r"\(train.memory_limit_gib\)"):
    aot.compile_step(_step(), *ARGS, name="step", limit_gib=1e-9)


def test_device_memory_limit_on_cpu_shares_the_host():
  limit, source = aot.device_memory_limit()
  assert 0 < limit * jax.local_device_count() <= 2**50 and "CPU" in source


def test_trainer_stops_before_allocating_state(tmp_path):
  config = lra_core.load_config(listops.SPEC, listops.build(tmp_path / "data") + ["train.memory_limit_gib=1e-6"])
  with pytest.raises(ResourceError, match="the train step needs about"):
    train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
