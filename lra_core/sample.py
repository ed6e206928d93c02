"""Sample from a trained model: text from language models, PNG grids from image models.

  python -m lra_core.sample --workdir=<dir> --prompt="The " \
      --max_new_tokens=200 --temperature=0.8 --top_p=0.9 [--top_k=40] [--num_samples=4]

Without --config the run's own config is used (`<workdir>/config.json`), with any
`--config.KEY=VALUE` overrides on top; only the parameters and model state of the checkpoint are
read. Without --prompt, the first --prompt_len tokens of the first validation example are used.
Text is encoded and decoded with the dataset's own codec (`data.text_codec`).

Image models write one PNG grid, by default `<workdir>/samples_step<N>.png` (N: the checkpoint's
step): autoregressive ones (task image_ar) sample whole images pixel by pixel from the START token
(--temperature, --top_k, --top_p apply), diffusion models (task diffusion) denoise from pure noise
with the sampler of `config.diffusion` unless --sampler / --steps / --guidance say otherwise; a
class-conditional denoiser draws random classes unless --label names one. A run trained with an
EMA of its weights (optim.ema_decay > 0) samples with the EMA weights.

  python -m lra_core.sample --workdir=<dir> --num_samples=16 [--png=samples.png] [--seed=1]
  python -m lra_core.sample --workdir=<dir> --sampler=ddim --steps=50 --label=207 [--guidance=3]

`training_samples(config, model, key, num)` draws the same images from a model in memory (the
trainer's grids every train.sample_every steps); `grid(images)` lays images out as one picture.
"""

from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from lra_core import cli, decoding, diffusion, layout, task_kinds
from lra_core import data as data_lib
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.data.datasets import imagenet64
from lra_core.errors import ConfigError, DecodingError
from lra_core.run.state import eval_params, run_setup, to_host
from lra_core.runtime import fs

EXAMPLE = "python -m lra_core.sample --workdir runs/e8 --prompt 'The ' --top_p 0.9 --num_samples 4"


def load_model(config, workdir, *, step: int | None = None) -> tuple[nnx.Module, int]:
  """The trained model of `workdir` (eval mode; the EMA of its weights when it kept one) and its
  checkpoint step."""
  mesh = layout.make_mesh(config.mesh)
  spec = run_setup(config, mesh, params_only=True).spec
  state, step = restore_params(workdir, spec.abstract, step)
  return nnx.merge(spec.eval_graphdef, eval_params(state), state["model_state"]), step


def sample(
  config,
  workdir,
  *,
  prompt: str | None,
  num_samples: int = 1,
  max_new_tokens: int | None = None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  prompt_len: int = 32,
  step: int | None = None,
) -> list[str]:
  if not task_kinds.kind(config.task).causal:
    raise ConfigError(f"sampling needs a causal task {list(task_kinds.names(causal=True))}, not {config.task!r}.")
  encode, decode = data_lib.text_codec(config)
  if prompt:
    ids = list(encode(prompt))
  else:
    ids = [int(i) for i in data_lib.make_source(config, "validation")[0]["inputs"][:prompt_len]]
  if not ids:
    raise ConfigError("the prompt encodes to no tokens; give a non-empty --prompt.")
  model, _ = load_model(config, workdir, step=step)
  max_new_tokens = new_tokens(model, len(ids), max_new_tokens)
  prompt_ids = np.tile(np.asarray(ids, np.int32)[None], (num_samples, 1))
  out = decoding.generate(
    model,
    prompt_ids,
    max_new_tokens=max_new_tokens,
    key=jax.random.key(seed),
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
  )
  return [decode(np.asarray(row)) for row in out]


DEFAULT_NEW_TOKENS = 100


def new_tokens(model, prompt_len: int, asked: int | None) -> int:
  """How many tokens to sample after a prompt of `prompt_len`: `asked`, or by default
  DEFAULT_NEW_TOKENS or as many as the model's decode limit leaves (a learned position table holds
  only so many); DecodingError (one sentence) where they do not fit."""
  limit = model.decode_limit() if hasattr(model, "decode_limit") else None
  if asked is None:
    asked = DEFAULT_NEW_TOKENS if limit is None else min(DEFAULT_NEW_TOKENS, limit - prompt_len)
  if limit is not None and prompt_len >= limit:
    raise DecodingError(
      f"the prompt's {prompt_len} tokens fill the {limit} positions this model's learned position table holds; "
      "give a shorter --prompt."
    )
  if limit is not None and prompt_len + asked > limit:
    raise DecodingError(
      f"the prompt's {prompt_len} tokens and {asked} new ones exceed the {limit} positions this model's learned "
      f"position table holds; give --max_new_tokens {limit - prompt_len} or less."
    )
  return asked


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


def sample_images(
  config, workdir, *, num_samples: int = 16, seed: int = 0, step: int | None = None, **options
) -> np.ndarray:
  """uint8 [N,S,S,C] images sampled from the trained image_ar or diffusion model of `workdir`;
  `options` as training_samples takes them."""
  if not task_kinds.kind(config.task).image:
    raise ConfigError(f"image sampling needs an image task {list(task_kinds.names(image=True))}, not {config.task!r}.")
  model, _ = load_model(config, workdir, step=step)
  return training_samples(config, model, jax.random.key(seed), num_samples, **options)


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


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--num_samples", type=int, default=None, help="default: 1 text, 16 images")
    parser.add_argument(
      "--max_new_tokens",
      type=int,
      default=None,
      help=f"default: {DEFAULT_NEW_TOKENS}, or what a learned position table leaves after the prompt",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0 = off")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass; 1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
      "--png", default="", help="image models: the PNG grid to write (default: <workdir>/samples_step<N>.png)"
    )
    parser.add_argument(
      "--png_scale",
      type=int,
      default=0,
      help=f"--png: pixels per image pixel (default: enough for a grid {PNG_MIN_WIDTH} pixels wide or more)",
    )
    parser.add_argument(
      "--sampler",
      default="",
      choices=("",) + diffusion.SAMPLERS,
      help="diffusion: the reverse process (default: config.diffusion.sampler)",
    )
    parser.add_argument(
      "--steps", type=int, default=0, help="diffusion: reverse steps (default: config.diffusion.sample_steps)"
    )
    parser.add_argument(
      "--label", type=int, default=None, help="class-conditional diffusion: the class of every sample (default: random)"
    )
    parser.add_argument(
      "--guidance",
      type=float,
      default=None,
      help="diffusion: classifier-free guidance scale w (default: config.diffusion.guidance)",
    )

  args = cli.parse(argv, extra=flags, prog="python -m lra_core.sample", config_from_workdir=True, example=EXAMPLE)
  e, config = args.extra, args.config
  check_guidance(config, e.guidance)
  if config.task != "diffusion" and (e.sampler or e.steps or e.label is not None):
    raise ConfigError(
      f"--sampler, --steps and --label apply to diffusion models; this config's task is {config.task!r}."
    )
  if e.png_scale < 0:
    raise ConfigError(f"--png_scale must be >= 0 (0: the default size), got {e.png_scale}.")
  if task_kinds.kind(config.task).image:
    num = e.num_samples or 16
    labels = None if e.label is None else np.full((num,), e.label, np.int32)
    if labels is not None and not 0 <= e.label < config.model.get("num_classes", 0):
      raise ConfigError(
        f"--label {e.label} is not a class of this model (model.num_classes={config.model.get('num_classes', 0)})."
      )
    model, step = load_model(config, args.workdir, step=e.step)
    images = training_samples(
      config,
      model,
      jax.random.key(e.seed),
      num,
      temperature=e.temperature,
      top_k=e.top_k,
      top_p=e.top_p,
      sampler=e.sampler,
      steps=e.steps,
      labels=labels,
      guidance=e.guidance,
    )
    png = e.png or str(fs.path(args.workdir, what="workdir") / f"samples_step{step}.png")
    save_grid(images, png, scale=e.png_scale)
    print(f"wrote {len(images)} samples of step {step} to {png}")
    return
  if e.png:
    raise ConfigError(
      f"--png applies to image models (tasks {list(task_kinds.names(image=True))}); "
      f"this config's task is {config.task!r}."
    )
  texts = sample(
    config,
    args.workdir,
    prompt=e.prompt,
    num_samples=e.num_samples or 1,
    max_new_tokens=e.max_new_tokens,
    temperature=e.temperature,
    top_k=e.top_k,
    top_p=e.top_p,
    seed=e.seed,
    prompt_len=e.prompt_len,
    step=e.step,
  )
  for i, text in enumerate(texts):
    print(f"--- sample {i}\n{text}")


if __name__ == "__main__":
  cli.run(main)
