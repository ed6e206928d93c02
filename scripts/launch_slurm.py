"""Launch a multi-node GPU training run under SLURM: render an sbatch script and submit it.

  python scripts/launch_slurm.py --nodes=2 --gpus_per_node=8 [--cpus_per_task=8] [--time=24:00:00] \
      [--job_name=lra_core] [--partition=P] [--account=A] [--output=FILE] [--chdir=DIR] \
      [--setup='source /shared/venv/bin/activate'] [--signal_seconds=120] [--requeue] [--script_out=FILE] \
      [--dry-run] -- --config=configs/... --workdir=/shared/runs/x [--config.<key>=<value> ...]

Everything after `--` goes to `python -m lra_core.train` unchanged. The job runs one task per GPU
(`--ntasks-per-node` = `--gpus-per-node`), and `srun` starts one training process per task with
`--distributed=on`: JAX reads the SLURM variables (job id, step node list, task count, task id,
local id), picks the first node as coordinator on a port derived from the job id (set
JAX_COORDINATOR_PORT, e.g. with --setup, to choose it) and gives each process the GPU of its
local task id.

Before the time limit: SLURM sends USR1 to the batch shell --signal_seconds before it (#SBATCH
--signal=B:USR1@N; 0 leaves it out). The script runs srun in the background and traps USR1: it
sends SIGTERM to srun, which passes it to every training process; the trainer finishes the step in
flight, saves a checkpoint and exits with status 75 (lra_core.cli.EXIT_PREEMPTED). With --requeue
(#SBATCH --requeue, and --open-mode=append so the log keeps every allocation's output) the script
then runs `scontrol requeue $SLURM_JOB_ID`, as it does whenever the run exits with status 75 (a
SIGTERM from SLURM's own preemption): the job waits in the queue again and the same command resumes
from that checkpoint.

The script is written to --script_out (default: <workdir>/launch.sbatch, the workdir taken from
the train args and, when relative, resolved against --chdir; without a workdir, or with one in an
object store (gs://...), a file in the temporary folder) and submitted with `sbatch FILE`.
--dry-run prints the script and the sbatch command, writes and submits nothing. The job's log goes to --output (default:
<workdir>/slurm-%j.out, %j being the job id; slurm-%j.out in --chdir for an object-store workdir,
which is passed to the trainer untouched). The workdir, --chdir and the environment must be on a
filesystem all nodes share. The launcher installs nothing: when a train argument is a gs:// or s3://
URL and this Python lacks the package that reaches it (gcsfs, s3fs), it warns that the job's
environment needs the extra (pip install -e ".[gcs]" / ".[s3]"). scripts/slurm/train.sbatch is a
rendered example; see docs/launching.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The trainer's exit status after saving at a SIGTERM (lra_core.cli.EXIT_PREEMPTED; this script runs
# without the package installed, tests/test_launchers.py checks that the two agree).
EXIT_PREEMPTED = 75
# Object stores by URL scheme: the pyproject.toml extra that reaches one, and the packages that do
# (lra_core/runtime/fs.py).
STORES = {"gs": ("gcs", ("gcsfs", "tensorflow")), "s3": ("s3", ("s3fs", "tensorflow"))}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
  """(launcher args, train args): the train args are everything after the first `--`."""
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  return argv[:i], argv[i + 1 :]


EXAMPLE = (
  "examples:\n"
  "  python scripts/launch_slurm.py --nodes=2 --gpus_per_node=8 --time=24:00:00 \\\n"
  "      -- --config=configs/c4/latte.py --workdir=/shared/runs/latte\n"
  "  python scripts/launch_slurm.py --nodes=2 --gpus_per_node=8 --dry-run \\\n"
  "      -- --config=configs/c4/latte.py --workdir=/shared/runs/latte   # print the sbatch script only"
)


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python scripts/launch_slurm.py",
    description=__doc__.splitlines()[0],
    usage="%(prog)s --nodes=N --gpus_per_node=G [options] -- <train args>",
    epilog=EXAMPLE,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
  parser.add_argument("--gpus_per_node", type=int, required=True, help="GPUs per node = tasks per node")
  parser.add_argument("--cpus_per_task", type=int, default=None, help="CPU cores per task (default: the cluster's)")
  parser.add_argument("--time", default=None, help="time limit, e.g. 24:00:00 (default: the partition's)")
  parser.add_argument("--job_name", default="lra_core")
  parser.add_argument("--partition", default=None)
  parser.add_argument("--account", default=None)
  parser.add_argument("--output", default=None, help="the job's log (default: <workdir>/slurm-%%j.out)")
  parser.add_argument(
    "--chdir", default=str(ROOT), help="the job's working folder, a checkout of this repository (default: this one)"
  )
  parser.add_argument("--setup", default="", help="shell line run before srun, e.g. 'source /shared/venv/bin/activate'")
  parser.add_argument(
    "--signal_seconds",
    type=int,
    default=120,
    help="seconds before the time limit at which the run saves and stops (0: no signal)",
  )
  parser.add_argument(
    "--requeue", action="store_true", help="requeue the job after that stop, so that it resumes from the checkpoint"
  )
  parser.add_argument("--script_out", default=None, help="where to write the sbatch script")
  parser.add_argument(
    "--dry-run",
    "--dry_run",
    dest="dry_run",
    action="store_true",
    help="print the script and the sbatch command, submit nothing",
  )
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  own, train = split_argv(list(sys.argv[1:] if argv is None else argv))
  parser = make_parser()
  args = parser.parse_args(own)
  args.train_args = train
  if not train:
    parser.error("no train arguments: put them after `--`, e.g. -- --config=configs/... --workdir=DIR.")
  if args.nodes < 1 or args.gpus_per_node < 1:
    parser.error(f"--nodes and --gpus_per_node must be at least 1, got {args.nodes} and {args.gpus_per_node}.")
  if any(a == "--distributed" or a.startswith("--distributed=") for a in train):
    parser.error("leave --distributed out of the train arguments: the launcher adds --distributed=on.")
  if args.signal_seconds < 0:
    parser.error(f"--signal_seconds must not be negative, got {args.signal_seconds}.")
  return args


def workdir(train_args: list[str]) -> str | None:
  """The value of --workdir in the train arguments (the last one, as argparse takes it)."""
  found = None
  for i, a in enumerate(train_args):
    if a.startswith("--workdir="):
      found = a.split("=", 1)[1]
    elif a == "--workdir" and i + 1 < len(train_args):
      found = train_args[i + 1]
  return found


def srun_line(train_args: list[str]) -> str:
  return shlex.join(["srun", "python", "-m", "lra_core.train", *train_args, "--distributed=on"])


def stop_lines(args: argparse.Namespace) -> list[str]:
  """srun in the background under a USR1 trap: SIGTERM to the run, wait for it, requeue (--requeue)."""
  lines = [
    f"# USR1 comes {args.signal_seconds} s before the time limit (--signal above): srun passes SIGTERM on to",
    "# every training process, which finishes the step in flight, saves a checkpoint and exits.",
    "stop_run() {",
    '  echo "USR1: the time limit is near; stopping the run with a checkpoint" >&2',
    "  stopping=1",
    '  kill -TERM "$srun_pid" 2>/dev/null || true',
    "}",
    "stopping=0",
    "trap stop_run USR1",
    srun_line(args.train_args) + " &",
    "srun_pid=$!",
    "while :; do  # the trap ends `wait` early: wait again while srun is still stopping the run",
    "  status=0",
    '  wait "$srun_pid" || status=$?',
    '  if [ "$status" -le 128 ] || ! kill -0 "$srun_pid" 2>/dev/null; then break; fi',
    "done",
  ]
  if args.requeue:
    lines += [
      "# back to the queue after the stop, or after a SIGTERM from elsewhere (the trainer saved and exited with",
      f"# status {EXIT_PREEMPTED}): the same command resumes from the checkpoint",
      f'if [ "$stopping" = 1 ] || [ "$status" = {EXIT_PREEMPTED} ]; then',
      '  echo "requeueing job $SLURM_JOB_ID" >&2',
      '  scontrol requeue "$SLURM_JOB_ID"',
      "fi",
    ]
  return lines + ['exit "$status"']


def local_workdir(train_args: list[str]) -> str | None:
  """The workdir when it is a folder of the cluster's file system; None for none or an object store
  (gs://...), where SLURM can write neither the script nor the log: those go to --chdir / the temp folder."""
  wd = workdir(train_args)
  return None if wd is None or "://" in wd else wd


def store_warning(train_args: list[str], have=lambda m: importlib.util.find_spec(m) is not None) -> str | None:
  """One line when a train argument, or its value after `=`, is a gs:// or s3:// URL and this Python
  has none of the packages that reach that store (the job's environment is often this one)."""
  missing = {
    scheme: extra
    for scheme, (extra, modules) in STORES.items()
    if any(a.startswith(f"{scheme}://") or f"={scheme}://" in a for a in train_args)
    and not any(have(m) for m in modules)
  }
  if not missing:
    return None
  urls, packages = " / ".join(f"{s}://" for s in missing), " / ".join(STORES[s][1][0] for s in missing)
  return (
    f"warning: the train arguments name {urls} URLs and this Python has no {packages}; the job's environment "
    f'(--setup, or the python on the PATH sbatch passes on) needs pip install -e ".[{",".join(missing.values())}]".'
  )


def render(args: argparse.Namespace) -> str:
  """The sbatch script."""
  wd = local_workdir(args.train_args)
  output = args.output or (f"{wd}/slurm-%j.out" if wd else "slurm-%j.out")
  options = [
    ("job-name", args.job_name),
    ("nodes", args.nodes),
    ("ntasks-per-node", args.gpus_per_node),
    ("gpus-per-node", args.gpus_per_node),
    ("cpus-per-task", args.cpus_per_task),
    ("time", args.time),
    ("partition", args.partition),
    ("account", args.account),
    ("output", output),
    ("chdir", args.chdir),
    ("signal", f"B:USR1@{args.signal_seconds}" if args.signal_seconds else None),
    ("requeue", "" if args.requeue else None),
    ("open-mode", "append" if args.requeue else None),
  ]
  lines = [
    "#!/bin/bash",
    f"# {args.nodes} node(s) x {args.gpus_per_node} GPU(s): one task, one JAX process per GPU.",
    "# Rendered by scripts/launch_slurm.py (docs/launching.md).",
  ]
  spaced = [f"--{key}={value}" for key, value in options if value is not None and any(c.isspace() for c in str(value))]
  if spaced:
    raise SystemExit(f"error: #SBATCH {spaced[0]!r} would be cut at its whitespace; use a path without spaces.")
  lines += [
    f"#SBATCH --{key}={value}" if value != "" else f"#SBATCH --{key}" for key, value in options if value is not None
  ]
  lines += ["", "set -e"]
  if args.setup:
    lines.append(args.setup)
  lines += stop_lines(args) if args.signal_seconds else [srun_line(args.train_args)]
  return "\n".join(lines) + "\n"


def script_path(args: argparse.Namespace) -> pathlib.Path:
  if args.script_out:
    return pathlib.Path(args.script_out)
  wd = local_workdir(args.train_args)
  if wd is None:
    return pathlib.Path(tempfile.gettempdir()) / f"{args.job_name}.sbatch"
  return pathlib.Path(args.chdir) / os.path.expanduser(wd) / "launch.sbatch"


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  script, path = render(args), script_path(args)
  warning = store_warning(args.train_args)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  submit = ["sbatch", str(path)]
  if args.dry_run:
    print(f"# {path}")
    print(script)
    print(f"# submit (not run: --dry-run)\n{shlex.join(submit)}")
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  if local_workdir(args.train_args):  # SLURM does not create the log's folder; the default log is in it
    (pathlib.Path(args.chdir) / os.path.expanduser(local_workdir(args.train_args))).mkdir(parents=True, exist_ok=True)
  path.write_text(script)
  print(f"wrote {path}", flush=True)
  try:
    subprocess.run(submit, check=True)
  except FileNotFoundError:
    raise SystemExit(
      "error: sbatch is not installed or not on PATH; submit the script from a SLURM login node."
    ) from None
  except subprocess.CalledProcessError as e:
    raise SystemExit(f"error: sbatch failed with exit status {e.returncode}.") from None


if __name__ == "__main__":
  main()
