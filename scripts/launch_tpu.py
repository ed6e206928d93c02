"""Launch a training run on a Cloud TPU VM (one host or a pod slice) with gcloud.

  python scripts/launch_tpu.py --name=NAME --zone=ZONE --accelerator_type=v4-32 [--project=P] \
      [--version=tpu-ubuntu2204-base] [--spot] [--code=copy|git] [--repo=URL] [--branch=main] \
      [--remote_dir=~/lra_core] [--extra=tpu] [--python=python3] [--setup=CMD] [--dry-run] \
      -- --config=configs/... --workdir=/mnt/shared/run [--config.<key>=<value> ...]

Everything after `--` goes to `python -m lra_core.train` unchanged. The steps, each one command:

  1. `describe` the TPU VM: if it exists and is READY it is reused; in any other state the
     launcher stops and says so (a preempted spot VM has to be deleted first).
  2. `create` it, only when the describe failed (the VM does not exist).
  3. the code on every worker: `--code=copy` (default) packs the files of this checkout that git
     tracks or would track (`git ls-files --cached --others --exclude-standard`: uncommitted edits
     travel, ignored outputs such as runs/ and venvs do not) into a tarball, copies it to every
     worker and unpacks it over --remote_dir (files deleted here are not deleted there);
     `--code=git` clones --repo on every worker, or fetches, checks out --branch and pulls.
  4. `python3 -m pip install -e ".[EXTRA]"` on every worker.
  5. the run: the identical train command, with `--distributed=on` added, on every worker
     (`--worker=all`). jax.distributed.initialize then finds the coordinator, process count and
     id of a pod slice itself (from the TPU VM's metadata server). The workers' output comes back
     here and the launcher waits for the run: keep it running (tmux, screen, a machine that stays
     up) until the run ends.

The steps are built by `build_steps` as plain argv lists (tests compare them exactly); --dry-run
prints them (shlex-quoted, each under a comment naming its step) and runs nothing. See
docs/launching.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
REMOTE_TARBALL = "lra_core-code.tar.gz"  # in the remote home folder, removed once unpacked


@dataclasses.dataclass(frozen=True)
class Step:
  """One command. kind: "run" must succeed; "probe" asks whether the VM exists (its failure is an
  answer, not an error); "create" runs only when the probe failed; "pack" writes the tarball
  `path` here, in Python (it has no argv)."""
  comment: str
  argv: tuple[str, ...]
  kind: str = "run"
  path: str = ""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
  """(launcher args, train args): the train args are everything after the first `--`."""
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  return argv[:i], argv[i + 1:]


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      usage="%(prog)s --name=NAME --zone=ZONE --accelerator_type=TYPE [options] -- <train args>")
  parser.add_argument("--name", required=True, help="the TPU VM's name (reused if it exists)")
  parser.add_argument("--zone", required=True, help="e.g. us-central2-b")
  parser.add_argument("--accelerator_type", required=True, help="e.g. v4-8 (one host), v4-32 (4 workers)")
  parser.add_argument("--project", default=None, help="gcloud project (default: gcloud's configured one)")
  parser.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU software runtime of a new VM")
  parser.add_argument("--spot", action="store_true", help="create a spot VM (preemptible, cheaper)")
  parser.add_argument("--code", choices=("copy", "git"), default="copy",
                      help="copy: this checkout's files; git: clone / pull --repo on the workers")
  parser.add_argument("--repo", default=None, help="git URL the workers clone (--code=git)")
  parser.add_argument("--branch", default="main", help="branch the workers check out (--code=git)")
  parser.add_argument("--remote_dir", default="~/lra_core", help="the checkout's folder on every worker")
  parser.add_argument("--extra", default="tpu", help="pyproject.toml extra to install ('' for none)")
  parser.add_argument("--python", default="python3", help="the workers' Python (3.11 or newer)")
  parser.add_argument("--setup", default="",
                      help="shell command run before install and train, e.g. 'source ~/venv/bin/activate'")
  parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                      help="print the commands, run none")
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  own, train = split_argv(list(sys.argv[1:] if argv is None else argv))
  parser = make_parser()
  args = parser.parse_args(own)
  args.train_args = train
  if not train:
    parser.error("no train arguments: put them after `--`, e.g. -- --config=configs/... --workdir=DIR.")
  if any(a == "--distributed" or a.startswith("--distributed=") for a in train):
    parser.error("leave --distributed out of the train arguments: the launcher adds --distributed=on.")
  if not re.fullmatch(r"[\w,-]*", args.extra):
    parser.error(f"--extra {args.extra!r} is not a comma-separated list of pyproject.toml extras.")
  if args.code == "git" and not args.repo:
    parser.error("--code=git needs --repo=URL, the repository every worker clones.")
  return args


def remote_path(path: str) -> str:
  """`path` quoted for the remote shell, leaving a leading ~/ outside the quotes so it expands."""
  if path == "~":
    return "~"
  if path.startswith("~/"):
    return "~/" + shlex.quote(path[2:])
  return shlex.quote(path)


def local_tarball(name: str) -> str:
  return os.path.join(tempfile.gettempdir(), f"lra_core-{name}.tar.gz")


def build_steps(args: argparse.Namespace) -> list[Step]:
  """The commands of a launch, in order."""
  tpu = ("gcloud", "compute", "tpus", "tpu-vm")
  where = (f"--zone={args.zone}",) + ((f"--project={args.project}",) if args.project else ())
  folder = remote_path(args.remote_dir)

  def ssh(command: str) -> tuple[str, ...]:
    return tpu + ("ssh", args.name) + where + ("--worker=all", f"--command={command}")

  def in_env(command: str) -> str:
    return (f"{args.setup} && " if args.setup else "") + f"cd {folder} && {command}"

  steps = [
      Step(f"1. does the TPU VM {args.name} exist? (reused if READY)",
           tpu + ("describe", args.name) + where + ("--format=value(state)",), "probe"),
      Step("2. create it (only if the describe fails)",
           tpu + ("create", args.name) + where + (f"--accelerator-type={args.accelerator_type}",
                                                   f"--version={args.version}")
           + (("--spot",) if args.spot else ()), "create"),
  ]
  if args.code == "git":
    repo, branch = shlex.quote(args.repo), shlex.quote(args.branch)
    steps.append(Step(
        f"3. code: clone or update {args.repo} ({args.branch}) on every worker",
        ssh(f"if [ -d {folder}/.git ]; then cd {folder} && git fetch && git checkout {branch} && git pull; "
            f"else git clone --branch {branch} {repo} {folder}; fi")))
  else:
    tarball = local_tarball(args.name)
    steps += [
        Step(f"3a. code: pack this checkout's files (git ls-files --cached --others --exclude-standard) "
             f"into {tarball}", (), "pack", tarball),
        Step("3b. copy the tarball to every worker",
             tpu + ("scp", tarball, f"{args.name}:{REMOTE_TARBALL}") + where + ("--worker=all",)),
        Step(f"3c. unpack it into {args.remote_dir} on every worker",
             ssh(f"mkdir -p {folder} && tar -xzf ~/{REMOTE_TARBALL} -C {folder} && rm ~/{REMOTE_TARBALL}")),
    ]
  target = f'".[{args.extra}]"' if args.extra else "."
  steps += [
      Step("4. install the package on every worker",
           ssh(in_env(f"{args.python} -m pip install -e {target}"))),
      Step("5. train: the same command on every worker",
           ssh(in_env(f"{args.python} -m lra_core.train {shlex.join(args.train_args)} --distributed=on"))),
  ]
  return steps


def code_files(root: pathlib.Path = ROOT) -> list[str]:
  """The files git tracks or would track (not ignored) that exist in the working tree."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                       check=True, capture_output=True).stdout.decode()
  return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def pack(tarball: str, root: pathlib.Path = ROOT) -> int:
  files = code_files(root)
  with tarfile.open(tarball, "w:gz") as tar:
    for f in files:
      tar.add(root / f, arcname=f, recursive=False)
  return len(files)


def render(steps: list[Step]) -> str:
  lines = []
  for step in steps:
    lines.append(f"# {step.comment}")
    if step.argv:
      lines.append(shlex.join(step.argv))
  return "\n".join(lines)


def execute(steps: list[Step]) -> None:
  exists = False
  for step in steps:
    print(f"# {step.comment}", flush=True)
    if step.kind == "pack":
      print(f"packed {pack(step.path)} files", flush=True)
      continue
    if step.kind == "create" and exists:
      print("skipped: the TPU VM exists", flush=True)
      continue
    print(shlex.join(step.argv), flush=True)
    if step.kind == "probe":
      probe = subprocess.run(step.argv, capture_output=True, text=True)
      state = probe.stdout.strip()
      exists = probe.returncode == 0
      if exists and state != "READY":
        raise SystemExit(f"error: the TPU VM exists but is {state or 'in an unknown state'}, not READY; "
                         "delete it (gcloud compute tpus tpu-vm delete) or choose another --name.")
      print("exists and is READY: reusing it" if exists else "not found: creating it", flush=True)
      continue
    subprocess.run(step.argv, check=True)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  steps = build_steps(args)
  if args.dry_run:
    print(render(steps))
    return
  try:
    execute(steps)
  except FileNotFoundError as e:
    raise SystemExit(f"error: {e.filename} is not installed or not on PATH.") from None
  except subprocess.CalledProcessError as e:
    raise SystemExit(f"error: this command failed with exit status {e.returncode}: {shlex.join(e.cmd)}") from None


if __name__ == "__main__":
  main()
