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

The images are drawn and laid out by lra_core/run/image_samples.py, which the trainer's grids share.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from lra_core import cli, decoding, diffusion, layout, task_kinds
from lra_core import data as data_lib
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.checkpoints.saved_config import load_workdir_config
from lra_core.errors import ConfigError, DecodingError
from lra_core.run.image_samples import PNG_MIN_WIDTH, check_guidance, save_grid, training_samples
from lra_core.run.state import eval_params, run_setup
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


def sample_images(
  config, workdir, *, num_samples: int = 16, seed: int = 0, step: int | None = None, **options
) -> np.ndarray:
  """uint8 [N,S,S,C] images sampled from the trained image_ar or diffusion model of `workdir`;
  `options` as training_samples takes them."""
  if not task_kinds.kind(config.task).image:
    raise ConfigError(f"image sampling needs an image task {list(task_kinds.names(image=True))}, not {config.task!r}.")
  model, _ = load_model(config, workdir, step=step)
  return training_samples(config, model, jax.random.key(seed), num_samples, **options)


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

  args = cli.parse(
    argv, extra=flags, prog="python -m lra_core.sample", config_from_workdir=load_workdir_config, example=EXAMPLE
  )
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
