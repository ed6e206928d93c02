"""The jitted train and eval steps, for any model and any task.

The train step: derive this step's key from the root key and the step number (so a resumed run
draws the same dropout masks), let the task prepare the batch, reset carried model state where
a new sequence begins, accumulate gradients over micro-batches, apply the optimizer, and return
metric sums plus the norms the numerics guard checks (with train.skip_nonfinite, a non-finite
update is dropped on device and reported as `skipped`). With optim.ema_decay d > 0 the state's
"ema" moves to d * ema + (1 - d) * params after each update (d by optim.ema_rate: with
optim.ema_warmup, smaller for the first updates).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lra_core.run import optim
from lra_core.run.state import StateSpec, split_model
from lra_core.tasks import Task

Array = jax.Array


def split_micro(x: Array, k: int) -> Array:
  """[B, ...] -> [k, B/k, ...] with micro-batch i = rows i::k, so every device keeps its rows."""
  return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def merge_micro(x: Array) -> Array:
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _reset_carry(model: nnx.Module, carry: Any, reset: Array | None, batch_size: int) -> Any:
  if carry is None or reset is None:
    return carry
  fresh = model.init_carry(batch_size)
  return jax.tree.map(lambda f, c: jnp.where(reset, f.astype(c.dtype), c), fresh, carry)


def _batch_size(batch: dict[str, Array]) -> int:
  return batch["inputs"].shape[0]


def make_train_step(config, spec: StateSpec, task: Task, tx: optax.GradientTransformation, schedule):
  k = config.train.grad_accum_steps
  skip_nonfinite = config.train.skip_nonfinite

  # Frozen groups' parameters pass no gradient: their zero gradients are constants, so the weight
  # gradients' matrix products are never formed (and grad_norm is the trained parameters').
  still = optim.frozen(config, spec.abstract["params"])

  def loss_fn(params, model_state, batch, carry, key, normalizer):
    params = jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, still)
    model = nnx.merge(spec.train_graphdef, params, model_state)
    loss, metrics, carry = task.loss_and_metrics(
      model, batch, normalizer=normalizer, rngs=nnx.Rngs(dropout=key), carry=carry
    )
    _, _, new_model_state = split_model(model)
    return loss, (metrics, nnx.to_pure_dict(new_model_state), carry)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state: dict, batch: dict[str, Array]) -> tuple[dict, dict[str, Array]]:
    params, model_state = state["params"], state["model_state"]
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    k_prep, k_model = jax.random.split(key)
    batch = dict(batch)
    reset = batch.pop("reset", None)
    batch = task.prepare(batch, k_prep)
    normalizer = task.normalizer(batch)
    carry = state.get("carry")
    if carry is not None:
      carry = _reset_carry(nnx.merge(spec.train_graphdef, params, model_state), carry, reset, _batch_size(batch))

    if k == 1:
      (loss, (metrics, model_state, carry)), grads = grad_fn(params, model_state, batch, carry, k_model, normalizer)
    else:
      micro = jax.tree.map(lambda x: split_micro(x, k), (batch, carry))

      def body(acc, xs):
        grads_acc, metrics_acc, loss_acc, ms = acc
        (mb, cb), i = xs
        (loss, (m, ms, cb)), g = grad_fn(params, ms, mb, cb, jax.random.fold_in(k_model, i), normalizer)
        acc = (jax.tree.map(jnp.add, grads_acc, g), jax.tree.map(jnp.add, metrics_acc, m), loss_acc + loss, ms)
        return acc, cb

      zeros_g = jax.tree.map(jnp.zeros_like, params)
      first = jax.tree.map(lambda x: x[0], micro)
      metric_shapes = jax.eval_shape(lambda: grad_fn(params, model_state, *first, k_model, normalizer)[0][1][0])
      zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
      init = (zeros_g, zeros_m, jnp.zeros((), jnp.float32), model_state)
      (grads, metrics, loss, model_state), carries = jax.lax.scan(body, init, (micro, jnp.arange(k)))
      carry = None if carry is None else jax.tree.map(merge_micro, carries)

    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state, model_state=model_state)
    if "ema" in state:
      d = optim.ema_rate(config, state["step"])
      new_state["ema"] = jax.tree.map(lambda e, p: (d * e + (1.0 - d) * p).astype(e.dtype), state["ema"], params)
    if carry is not None:
      new_state["carry"] = carry
    out = {name: jnp.stack(pair) for name, pair in metrics.items()}
    out.update(
      objective=loss,
      grad_norm=optax.tree.norm(grads),
      param_norm=optax.tree.norm(params),
      learning_rate=schedule(state["step"]),
    )
    if skip_nonfinite:
      # A non-finite update changes nothing but the step (the data and the keys move on): the
      # parameters, optimizer, model state (e.g. codebook EMAs) and carried state stay as they were.
      ok = jnp.isfinite(loss) & jnp.isfinite(out["grad_norm"]) & jnp.isfinite(out["param_norm"])
      kept = dict(state, step=new_state["step"])
      new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, kept)
      out["skipped"] = (~ok).astype(jnp.float32)
    return new_state, out

  return train_step


def make_eval_step(config, spec: StateSpec, task: Task):
  seed = config.train.seed + 1  # fixed: MLM masks are the same at every eval

  def eval_step(params, model_state, batch: dict[str, Array], carry):
    eval_key = jax.random.key(seed)  # made while tracing: no array on any device before the compile
    model = nnx.merge(spec.eval_graphdef, params, model_state)
    batch = dict(batch)
    reset = batch.pop("reset", None)
    batch = task.prepare(batch, eval_key)
    carry = _reset_carry(model, carry, reset, _batch_size(batch))
    _, metrics, carry = task.loss_and_metrics(model, batch, normalizer=jnp.ones(()), rngs=None, carry=carry)
    return {name: jnp.stack(pair) for name, pair in metrics.items()}, carry

  return eval_step
