"""A soak test of recovery: SIGKILLs at random moments across a two-process run, each followed by a
restart, every restart checked bit for bit against an uninterrupted run.

  python scripts/soak.py --kills=20 --workdir=runs/soak          # 4.5 minutes on a 2-core host

Both runs are two processes joined by `jax.distributed` on this host (2 CPU devices each, the data
axis over both), the path a pod or a SLURM job takes. First the reference runs to its end, keeping
every checkpoint. Then the soak: both processes start, one of them (chosen at random) is killed with
SIGKILL after a random time (start-up, compiles, steps and checkpoint writes all get hit), the other
is killed a moment later as a pod's supervisor would after losing a peer, and both start again with
the same command. Near its end (no checkpoint left to check a restart by) the soaked run starts
afresh. After `--kills` kills the run goes on to its end.

A kill was recovered from when the first checkpoint written after it, by the restart or (where that
restart was itself killed first, in start-up or inside its first write) by a later one, is
bit-identical to the reference's of the same step (every array's digest in the checkpoint's meta,
lra_core/checkpoints/checkpointer.py); the soak ends with the reference's `param_checksum`. The report: kills, kills
recovered from (the steps the restarts resumed from, the checkpoint that showed it), the final checksum
against the reference's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import orbax.checkpoint as ocp

from lra_core import cli
from lra_core.checkpoints.checkpointer import reader_options
from lra_core.errors import ConfigError

DEFAULT_CONFIG = "configs/lra/listops/transformer.py:tiny"
# Small enough to restart often; 10 checkpoints a run, all of them kept for the comparison.
RUN = ("mesh.data=-1", "train.log_every=1", "train.eval_batches=1", "train.eval_every=0", "train.test_at_end=False")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(config: str, workdir: pathlib.Path, overrides: list[str], logs: pathlib.Path) -> list[subprocess.Popen]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  port = _free_port()
  command = [sys.executable, "-m", "lra_core.train", f"--config={config}", f"--workdir={workdir}"]
  command += [f"--config.{o}" for o in overrides]
  command += [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
  logs.mkdir(parents=True, exist_ok=True)
  procs = [
    subprocess.Popen(
      [*command, f"--process_id={i}"], stdout=(logs / f"process{i}.log").open("a"), stderr=subprocess.STDOUT, env=env
    )
    for i in range(2)
  ]
  _CHILDREN.extend(procs)
  return procs


_CHILDREN: list[subprocess.Popen] = []  # every run process started: ended with the soak, however it ends


@contextlib.contextmanager
def _children_ended() -> Iterator[None]:
  """The soak's run processes end with it: stopped by Ctrl-C, SIGTERM (a job's time limit) or an error,
  it kills those still running (they were left training on, their peer gone)."""
  previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
    _kill(_CHILDREN)
    _CHILDREN.clear()


def logged_step(log: pathlib.Path, offset: int) -> int:
  """The newest step the progress lines written after `offset` report (0 if none yet)."""
  if not log.exists():
    return 0
  with log.open("rb") as f:
    f.seek(offset)
    text = f.read().decode(errors="replace")
  return max((int(m) for m in re.findall(r" step (\d+)/\d+ ", text)), default=0)


def timed_kill_moment(delay: float, step: int) -> str:
  """The label of a kill `delay` seconds after a start whose log had reached `step` (0: no step yet)."""
  where = f"at step {step}" if step else "in start-up"
  return f"{where}, timed at {delay:.1f} s"


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
  end = time.monotonic() + timeout
  while time.monotonic() < end and any(p.poll() is None for p in procs):
    time.sleep(0.1)
  return [p.poll() for p in procs]


def _kill(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def _digests(workdir: pathlib.Path) -> dict[int, dict]:
  """Every checkpoint step of `workdir` -> its arrays' digests (read from the meta alone)."""
  manager = ocp.CheckpointManager(workdir / "checkpoints", options=reader_options(), item_names=("state", "meta"))
  try:
    return {
      step: manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["digests"]
      for step in manager.all_steps()
    }
  finally:
    manager.close()


def _steps(workdir: pathlib.Path) -> set[int]:
  folder = workdir / "checkpoints"
  return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else set()


def soak(config: str, workdir: pathlib.Path, kills: int, steps: int, seed: int, log=print) -> dict:
  every = max(steps // 10, 1)
  overrides = [*RUN, f"train.steps={steps}", f"train.checkpoint_every={every}", f"train.keep_checkpoints={steps}"]
  rng = random.Random(seed)
  reference, run, logs = workdir / "reference", workdir / "soak", workdir / "logs"
  for folder in (reference, run, logs):
    shutil.rmtree(folder, ignore_errors=True)
  log(f"soak: the uninterrupted reference, {steps} steps over 2 processes ...")
  start = time.monotonic()
  procs = _start(config, reference, overrides, logs / "reference")
  while logged_step(logs / "reference" / "process0.log", 0) < 1 and all(p.poll() is None for p in procs):
    time.sleep(0.05)
  first_step_s = time.monotonic() - start  # start-up: the window of the kills that land there
  if _wait(procs, 900) != [0, 0]:
    _kill(procs)
    raise RuntimeError(f"the reference run failed; see {logs / 'reference'}")
  expected = json.loads((reference / "summary.json").read_text())["param_checksum"]
  wanted = _digests(reference)
  restarts, pending = [], []  # every kill; those no checkpoint written since has checked yet

  def settle(before: set[int]) -> list[int]:
    """The checkpoints written since `before`; the first of them checks every pending kill (checked now:
    a later fresh start removes them)."""
    written = sorted(_steps(run) - before)
    if written and pending:
      same = _digests(run)[written[0]] == wanted[written[0]]
      for kill in pending:
        kill.update(checked_at=written[0], bit_identical=same)
      pending.clear()
    return written

  while len(restarts) < kills:
    before = _steps(run)
    resumed = max(before, default=0)
    if resumed >= steps - every:  # in the last interval a kill would leave no checkpoint to check it by
      if pending:  # so the run finishes; its last checkpoint checks the kills before it
        procs = _start(config, run, overrides, logs / "soak")
        _wait(procs, 900)
        _kill(procs)
        settle(before)
        continue
      shutil.rmtree(run)  # and the soaked run starts afresh
      before, resumed = set(), 0
    offset = (logs / "soak" / "process0.log").stat().st_size if (logs / "soak" / "process0.log").exists() else 0
    procs = _start(config, run, overrides, logs / "soak")
    start = time.monotonic()
    # A quarter of the kills land in start-up and compiles; the rest at a random step of the interval
    # after the restart's first checkpoint (so the restart is checked), plus up to 50 ms: inside a step,
    # or in a checkpoint being written.
    if rng.random() < 0.25:
      delay = rng.uniform(0.5, first_step_s)
      _wait(procs, delay)
      # A restart can be past its start-up by then (its compiles cached, its data read): say where it was.
      moment = timed_kill_moment(delay, logged_step(logs / "soak" / "process0.log", offset))
    else:
      target = min((resumed // every + 1) * every + rng.randrange(every), steps - 1)
      moment = f"at step {target}"
      while logged_step(logs / "soak" / "process0.log", offset) < target and all(p.poll() is None for p in procs):
        time.sleep(0.005)
      time.sleep(rng.uniform(0.0, 0.05))
    if any(p.poll() is not None for p in procs):  # it ended (or failed) before the kill: not a kill
      _kill(procs)
      settle(before)
      continue
    victim = rng.randrange(2)
    procs[victim].send_signal(signal.SIGKILL)
    time.sleep(rng.uniform(0.0, 1.0))  # the supervisor notices the lost peer and stops the job
    _kill(procs)
    written = settle(before)  # this start's first checkpoint checks the kills before it
    kill = dict(process=victim, moment=moment, resumed_from=resumed, wrote=written, checked_at=None, bit_identical=None)
    restarts.append(kill)
    pending.append(kill)
    log(
      f"soak: kill {len(restarts)}/{kills}: process {victim} {moment} ({time.monotonic() - start:.1f} s after its "
      f"start, which resumed from step {resumed}); checkpoints written {written}"
    )
  before = _steps(run)
  procs = _start(config, run, overrides, logs / "soak")
  finished = _wait(procs, 900) == [0, 0]
  _kill(procs)
  settle(before)
  checksum = json.loads((run / "summary.json").read_text())["param_checksum"] if finished else None
  checked = [r for r in restarts if r["bit_identical"] is not None]
  return dict(
    kills=kills,
    kills_checked=len(checked),
    kills_recovered=sum(r["bit_identical"] for r in checked),
    starts_killed_before_writing_a_checkpoint=sum(not r["wrote"] for r in restarts),
    final_checksum=checksum,
    reference_checksum=expected,
    final_equal=checksum == expected,
    restarts=restarts,
  )


def main(argv: list[str] | None = None) -> dict:
  parser = cli.doc_parser("python scripts/soak.py", __doc__)
  parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config spec (tiny: restarts are cheap)")
  parser.add_argument("--workdir", default="runs/soak", help="the reference, the soaked run and their logs")
  parser.add_argument("--kills", type=int, default=20)
  parser.add_argument("--steps", type=int, default=300, help="of each run")
  parser.add_argument("--seed", type=int, default=0, help="of the kills' moments and victims")
  args = parser.parse_args(argv)
  if args.kills < 1 or args.steps < 8:
    raise ConfigError(f"--kills must be at least 1 and --steps at least 8, got {args.kills} and {args.steps}.")
  with _children_ended():
    report = soak(args.config, pathlib.Path(args.workdir), args.kills, args.steps, args.seed)
  print(json.dumps(report, indent=1))
  print(
    f"soak: {report['kills_recovered']} of {report['kills']} kills recovered from, bit-identical at the first "
    f"checkpoint written after them ({report['kills_checked']} checked; "
    f"{report['starts_killed_before_writing_a_checkpoint']} starts killed before writing one, the kill before each "
    f"checked by a later start); final param_checksum "
    f"{'equal to' if report['final_equal'] else 'DIFFERENT from'} the uninterrupted run's"
  )
  return report


if __name__ == "__main__":
  cli.run(main)
