"""Experiment trackers: a run's config, metrics and sample images mirrored to W&B or Trackio.

`train.tracker` picks one ("none", "wandb" or "trackio") and `train.tracker_project` names the
project. metrics.jsonl and TensorBoard stay the record of a run; a tracker is a mirror of it.

Runs. A run is named after the workdir's last folder and keeps one identity per workdir, so a run
resumed from its checkpoints (after preemption, or with more steps) continues the same tracker run:
W&B gets `id=` a hash of the workdir and `resume="allow"`; Trackio resumes runs by name, so its run
name carries the first characters of that hash (two sweeps' "lr-0.001" folders stay two runs).
Metrics are plotted against their training step (the metric "step"), so the records a resumed run
writes again after its last checkpoint are kept, as in metrics.jsonl.

Files. W&B writes under <workdir>/wandb when the workdir is local (else where W&B writes by default:
$WANDB_DIR or ./wandb); Trackio keeps its database in $TRACKIO_DIR (default $HF_HOME/trackio), read
when trackio is first imported. Both honour their own settings (WANDB_MODE=offline, WANDB_ENTITY,
TRACKIO_SPACE_ID, ...).

Processes. Every process checks that the tracker's package is installed (so all of them stop with
the same sentence); only the one made with enabled=True (process 0) tracks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np

from lra_core.errors import ConfigError, optional_import
from lra_core.runtime import fs

TRACKERS = ("none", "wandb", "trackio")  # train.tracker's choices (lra_core.config checks them)


class Tracker:
  """The no-op tracker: train.tracker="none", and every process but 0."""

  def log_config(self, config_dict: Mapping) -> None:
    """The run's config (config.to_dict()); call it once, before the first `log`."""

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    """Scalar metrics at `step` (lists and strings are left out)."""

  def log_images(self, step: int, name: str, images: np.ndarray) -> None:
    """uint8 images [N,H,W,C] or one grid [H,W,C], C in (1, 3, 4), under `name`."""

  def close(self) -> None:
    """Flushes and ends the run; later calls do nothing."""


class WandbTracker(Tracker):
  """A Weights & Biases run (online, or offline with WANDB_MODE=offline)."""

  def __init__(self, project: str, name: str, run_id: str, folder: str | None):
    self.wandb = optional_import("wandb", "wandb")
    self.run = self.wandb.init(project=project, name=name, id=run_id, resume="allow", dir=folder)
    self.run.define_metric("step")
    self.run.define_metric("*", step_metric="step")

  def log_config(self, config_dict: Mapping) -> None:
    # A resumed run may change values (e.g. train.steps), which W&B refuses unless allowed.
    self.run.config.update(dict(config_dict), allow_val_change=True)

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    self.run.log({**scalars(metrics), "step": int(step)})

  def log_images(self, step: int, name: str, images: np.ndarray) -> None:
    self.run.log({name: [self.wandb.Image(image) for image in image_list(images)], "step": int(step)})

  def close(self) -> None:
    if self.run is not None:
      self.run.finish()
      self.run = None


class TrackioTracker(Tracker):
  """A Trackio run in its local database (or a Space / server its settings name)."""

  def __init__(self, project: str, name: str):
    self.trackio = optional_import("trackio", "trackio")
    self.run = self.trackio.init(project=project, name=name, resume="allow", embed=False)

  def log_config(self, config_dict: Mapping) -> None:
    # Trackio stores the run's config with its first logged record.
    self.run.config.update(config_dict)

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    self.run.log(scalars(metrics), step=int(step))

  def log_images(self, step: int, name: str, images: np.ndarray) -> None:
    # Trackio logs one image per key: several become one grid.
    self.run.log({name: self.trackio.Image(tile(image_list(images)))}, step=int(step))

  def close(self) -> None:
    if self.run is not None:
      self.run.finish()
      self.run = None


def make_tracker(config, workdir: str, *, enabled: bool) -> Tracker:
  """The tracker config.train.tracker names for the run in `workdir`; the no-op one for "none" and
  when not `enabled` (every process but 0). MissingExtra when the tracker's package is absent."""
  kind = config.train.tracker
  project = config.train.tracker_project
  if kind == "none":
    return Tracker()
  if kind not in TRACKERS:
    raise ConfigError(f"train.tracker {kind!r} is not one of {list(TRACKERS)}.")
  optional_import(kind, kind)  # on every process, so that all of them stop alike
  if not enabled:
    return Tracker()
  path = fs.path(workdir, what="workdir")
  folder = os.fspath(path).rstrip("/")
  name = folder.rpartition("/")[2]
  if kind == "wandb":
    local = fs.local_or_none(path)
    if local is not None:
      local.mkdir(parents=True, exist_ok=True)
    return WandbTracker(project, name, run_id(folder), None if local is None else str(local))
  return TrackioTracker(project, f"{name}-{run_id(folder)[:6]}")


def run_id(workdir: str) -> str:
  """16 hex digits naming the tracker run of `workdir` (an absolute path or a URL)."""
  return hashlib.sha256(workdir.encode()).hexdigest()[:16]


def scalars(metrics: Mapping) -> dict[str, int | float]:
  """The scalar numbers of `metrics` as Python ints and floats."""
  out = {}
  for key, value in metrics.items():
    if np.ndim(value) == 0:
      value = np.asarray(value).item()
      if isinstance(value, (int, float)):
        out[key] = value
  return out


def image_list(images: np.ndarray) -> list[np.ndarray]:
  """uint8 [N,H,W,C] or [H,W,C] -> N images [H,W,C] ([H,W] for one channel)."""
  images = np.asarray(images)
  if images.dtype != np.uint8 or images.ndim not in (3, 4) or images.shape[-1] not in (1, 3, 4):
    raise ValueError(
      f"images must be uint8 [N,H,W,C] or [H,W,C] with C in (1, 3, 4), got {images.dtype} {list(images.shape)}."
    )
  if images.ndim == 3:
    images = images[None]
  return [image[..., 0] if image.shape[-1] == 1 else image for image in images]


def tile(images: list[np.ndarray]) -> np.ndarray:
  """Images of one shape -> one near-square grid with 1-pixel white gaps (one image as it is)."""
  if len(images) == 1:
    return images[0]
  h, w = images[0].shape[:2]
  cols = int(np.ceil(np.sqrt(len(images))))
  rows = -(-len(images) // cols)
  grid = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, *images[0].shape[2:]), 255, np.uint8)
  for i, image in enumerate(images):
    r, c = divmod(i, cols)
    grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = image
  return grid
