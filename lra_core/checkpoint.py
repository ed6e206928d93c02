"""Checkpoints of the train state and the data position (orbax CheckpointManager).

Each checkpoint `<workdir>/checkpoints/<step>/` holds `state` (params, optimizer state, step,
root RNG key, model state, carried state) and `meta` (JSON: the data position and anything small
the loop needs). Orbax writes to a temporary folder and renames it when complete, so a
checkpoint that was cut off is never listed. Restores always use an abstract target with
shardings: the state lands directly on the current mesh, whatever mesh saved it.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import orbax.checkpoint as ocp

from lra_core.errors import CheckpointError


class Checkpointer:
  def __init__(self, workdir: str | pathlib.Path, *, keep: int = 3, async_save: bool = True):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: dict, meta: dict, *, force: bool = True) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, step: int, abstract_state: dict | None) -> tuple[dict, dict]:
    """-> (state placed as `abstract_state`'s shardings say, meta).

    Without `abstract_state` the arrays come back as saved (for inspection, not for training:
    containers such as optax states are then plain lists and dicts).
    """
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"checkpoint {self.directory / str(step)} does not match this model and "
                            f"optimizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}).") from e
    logging.info("restored checkpoint at step %d from %s", step, self.directory)
    return restored["state"], dict(restored["meta"])

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(workdir: str | pathlib.Path, abstract_state: dict, step: int | None = None) -> tuple[dict, int]:
  """The params (and step) of the latest (or given) checkpoint in `workdir`, for eval and sampling."""
  ckpt = Checkpointer(workdir, async_save=False)
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"no checkpoint in {ckpt.directory}; train first with "
                          f"`python -m lra_core.train --workdir={workdir}`.")
  state, _ = ckpt.restore(step, abstract_state)
  ckpt.close()
  jax.block_until_ready(state["params"])
  return state, step
