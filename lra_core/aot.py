"""Compiles a config for accelerators that are not there, on any host, and reports memory, fit and step time.

  python -m lra_core.aot --config=configs/enwik8/transformer_vq.py --topology=v3:2x2 \
      --config.train.batch_size=8 --config.train.seq_len=8192 --config.mesh.data=8 [--json=FILE]
  python -m lra_core.aot --config=configs/c4/latte.py:latte --topology=a100x4 --config.mesh.data=4

--topology is a TPU slice, <generation>:<chips> (v3:2x2, v5p:2x2x1, ...), compiled by libtpu's compiler,
or GPUs, <gpu>[x<count>] with <gpu> one of lra_core.compilation.topologies.GPUS (h100, h200, a100, a100-40g, v100,
v100-32g; h100x16 is two hosts of 8), compiled by XLA:GPU, Triton and ptxas of the CUDA plugin, no
driver needed. It builds the trainer's own train step (state spec, shardings, donation, micro-batches,
kernels) and eval step for the config's batch shapes, with no data files (lra_core/compilation/aot_targets.py), and
prints memory per device, whether it fits, and a roofline estimate of the step (lra_core/compilation/aot_report.py).
A TPU step fits its chip's HBM; a GPU step fits the part of the GPU's memory JAX preallocates,
XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set) of it, read from this process's environment.
--slices=N compiles for N such TPU slices joined over the data-center network (DCN): the mesh's
mesh.slice_axis (data unless set) spans them (mesh.slices, lra_core/layout.py), and the estimate
charges the collectives between slices at the chip's DCN bandwidth (lra_core/cost/chips.py).
Exit status: 0 fits, 3 compiles but does not fit, 2 a config or topology error (one sentence).
The trainer's own compile and memory check is lra_core/compilation/step_compile.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys

import jax

from lra_core import cli, sharding
from lra_core.compilation import topologies
from lra_core.compilation.aot_report import Report, estimate_from_hlo, write_hlo
from lra_core.compilation.aot_targets import (
  OutOfMemory,
  compile_for_target,
  eval_step_args,
  target_devices,
  trace_train_step,
)
from lra_core.compilation.step_compile import GIB, MemoryEstimate, gpu_memory_fraction, memory_limit
from lra_core.cost import chips
from lra_core.cost.pallas_costs import pallas_kernel_costs
from lra_core.data import pipeline
from lra_core.errors import ConfigError


def compile_config(
  config,
  topology: str,
  *,
  devices: list[jax.Device] | None = None,
  hotspots: int = 0,
  hlo_path: str | os.PathLike | None = None,
  slices: int = 1,
) -> Report:
  """Compiles `config`'s train and eval steps for the TPU slice or GPUs `topology` (their devices by
  `target_devices` unless given) and measures them. Raises ConfigError for a bad topology or a
  mesh the devices cannot hold; a step that compiles but does not fit comes back with fits=False.
  `hlo_path` also keeps the compiled train step's HLO text there (gzip if it ends in .gz), from
  which `estimate_from_hlo` recomputes the estimate without compiling again."""
  devices = target_devices(topology, slices) if devices is None else devices
  chip = chips.chip_of(devices[0])
  if chip is None:
    raise ConfigError(f"device kind {devices[0].device_kind!r} has no entry in lra_core.cost.chips.CHIPS.")
  config = _over_slices(config, slices, chip)
  platform = "gpu" if devices[0].platform == "gpu" else "tpu"
  t = config.train
  mesh, task, spec, traced = trace_train_step(config, devices)
  rules = config.sharding.rules
  with jax.set_mesh(mesh), sharding.activate(mesh, rules):
    train, train_s, train_fallback = compile_for_target(traced, platform=platform)
    evaluate, eval_s, eval_fallback = compile_for_target(
      *eval_step_args(config, spec, task, mesh, rules), platform=platform
    )
  limit, _ = memory_limit(t.memory_limit_gib, devices[0])
  tokens = t.batch_size * t.seq_len // pipeline.num_windows(config)
  # A GPU program's Triton calls keep no cost estimate: the traced program's Pallas calls give theirs.
  kernel_costs = pallas_kernel_costs(traced.jaxpr) if platform == "gpu" else ()
  common = dict(
    topology=topology,
    num_devices=len(devices),
    device_kind=devices[0].device_kind,
    mesh={k: v for k, v in mesh.shape.items()},
    slices=int(config.mesh.get("slices", 1)),
    slice_axis=str(config.mesh.get("slice_axis", "data")),
    hbm_gib=chip.hbm_bytes / GIB,
    compile_seconds=train_s + eval_s,
    remat=str(config.model.remat),
    scan_layers=bool(config.model.scan_layers),
    num_params=spec.num_params,
    tokens_per_step=tokens,
    platform=platform,
    usable_gib=limit / GIB,
    memory_fraction=gpu_memory_fraction() if platform == "gpu" else 1.0,
    kernel_costs=kernel_costs,
    gemm_fallback=train_fallback or eval_fallback,
    # The estimate's fields, until estimate_from_hlo reads them off the compiled step.
    flops_per_device=math.nan,
    est_step_seconds=math.nan,
    est_tokens_per_s=math.nan,
    est_mfu=math.nan,
    est_hfu=math.nan,
    recompute_flops=math.nan,
    memory_bound_share=math.nan,
    bound="-",
    mosaic_kernels=0,
  )
  if isinstance(train, OutOfMemory):
    eval_peak = evaluate.required if isinstance(evaluate, OutOfMemory) else MemoryEstimate.of(evaluate).peak
    logging.info("the train step does not fit: %s", train.message)
    return Report(
      **common,
      arguments_gib=math.nan,
      temporaries_gib=train.required / GIB,
      peak_gib=train.required / GIB,
      eval_peak_gib=eval_peak / GIB,
      fits=False,
      refusal=train.message,
    )
  memory = MemoryEstimate.of(train)
  eval_peak = evaluate.required if isinstance(evaluate, OutOfMemory) else MemoryEstimate.of(evaluate).peak
  hlo = train.as_text()
  if hlo_path is not None:
    write_hlo(hlo, hlo_path)
  report = Report(
    **common,
    arguments_gib=memory.arguments / GIB,
    temporaries_gib=memory.temporaries / GIB,
    peak_gib=memory.peak / GIB,
    eval_peak_gib=eval_peak / GIB,
    fits=max(memory.peak, eval_peak) <= limit,
  )
  return estimate_from_hlo(report, hlo, hotspots=hotspots)


def _over_slices(config, slices: int, chip: chips.Chip):
  """`config` with mesh.slices set to --slices (where the config leaves it at 1)."""
  saved = int(config.mesh.get("slices", 1))
  if slices == 1 or saved == slices:
    return config
  if saved != 1:
    raise ConfigError(f"--slices={slices} contradicts the config's mesh.slices={saved}; give one of them.")
  if chip.dcn_bandwidth is None:
    raise ConfigError(
      f"{chip.name} has no published data-center network bandwidth (lra_core/cost/chips.py), so a multi-slice "
      "estimate cannot be made for it; use v5e, v5p or v6e."
    )
  config = config.copy_and_resolve_references()
  config.mesh.slices = slices
  if -1 not in [config.mesh.get(axis) for axis in sharding.MESH_AXES]:
    # A mesh over slices uses every device: a config sized for one host (the tiny ones) grows along the
    # axis that spans the slices, as --config.mesh.<axis>=-1 would make it.
    axis = config.mesh.get("slice_axis", "data")
    logging.warning(
      "mesh.%s -1 (was %s): a mesh over %d slices uses all their devices", axis, config.mesh[axis], slices
    )
    config.mesh[axis] = -1
  return config


# ----------------------------------------------------------------------------- command line

EXIT_FITS, EXIT_USER_ERROR, EXIT_DOES_NOT_FIT = 0, cli.EXIT_USER_ERROR, 3
EXAMPLE = (
  "python -m lra_core.aot --config configs/enwik8/transformer_vq.py --topology v5e:2x2 \\\n"
  "      --config.mesh.data=4 --config.train.batch_size 8 --json runs/vq_v5e.json"
)


def main(argv=None) -> int:
  def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
      "--topology",
      required=True,
      help="a TPU slice, <generation>:<chips>, e.g. v3:2x2 (8 cores), v4:2x2x2, v5e:4x4, v5p:2x2x4; "
      "or NVIDIA GPUs, <gpu>[x<count>] with <gpu> one of "
      + ", ".join(topologies.GPUS)
      + ", e.g. h100, a100x4, a100-40gx8, h100x16 (two hosts of 8)",
    )
    parser.add_argument(
      "--slices",
      type=int,
      default=1,
      help="TPU only: compile for this many slices of --topology joined over the data-center network "
      "(mesh.slices; mesh.slice_axis spans them)",
    )
    parser.add_argument("--json", default="", help="also write the report's fields to this JSON file")
    parser.add_argument(
      "--hotspots",
      type=int,
      default=0,
      help="also list this many of the train step's dearest operations (what bounds the estimate)",
    )
    parser.add_argument(
      "--hlo", default="", help="also write the compiled train step's HLO text to this file (gzip if it ends in .gz)"
    )

  args = cli.parse(
    argv,
    extra=flags,
    workdir=False,
    prog="python -m lra_core.aot",
    example=EXAMPLE,
    description="Compiles a config's train and eval steps for a TPU slice (libtpu) or NVIDIA GPUs "
    "(the CUDA plugin) on this host and reports memory, fit and an estimated step time.",
  )
  report = compile_config(
    args.config,
    args.extra.topology,
    hotspots=args.extra.hotspots,
    hlo_path=args.extra.hlo or None,
    slices=args.extra.slices,
  )
  if report.mesh_warning():
    print(report.mesh_warning(), file=sys.stderr)
  on = f"{report.slices} x {args.extra.topology}" if report.slices > 1 else args.extra.topology
  print(f"{args.spec} on {on}:")
  print(report.table())
  if args.extra.json:
    path = pathlib.Path(args.extra.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
  return EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
  status = []
  cli.run(lambda: status.append(main()))
  sys.exit(status[0] if status else EXIT_USER_ERROR)
