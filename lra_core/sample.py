"""Sample from a trained autoregressive model with its decode-state API.

  python -m lra_core.sample --config=<spec> --workdir=<dir> --prompt="The " \
      --max_new_tokens=200 --temperature=0.8 --top_p=0.9 [--top_k=40] [--num_samples=4]

Without --prompt, the first --prompt_len tokens of the first validation example are used.
Text is encoded and decoded with the dataset's own codec (`data.text_codec`).

Image models (task image_ar) sample whole images pixel by pixel from the START token and write
them as one PNG grid:

  python -m lra_core.sample --config=<spec> --workdir=<dir> --num_samples=16 --png=samples.png
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lra_core import cli, decoding, optim, sharding
from lra_core import data as data_lib
from lra_core.checkpoint import restore_params
from lra_core.data import imagenet64
from lra_core.errors import ConfigError, optional_import
from lra_core.state import make_state_spec

AUTOREGRESSIVE = ("lm", "image_ar")


def load_model(config, workdir, *, step: int | None = None) -> tuple[nnx.Module, int]:
  """The trained model of `workdir` (eval mode) and its checkpoint step."""
  mesh = sharding.make_mesh(config.mesh)
  tx, _ = optim.make_optimizer(config)
  spec = make_state_spec(config, mesh, tx)
  state, step = restore_params(workdir, spec.abstract, step)
  return nnx.merge(spec.eval_graphdef, state["params"], state["model_state"]), step


def sample(config, workdir, *, prompt: str | None, num_samples: int = 1, max_new_tokens: int = 100,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           prompt_len: int = 32, step: int | None = None) -> list[str]:
  if config.task not in AUTOREGRESSIVE:
    raise ConfigError(f"sampling needs an autoregressive task {AUTOREGRESSIVE}, not {config.task!r}.")
  encode, decode = data_lib.text_codec(config)
  if prompt:
    ids = list(encode(prompt))
  else:
    ids = [int(i) for i in data_lib.make_source(config, "validation")[0]["inputs"][:prompt_len]]
  if not ids:
    raise ConfigError("the prompt encodes to no tokens; give a non-empty --prompt.")
  model, _ = load_model(config, workdir, step=step)
  prompt_ids = np.tile(np.asarray(ids, np.int32)[None], (num_samples, 1))
  out = decoding.generate(model, prompt_ids, max_new_tokens=max_new_tokens, key=jax.random.key(seed),
                          temperature=temperature, top_k=top_k, top_p=top_p)
  return [decode(np.asarray(row)) for row in out]


class PixelsOnly(nnx.Module):
  """Decodes with `model` but never samples a token >= `num_pixels` (the START token)."""

  def __init__(self, model: nnx.Module, num_pixels: int):
    self.model, self.num_pixels = model, num_pixels

  def init_decode_state(self, batch_size: int, max_len: int):
    return self.model.init_decode_state(batch_size, max_len)

  def decode_step(self, tokens, state):
    logits, state = self.model.decode_step(tokens, state)
    return logits.at[..., self.num_pixels:].set(-jnp.inf), state


def sample_images(config, workdir, *, num_samples: int = 16, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, step: int | None = None) -> np.ndarray:
  """uint8 [N,S,S,C] images sampled token by token from a trained image_ar model."""
  if config.task != "image_ar" or config.data.name != "imagenet64":
    raise ConfigError(f"image sampling needs task 'image_ar' on imagenet64, not {config.task!r} on "
                      f"{config.data.name!r}.")
  model, _ = load_model(config, workdir, step=step)
  prompt = np.full((num_samples, 1), imagenet64.START, np.int32)
  out = decoding.generate(PixelsOnly(model, imagenet64.START), prompt, max_new_tokens=config.train.seq_len, key=jax.random.key(seed),
                          temperature=temperature, top_k=top_k, top_p=top_p)
  d = config.data
  return imagenet64.to_image(np.asarray(out[:, 1:]), d.image_size, d.order, d.patch_size)


def save_grid(images: np.ndarray, path: str, columns: int = 0, scale: int = 1) -> None:
  """uint8 [N,S,S,C] -> one PNG, `columns` images per row (default: a near-square grid), 1-pixel gaps;
  each pixel drawn as a `scale` x `scale` square."""
  matplotlib_image = optional_import("matplotlib.image", "plot")
  images = np.repeat(np.repeat(np.asarray(images), scale, axis=1), scale, axis=2)
  n, s, _, c = images.shape
  cols = columns or int(np.ceil(np.sqrt(n)))
  rows = -(-n // cols)
  grid = np.full((rows * (s + 1) + 1, cols * (s + 1) + 1, c), 255, np.uint8)
  for i, image in enumerate(images):
    r, k = divmod(i, cols)
    grid[1 + r * (s + 1):1 + r * (s + 1) + s, 1 + k * (s + 1):1 + k * (s + 1) + s] = image
  matplotlib_image.imsave(path, grid[..., 0] if c == 1 else grid, cmap="gray" if c == 1 else None)


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0 = off")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass; 1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--png", default="", help="image_ar: write the sampled images to this PNG grid")
    parser.add_argument("--png_scale", type=int, default=1, help="--png: pixels per image pixel")

  args = cli.parse(argv, extra=flags, prog="python -m lra_core.sample")
  e = args.extra
  if e.png:
    images = sample_images(args.config, args.workdir, num_samples=e.num_samples, temperature=e.temperature,
                           top_k=e.top_k, top_p=e.top_p, seed=e.seed, step=e.step)
    save_grid(images, e.png, scale=e.png_scale)
    print(f"wrote {len(images)} samples to {e.png}")
    return
  texts = sample(args.config, args.workdir, prompt=e.prompt, num_samples=e.num_samples,
                 max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k,
                 top_p=e.top_p, seed=e.seed, prompt_len=e.prompt_len, step=e.step)
  for i, text in enumerate(texts):
    print(f"--- sample {i}\n{text}")


if __name__ == "__main__":
  cli.run(main)
