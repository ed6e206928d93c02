"""Deterministic, shardable, resumable batches from a random-access `Source` (grain).

Training batch number s is a pure function of (seed, s): examples are shuffled per epoch by
grain from `train.seed`, global batch j holds shuffled examples [j*B, (j+1)*B), and each
process reads only its own rows of it. So a run on any number of processes sees the same global
batches, and resuming needs nothing but the step (stored with grain's iterator state).

For causal tasks (lra_core.task_kinds) with `train.update_len` < `seq_len` each sequence batch is
cut into update windows along time; batch s is window s % n of sequence batch s // n. Causal
batches carry `reset` = (window == 0), which tells the trainer to start the carried model
state afresh (for every batch when there is one window per sequence).
Evaluation batches are unshuffled, cover the split once, and pad the last batch with all-zero
(zero-weight) examples.
"""

from __future__ import annotations

import functools
import logging
import math

import grain
import jax
import numpy as np

from lra_core import task_kinds
from lra_core.data import Source, example_fields
from lra_core.errors import ConfigError, DataError


def num_windows(config) -> int:
  update_len = config.train.update_len
  if task_kinds.kind(config.task).causal and update_len and update_len < config.train.seq_len:
    return config.train.seq_len // update_len
  return 1


def batch_fields(config, batch_size: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """name -> (shape, dtype) of one global batch as `BatchReader` gives it, from the config alone:
  `batch_size` rows of `example_fields`, cut to one update window along time, with `reset`."""
  seq_len = config.train.seq_len
  size = seq_len // num_windows(config)
  fields = {}
  for name, (shape, dtype) in example_fields(config).items():
    if shape and shape[0] == seq_len:  # [T, ...] fields are cut to the window, as `window` does
      shape = (size,) + shape[1:]
    fields[name] = ((batch_size,) + shape, dtype)
  if task_kinds.kind(config.task).causal:
    fields["reset"] = ((), np.dtype(bool))
  return fields


def stack(examples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def window(batch: dict[str, np.ndarray], index: int, count: int, seq_len: int) -> dict[str, np.ndarray]:
  """Window `index` of `count` along the time axis (axis 1) of every [B, seq_len, ...] field,
  with `reset` = whether it starts a sequence (always, for one window per sequence)."""
  size = seq_len // count
  out = {
    k: (v[:, index * size : (index + 1) * size] if v.ndim >= 2 and v.shape[1] == seq_len else v)
    for k, v in batch.items()
  }
  out["reset"] = np.asarray(index == 0)
  return out


class BatchReader:
  """Reads this process's rows of global batches; `train=True` shuffles and repeats."""

  def __init__(
    self,
    config,
    source: Source,
    *,
    train: bool,
    batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    if batch_size % self.process_count:
      raise ConfigError(f"batch size {batch_size} is not a multiple of the process count {self.process_count}.")
    if len(source) == 0:
      raise DataError("the data source is empty.")
    self.source, self.batch_size, self.train = source, batch_size, train
    self.local_batch = batch_size // self.process_count
    self.windows = num_windows(config)
    self.autoregressive = task_kinds.kind(config.task).causal
    self.seq_len = config.train.seq_len
    self.seed = config.train.seed
    self._rows = functools.lru_cache(maxsize=2)(self._read_rows)  # windows of a batch read it once
    self._zero = {k: np.zeros_like(v) for k, v in source[0].items()}

  def example_index(self, i: int) -> int:
    """The example at position i of the training stream: epoch i // n in grain's shuffle order.

    The same permutation as `grain.MapDataset.source(s).shuffle(seed).repeat()`, computed with
    grain's index_shuffle directly: the dataset wrappers cost ~40 us per example.
    """
    epoch, position = divmod(i, len(self.source))
    return grain.experimental.index_shuffle(
      position, max_index=len(self.source) - 1, seed=(self.seed + epoch) % 2**32, rounds=4
    )

  def _example(self, i: int) -> dict[str, np.ndarray]:
    if self.train:
      return self.source[self.example_index(i)]
    return self.source[i] if i < len(self.source) else self._zero

  def _read_rows(self, j: int) -> dict[str, np.ndarray]:
    first = j * self.batch_size + self.process_index * self.local_batch
    return stack([self._example(first + r) for r in range(self.local_batch)])

  def __call__(self, s: int) -> dict[str, np.ndarray]:
    j, w = divmod(s, self.windows)
    rows = self._rows(j)
    return window(rows, w, self.windows, self.seq_len) if self.autoregressive else rows

  def num_eval_batches(self, limit: int = 0) -> int:
    n = math.ceil(len(self.source) / self.batch_size) * self.windows
    return min(n, limit * self.windows) if limit else n


def iterate(
  reader: BatchReader, start: int, stop: int, *, num_threads: int = 2, prefetch: int = 4
) -> grain.DatasetIterator:
  """An iterator over batches start..stop-1 read ahead by threads; its state is resumable."""
  ds = grain.MapDataset.range(start, stop).map(reader)
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  return iter(ds.to_iter_dataset(options))


def log_sizes(config, sources: dict[str, Source]) -> None:
  parts = ", ".join(f"{split} {len(src)}" for split, src in sources.items())
  logging.info(
    "data %s: %s examples; %d update window(s) per sequence batch.", config.data.name, parts, num_windows(config)
  )
