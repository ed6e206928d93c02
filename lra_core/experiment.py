"""Pieces that train, evaluate and sample share: data setup and checks, host-to-device
batches, and the evaluation loop."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lra_core import data as data_lib
from lra_core import fs, optim, registry, sharding
from lra_core.checkpoint import restore_params
from lra_core.data import pipeline
from lra_core.errors import ConfigError, DataError
from lra_core.state import eval_params, make_state_spec, to_host
from lra_core.steps import make_eval_step
from lra_core.tasks import Task, make_task


def setup_data(config, splits, mesh) -> tuple[dict[str, data_lib.Source], Task]:
  """Validates the dataset settings, opens the splits and builds the task (no compilation)."""
  registry.dataset_module(config.data.name).validate_config(config)
  sources = {split: data_lib.make_source(config, split) for split in splits}
  pipeline.log_sizes(config, sources)
  info = next(iter(sources.values())).info
  check_compatible(config, info, mesh)
  return sources, make_task(config, info)


# What one target is, by data.name (only names a metric; the step does not depend on it).
UNITS = {"bytes": "byte", "imdb": "byte", "retrieval": "byte", "cifar10": "pixel", "pathfinder": "pixel",
         "imagenet64": "dim"}


def config_data_info(config) -> data_lib.DataInfo:
  """What the task needs to know about the data, from the model config alone (no dataset opened):
  for compiling ahead of time and for benchmarks on random tokens."""
  m = config.model
  vocab = int(m.get("vocab_size", 256))
  if config.task == "mlm" and config.mlm.mask_id < 0:
    vocab -= 1  # the last id is the mask token, not a data token
  num_classes = int(m.get("num_classes", 0)) if config.task in ("classify", "retrieval") else 0
  return data_lib.DataInfo(vocab_size=vocab, num_classes=num_classes, unit=UNITS.get(config.data.name, "token"))


def check_compatible(config, info: data_lib.DataInfo, mesh) -> None:
  """Cross-checks between config, data and devices that need the data or the mesh."""
  m, t = config.model, config.train
  if m.get("vocab_size", info.vocab_size) < info.vocab_size:
    raise ConfigError(f"model.vocab_size {m.vocab_size} is smaller than the {config.data.name} "
                      f"vocabulary ({info.vocab_size} ids).")
  if config.task == "mlm":
    mask_id = config.mlm.mask_id if config.mlm.mask_id >= 0 else m.vocab_size - 1
    if mask_id < info.vocab_size:
      raise ConfigError(f"mlm mask id {mask_id} is a real {config.data.name} token; set model.vocab_size "
                        f"to at least {info.vocab_size + 1} or mlm.mask_id outside the data vocabulary.")
  if info.num_classes and m.get("num_classes", info.num_classes) != info.num_classes:
    raise ConfigError(f"model.num_classes {m.num_classes} does not match the {info.num_classes} classes "
                      f"of {config.data.name}.")
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  micro = t.batch_size // t.grad_accum_steps
  if micro % shards:
    raise ConfigError(f"micro-batch size {micro} (train.batch_size {t.batch_size} / grad_accum_steps "
                      f"{t.grad_accum_steps}) is not a multiple of the {shards} data-parallel shards.")
  eval_bs = t.eval_batch_size or t.batch_size
  if eval_bs % shards:
    raise ConfigError(f"eval batch size {eval_bs} is not a multiple of the {shards} data-parallel shards.")


def check_batch(batch: dict[str, np.ndarray], config, index: int) -> None:
  """Token ids and labels must fit the model: a one-sentence DataError (before the step that
  would read them, and for the first batch before anything compiles) instead of silent garbage
  from an out-of-range embedding lookup."""
  limits = {"inputs": ("model.vocab_size", config.model.get("vocab_size")),
            "targets": (("model.num_classes", config.model.get("num_classes")) if config.task in ("classify", "retrieval")
                        else ("model.vocab_size", config.model.get("vocab_size")))}
  for name, (key, limit) in limits.items():
    x = batch.get(name)
    if limit is None or x is None or not np.issubdtype(x.dtype, np.integer) or not x.size:
      continue
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= limit:
      bad = low if low < 0 else high
      raise DataError(f"training batch {index} holds {name} id {bad}, outside 0..{limit - 1} ({key}); "
                      "the data does not match the model's vocabulary or classes.")


def _global_layout(local: np.ndarray, mesh, rules) -> tuple[tuple[int, ...], sharding.NamedSharding]:
  """The global shape and sharding of a batch field of which this process holds `local`."""
  if not local.ndim:
    return (), sharding.NamedSharding(mesh, sharding.P())
  shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  return shape, sharding.NamedSharding(mesh, sharding.batch_spec(rules, mesh, shape))


def to_device(batch: dict[str, np.ndarray], mesh, rules) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over the batch mesh axes."""
  out = {}
  for name, local in batch.items():
    shape, named = _global_layout(local, mesh, rules)
    out[name] = jax.make_array_from_process_local_data(named, local, shape)
  return out


def abstract_batch(batch: dict[str, np.ndarray], mesh, rules) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes, dtypes and shardings `to_device(batch, ...)` gives, for compiling ahead of time."""
  out = {}
  for name, local in batch.items():
    local = np.asarray(local)
    shape, named = _global_layout(local, mesh, rules)
    out[name] = jax.ShapeDtypeStruct(shape, local.dtype, sharding=named)
  return out


def config_batch(config, mesh, rules, *, batch_size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract global batch of `config` (train.batch_size rows unless `batch_size`), laid out
  as `to_device` lays out real batches: for compiling ahead of time without any data."""
  fields = pipeline.batch_fields(config, batch_size or config.train.batch_size)
  out = {}
  for name, (shape, dtype) in fields.items():
    spec = sharding.batch_spec(rules, mesh, shape) if shape else sharding.P()
    out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.NamedSharding(mesh, spec))
  return out


class Evaluator:
  """Runs the eval step over a split and turns metric sums into values.

  A state with an EMA of the weights (optim.ema_decay > 0) is evaluated with the EMA, and once
  more with the raw weights, whose metrics come back with the suffix `_raw` (`loss_raw`, ...).
  """

  def __init__(self, config, spec, task, mesh, sources):
    self.config, self.spec, self.task, self.mesh = config, spec, task, mesh
    self.rules = config.sharding.rules
    self.batch_size = config.train.eval_batch_size or config.train.batch_size
    self.readers = {split: pipeline.BatchReader(config, src, train=False, batch_size=self.batch_size)
                    for split, src in sources.items()}
    self.step = jax.jit(make_eval_step(config, spec, task))

  def __call__(self, state: dict, split: str, limit: int = 0) -> dict[str, float]:
    metrics = self._run(eval_params(state), state["model_state"], split, limit)
    if "ema" in state:
      raw = self._run(state["params"], state["model_state"], split, limit)
      metrics.update({f"{k}_raw": v for k, v in raw.items()})
    return metrics

  def _run(self, params: dict, model_state: dict, split: str, limit: int) -> dict[str, float]:
    reader = self.readers[split]
    # Every autoregressive eval batch starts with reset=True, so this only fixes the shapes.
    carry = None
    if self.spec.has_carry:
      carry = jax.tree.map(lambda a: jnp.zeros((self.batch_size,) + a.shape[1:], a.dtype),
                           self.spec.abstract["carry"])
    totals = None
    n = reader.num_eval_batches(limit)
    it = pipeline.iterate(reader, 0, n, num_threads=self.config.data.num_threads,
                          prefetch=self.config.data.prefetch)
    for local in it:
      batch = to_device(local, self.mesh, self.rules)
      metrics, carry = self.step(params, model_state, batch, carry)
      totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
    sums = {k: tuple(float(x) for x in to_host(v)) for k, v in totals.items()}
    return self.task.finalize(sums)


def warm_start(config, spec, state: dict, source_workdir: str, mesh) -> dict:
  """`state` with its parameters taken from the latest checkpoint in `source_workdir`.

  The source run's own config.json rebuilds its state for restoring. A family with capability
  `uptrain` maps the source parameters onto its own with its record's `uptrain_params` (e.g. a
  Block Transformer from a vanilla Transformer); otherwise the two models must have the same
  parameter shapes. The optimizer state stays fresh (it starts at zero either way).
  """
  path = fs.path(source_workdir, what="train.init_from")
  if not (path / "config.json").is_file():
    raise ConfigError(f"train.init_from {source_workdir!r} has no config.json; expected the workdir of a run.")
  source_config = ml_collections.ConfigDict(json.loads((path / "config.json").read_text()))
  source_tx, _ = optim.make_optimizer(source_config)
  source, step = restore_params(path, make_state_spec(source_config, mesh, source_tx).abstract)
  family = registry.family(config.model.name)
  params = jax.device_get(state["params"])
  source_params = jax.device_get(source["params"])
  if family.capabilities.uptrain:
    params = family.uptrain_params(params, source_params, config)
  else:
    mine, theirs = jax.tree.structure(params), jax.tree.structure(source_params)
    shapes = [np.shape(x) for x in jax.tree.leaves(params)] == [np.shape(x) for x in jax.tree.leaves(source_params)]
    if mine != theirs or not shapes:
      raise ConfigError(f"train.init_from {source_workdir!r} holds a {source_config.model.name} model whose "
                        f"parameters do not match this {config.model.name} model.")
    params = source_params
  logging.info("parameters initialised from %s (step %d)", path, step)
  state = dict(state, params=jax.device_put(params, spec.shardings["params"]))
  if "ema" in state:  # the average starts at the parameters the run starts from
    state["ema"] = jax.device_put(params, spec.shardings["ema"])
  return state
