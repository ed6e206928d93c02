"""Settings shared by the Long Range Arena configs (Tay et al. 2021 and its public configs)."""

from __future__ import annotations

import ml_collections

from lra_core.config import config_arg
from lra_core.configs.presets import latte as latte_presets
from lra_core.models import fit, latte, transformer
from lra_core.run import optim_settings


def lra_optim(lr: float, warmup: int, weight_decay: float) -> ml_collections.ConfigDict:
  """Adam b1 .9 b2 .98 eps 1e-9, decoupled weight decay, constant * linear_warmup * rsqrt_decay."""
  c = optim_settings.default_config()
  c.update(
    dict(
      name="adamw",
      lr=lr,
      schedule="rsqrt",
      warmup_steps=warmup,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      weight_decay=weight_decay,
      weight_decay_schedule="lr",
    )
  )
  return c


def lra_transformer(parts: set[str], **sizes) -> ml_collections.ConfigDict:
  """The LRA Transformer encoder (dropout 0.1, CLS pooling); args plus / plusplus pick
  Transformer+ / Transformer++. The plain one uses fixed sinusoids, as LRA's encoders do."""
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  model = transformer.model_config(variant, pooling="cls", dropout=0.1, attention_dropout=0.1, **sizes)
  if variant == "transformer":
    model.position = "sinusoid"
  return model


LATTE_ARGS = tuple(latte.VARIANTS)


def lra_latte(
  parts: set[str], *, rope: bool, lr: float, weight_decay: float, dropout: float, **sizes
) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """Bidirectional Latte for LRA (Dolga et al., Table 7 and Section 4.4): 6 layers, 4 heads,
  fixed sinusoids added to the tokens, mean pooling; the variant is one of LATTE_ARGS (default
  `latte`, the Table 3 rows are latte, latte_rglru++ and latte_rglru_swa++). `rope`: Table 7's
  "Embed." column, RoPE on the sliding window (else the window reads only the sinusoids). The
  feed-forward width (4 D) and the window (128) are not in Table 7; we take the authors' blocks and
  the LM setting. Table 7 gives no schedule: AdamW with linear warmup and cosine decay, as Table 5.
  Returns (model, optim) sections."""
  model = latte.model_config(
    latte_presets.variant_from_args(parts),
    num_layers=6,
    num_heads=4,
    position="sinusoid",
    rope=rope,
    vapor=False,
    dropout=dropout,
    tie_embeddings=False,
    **sizes,
  )
  model.d_ff = 4 * model.d_model
  if model.window:
    model.window = 128
  opt = optim_settings.default_config()
  opt.update(
    dict(
      name="adamw",
      lr=lr,
      schedule="cosine",
      warmup_steps=1000,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      weight_decay=weight_decay,
      weight_decay_schedule="lr",
    )
  )
  return model, opt


def lra_fit_config(
  arg: str | None, baseline, *, group: int, latents_per_group: int, tiny: tuple[int, int], image: bool = False
) -> ml_collections.ConfigDict:
  """A task's `configs/lra/<task>/fit.py` config: `lra_fit` on its Transformer config `baseline`
  (the module), with (group, latents) = `tiny` for the arg `tiny`."""
  if "tiny" in config_arg(arg, ("tiny",)):
    return lra_fit(baseline.get_config("tiny"), group=tiny[0], latents_per_group=tiny[1], image=image)
  return lra_fit(baseline.get_config(), group=group, latents_per_group=latents_per_group, image=image)


def lra_fit(
  config: ml_collections.ConfigDict, *, group: int, latents_per_group: int, image: bool = False
) -> ml_collections.ConfigDict:
  """Turns a task's Transformer config into FIT with the same local layers (FIT Table 2: the ViT's
  layers become the local layers, split into two blocks around global layers): N layers of the
  baseline -> L(ceil(N/2))G(g)L(floor(N/2)), g = 2 for N >= 4 else 1. Data and latents keep the
  baseline's width, heads (head width d / heads), MLP, dropout and classifier; training settings
  are unchanged. 1-D tasks split the sequence into groups of `group` tokens; `image` tasks block
  the square image into `group` x `group` pixel groups."""
  m = config.model
  first = -(-m.num_layers // 2)
  layers = f"L({first})G({2 if m.num_layers >= 4 else 1})L({m.num_layers - first})"
  grouping = dict(grouping="2d", group_side=group) if image else dict(grouping="1d", group_size=group)
  config.model = fit.model_config(
    vocab_size=m.vocab_size,
    num_classes=m.num_classes,
    layers=layers,
    latents_per_group=latents_per_group,
    d_model=m.d_model,
    num_heads=m.num_heads,
    d_ff=m.d_ff,
    d_latent=m.d_model,
    latent_heads=m.num_heads,
    latent_d_ff=m.d_ff,
    dropout=m.dropout,
    attention_dropout=m.attention_dropout,
    classifier_hidden=m.classifier_hidden,
    pooling="mean",
    tie_embeddings=False,
    **grouping,
  )
  return config


def epochs(train_examples: int, batch_size: int, num_epochs: int, *, checkpoint_epochs: int = 1) -> dict:
  """`config.train` settings for `num_epochs` epochs, evaluating once per epoch."""
  epoch = train_examples // batch_size
  return dict(
    steps=num_epochs * epoch, batch_size=batch_size, eval_every=epoch, checkpoint_every=checkpoint_epochs * epoch
  )
