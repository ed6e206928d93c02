"""Run outputs: metrics.jsonl, TensorBoard events, summary.json and a terminal progress line.

Only process 0 writes files; every process computes the same numbers.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import time
from collections.abc import Mapping

import jax
import numpy as np


def _plain(value):
  if isinstance(value, (np.generic, np.ndarray)):
    return value.item() if np.ndim(value) == 0 else value.tolist()
  return value


class MetricWriter:
  """Appends one JSON object per logged step to metrics.jsonl and mirrors it to TensorBoard."""

  def __init__(self, workdir: str | pathlib.Path, *, enabled: bool | None = None):
    self.workdir = pathlib.Path(workdir)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._tb = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    with open(self.workdir / "metrics.jsonl", "a") as f:
      f.write(json.dumps(record) + "\n")
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
        self._tb.add_scalar(k, v, step)
    self._tb.flush()

  def write_json(self, name: str, payload: Mapping) -> None:
    if self.enabled:
      tmp = self.workdir / (name + ".tmp")
      tmp.write_text(json.dumps({k: _plain(v) for k, v in payload.items()}, indent=2) + "\n")
      tmp.replace(self.workdir / name)  # atomic: readers never see half a file

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
  """A tqdm bar with tokens/s on a terminal; plain log lines with rate and ETA otherwise."""

  def __init__(self, start: int, total: int, tokens_per_step: int, *, enabled: bool | None = None):
    self.start, self.total, self.tokens_per_step = start, total, tokens_per_step
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.t0 = time.perf_counter()
    self.bar = None
    if self.enabled and sys.stderr.isatty():
      from tqdm import tqdm
      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, smoothing=0.1)
    self.done = start

  def rate(self) -> float:
    """Tokens per second since this run (re)started."""
    elapsed = time.perf_counter() - self.t0
    return (self.done - self.start) * self.tokens_per_step / max(elapsed, 1e-9)

  def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
    if self.bar is not None:
      self.bar.update(step - self.done)
    self.done = step
    if metrics is None or not self.enabled:
      return
    rate = self.rate()
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{metrics.get('train_loss', float('nan')):.4f}", tok_s=f"{rate:,.0f}")
    else:
      steps_per_s = rate / max(self.tokens_per_step, 1)
      eta = (self.total - step) / steps_per_s if steps_per_s > 0 else float("inf")
      shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))
      logging.info("step %d/%d %s | %.0f tokens/s | ETA %s", step, self.total, shown, rate, _clock(eta))

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _clock(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
