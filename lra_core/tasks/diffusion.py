"""Denoising diffusion on images (`diffusion`): MSE between the denoiser's output and its target.

The batch holds pixels `inputs` [B, S*S*C] (raster order, 0..255) or images [B,S,S,C], class
`targets` [B] and `weights` [B]. `prepare` draws t ~ U[0, 1] and the noise from the step's key
(so a resumed run draws the same ones, and evaluation, whose key is fixed, always the same),
and makes x_t, gamma(t) and the regression target (`config.diffusion.pred_type`). Latent
self-conditioning (RIN / pix2seq with self_cond_by_masking): a first pass without gradient gives
latents, which the second pass sees for a `self_cond_rate` share of the examples (zeros for the
rest), so the model learns both to start from nothing and to refine its previous estimate.

Classifier-free guidance (`diffusion.cond_dropout` p > 0): in training (the train step passes
`rngs`; evaluation passes none) a share p of the examples, drawn in `prepare`, get the null
class (`model.null_label`) in place of their label, so the model also learns the unconditional
prediction; evaluation measures the conditional loss. `diffusion.normalize_noisy_input`: the
model sees x_t divided by its per-example standard deviation (`diffusion.normalize_input`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core import diffusion
from lra_core.tasks.base import Task, apply_model


class DiffusionTask(Task):
  name = "diffusion"
  metric_names = ("loss",)

  def __init__(self, config, info):
    super().__init__(config, info)
    diffusion.validate_config(config)
    d, m = config.diffusion, config.model
    self.gamma = diffusion.make_schedule(d.schedule)
    self.pred_type = d.pred_type
    self.self_cond_rate = d.self_cond_rate
    self.self_condition = bool(m.get("self_condition", False)) and d.self_cond_rate > 0
    self.conditional = m.get("num_classes", 0) > 0
    self.cond_dropout = float(d.get("cond_dropout", 0.0))
    self.null_label = diffusion.null_label(config)
    self.normalize = bool(d.get("normalize_noisy_input", False))
    self.image_shape = (m.image_size, m.image_size, m.image_channels)

  def prepare(self, batch, key):
    k_t, k_eps, k_sc = jax.random.split(key, 3)
    pixels = batch["inputs"]
    x0 = diffusion.pixels_to_unit(pixels.reshape((pixels.shape[0],) + self.image_shape))
    b = x0.shape[0]
    t = jax.random.uniform(k_t, (b,), jnp.float32)
    gamma = self.gamma(t)
    eps = jax.random.normal(k_eps, x0.shape, jnp.float32)
    x_t = diffusion.q_sample(x0, gamma, eps)
    out = {
      "inputs": diffusion.normalize_input(x_t) if self.normalize else x_t,
      "gamma": gamma,
      "targets": diffusion.prediction_target(self.pred_type, x0, eps, gamma),
      "weights": batch["weights"].astype(jnp.float32).reshape(b),
      "self_cond": (jax.random.uniform(k_sc, (b,)) < self.self_cond_rate).astype(jnp.float32),
    }
    if self.conditional:
      out["labels"] = batch["targets"].astype(jnp.int32).reshape(b)
    if self.null_label is not None:  # its own key: the draws above stay those of a run without it
      out["drop_label"] = jax.random.uniform(jax.random.fold_in(key, 1), (b,)) < self.cond_dropout
    return out

  def loss_and_metrics(self, model, batch, *, normalizer, rngs, carry=None):
    x_t, gamma, labels = batch["inputs"], batch["gamma"], batch.get("labels")
    if rngs is not None and "drop_label" in batch:  # training: the dropped labels become the null class
      labels = jnp.where(batch["drop_label"], self.null_label, labels)
    latents_prev = None
    if self.self_condition:
      _, latents = model(x_t, gamma, labels=labels, rngs=rngs)
      latents_prev = jax.lax.stop_gradient(latents) * batch["self_cond"][:, None, None].astype(latents.dtype)
    (pred, _), (aux_loss, aux_metrics) = apply_model(
      model, x_t, gamma, labels=labels, latents_prev=latents_prev, rngs=rngs
    )
    mse = jnp.square(pred.astype(jnp.float32) - batch["targets"]).mean(axis=tuple(range(1, pred.ndim)))
    weights = batch["weights"]
    total, weight = (mse * weights).sum(), weights.sum()
    loss = (total + aux_loss * weight) / normalizer
    metrics = {"loss": (total, weight)}
    metrics.update({name: (value, jnp.ones((), jnp.float32)) for name, value in aux_metrics.items()})
    return loss, metrics, carry
