"""Launch a training run on a Cloud TPU VM (one host or a pod slice) with gcloud.

  python scripts/launch_tpu.py --name=NAME --zone=ZONE --accelerator_type=v4-32 [--project=P] \
      [--version=RUNTIME] [--spot] [--queued] [--queued_resource=QR] [--poll_seconds=30] \
      [--supervise] [--max_restarts=20] [--code=copy|git] [--repo=URL] [--branch=main] \
      [--remote_dir=~/lra_core] [--extra=tpu] [--python=python3] [--setup=CMD] [--dry-run] \
      -- --config=configs/... --workdir=gs://bucket/run [--config.<key>=<value> ...]

Everything after `--` goes to `python -m lra_core.train` unchanged. The steps, each one command:

  1. `describe` the TPU VM: if it exists and is READY it is reused; in any other state the
     launcher stops and says so (a preempted spot VM has to be deleted first). With --queued,
     the queued resource is described instead: reused if ACTIVE, waited for while provisioning.
  2. `create` it, only when the describe failed (the VM does not exist). With --queued, a
     queued resource (`queued-resources create QR --node-id=NAME`) instead of `tpu-vm create`,
     then (2b) its state is polled every --poll_seconds until it is ACTIVE.
     The runtime (--version) defaults to the one of the accelerator type's generation (RUNTIMES).
  3. the code on every worker: `--code=copy` (default) packs the files of this checkout that git
     tracks or would track (`git ls-files --cached --others --exclude-standard`: uncommitted edits
     travel, ignored outputs such as runs/ and venvs do not) into a tarball, copies it to every
     worker and unpacks it over --remote_dir (files deleted here are not deleted there);
     `--code=git` clones --repo on every worker, or fetches, checks out --branch and pulls.
  4. `python3 -m pip install -e ".[EXTRA]"` on every worker, EXTRA being --extra plus gcs / s3 when a
     train argument (--workdir, --config.data.dir, ...) is a gs:// / s3:// URL (STORE_EXTRAS).
  5. the run: the identical train command, with `--distributed=on` added, on every worker
     (`--worker=all`). jax.distributed.initialize then finds the coordinator, process count and
     id of a pod slice itself (from the TPU VM's metadata server). The workers' output comes back
     here and the launcher waits for the run: keep it running (tmux, screen, a machine that stays
     up) until the run ends.

--supervise keeps the run going through preemptions: after step 5 it asks for the TPU VM's state
(step 6). READY: the run succeeded (exit 0), saved at a preemption notice while the VM stayed up
(exit 75, the trainer's EXIT_PREEMPTED: the train command runs again on the same VM), or failed for
another reason (the launcher exits with its status). PREEMPTED, TERMINATED, FAILED, SUSPENDED or
gone: the slice was lost, so it is deleted (R1: the node, or with --queued the queued resource
with --force), re-created (R2), given the code again (R3, the tarball of step 3a) and the package
(R4), and the identical train command runs again (R5), at most --max_restarts times. The trainer
resumes from the workdir's latest checkpoint, so the workdir has to outlive the VM: a gs:// bucket.

The steps are built by `build_steps` and `supervise_steps` as plain argv lists (tests compare
them exactly); --dry-run prints them (shlex-quoted, each under a comment naming its step) and runs
nothing. See docs/launching.md.
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
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
REMOTE_TARBALL = "lra_core-code.tar.gz"  # in the remote home folder, removed once unpacked

# The software runtime of a new VM, by TPU generation (the accelerator type without its "-<cores>").
RUNTIMES = {
  "v2": "tpu-ubuntu2204-base",
  "v3": "tpu-ubuntu2204-base",
  "v4": "tpu-ubuntu2204-base",
  "v5litepod": "v2-alpha-tpuv5-lite",  # v5e
  "v5p": "v2-alpha-tpuv5",
  "v6e": "v2-alpha-tpuv6e",
}
GONE = "GONE"  # the state this launcher gives a node or queued resource that gcloud does not find
# Node states (and GONE) after which the slice is deleted and created again under --supervise.
# The trainer's exit status after saving at a SIGTERM (lra_core.cli.EXIT_PREEMPTED; this script runs
# without the package installed, tests/test_launchers.py checks that the two agree).
EXIT_PREEMPTED = 75
LOST = ("PREEMPTED", "TERMINATED", "FAILED", "SUSPENDING", "SUSPENDED", GONE)
# Queued resource states on the way to ACTIVE.
PENDING = ("ACCEPTED", "CREATING", "PROVISIONING", "WAITING_FOR_RESOURCES")
# The pyproject.toml extra that reaches each object store (lra_core/runtime/fs.py), by URL scheme: step 4 adds
# it to --extra when a train argument is such a URL, since the trainer cannot start without it.
STORE_EXTRAS = {"gs": "gcs", "s3": "s3"}


@dataclasses.dataclass(frozen=True)
class Step:
  """One command. kind: "run" must succeed; "probe" asks whether the VM (or queued resource)
  exists (its failure is an answer, not an error); "create" runs only when the probe failed;
  "wait" polls a queued resource until it is ACTIVE; "state" asks for the node's state under
  --supervise; "delete" must succeed or find nothing to delete; "pack" writes the tarball `path`
  here, in Python (it has no argv)."""

  comment: str
  argv: tuple[str, ...]
  kind: str = "run"
  path: str = ""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
  """(launcher args, train args): the train args are everything after the first `--`."""
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  return argv[:i], argv[i + 1 :]


def runtime_version(accelerator_type: str) -> str:
  """The runtime of RUNTIMES for the generation of `accelerator_type` (e.g. v5p-8 -> v5p)."""
  match = re.fullmatch(r"(v\d+[a-z]*)-\d+", accelerator_type)
  generation = match.group(1) if match else accelerator_type
  if generation not in RUNTIMES:
    raise ValueError(
      f"--accelerator_type={accelerator_type}: unknown TPU generation {generation!r}, choose the "
      f"runtime with --version (known generations: {', '.join(RUNTIMES)})."
    )
  return RUNTIMES[generation]


def train_workdir(train_args: list[str]) -> str | None:
  """The value of --workdir in the train arguments (the last one, as argparse takes it)."""
  found = None
  for i, a in enumerate(train_args):
    if a.startswith("--workdir="):
      found = a.split("=", 1)[1]
    elif a == "--workdir" and i + 1 < len(train_args):
      found = train_args[i + 1]
  return found


def store_extras(train_args: list[str]) -> list[str]:
  """The STORE_EXTRAS of the object stores the train arguments name: an argument, or its value
  after `=` (--workdir=gs://..., --config.data.dir=s3://...), that is a gs:// or s3:// URL."""
  return [
    extra
    for scheme, extra in STORE_EXTRAS.items()
    if any(a.startswith(f"{scheme}://") or f"={scheme}://" in a for a in train_args)
  ]


EXAMPLE = (
  "examples:\n"
  "  python scripts/launch_tpu.py --name=vq --zone=us-central2-b --accelerator_type=v4-32 --spot --supervise \\\n"
  "      -- --config=configs/enwik8/transformer_vq.py --workdir=gs://my-bucket/runs/vq\n"
  "  python scripts/launch_tpu.py --name=vq --zone=us-central2-b --accelerator_type=v4-32 --dry-run \\\n"
  "      -- --config=configs/enwik8/transformer_vq.py --workdir=gs://my-bucket/runs/vq   # print the steps only"
)


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python scripts/launch_tpu.py",
    description=__doc__.splitlines()[0],
    epilog=EXAMPLE,
    formatter_class=argparse.RawDescriptionHelpFormatter,
    usage="%(prog)s --name=NAME --zone=ZONE --accelerator_type=TYPE [options] -- <train args>",
  )
  parser.add_argument("--name", required=True, help="the TPU VM's name (reused if it exists)")
  parser.add_argument("--zone", required=True, help="e.g. us-central2-b")
  parser.add_argument("--accelerator_type", required=True, help="e.g. v4-8 (one host), v4-32 (4 workers)")
  parser.add_argument("--project", default=None, help="gcloud project (default: gcloud's configured one)")
  parser.add_argument(
    "--version", default=None, help="TPU software runtime of a new VM (default: by generation, see RUNTIMES)"
  )
  parser.add_argument("--spot", action="store_true", help="create a spot VM (preemptible, cheaper)")
  parser.add_argument(
    "--queued", action="store_true", help="create the VM through a queued resource, which waits for capacity"
  )
  parser.add_argument("--queued_resource", default=None, help="the queued resource's name (default: --name)")
  parser.add_argument(
    "--poll_seconds",
    type=float,
    default=30.0,
    help="seconds between two state queries while waiting for a queued resource",
  )
  parser.add_argument(
    "--supervise", action="store_true", help="re-create a preempted slice and relaunch the run until it ends"
  )
  parser.add_argument("--max_restarts", type=int, default=20, help="relaunches --supervise makes at most")
  parser.add_argument(
    "--code",
    choices=("copy", "git"),
    default="copy",
    help="copy: this checkout's files; git: clone / pull --repo on the workers",
  )
  parser.add_argument("--repo", default=None, help="git URL the workers clone (--code=git)")
  parser.add_argument("--branch", default="main", help="branch the workers check out (--code=git)")
  parser.add_argument("--remote_dir", default="~/lra_core", help="the checkout's folder on every worker")
  parser.add_argument(
    "--extra",
    default="tpu",
    help="pyproject.toml extras to install, comma-separated ('' for none); gcs / s3 are added when a train "
    "argument is a gs:// / s3:// URL",
  )
  parser.add_argument("--python", default="python3", help="the workers' Python (3.11 or newer)")
  parser.add_argument(
    "--setup", default="", help="shell command run before install and train, e.g. 'source ~/venv/bin/activate'"
  )
  parser.add_argument(
    "--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the commands, run none"
  )
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
  if args.queued_resource and not args.queued:
    parser.error("--queued_resource names a queued resource, which only --queued creates.")
  if args.max_restarts < 0 or args.poll_seconds < 0:
    parser.error(
      f"--max_restarts and --poll_seconds must not be negative, got {args.max_restarts} and {args.poll_seconds}."
    )
  if args.version is None:
    try:
      args.version = runtime_version(args.accelerator_type)
    except ValueError as e:
      parser.error(str(e))
  args.queued_resource = args.queued_resource or args.name
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


TPU = ("gcloud", "compute", "tpus", "tpu-vm")
QUEUED = ("gcloud", "compute", "tpus", "queued-resources")


def _where(args: argparse.Namespace) -> tuple[str, ...]:
  return (f"--zone={args.zone}",) + ((f"--project={args.project}",) if args.project else ())


def _create(args: argparse.Namespace, label: str, comment: str, kind: str) -> list[Step]:
  """The create command of a new slice (and with --queued the wait until it is ACTIVE)."""
  where = _where(args)
  spot = ("--spot",) if args.spot else ()
  if not args.queued:
    return [
      Step(
        f"{label}. {comment}",
        TPU
        + ("create", args.name)
        + where
        + (f"--accelerator-type={args.accelerator_type}", f"--version={args.version}")
        + spot,
        kind,
      )
    ]
  return [
    Step(
      f"{label}. {comment}: a queued resource {args.queued_resource} for the TPU VM {args.name}",
      QUEUED
      + ("create", args.queued_resource, f"--node-id={args.name}")
      + where
      + (f"--accelerator-type={args.accelerator_type}", f"--runtime-version={args.version}")
      + spot,
      kind,
    ),
    Step(
      f"{label}b. wait until it is ACTIVE (state every {args.poll_seconds:g} s)",
      QUEUED + ("describe", args.queued_resource) + where + ("--format=value(state.state)",),
      "wait",
    ),
  ]


def _work(args: argparse.Namespace, prefix: str = "", pack: bool = True) -> list[Step]:
  """Steps 3 to 5: code, install, train. pack=False leaves out packing (the tarball exists)."""
  where = _where(args)
  folder = remote_path(args.remote_dir)

  def ssh(command: str) -> tuple[str, ...]:
    return TPU + ("ssh", args.name) + where + ("--worker=all", f"--command={command}")

  def in_env(command: str) -> str:
    return (f"{args.setup} && " if args.setup else "") + f"cd {folder} && {command}"

  if args.code == "git":
    repo, branch = shlex.quote(args.repo), shlex.quote(args.branch)
    steps = [
      Step(
        f"{prefix}3. code: clone or update {args.repo} ({args.branch}) on every worker",
        ssh(
          f"if [ -d {folder}/.git ]; then cd {folder} && git fetch && git checkout {branch} && git pull; "
          f"else git clone --branch {branch} {repo} {folder}; fi"
        ),
      )
    ]
  else:
    tarball = local_tarball(args.name)
    steps = [
      Step(
        f"{prefix}3a. code: pack this checkout's files (git ls-files --cached --others --exclude-standard) "
        f"into {tarball}",
        (),
        "pack",
        tarball,
      ),
      Step(
        f"{prefix}3b. copy the tarball{'' if pack else ' of step 3a'} to every worker",
        TPU + ("scp", tarball, f"{args.name}:{REMOTE_TARBALL}") + where + ("--worker=all",),
      ),
      Step(
        f"{prefix}3c. unpack it into {args.remote_dir} on every worker",
        ssh(f"mkdir -p {folder} && tar -xzf ~/{REMOTE_TARBALL} -C {folder} && rm ~/{REMOTE_TARBALL}"),
      ),
    ][0 if pack else 1 :]
  extras = [e for e in args.extra.split(",") if e]
  added = [e for e in store_extras(args.train_args) if e not in extras]
  target = f'".[{",".join(extras + added)}]"' if extras + added else "."
  why = f" ({', '.join(added)} added for the train arguments' object-store URLs)" if added else ""
  return steps + [
    Step(
      f"{prefix}4. install the package on every worker{why}", ssh(in_env(f"{args.python} -m pip install -e {target}"))
    ),
    Step(
      f"{prefix}5. train: the same command on every worker",
      ssh(in_env(f"{args.python} -m lra_core.train {shlex.join(args.train_args)} --distributed=on")),
    ),
  ]


def build_steps(args: argparse.Namespace) -> list[Step]:
  """The commands of a launch, in order."""
  where = _where(args)
  if args.queued:
    probe = Step(
      f"1. does the queued resource {args.queued_resource} exist? (reused if ACTIVE, waited for while provisioning)",
      QUEUED + ("describe", args.queued_resource) + where + ("--format=value(state.state)",),
      "probe",
    )
  else:
    probe = Step(
      f"1. does the TPU VM {args.name} exist? (reused if READY)",
      TPU + ("describe", args.name) + where + ("--format=value(state)",),
      "probe",
    )
  return [probe, *_create(args, "2", "create it (only if the describe fails)", "create"), *_work(args)]


def supervise_steps(args: argparse.Namespace) -> list[Step]:
  """The commands --supervise adds: the node's state after the run, and the recovery from a
  preemption, which ends with the same train command as step 5."""
  where = _where(args)
  if args.queued:
    delete = Step(
      f"R1. delete the queued resource {args.queued_resource} and its TPU VM",
      QUEUED + ("delete", args.queued_resource) + where + ("--force", "--quiet"),
      "delete",
    )
  else:
    delete = Step(f"R1. delete the TPU VM {args.name}", TPU + ("delete", args.name) + where + ("--quiet",), "delete")
  return [
    Step(
      f"6. supervise, after step 5: the TPU VM's state (READY: stop with the run's exit status; "
      f"{', '.join(s for s in LOST if s != GONE)} or not found: R1 to R5, at most {args.max_restarts} times)",
      TPU + ("describe", args.name) + where + ("--format=value(state)",),
      "state",
    ),
    delete,
    *_create(args, "R2", "re-create it", "run"),
    *_work(args, "R", pack=False),
  ]


def code_files(root: pathlib.Path = ROOT) -> list[str]:
  """The files git tracks or would track (not ignored) that exist in the working tree."""
  out = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, check=True, capture_output=True
  ).stdout.decode()
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


def _said(state: str) -> str:
  return "gone" if state == GONE else state or "in an unknown state"


def _not_found(stderr: str) -> bool:
  return "NOT_FOUND" in stderr  # gcloud's error code for a resource that does not exist


def query_state(argv: tuple[str, ...], run=None) -> tuple[int, str, str]:
  """(exit status, state, stderr) of a describe command; the state is GONE when nothing was found."""
  out = (run or subprocess.run)(argv, capture_output=True, text=True)
  state = out.stdout.strip()
  if out.returncode != 0 and _not_found(out.stderr or ""):
    state = GONE
  return out.returncode, state, (out.stderr or "").strip()


def wait_active(argv: tuple[str, ...], poll_seconds: float, run=None, sleep=None) -> None:
  """Polls a queued resource's state until it is ACTIVE; one on the way there is printed once."""
  sleep = sleep or time.sleep
  last = None
  while True:
    code, state, err = query_state(argv, run)
    if state == "ACTIVE":
      print("ACTIVE", flush=True)
      return
    if state not in PENDING:
      detail = f" ({err.splitlines()[-1]})" if code and err else ""
      raise SystemExit(f"error: the queued resource is {_said(state)} instead of becoming ACTIVE{detail}.")
    if state != last:
      print(f"{state}: waiting", flush=True)
      last = state
    sleep(poll_seconds)


def execute(steps: list[Step], poll_seconds: float = 30.0, run=None, sleep=None) -> None:
  """Runs the steps in order (see Step for what each kind does); a failing one ends the launch."""
  run = run or subprocess.run
  exists, what = False, "TPU VM"
  for step in steps:
    print(f"# {step.comment}", flush=True)
    if step.kind == "pack":
      print(f"packed {pack(step.path)} files", flush=True)
      continue
    if step.kind == "create" and exists:
      print(f"skipped: the {what} exists", flush=True)
      continue
    print(shlex.join(step.argv), flush=True)
    if step.kind == "probe":
      queued = step.argv[:4] == QUEUED
      what, ready = ("queued resource", "ACTIVE") if queued else ("TPU VM", "READY")
      probe = run(step.argv, capture_output=True, text=True)
      state = probe.stdout.strip()
      exists = probe.returncode == 0
      if exists and queued and state in PENDING:
        print(f"exists and is {state}: waiting for it", flush=True)
        continue
      if exists and state != ready:
        delete = "queued-resources delete --force" if queued else "tpu-vm delete"
        raise SystemExit(
          f"error: the {what} exists but is {state or 'in an unknown state'}, not {ready}; delete it "
          f"(gcloud compute tpus {delete}) or choose another --name."
        )
      print(f"exists and is {state}: reusing it" if exists else "not found: creating it", flush=True)
      continue
    if step.kind == "wait":
      wait_active(step.argv, poll_seconds, run, sleep)
      continue
    if step.kind == "delete":
      out = run(step.argv, stderr=subprocess.PIPE, text=True)
      if out.returncode != 0:
        if not _not_found(out.stderr or ""):
          print(out.stderr, end="", file=sys.stderr, flush=True)
          raise subprocess.CalledProcessError(out.returncode, step.argv)
        print("not found: nothing to delete", flush=True)
      continue
    run(step.argv, check=True)


def supervise(args: argparse.Namespace, launch: list[Step], recovery: list[Step], run=None, sleep=None) -> int:
  """Runs the launch and, after each preemption, the recovery; returns the exit status to leave with."""
  run = run or subprocess.run
  state_step, again = recovery[0], recovery[1:]
  execute(launch[:-1], args.poll_seconds, run, sleep)
  train, restarts = launch[-1], 0
  while True:
    print(f"# {train.comment}\n{shlex.join(train.argv)}", flush=True)
    status = run(train.argv).returncode
    print(f"# {state_step.comment}\n{shlex.join(state_step.argv)}", flush=True)
    for attempt in range(3):  # a failed query that is not a "not found" is asked again
      code, state, err = query_state(state_step.argv, run)
      if not code or state == GONE or attempt == 2:
        break
      (sleep or time.sleep)(args.poll_seconds)
    if code and state != GONE:
      reason = err.splitlines()[-1] if err else f"exit status {code}"
      print(
        f"supervise: the run exited with status {status} and the TPU VM's state could not be read ({reason}): stopping",
        flush=True,
      )
      return status
    if state == "READY" and status == EXIT_PREEMPTED:
      print(
        f"supervise: the run saved at a preemption notice (exit status {status}) and the TPU VM is READY", flush=True
      )
      if restarts == args.max_restarts:
        print(f"supervise: stopping after {restarts} relaunches (--max_restarts={args.max_restarts})", flush=True)
        return status
      restarts += 1
      print(f"supervise: relaunching #{restarts} on the same TPU VM from the workdir's latest checkpoint", flush=True)
      continue
    if state == "READY":
      if status == 0:
        print("supervise: the run finished", flush=True)
      else:
        print(
          f"supervise: the run failed with exit status {status} on a READY TPU VM, not a preemption: stopping",
          flush=True,
        )
      return status
    if state not in LOST:
      print(
        f"supervise: the run exited with status {status} and the TPU VM is {state}, neither READY nor "
        "preempted: stopping",
        flush=True,
      )
      return status
    print(
      f"supervise: preempted: the run exited with status {status} and the TPU VM {args.name} is {_said(state)}",
      flush=True,
    )
    if restarts == args.max_restarts:
      print(f"supervise: stopping after {restarts} relaunches (--max_restarts={args.max_restarts})", flush=True)
      return status or 1
    restarts += 1
    print(f"supervise: re-creating {args.queued_resource if args.queued else args.name}", flush=True)
    execute(again[:-1], args.poll_seconds, run, sleep)
    print(f"supervise: relaunching #{restarts}: the run resumes from its workdir's latest checkpoint", flush=True)
    train = again[-1]


def workdir_warning(args: argparse.Namespace) -> str | None:
  """One line when a preemptible or supervised run keeps its checkpoints on a VM's own disk."""
  if not (args.spot or args.supervise):
    return None
  wd = train_workdir(args.train_args)
  if wd and wd.startswith("gs://"):
    return None
  flag = "--supervise" if args.supervise else "--spot"
  return (
    f"warning: {flag} with --workdir={wd or '(the trainer default)'}, not a gs:// bucket: a re-created TPU VM "
    "would not have its checkpoints unless that folder is a mount every new VM shares."
  )


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  steps = build_steps(args)
  recovery = supervise_steps(args) if args.supervise else []
  warning = workdir_warning(args)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  if args.dry_run:
    print(render(steps + recovery))
    return
  try:
    if args.supervise:
      raise SystemExit(supervise(args, steps, recovery))
    execute(steps, args.poll_seconds)
  except FileNotFoundError as e:
    raise SystemExit(f"error: {e.filename} is not installed or not on PATH.") from None
  except subprocess.CalledProcessError as e:
    raise SystemExit(f"error: this command failed with exit status {e.returncode}: {shlex.join(e.cmd)}") from None


if __name__ == "__main__":
  main()
