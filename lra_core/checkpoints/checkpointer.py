"""Checkpoints of the train state and the data position (orbax CheckpointManager).

Each checkpoint `<workdir>/checkpoints/<step>/` holds `state` (params, optimizer state, step,
root RNG key, model state, carried state) and `meta` (JSON: the data position and anything small
the loop needs). Orbax writes to a temporary folder and renames it when complete, so a
checkpoint that was cut off is never listed. Restores always use an abstract target with
shardings: the state lands directly on the current mesh, whatever mesh saved it.

Silent corruption is caught: `meta` records a digest of every saved array (`digests`: a sum of
the array's bit patterns with odd position weights, modulo 2^32, so one changed byte always
changes it), and a restore recomputes them. A mismatch is an unreadable checkpoint, reported
with the array's path.

A listed checkpoint that cannot be read (a disk that lost blocks, a file truncated by hand, a
digest that does not match) is never fatal while an older one can be read: `restore_latest`
falls back to the newest readable step, warns with the step it skipped, and moves the bad folder
to `<workdir>/unreadable_checkpoints/` (kept, not deleted) so later saves do not trip over it.
With several processes they decide together: every process tries the same step, all take the
newest step that every one of them read, and the folder is moved only after all have tried it.

`restore_params` reads only the parameters (evaluation, sampling, and a new run's start from another
run's: lra_core/checkpoints/init_from.py).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from lra_core.checkpoints import read_failures, save_limit
from lra_core.errors import CheckpointError, ConfigError, StoreFailure, brief
from lra_core.layer_stacks import STACKED
from lra_core.runtime import fs

READ_ONLY_NOTICE = "Given directory is read only=%s"  # orbax's warning at every read-only manager


def _not_read_only_notice(record: logging.LogRecord) -> bool:
  return record.msg != READ_ONLY_NOTICE


logging.getLogger("absl").addFilter(_not_read_only_notice)  # readers are read-only by design: no news


def reader_options() -> ocp.CheckpointManagerOptions:
  """Options of a manager that only reads (nothing to save, so no save interval to warn about). With
  several processes each reads on its own, without orbax's cross-process barriers: a process that
  cannot read a step must not leave the others waiting inside the restore; the callers make them
  agree afterwards (`_failed_processes`)."""
  alone = {}
  if jax.process_count() > 1:
    me = jax.process_index()
    alone = dict(multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))
  return ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0, **alone)


def check_directory(workdir: str | os.PathLike, what: str = "workdir") -> None:
  """ConfigError where checkpoints could be written under `workdir` but never read back: orbax finds a
  step's per-process files by a glob under the step's own path, so each part of the path must match
  itself as a pattern. A matched `[...]` does not (it is a set of characters: `runs/lr[1e-3]` would
  read `runs/lr1`, `runs/lre`, ...); `*`, `?` and a lone bracket do."""
  for part in pathlib.PurePosixPath(os.fspath(workdir)).parts:
    if not fnmatch.fnmatchcase(part, part):
      raise ConfigError(
        f"{what} {os.fspath(workdir)} cannot hold checkpoints: the checkpoint library reads its path as a "
        f"file pattern, where {part!r} holds a [...] set of characters, so what it saved there could never "
        "be read back; choose a path without a matched '[' and ']'."
      )


def check_writable(workdir: fs.Path) -> None:
  """ConfigError before the first step where no checkpoint could be saved (a read-only `checkpoints/`):
  found at the first save, it cost a whole checkpoint interval of training. Every process checks: each
  writes its own shards."""
  folder = workdir / "checkpoints"
  local = fs.is_local(folder)
  probe = folder / (f".write_check.{jax.process_index()}" + (f".{os.getpid()}" if local else ""))
  try:
    folder.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    # An object store's folder exists only while an object is in it: a probe that came and went would
    # let another process see `checkpoints/` between its exists() and its listing (orbax's, and
    # checkpoints.workdir.check_resumable's), whose listing then fails. There each process's probe stays, one per
    # process index, so the folder never vanishes.
    if local:
      probe.unlink()
  except OSError as e:
    raise ConfigError(
      f"checkpoints cannot be written to {folder} ({e.strerror or type(e).__name__}); make it a writable "
      "folder or use another workdir."
    ) from e


class SaveAbandoned(CheckpointError):
  """A stop was asked for (SIGTERM) while the previous save was still being written: no new save."""


class Checkpointer:
  """`workdir`'s checkpoints; a local folder or an object store (gs:// is written by TensorStore's own
  GCS driver, the small files through etils.epath: lra_core/runtime/fs.py).

  Saves are asynchronous: `save` (and `wait`, `close`) first wait for the one in flight, within its
  limit (lra_core/checkpoints/save_limit.py: `save_timeout_s`, then derived from the saves measured;
  0: as long as it takes; `poll` checks it between steps), and give up once `abandon()` is true (the
  trainer's SIGTERM) and the wait has lasted ABANDON_AFTER_S (a healthy save finishes first): a store
  that keeps failing neither blocks the run for its retries nor hides its error (StoreFailure, naming
  the step and the last complete checkpoint)."""

  ABANDON_AFTER_S = 30.0

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    keep: int = 3,
    preserve: Sequence[int] = (),
    async_save: bool = True,
    save_timeout_s: float = 0.0,
    abandon: Callable[[], bool] = lambda: False,
  ):
    check_directory(workdir)
    self.directory = fs.path(workdir, what="workdir") / "checkpoints"
    settings = dict(max_to_keep=keep)
    if preserve:  # the last `keep` and the `preserve` steps (finished runs this one extends)
      policies = [preservation.LatestN(keep), preservation.CustomSteps(list(preserve))]
      settings = dict(preservation_policy=preservation.AnyPreservationPolicy(policies))
    self.clock, self.store_errors = save_limit.SaveClock(save_timeout_s), save_limit.StoreErrors()
    if async_save:  # a save's end is seen on orbax's writer thread, when it has finalized the step
      settings["async_options"] = ocp.AsyncOptions(post_finalization_callback=self.clock.done)
    options = ocp.CheckpointManagerOptions(**settings, create=True, enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
    self.async_save, self.abandon = async_save, abandon
    self._in_flight: int | None = None
    self._complete = self.manager.latest_step()
    self._reader = self.manager
    if jax.process_count() > 1:
      self._reader = ocp.CheckpointManager(self.directory, options=reader_options(), item_names=("state", "meta"))

  @property
  def last_complete(self) -> int | None:
    """The newest step whose save finished (None before any)."""
    return self._complete

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: dict, meta: dict, *, force: bool = True) -> None:
    self.wait()
    if self._complete is not None and jax.process_index() == 0 and not (self.directory / str(self._complete)).exists():
      # Deleted under the run (a cleanup script, a mistaken rm): said, not found at the next resume.
      logging.warning(
        "checkpoint step %d is gone from %s (deleted while the run trained); step %d is saved anew",
        self._complete,
        self.directory,
        step,
      )
      self.directory.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, digests=digests(state))
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    self._in_flight = step
    if self.store_errors not in logging.getLogger().handlers:
      logging.getLogger().addHandler(self.store_errors)
    self.store_errors.reset()
    self.clock.begin()
    try:
      self.manager.save(step, args=args, force=force)
    except Exception as e:  # noqa: BLE001  (the store's errors come in many types)
      raise self._failure(f"writing checkpoint step {step} to {self.directory} failed ({_first_line(e)})") from e
    if not self.async_save:
      self.clock.done()

  def poll(self) -> None:
    """Between steps, without waiting: StoreFailure where the save in flight is past its limit or has
    failed; a finished one is recorded complete."""
    if self._in_flight is None:
      return
    if self.manager.is_saving_in_progress():
      self._raise_if_overdue()
    else:
      self.wait()

  def _raise_if_overdue(self) -> None:
    if self.store_errors.final:
      raise self._failure(f"checkpoint step {self._in_flight} in {self.directory} cannot be written: a writer failed")
    overdue = self.clock.overdue()
    if overdue is not None:
      raise self._failure(
        f"checkpoint step {self._in_flight} in {self.directory} was still being written {overdue}: the store "
        "is failing or too slow"
      )

  def _failure(self, what: str) -> StoreFailure:
    last = f"step {self._complete}" if self._complete is not None else "none yet"
    cause = self.store_errors.cause
    said = f" (it said: {cause})" if cause and cause not in what else ""  # from the store's log lines
    return StoreFailure(f"{what}{said}; the last complete checkpoint is {last}.")

  def restore(self, step: int, abstract_state: dict | None) -> tuple[dict, dict]:
    """-> (state placed as `abstract_state`'s shardings say, meta), its digests checked.

    Without `abstract_state` the arrays come back as saved, unchecked (for inspection, not for
    training: containers such as optax states are then plain lists and dicts). With several
    processes every one of them must call it (the digests are computed over the global arrays).
    """
    state, meta = self._read(step, abstract_state)
    if abstract_state is not None:
      check_digests(state, meta.get("digests"), f"checkpoint {self.directory / str(step)}")
    return state, meta

  def _read(self, step: int, abstract_state: dict | None) -> tuple[dict, dict]:
    """The state and meta of `step` as this process reads them (no collective, no digest check)."""
    if self._reader is not self.manager:
      self._reader.reload()  # it lists the steps it saw when it was made
    read_failures.install()
    try:
      try:
        restored = self._reader.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
      except Exception:
        read_failures.failed(self.directory)
        raise
    except json.JSONDecodeError:
      raise  # a damaged file, not a mismatch: restore_latest falls back on it
    except (ValueError, KeyError, TypeError) as e:
      layout = self._scan_mismatch(step, abstract_state)
      if layout:
        raise CheckpointError(layout) from e
      if self._shapes_match(step, abstract_state):  # the layout is this model's: its files are at fault
        raise CheckpointError(
          f"checkpoint {self.directory / str(step)} cannot be read: its files are damaged or missing "
          f"({_first_line(e)})."
        ) from e
      raise CheckpointError(
        f"checkpoint {self.directory / str(step)} does not match this model and optimizer ({_first_line(e)})."
      ) from e
    logging.info("restored checkpoint at step %d from %s", step, self.directory)
    return restored["state"], dict(restored["meta"])

  def _shapes_match(self, step: int, abstract_state: dict | None) -> bool:
    """Whether the arrays the checkpoint's metadata lists have the shapes of `abstract_state`'s (True
    also when the metadata itself cannot be read: then the files are at fault, not the model)."""
    if abstract_state is None:
      return True
    try:
      saved = self.manager.item_metadata(step)["state"]
    except Exception:  # noqa: BLE001  (a missing or damaged metadata file)
      return True
    saved = saved.tree if hasattr(saved, "tree") else saved
    listed = sorted(tuple(m.shape) for m in jax.tree.leaves(saved) if hasattr(m, "shape"))
    return listed == sorted(tuple(a.shape) for a in jax.tree.leaves(abstract_state))

  def _scan_mismatch(self, step: int, abstract_state: dict | None) -> str | None:
    """The sentence for a checkpoint whose layer stacks are laid out for the other model.scan_layers."""
    try:
      saved = _has_stacked(self.manager.item_metadata(step)["state"])
    except Exception:  # noqa: BLE001  (no readable metadata: the caller's generic error stands)
      return None
    wanted = _has_stacked(abstract_state)
    if abstract_state is None or saved == wanted:
      return None
    return (
      f"checkpoint {self.directory / str(step)} was written with model.scan_layers={saved} and this run has "
      f"model.scan_layers={wanted}; resume with the same setting or convert the state with "
      f"lra_core.run.state.{'unscan' if saved else 'scan'}_params."
    )

  def restore_latest(self, abstract_state: dict) -> tuple[dict, dict, int] | None:
    """(state, meta, step) of the newest checkpoint that can be read, or None if there is none.

    If none can be read, the newest one's error is raised (most likely the model does not match:
    nothing is moved then).
    """
    steps = _same_on_every_process(sorted(self.all_steps(), reverse=True))
    found = _newest_readable(
      steps,
      lambda step: self._read(step, abstract_state),
      self.directory,
      " and no older one can; move the folder away to start afresh.",
    )
    if found is None:
      return None
    state, meta, step, errors = found
    for bad, e in errors:
      logging.warning(
        "checkpoint step %d in %s cannot be read (%s); resuming from step %d instead",
        bad,
        self.directory,
        _first_line(e),
        step,
      )
      self._set_aside(bad)
    if errors:
      _all_processes_here("set aside unreadable checkpoints")  # no process lists a step being moved
      self.manager.reload()
    return state, meta, step

  def _set_aside(self, step: int) -> None:
    if jax.process_index() != 0:
      return
    target = self.directory.parent / "unreadable_checkpoints" / str(step)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
      target = target.with_name(f"{step}.{len(list(target.parent.iterdir()))}")
    (self.directory / str(step)).rename(target)
    logging.warning("moved the unreadable checkpoint to %s", target)

  def wait(self) -> None:
    """Waits for the save in flight (bounded and abandonable, see the class); raises StoreFailure if it
    failed or did not finish in time, SaveAbandoned if `abandon()` turned true first."""
    if self._in_flight is None:
      return
    start, limit = time.monotonic(), self.clock.limit_s()
    grace = min(self.ABANDON_AFTER_S, limit[0] / 4) if limit else self.ABANDON_AFTER_S
    while self.manager.is_saving_in_progress():
      if time.monotonic() - start > grace and self.abandon():
        raise SaveAbandoned(
          f"checkpoint step {self._in_flight} in {self.directory} was still being written when the run was asked "
          "to stop; it stops without a new checkpoint"
          + (f" (the last complete one is step {self._complete})." if self._complete is not None else ".")
        )
      self._raise_if_overdue()
      time.sleep(0.05)
    try:
      self.manager.wait_until_finished()  # raises what the writer threads met
    except Exception as e:  # noqa: BLE001
      raise self._failure(
        f"writing checkpoint step {self._in_flight} to {self.directory} failed ({_first_line(e)})"
      ) from e
    self._complete, self._in_flight = self._in_flight, None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      logging.getLogger().removeHandler(self.store_errors)
    self.manager.close()
    if self._reader is not self.manager:
      self._reader.close()


def _first_line(e: BaseException) -> str:
  """`Type: first line of the message`, shortened in its middle (errors.brief: TensorStore's run to pages)."""
  return f"{type(e).__name__}: {brief(e)}"


def _has_stacked(tree) -> bool:
  """Whether a (metadata) tree holds a scanned layer stack (lra_core.layer_stacks.STACKED)."""
  if isinstance(tree, dict) or hasattr(tree, "items"):
    return any(k == STACKED or _has_stacked(v) for k, v in tree.items())
  if isinstance(tree, (list, tuple)):
    return any(_has_stacked(v) for v in tree)
  return False


# The entries of the train state that evaluation and sampling need (lra_core.run.state.make_state_spec);
# "ema" only where the state has one (optim.ema_decay > 0).
PARAM_ENTRIES = ("params", "model_state", "ema")


def _newest_readable(
  steps: list[int], read: Callable[[int], tuple[dict, dict]], directory, none_readable: str
) -> tuple[dict, dict, int, list[tuple[int, BaseException]]] | None:
  """The first of `steps` (newest first, the same on every process) that every process reads and whose
  digests hold: (state, meta, step, [(each newer step that failed, its error)]); None for no steps.
  Each process reads on its own (no orbax barrier a failing read could leave the others waiting in),
  then all learn who could not, and check the digests together. None readable: the newest one's error,
  as one sentence ending in `none_readable`."""
  errors: list[tuple[int, BaseException]] = []
  for step in steps:
    try:
      state, meta = read(step)
      error = None
    except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many kinds)
      error = e
      logging.info("process %d cannot read checkpoint step %d: %s", jax.process_index(), step, _first_line(e))
    failed = _failed_processes(error is not None)
    if failed and error is None:
      error = CheckpointError(f"process {failed[0]} of {jax.process_count()} could not read it")
    if not failed:
      try:  # over the global arrays: every process takes part
        check_digests(state, meta.get("digests"), f"checkpoint {directory / str(step)}")
      except CheckpointError as e:
        error = e
    if error is None:
      return state, meta, step, errors
    errors.append((step, error))
  if not errors:
    return None
  step, e = errors[0]
  if isinstance(e, CheckpointError):
    raise e
  raise CheckpointError(
    f"checkpoint step {step} in {directory} cannot be read ({_first_line(e)}){none_readable}"
  ) from e


def restore_params(
  workdir: str | pathlib.Path | fs.Path, abstract_state: dict, step: int | None = None
) -> tuple[dict, int]:
  """({"params", "model_state"[, "ema"]}, step) of the latest (or given) checkpoint in `workdir`
  (local or gs://), placed as `abstract_state`'s shardings say, for eval, sampling and warm starts.
  "ema" (the moving average of the weights) is read when `abstract_state` has it (optim.ema_decay > 0).

  Only those entries are read: the rest of the saved state (optimizer state, step, key, carry)
  is marked as orbax placeholders and skipped, so any optimizer (or none) may be set in the
  config. The two entries must match the checkpoint's exactly (no leaf missing or left over).
  Without `step`, a newest checkpoint that cannot be read gives way to the newest that can, as a
  resume does (every process reads the same step; nothing is moved: the workdir may be another run's).
  """
  directory = fs.path(workdir, what="workdir") / "checkpoints"
  manager = None
  if directory.is_dir():
    manager = ocp.CheckpointManager(
      directory,
      options=reader_options(),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )
  try:
    steps = list(manager.all_steps()) if manager is not None else []
    if step is None and not steps:
      raise CheckpointError(
        f"no checkpoint in {directory}; train first with `python -m lra_core.train --workdir={workdir}`."
      )
    if step is not None and step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {directory}; it has steps {sorted(steps)}.")
    candidates = [step] if step is not None else _same_on_every_process(sorted(steps, reverse=True))
    state, _, candidate, errors = _newest_readable(
      candidates,
      lambda candidate: _read_params(manager, directory, candidate, abstract_state),
      directory,
      "." if step is not None else " and no older one can.",
    )
    for bad, e in errors:
      logging.warning(
        "checkpoint step %d in %s cannot be read (%s); using step %d", bad, directory, _first_line(e), candidate
      )
  finally:
    if manager is not None:
      manager.close()
  jax.block_until_ready(state["params"])
  logging.info("restored the parameters of step %d from %s", candidate, directory)
  return state, candidate


def _read_params(manager, directory: fs.Path, step: int, abstract_state: dict) -> tuple[dict, dict]:
  """(the PARAM_ENTRIES of `abstract_state`, meta) as step `step` holds them, unchecked; CheckpointError
  where the checkpoint is of another model."""
  saved = manager.item_metadata(step)["state"]
  saved = saved.tree if hasattr(saved, "tree") else saved
  item = {
    k: abstract_state[k] if k in PARAM_ENTRIES and k in abstract_state else jax.tree.map(lambda _: ocp.PLACEHOLDER, v)
    for k, v in saved.items()
  }
  missing = [k for k in PARAM_ENTRIES if k in abstract_state and k not in saved]
  if missing == ["ema"]:
    raise CheckpointError(
      f"checkpoint {directory / str(step)} holds no EMA of the weights (its run had "
      "optim.ema_decay 0); set --config.optim.ema_decay=0.0 to use its raw weights."
    )
  if missing:
    raise CheckpointError(
      f"checkpoint {directory / str(step)} holds no {missing[0]!r}; it is not a train state of lra_core."
    )
  args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item))
  try:
    both = manager.restore(step, args=ocp.args.Composite(state=args, meta=ocp.args.JsonRestore()))
  except (ValueError, KeyError, TypeError) as e:
    scanned, wanted = _has_stacked(saved["params"]), _has_stacked(abstract_state["params"])
    if scanned != wanted:
      raise CheckpointError(
        f"checkpoint {directory / str(step)} was written with model.scan_layers={scanned} "
        f"and this config has model.scan_layers={wanted}; set "
        f"--config.model.scan_layers={scanned}."
      ) from e
    raise CheckpointError(
      f"checkpoint {directory / str(step)} does not match this model ({type(e).__name__}: {brief(e)})."
    ) from e
  state = {k: both["state"][k] for k in PARAM_ENTRIES if k in abstract_state}
  return state, dict(both["meta"] or {})


# -- digests of the saved arrays -------------------------------------------------------------------


@jax.jit
def _leaf_digest(x: jax.Array) -> jax.Array:
  """uint32 sum over the array's elements of (bit pattern) * (2 * position + 1), wrapping mod 2^32.

  An element changed in one byte changes the sum by d * 2^(8k) * w with 0 < |d| < 256, k < 4 and w
  odd, which is never a multiple of 2^32: one flipped byte is always seen. Integer arithmetic, so
  the digest is the same on any mesh and any backend."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:  # 8-byte types become two uint32 words along a new last axis
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  position = jnp.zeros(bits.shape, jnp.uint32)
  for dim, size in enumerate(bits.shape):  # the row-major index, built without reshaping a sharded array
    position = position * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim)
  return jnp.sum(bits * (2 * position + 1), dtype=jnp.uint32)


def digests(state: dict) -> dict[str, int]:
  """{array path (jax.tree_util.keystr): digest} for every array of `state` (see _leaf_digest).

  One small program per array, compiled once per shape, dtype and sharding: a model's layers repeat a
  few shapes, so a state of hundreds of arrays compiles a few dozen (one program over every array
  compiled for each new state: 1.7 s of a tiny FIT run's 16 on a CPU, a third of it here). Every
  process runs them in the same order (the tree's), one at a time: two processes' CPU collectives
  deadlocked with several of these programs in flight at once (the two-process save hung at its first
  checkpoint), and the wait is one small read per array."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0]) if jax.tree.leaves(state) else ((), ())
  return {jax.tree_util.keystr(p): int(jax.device_get(_leaf_digest(x))) for p, x in zip(paths, leaves)}


def check_digests(state: dict, saved: dict | None, what: str) -> None:
  """Raises CheckpointError naming the first array of `state` whose digest differs from `saved`'s
  (the digests written with it; None for a checkpoint written before they were recorded)."""
  if not saved:
    return
  for path, value in digests(state).items():
    if path in saved and saved[path] != value:
      raise CheckpointError(f"{what} holds corrupted data: array {path} does not match the digest saved with it.")


# -- agreement between processes -------------------------------------------------------------------


def _same_on_every_process(steps: list[int]) -> list[int]:
  """Process 0's list of checkpoint steps, on every process (they try the same steps in the same order)."""
  if jax.process_count() == 1:
    return steps
  from jax.experimental import multihost_utils

  padded = np.full(64, -1, np.int64)
  padded[: min(len(steps), 64)] = steps[:64]
  shared = multihost_utils.broadcast_one_to_all(padded.astype(np.int32))
  return [int(s) for s in np.asarray(shared) if s >= 0]


def _all_processes_here(name: str) -> None:
  """Returns once every process has called it with the same `name`."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _failed_processes(failed_here: bool) -> list[int]:
  """The indices of the processes that could not read the step they all tried, the same list on every
  process."""
  if jax.process_count() == 1:
    return [0] if failed_here else []
  from jax.experimental import multihost_utils

  flags = np.asarray(multihost_utils.process_allgather(np.int32(failed_here)))
  return [int(i) for i in np.flatnonzero(flags)]
