"""The run's evaluation: its eval step over a split, metric sums turned into values.

The trainer evaluates with it every train.eval_every steps and at the end; `python -m lra_core.evaluate`
(lra_core/evaluate.py) with it evaluates a workdir's checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lra_core.data import pipeline
from lra_core.run.batches import row_block, to_device
from lra_core.run.state import eval_params, to_host
from lra_core.run.steps import make_eval_step


class Evaluator:
  """Runs the eval step over a split and turns metric sums into values.

  A state with an EMA of the weights (optim.ema_decay > 0) is evaluated with the EMA, and once
  more with the raw weights, whose metrics come back with the suffix `_raw` (`loss_raw`, ...).
  """

  def __init__(self, config, spec, task, mesh, sources):
    self.config, self.spec, self.task, self.mesh = config, spec, task, mesh
    self.rules = config.sharding.rules
    self.batch_size = config.train.eval_batch_size or config.train.batch_size
    block, blocks = row_block(mesh, self.rules)
    self.readers = {
      split: pipeline.BatchReader(
        config, src, train=False, batch_size=self.batch_size, process_index=block, process_count=blocks
      )
      for split, src in sources.items()
    }
    self.step = jax.jit(make_eval_step(config, spec, task))

  def __call__(self, state: dict, split: str, limit: int = 0) -> dict[str, float]:
    metrics = self._run(eval_params(state), state["model_state"], split, limit)
    if "ema" in state:
      raw = self._run(state["params"], state["model_state"], split, limit)
      metrics.update({f"{k}_raw": v for k, v in raw.items()})
    return metrics

  def coverage(self, split: str, limit: int = 0) -> tuple[int, int]:
    """(examples an evaluation of `split` over `limit` batches (0: all) reads, examples in `split`)."""
    total = len(self.readers[split].source)
    return (min(total, limit * self.batch_size) if limit else total), total

  def _run(self, params: dict, model_state: dict, split: str, limit: int) -> dict[str, float]:
    reader = self.readers[split]
    # Every autoregressive eval batch starts with reset=True, so this only fixes the shapes.
    carry = None
    if self.spec.has_carry:
      carry = jax.tree.map(lambda a: jnp.zeros((self.batch_size,) + a.shape[1:], a.dtype), self.spec.abstract["carry"])
    totals = None
    n = reader.num_eval_batches(limit)
    it = pipeline.iterate(reader, 0, n, num_threads=self.config.data.num_threads, prefetch=self.config.data.prefetch)
    for local in it:
      batch = to_device(local, self.mesh, self.rules)
      metrics, carry = self.step(params, model_state, batch, carry)
      if totals is not None:
        # The steps before this one done, while it runs: at most two in flight. Dispatched all at once
        # (thousands for a whole test split) they hold every batch in device memory, and XLA:CPU's
        # devices, which share one thread pool, deadlock in their collectives past a few hundred queued
        # programs (aborted after 60 s: "Termination timeout ... Exiting to ensure a consistent program
        # state"; 1,000 queued fsdp steps over 8 CPU devices did, 300 did not).
        jax.block_until_ready(totals)
      totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
    sums = {k: tuple(float(x) for x in to_host(v)) for k, v in totals.items()}
    return self.task.finalize(sums)
