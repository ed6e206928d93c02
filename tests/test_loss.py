"""lra_core/tasks/base.py's token loss: equal to log_softmax read at the target (values exactly, gradients
to float32 rounding), and its gradient, compiled for a TPU slice (libtpu), needs no temporary beyond what
it returns, with whole rows per chip and with the time axis split over chips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lra_core.compilation import topologies
from lra_core.tasks.base import token_nll

needs_libtpu = pytest.mark.skipif(not topologies.libtpu_installed(), reason="libtpu is not installed")


def log_softmax_at_target(logits, targets):
  """The textbook form: the whole float32 log_softmax, then a gather."""
  return -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_token_loss_equals_log_softmax_at_the_target(dtype):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 17, 50)) * 4, dtype)
  targets = jnp.asarray(rng.integers(0, 50, (3, 17)))
  weights = jnp.asarray(rng.normal(size=(3, 17)), jnp.float32)
  np.testing.assert_array_equal(token_nll(logits, targets), log_softmax_at_target(logits, targets))
  grad = lambda nll: jax.grad(lambda x: (nll(x, targets) * weights).sum())(logits)
  got, want = grad(token_nll), grad(log_softmax_at_target)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)


@needs_libtpu
@pytest.mark.parametrize("split", ["rows", "time"])
def test_the_loss_gradient_keeps_no_vocabulary_sized_temporary(split):
  """Per chip 4,096 x 32,768 bfloat16 logits (256 MiB): the textbook form keeps their float32 log_softmax
  for the backward pass (512 MiB), and with time split over chips its gather's transpose adds a float32
  scatter-add buffer (1.5 GiB in all)."""
  devices = topologies.tpu_devices("v5e:2x2")
  axis = "data" if split == "rows" else "sequence"
  mesh = jax.sharding.Mesh(np.array(devices), (axis,))
  spec = P(axis) if split == "rows" else P(None, axis)
  rows, length = (4, 4096) if split == "rows" else (1, 4 * 4096)
  logits = jax.ShapeDtypeStruct((rows, length, 32768), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
  targets = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=NamedSharding(mesh, spec))
  temporaries = {}
  for name, nll in (("fused", token_nll), ("textbook", log_softmax_at_target)):
    step = jax.jit(jax.value_and_grad(lambda x, y: nll(x, y).sum()))
    with jax.set_mesh(mesh):
      temporaries[name] = step.lower(logits, targets).compile().memory_analysis().temp_size_in_bytes
  per_chip = 4096 * 32768 * 2
  assert temporaries["fused"] < per_chip / 16, temporaries
  assert temporaries["textbook"] >= 2 * per_chip, temporaries  # what the fused form saves
