"""Checkpoints on each host's own disk, beside the workdir's: a restart loses the steps since the last
local save, not those since the workdir's last checkpoint.

A save to an object store takes minutes on a large pod, so `train.checkpoint_every` stays long and a
lost slice loses every step since the last one. With `train.local_checkpoint_every` and
`train.local_checkpoint_dir` (a local SSD or RAM disk of each host), every process also writes its own
shards of the train state there that often, at its disk's speed and with no collective: one .npz of
the arrays its devices hold (each shard once per device) and the checkpoint's meta (data position,
sums, training time), made complete by a rename. It keeps the newest two; they are for this workdir
only (a folder named after it), for this mesh and process count, and for this config (a layout key:
a workdir deleted and started again with other settings does not pick up the old run's steps; with
the same settings, data and code those steps are the ones it would train again).

On a restart every process offers the local steps it holds with the run's layout, and the run starts
from the newest step every process holds, if it is newer than the workdir's newest checkpoint, else
from that one (`newest_held`, a collective): a host that lost its disk, or came back as another
machine, sends every process back to the persistent checkpoint. The npz members' CRCs catch a damaged
file as a read error. A mesh or process count that changed reads the persistent tier only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import shutil
import zipfile

import jax
import numpy as np
from jax.experimental import multihost_utils

from lra_core.errors import CheckpointError
from lra_core.runtime import agreement

KEEP = 2  # local steps kept: the newest one and the one before it, while the newest is written
DONE = "meta.json"  # written last, inside the step's folder before its rename: a folder without it is not a step


def folder_for(root: str, workdir: str) -> pathlib.Path:
  """This process's folder for `workdir`'s local checkpoints under `root` (a local path: lra_core.config
  refuses an object store there)."""
  name = pathlib.PurePath(str(workdir).rstrip("/")).name or "run"
  key = hashlib.sha1(str(workdir).encode()).hexdigest()[:12]  # two workdirs of one name stay apart
  return pathlib.Path(root).expanduser() / f"{name}-{key}" / f"process_{jax.process_index()}"


# Of the train section, the settings a run's steps depend on; the others say how often it logs, evaluates
# and saves, and may change between restarts.
TRAJECTORY = ("seed", "steps", "batch_size", "seq_len", "update_len", "grad_accum_steps", "skip_nonfinite")


def layout_key(state: dict, config=None) -> str:
  """What a local step must match to be read back by this run: every array's path, shape, dtype and
  sharding, the process count and this process's devices, and what of `config` its steps depend on
  (model, optimizer, data, task, TRAJECTORY)."""
  parts = [f"processes={jax.process_count()}", f"devices={[d.id for d in jax.local_devices()]}"]
  if config is not None:
    kept = lambda k: not k.startswith(("train.", "mesh.")) or k.removeprefix("train.") in TRAJECTORY  # noqa: E731
    parts += [f"{k}={v}" for k, v in sorted(agreement.config_table(config).items()) if kept(k)]
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    parts.append(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{getattr(leaf, 'sharding', None)}")
  return hashlib.sha1("\n".join(parts).encode()).hexdigest()


class LocalTier:
  """Saves and restores this process's shards of the train state under `folder`, for the layout `key`
  (`layout_key` of the run's abstract state)."""

  def __init__(self, folder: pathlib.Path, key: str):
    self.folder, self.key = folder, key

  def steps(self) -> list[int]:
    """The complete local steps saved with this layout, oldest first."""
    held = []
    for path in self.folder.glob("[0-9]*") if self.folder.is_dir() else ():
      try:
        if path.name.isdigit() and json.loads((path / DONE).read_text())["layout"] == self.key:
          held.append(int(path.name))
      except (OSError, ValueError, KeyError):  # a step cut short, or damaged: not offered
        continue
    return sorted(held)

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Writes this process's shards of `state` at `step` (blocks until they are on the host)."""
    self.folder.mkdir(parents=True, exist_ok=True)
    for stale in self.folder.glob("*.partial"):  # saves a kill cut short
      shutil.rmtree(stale, ignore_errors=True)
    staging = self.folder / f"{step}.partial"
    staging.mkdir()
    arrays, index = {}, []
    for i, leaf in enumerate(jax.tree.leaves(state)):
      for j, shard in enumerate(leaf.addressable_shards):
        name, data = f"a{i}_{j}", np.asarray(shard.data)
        # As raw bytes: npz keeps numpy's own dtypes only (bfloat16 would come back as void).
        arrays[name] = np.atleast_1d(data).view(f"u{data.dtype.itemsize}")
        index.append([i, shard.device.id, name, str(data.dtype), list(data.shape)])
    np.savez(staging / "shards.npz", **arrays)
    done = {"layout": self.key, "step": step, "shards": index, "meta": meta}
    (staging / DONE).write_text(json.dumps(done))
    final = self.folder / str(step)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for old in self.steps()[:-KEEP]:
      shutil.rmtree(self.folder / str(old), ignore_errors=True)

  def restore(self, step: int, abstract: dict) -> tuple[dict, dict]:
    """(state laid out as `abstract`'s shardings say, meta) of local step `step`."""
    path = self.folder / str(step)
    try:
      saved = json.loads((path / DONE).read_text())
      with np.load(path / "shards.npz") as shards:
        by_place = {
          (i, device): shards[name].view(jax.numpy.dtype(dtype)).reshape(shape)
          for i, device, name, dtype, shape in saved["shards"]
        }
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
      raise CheckpointError(f"local checkpoint {path} cannot be read ({type(e).__name__}: {e}).") from e
    leaves, tree = jax.tree.flatten(abstract)
    restored = []
    for i, leaf in enumerate(leaves):
      devices = leaf.sharding.addressable_devices_indices_map(leaf.shape)
      parts = [jax.device_put(by_place[(i, d.id)], d) for d in devices]
      restored.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts))
    return jax.tree.unflatten(tree, restored), saved["meta"]


def newest_held(tier: LocalTier, above: int | None) -> int | None:
  """The newest local step every process holds with the run's layout, if newer than `above` (the
  workdir's newest checkpoint); None otherwise. Every process must call it (a collective when there are
  several)."""
  held = tier.steps()[-KEEP:]
  offered = np.full((KEEP,), -1, np.int64)
  offered[: len(held)] = held
  if jax.process_count() > 1:
    every = np.asarray(multihost_utils.process_allgather(offered))
    common = set.intersection(*(set(row.tolist()) for row in every)) - {-1}
  else:
    common = set(held)
  newest = max(common, default=None)
  if newest is None or (above is not None and newest <= above):
    if held and (above is None or held[-1] > above):
      logging.warning(
        "local checkpoint step %d of %s is not held by every process: the run starts from the workdir's checkpoint",
        held[-1],
        tier.folder,
      )
    return None
  return newest
