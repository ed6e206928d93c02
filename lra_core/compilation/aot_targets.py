"""A config's steps traced and compiled for accelerators that are not attached: a TPU slice or NVIDIA GPUs.

The devices come from a topology name (`target_devices`): libtpu's compiler for a TPU slice, XLA:GPU
with Triton and ptxas of the CUDA plugin for GPUs, no driver needed. The trainer's own train step
(state spec, shardings, donation, micro-batches, kernels) and eval step are built for the config's batch
shapes from shapes alone, with no data files (`trace_train_step`, `eval_step_args`). Compiling them
(`compile_for_target`) turns the compiler's out-of-memory refusal into an answer (`OutOfMemory`: the
devices cannot hold the step), not an error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time

import jax

from lra_core import layout, sharding
from lra_core.compilation import topologies
from lra_core.compilation.step_compile import jit_train_step
from lra_core.errors import ConfigError, brief
from lra_core.run import data_setup
from lra_core.run.batches import batch_spec, config_batch
from lra_core.run.state import StateSpec, run_setup
from lra_core.run.steps import make_eval_step
from lra_core.tasks import Task, make_task


def target_devices(topology: str, slices: int = 1) -> list[jax.Device]:
  """The devices of a TPU slice ("v3:2x2"), of `slices` of them, or of NVIDIA GPUs ("h100", "a100x4"),
  compile-only. Raises ConfigError (one sentence) for a name that is neither."""
  if slices < 1:
    raise ConfigError(f"--slices must be a positive integer, got {slices}.")
  if topologies.is_gpu_topology(topology):
    if slices > 1:
      raise ConfigError(f"--slices applies to TPU slices, not to GPUs ({topology!r}); give more GPUs instead.")
    return topologies.gpu_devices(topology)
  if ":" in topology:
    return topologies.tpu_devices(topology, slices)
  raise ConfigError(
    f"topology {topology!r} is neither a TPU slice, <generation>:<chips> (e.g. v3:2x2, v5p:2x2x1), "
    f"nor GPUs, <gpu> or <gpu>x<count> with <gpu> one of {', '.join(topologies.GPUS)} (e.g. h100, "
    "a100x4, h100x16)."
  )


def trace_train_step(config, devices: list[jax.Device]) -> tuple[sharding.Mesh, Task, StateSpec, jax.stages.Traced]:
  """(mesh, task, state spec, traced train step) of `config` over `devices`, from shapes alone (no data,
  nothing allocated). Compile the step inside `with jax.set_mesh(mesh), sharding.activate(mesh, rules)`,
  where the Pallas kernels lower for the mesh's devices: `traced.lower().compile()`."""
  mesh = layout.make_mesh(config.mesh, devices)
  rules = config.sharding.rules
  info = data_setup.config_data_info(config)
  data_setup.check_compatible(config, info, mesh)
  task = make_task(config, info)
  tx, schedule, spec = run_setup(config, mesh)
  with jax.set_mesh(mesh), sharding.activate(mesh, rules):
    batch = config_batch(config, mesh, rules)
    return mesh, task, spec, jit_train_step(config, spec, task, tx, schedule).trace(spec.abstract, batch)


def eval_step_args(config, spec, task, mesh, rules) -> tuple:
  """The evaluator's jitted step and its abstract arguments at the eval batch size."""
  batch_size = config.train.eval_batch_size or config.train.batch_size
  batch = config_batch(config, mesh, rules, batch_size=batch_size)
  carry = None
  if spec.has_carry:
    carry = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(
        (batch_size,) + a.shape[1:],
        a.dtype,
        sharding=sharding.NamedSharding(mesh, batch_spec(rules, mesh, (batch_size,) + a.shape[1:])),
      ),
      spec.abstract["carry"],
    )
  step = jax.jit(make_eval_step(config, spec, task))
  return step, spec.abstract["params"], spec.abstract["model_state"], batch, carry


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """A compile the TPU compiler refused because its buffers exceed the chip's memory."""

  required: float  # bytes the compiler said it needs (NaN if its message names none)
  message: str


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_TRITON_TOO_OLD = re.compile(r"Triton support is only enabled for .*compute capability")
_NO_TRITON_TILING = "Couldn't find output tile sizes"
CUBLAS_ONLY_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
GEMM_FALLBACK = (
  "cuBLAS GEMMs (xla_gpu_enable_triton_gemm=false): XLA:GPU's Triton GEMM emitter found no "
  "tiling for a matmul of the step"
)


def compile_for_target(step, *abstract_args, platform: str = "tpu"):
  """(compiled, seconds, fallback): timed_compile of a jitted step (or an already traced one, with no
  arguments), except that the compiler's out-of-memory refusal comes back as OutOfMemory (the devices
  cannot hold the step: an answer, not an error). On a GPU, Triton's refusal of a compute capability
  below 8.0 is a ConfigError, and a step whose matmul XLA's Triton GEMM emitter finds no tiling for
  compiles again with cuBLAS GEMMs (`fallback` says so; "" when none was needed)."""
  t0 = time.perf_counter()
  fallback = ""
  try:
    lowered = step.lower() if isinstance(step, jax.stages.Traced) else step.lower(*abstract_args)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # Without a device XLA cannot autotune, and its default Triton tiling fails for some matmul shapes
      # (e.g. 82,080 rows); on a GPU its autotuner chooses between Triton and cuBLAS per matmul.
      if platform != "gpu" or _NO_TRITON_TILING not in str(e):
        raise
      logging.warning(
        "XLA:GPU found no Triton tiling for a matmul (%s); compiling with cuBLAS GEMMs",
        brief(e),
      )
      compiled = lowered.compile(compiler_options=dict(CUBLAS_ONLY_OPTIONS))
      fallback = GEMM_FALLBACK
    return compiled, time.perf_counter() - t0, fallback
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if platform == "gpu" and _TRITON_TOO_OLD.search(text):
      raise ConfigError(
        "Pallas kernels compile to Triton, which needs compute capability 8.0 or newer and this GPU "
        "has less (a V100 has 7.0); use model.impl=xla."
      ) from e
    if "RESOURCE_EXHAUSTED" not in text:
      raise
    first = text.strip().splitlines()[0]
    m = re.search(r"required for [\w ]+\(([\d.]+)([KMGTP]?)\)", first) or re.search(r"\(([\d.]+)([KMGTP]?)\)", first)
    # XLA:GPU plans any size of program: its RESOURCE_EXHAUSTED is a kernel's shared memory, not HBM.
    required = float(m.group(1)) * _UNITS[m.group(2)] if m and platform != "gpu" else math.nan
    return OutOfMemory(required, first), time.perf_counter() - t0, fallback
