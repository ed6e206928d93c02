"""A run's data: opening its splits, building its task, and checking the config against the data, the
devices and each batch, all before anything compiles."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np

from lra_core import data as data_lib
from lra_core import registry, task_kinds
from lra_core.data import cache, pipeline
from lra_core.errors import ConfigError, DataError
from lra_core.runtime import fs
from lra_core.tasks import Task, make_task


def setup_data(config, splits, mesh) -> tuple[dict[str, data_lib.Source], Task]:
  """Validates the dataset settings, opens the splits and builds the task (no compilation)."""
  data_lib.validate_config(config)
  sources = {split: data_lib.make_source(config, split) for split in splits}
  pipeline.log_sizes(config, sources)
  info = next(iter(sources.values())).info
  check_compatible(config, info, mesh)
  return sources, make_task(config, info)


DATA_FILES = "data_files"  # <workdir>/data_files/<digest>.json: a table of the run's data files


def keep_data_files(workdir: fs.Path, files: dict[str, list[int]]) -> str:
  """The name (a digest of its content) under which `files` ({path: [size, mtime]}, data/cache.py
  recording_files) is kept in <workdir>/data_files/, written once by process 0: each checkpoint's meta
  names the table rather than holding it (PG-19's 28,000 books would be 2 MB of every meta)."""
  name = cache.digest(files)
  path = workdir / DATA_FILES / f"{name}.json"
  if jax.process_index() != 0 or path.exists():
    return name
  text = json.dumps(files, sort_keys=True)
  if not fs.is_local(path):  # an object appears whole (and a rename there is a slow copy and delete)
    path.write_text(text)
    return name
  path.parent.mkdir(parents=True, exist_ok=True)
  staged = path.parent / f".{name}.json.tmp"  # complete or absent: renamed once written
  staged.write_text(text)
  staged.rename(path)
  return name


def saved_data_files(workdir: fs.Path, saved: str | dict | None) -> dict | None:
  """The table of data files a checkpoint's meta names (`keep_data_files`; a meta saved before holds
  the table itself, or nothing). One that cannot be read is a warning: the files go unchecked."""
  if not isinstance(saved, str):
    return saved
  path = workdir / DATA_FILES / f"{saved}.json"
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    logging.warning("the table of data files %s cannot be read (%s): the data files go unchecked", path, e)
    return None


def check_data_files(saved: dict | None, now: dict, step: int) -> None:
  """A resume reads the data files checkpoint `step` was saved from (both {path: [size, mtime, sample]},
  data/cache.py recording_files): a file shorter now is one sentence (the saved data position no longer
  names the same examples, and a memory-mapped read past its end would kill the run); one rewritten,
  grown or no longer read is a warning, once."""
  if not saved:  # a checkpoint from before data files were kept
    return
  shorter = [(p, old[0], now[p][0]) for p, old in saved.items() if p in now and now[p][0] < old[0]]
  if shorter:
    path, before, size = shorter[0]
    raise DataError(
      f"data file {path} holds {size:,} bytes where it held {before:,} when checkpoint step {step} was saved; "
      "put the original back to resume, or start the changed data in a new workdir."
    )
  # A table saved before content samples were kept holds [size, mtime]: compared as far as it goes.
  changed = sorted(p for p, old in saved.items() if (now.get(p) or [])[: len(old)] != old)
  if changed:
    logging.warning(
      "%d data file(s) changed since checkpoint step %d was saved (%s%s): the run resumes its data position "
      "over the files as they are now",
      len(changed),
      step,
      changed[0],
      f" and {len(changed) - 1} more" if len(changed) > 1 else "",
    )


def config_data_info(config) -> data_lib.DataInfo:
  """What the task needs to know about the data, from the model config alone (no dataset opened):
  for compiling ahead of time and for benchmarks on random tokens."""
  m = config.model
  vocab = int(m.get("vocab_size", 256))
  if config.task == "mlm" and config.mlm.mask_id < 0:
    vocab -= 1  # the last id is the mask token, not a data token
  num_classes = int(m.get("num_classes", 0)) if task_kinds.kind(config.task).classifies else 0
  # The unit only names a metric (bits per <unit>); the step does not depend on it.
  return data_lib.DataInfo(vocab_size=vocab, num_classes=num_classes, unit=registry.dataset(config.data.name).unit)


def check_compatible(config, info: data_lib.DataInfo, mesh) -> None:
  """Cross-checks between config, data and devices that need the data or the mesh."""
  m, t = config.model, config.train
  if m.get("vocab_size", info.vocab_size) < info.vocab_size:
    raise ConfigError(
      f"model.vocab_size {m.vocab_size} is smaller than the {config.data.name} vocabulary ({info.vocab_size} ids)."
    )
  if config.task == "mlm":
    mask_id = config.mlm.mask_id if config.mlm.mask_id >= 0 else m.vocab_size - 1
    if mask_id < info.vocab_size:
      raise ConfigError(
        f"mlm mask id {mask_id} is a real {config.data.name} token; set model.vocab_size "
        f"to at least {info.vocab_size + 1} or mlm.mask_id outside the data vocabulary."
      )
  if info.num_classes and m.get("num_classes", info.num_classes) != info.num_classes:
    raise ConfigError(
      f"model.num_classes {m.num_classes} does not match the {info.num_classes} classes of {config.data.name}."
    )
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  micro = t.batch_size // t.grad_accum_steps
  if micro % shards:
    raise ConfigError(
      f"micro-batch size {micro} (train.batch_size {t.batch_size} / grad_accum_steps "
      f"{t.grad_accum_steps}) is not a multiple of the {shards} data-parallel shards."
    )
  eval_bs = t.eval_batch_size or t.batch_size
  if eval_bs % shards:
    raise ConfigError(f"eval batch size {eval_bs} is not a multiple of the {shards} data-parallel shards.")


def check_batch(batch: dict[str, np.ndarray], config, index: int) -> None:
  """Token ids and labels must fit the model: a one-sentence DataError (before the step that
  would read them, and for the first batch before anything compiles) instead of silent garbage
  from an out-of-range embedding lookup."""
  limits = {
    "inputs": ("model.vocab_size", config.model.get("vocab_size")),
    "targets": (
      ("model.num_classes", config.model.get("num_classes"))
      if task_kinds.kind(config.task).classifies
      else ("model.vocab_size", config.model.get("vocab_size"))
    ),
  }
  for name, (key, limit) in limits.items():
    x = batch.get(name)
    if limit is None or x is None or not np.issubdtype(x.dtype, np.integer) or not x.size:
      continue
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= limit:
      bad = low if low < 0 else high
      raise DataError(
        f"training batch {index} holds {name} id {bad}, outside 0..{limit - 1} ({key}); "
        "the data does not match the model's vocabulary or classes."
      )
