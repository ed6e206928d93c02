"""lra_core/checkpoints/local_tier.py: each process's shards on its host's own disk, read back into
the same layout. The trainer's use of it (a SIGKILL after a local save resumes from it bit-identically;
a lost local disk falls back to the workdir's checkpoint) is in test_kill_resume.py and, over two
processes, test_multiprocess.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lra_core
from lra_core.checkpoints import local_tier
from lra_core.errors import CheckpointError, ConfigError


def _state():
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  return {
    "params": {"w": put(jnp.arange(64.0).reshape(8, 8), P("fsdp")), "b": put(jnp.arange(8, dtype=jnp.bfloat16), P())},
    "step": put(jnp.asarray(7, jnp.int32), P()),
    "flags": put(jnp.asarray([True, False]), P()),
  }


def _abstract(state):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def test_a_saved_step_reads_back_into_the_same_layout_and_two_are_kept(tmp_path):
  state = _state()
  tier = local_tier.LocalTier(tmp_path / "process_0", local_tier.layout_key(_abstract(state)))
  for step in (2, 4, 6):
    tier.save(step, state, {"next_batch": step})
  assert tier.steps() == [4, 6]
  restored, meta = tier.restore(6, _abstract(state))
  assert meta == {"next_batch": 6}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert local_tier.newest_held(tier, above=4) == 6 and local_tier.newest_held(tier, above=6) is None


def test_a_step_cut_short_or_of_another_layout_is_not_offered_and_a_damaged_one_is_a_sentence(tmp_path):
  state = _state()
  tier = local_tier.LocalTier(tmp_path / "process_0", local_tier.layout_key(_abstract(state)))
  tier.save(2, state, {"next_batch": 2})
  (tmp_path / "process_0" / "4.partial").mkdir()  # killed while writing step 4
  other = local_tier.LocalTier(tmp_path / "process_0", "another mesh")
  assert tier.steps() == [2] and other.steps() == []
  shards = tmp_path / "process_0" / "2" / "shards.npz"
  data = bytearray(shards.read_bytes())
  data[len(data) // 3] ^= 0xFF
  shards.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"^local checkpoint .*/2 cannot be read \("):
    tier.restore(2, _abstract(state))


def test_a_workdir_s_local_folder_is_its_own():
  a, b = local_tier.folder_for("/ssd", "gs://bucket/runs/pg19"), local_tier.folder_for("/ssd", "gs://other/runs/pg19")
  assert a.parent.name.startswith("pg19-") and a != b and a.name == "process_0"


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["train.local_checkpoint_every=2"], "train.local_checkpoint_every needs train.local_checkpoint_dir"),
    (["train.local_checkpoint_every=2", "train.local_checkpoint_dir=gs://b/x"], "is an object store"),
    (["train.local_checkpoint_every=-1"], "train.local_checkpoint_every must be >= 0"),
  ],
)
def test_local_tier_settings_are_checked_with_the_config(overrides, message):
  with pytest.raises(ConfigError, match=message):
    lra_core.load_config("configs/lra/listops/transformer.py:tiny", overrides)


def test_a_run_with_other_settings_does_not_take_the_local_steps_of_the_old_one():
  """A workdir deleted and started again with another learning rate: another layout key, so the old
  run's local steps are not offered; the local tier's own cadence may change between restarts."""
  abstract = _abstract(_state())
  spec = "configs/lra/listops/transformer.py:tiny"
  key = lambda *o: local_tier.layout_key(abstract, lra_core.load_config(spec, list(o)))  # noqa: E731
  assert key() != key("optim.lr=0.5") and key() != key("train.seed=1")
  # How often it logs, evaluates and saves may change between restarts.
  assert key("train.checkpoint_every=100", "train.log_every=1") == key(
    "train.local_checkpoint_every=3", "train.local_checkpoint_dir=/dev/shm/ckpt"
  )
