"""Images drawn from a model in memory, and laid out as one picture.

`training_samples(config, model, key, num)` samples uint8 images from an `image_ar` model (pixel by pixel
from the START token) or a `diffusion` denoiser (config.diffusion's sampler unless told otherwise): the
trainer's grids every train.sample_every steps and `python -m lra_core.sample` on a workdir
(lra_core/sample.py) both draw with it. `grid(images)` lays images out as one picture, `save_grid` writes
it as a PNG.
"""

from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from lra_core import decoding, diffusion, task_kinds
from lra_core.data.datasets import imagenet64
from lra_core.errors import ConfigError
from lra_core.run.state import to_host
from lra_core.runtime import fs


class PixelsOnly(nnx.Module):
  """Decodes with `model` but never samples a token >= `num_pixels` (the START token)."""

  def __init__(self, model: nnx.Module, num_pixels: int):
    self.model, self.num_pixels = model, num_pixels

  def init_decode_state(self, batch_size: int, max_len: int):
    return self.model.init_decode_state(batch_size, max_len)

  def decode_step(self, tokens, state):
    logits, state = self.model.decode_step(tokens, state)
    return logits.at[..., self.num_pixels :].set(-jnp.inf), state


@functools.partial(
  nnx.jit, static_argnames=("shape", "steps", "schedule", "pred_type", "sampler", "x0_clip", "guidance", "normalize")
)
def _denoise(model, key, labels, *, shape, steps, schedule, pred_type, sampler, x0_clip, guidance, normalize):
  """uint8 images from pure noise; one program per model structure and sampling setting."""
  x0 = diffusion.sample(
    model,
    key,
    shape,
    steps,
    schedule=schedule,
    pred_type=pred_type,
    sampler=sampler,
    labels=labels,
    x0_clip=x0_clip,
    guidance=guidance,
    normalize=normalize,
  )
  return diffusion.unit_to_pixels(x0)


def training_samples(
  config,
  model,
  key: jax.Array,
  num: int,
  *,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  sampler: str = "",
  steps: int = 0,
  labels: np.ndarray | None = None,
  guidance: float | None = None,
) -> np.ndarray:
  """uint8 [num,S,S,C] images drawn from `model` in eval mode (e.g. nnx.merge(spec.eval_graphdef,
  state["params"], state["model_state"])) for tasks image_ar and diffusion.

  image_ar: pixel by pixel from the START token, with temperature / top_k / top_p.
  diffusion: config.diffusion's sampler, sample_steps and guidance unless `sampler` / `steps` /
  `guidance` are given (guidance needs a denoiser trained with diffusion.cond_dropout > 0); a
  class-conditional denoiser (model.num_classes > 0) draws `labels` int[num], random ones by
  default. Programs are compiled once per setting, so repeated calls (every train.sample_every
  steps) only run them.
  """
  conditional = config.task == "diffusion" and config.model.get("num_classes", 0) > 0
  if labels is not None and not conditional:
    raise ConfigError(
      f"labels need a class-conditional diffusion model; this {config.model.name} ({config.task}) is unconditional."
    )
  if config.task == "image_ar":
    if config.data.name != "imagenet64":
      raise ConfigError(f"image sampling needs task 'image_ar' on imagenet64, not on {config.data.name!r}.")
    prompt = np.full((num, 1), imagenet64.START, np.int32)
    out = decoding.generate(
      PixelsOnly(model, imagenet64.START),
      prompt,
      max_new_tokens=config.train.seq_len,
      key=key,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
    )
    d = config.data
    return imagenet64.to_image(to_host(out)[:, 1:], d.image_size, d.order, d.patch_size)
  if config.task != "diffusion":
    raise ConfigError(f"image samples need an image task {list(task_kinds.names(image=True))}, not {config.task!r}.")
  d, m = config.diffusion, config.model
  if sampler and sampler not in diffusion.SAMPLERS:
    raise ConfigError(f"sampler {sampler!r} is not one of {list(diffusion.SAMPLERS)}.")
  if steps < 0:
    raise ConfigError(f"sampling steps must be >= 1 (0: config.diffusion.sample_steps), got {steps}.")
  guidance = float(d.get("guidance", 0.0) if guidance is None else guidance)
  check_guidance(config, guidance)
  k_labels, k_draw = jax.random.split(key)
  if conditional:
    labels = (
      jax.random.randint(k_labels, (num,), 0, m.num_classes) if labels is None else jnp.asarray(labels, jnp.int32)
    )
  images = _denoise(
    model,
    k_draw,
    labels,
    shape=(num, m.image_size, m.image_size, m.image_channels),
    steps=steps or d.sample_steps,
    schedule=d.sample_schedule or d.schedule,
    pred_type=d.pred_type,
    sampler=sampler or d.sampler,
    x0_clip=bool(d.x0_clip),
    guidance=guidance,
    normalize=bool(d.get("normalize_noisy_input", False)),
  )
  return to_host(images)


def grid(images: np.ndarray, columns: int = 0, scale: int = 1) -> np.ndarray:
  """uint8 [N,S,S,C] -> one uint8 [H,W,C] picture: `columns` images per row (default: a near-square
  grid), 1-pixel white gaps, each pixel drawn as a `scale` x `scale` square."""
  images = np.asarray(images)
  if images.ndim != 4 or not len(images):
    raise ConfigError(f"a grid needs images [N,S,S,C] with N >= 1, got shape {images.shape}.")
  images = np.repeat(np.repeat(images, scale, axis=1), scale, axis=2)
  n, h, w, c = images.shape
  cols = columns or int(np.ceil(np.sqrt(n)))
  rows = -(-n // cols)
  out = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, c), 255, np.uint8)
  for i, image in enumerate(images):
    r, k = divmod(i, cols)
    out[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + k * (w + 1) : 1 + k * (w + 1) + w] = image
  return out


PNG_MIN_WIDTH = 256  # pixels: save_grid's default scale draws a grid at least this wide


def grid_scale(images: np.ndarray, columns: int = 0, min_width: int = PNG_MIN_WIDTH) -> int:
  """The smallest pixel scale at which `grid(images, columns)` is at least min_width pixels wide."""
  n, width = len(images), np.shape(images)[2]
  cols = columns or int(np.ceil(np.sqrt(n)))
  return max(1, -(-(min_width - 1 - cols) // (cols * width)))


def save_grid(images: np.ndarray, path, columns: int = 0, scale: int = 0) -> None:
  """Writes `grid(images, columns, scale)` as a PNG to `path` (local or gs://); scale 0: the
  smallest that makes the picture PNG_MIN_WIDTH pixels wide or more."""
  picture = grid(images, columns, scale or grid_scale(images, columns))
  buffer = io.BytesIO()
  Image.fromarray(picture[..., 0] if picture.shape[-1] == 1 else picture).save(buffer, format="png")
  target = fs.path(path, what="--png")
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_bytes(buffer.getvalue())


def check_guidance(config, guidance: float | None) -> None:
  """A guidance scale (None: the config's) needs a diffusion model trained with a null class."""
  if guidance is None or guidance == 0:
    return
  if config.task != "diffusion":
    raise ConfigError(
      f"guidance applies to diffusion models trained with diffusion.cond_dropout > 0; this "
      f"config's task is {config.task!r}."
    )
  if not (np.isfinite(guidance) and guidance > 0):
    raise ConfigError(f"the guidance scale must be a finite number >= 0, got {guidance}.")
  if diffusion.null_label(config) is None:
    raise ConfigError(
      f"guidance {guidance:g} needs a class-conditional denoiser trained with "
      f"diffusion.cond_dropout > 0 (the null class); this {config.model.name} has none."
    )
