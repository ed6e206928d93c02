"""Multi-process (multi-host) start-up: `jax.distributed.initialize` from flags or the cluster.

JAX's multi-controller runtime runs one Python process per host (or per GPU); every process
runs the same program on its own devices and the processes meet in collectives. The trainer is
written for it already: each process reads only its rows of a global batch (data/pipeline.py),
`run.batches.to_device` assembles global arrays from those rows, process 0 alone writes metrics,
and every process takes part in orbax's checkpoint saves. What remains is joining the
processes, which must happen before anything touches a device:

  --distributed=auto (default)  join when --coordinator_address is given, or when JAX can see a
                                multi-process cluster: a Cloud TPU pod slice (several workers) or
                                a SLURM job step with more than one task.
  --distributed=on              always join; coordinator, count and id come from the flags or,
                                missing there, from the cluster environment.
  --distributed=off             never join (one process, its local devices).
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I
                                explicit settings, for GPU clusters without a scheduler JAX knows
                                and for several processes on one machine (tests, debugging).

On CPU the processes' collectives go through gloo (JAX's default CPU implementation).
See docs/launching.md.

Once joined, every process runs the failure watchdog (lra_core/runtime/process_end.py): one process
failing, or a peer failing or disappearing, ends them all with one line and one status.
"""

from __future__ import annotations

import argparse
import logging
import os

import jax

from lra_core.errors import ConfigError
from lra_core.runtime import coordinator_watch, process_end

MODES = ("auto", "on", "off")


def add_flags(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group("multi-process runs (docs/launching.md)")
  group.add_argument(
    "--distributed",
    choices=MODES,
    default="auto",
    help="join a multi-process run with jax.distributed.initialize (auto: when "
    "--coordinator_address is given or a TPU pod / multi-task SLURM step is detected)",
  )
  group.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0's coordinator")
  group.add_argument("--num_processes", type=int, default=None, help="number of processes in the run")
  group.add_argument("--process_id", type=int, default=None, help="this process's index, 0..num_processes-1")
  group.add_argument(
    "--peer_timeout_s",
    type=float,
    default=process_end.PEER_TIMEOUT_S,
    help="end the run, naming the process, when another process has been silent this long (killed, or its "
    "host lost); below JAX's own heartbeat timeout (100 s), which aborts every process",
  )


def cluster_detected(environ=os.environ) -> str | None:
  """The name of a multi-process environment JAX can configure itself from, if this is one."""
  hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  if len(hosts) > 1:
    return "Cloud TPU pod slice"
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
  if all(k in environ for k in slurm) and int(environ["SLURM_NTASKS"]) > 1:
    return "SLURM job step"
  return None


def settings(
  mode: str, coordinator_address: str | None, num_processes: int | None, process_id: int | None, environ=os.environ
) -> dict | None:
  """The keyword arguments for `jax.distributed.initialize`, or None to stay a single process.

  Raises ConfigError (one sentence) for inconsistent flags, before any device is touched.
  """
  if mode not in MODES:
    raise ConfigError(f"--distributed must be one of {MODES}, got {mode!r}.")
  explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
  given = {k: v for k, v in explicit.items() if v is not None}
  if mode == "off":
    if given:
      raise ConfigError(f"--distributed=off contradicts --{sorted(given)[0]}; drop one of them.")
    return None
  if mode == "auto" and not given and cluster_detected(environ) is None:
    return None
  if given and cluster_detected(environ) is None and len(given) < 3:
    missing = sorted(set(explicit) - set(given))
    raise ConfigError(
      f"a multi-process run outside a TPU pod or SLURM step needs --{missing[0]} as well "
      "(give --coordinator_address, --num_processes and --process_id together)."
    )
  if num_processes is not None and num_processes < 1:
    raise ConfigError(f"--num_processes must be at least 1, got {num_processes}.")
  if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
    raise ConfigError(f"--process_id {process_id} is outside 0..{(num_processes or 1) - 1}.")
  if coordinator_address is not None and not coordinator_address.rpartition(":")[2].isdigit():
    raise ConfigError(f"--coordinator_address {coordinator_address!r} is not of the form HOST:PORT.")
  return given


def initialize(
  mode: str = "auto",
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  peer_timeout_s: float = process_end.PEER_TIMEOUT_S,
) -> bool:
  """Joins the multi-process run if the flags or the environment ask for one; True if joined."""
  kwargs = settings(mode, coordinator_address, num_processes, process_id)
  if kwargs is None:
    return False
  if jax.distributed.is_initialized():
    return True
  if peer_timeout_s <= 0:
    raise ConfigError(f"--peer_timeout_s must be positive, got {peer_timeout_s:g}.")
  jax.distributed.initialize(**kwargs)
  coordinator_watch.joined()
  # The watchdog's first device query starts the backends, outside the start-up filter: the CUDA plugin's
  # two lines pass, but a fatal line of JAX's client (a peer killed during the backends' exchange of
  # topologies, SIGABRT) cannot die in the filter's file with the process.
  process_end.start_watchdog(peer_timeout_s)
  logging.info(
    "process %d of %d joined the run (%d local / %d global devices)",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True


def settings_from_args(ns: argparse.Namespace) -> dict | None:
  """`settings` of the parsed flags: None for one process."""
  return settings(ns.distributed, ns.coordinator_address, ns.num_processes, ns.process_id)


def initialize_from_args(ns: argparse.Namespace) -> bool:
  return initialize(ns.distributed, ns.coordinator_address, ns.num_processes, ns.process_id, ns.peer_timeout_s)
