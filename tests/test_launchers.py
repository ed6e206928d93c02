"""scripts/launch_tpu.py and scripts/launch_slurm.py build the exact commands they document.

Neither gcloud nor SLURM is needed: the commands are compared as built and as printed by --dry-run;
the TPU launcher's supervisor runs in a subprocess against a fake gcloud on PATH; the SLURM batch
script's USR1 trap runs under bash with srun and scontrol faked; the remote shell commands of the
TPU launcher's copy step run with bash and a temporary HOME on a throwaway repo.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal as signal_lib
import subprocess
import sys
import tarfile
import time

import pytest

from lra_core import cli
from lra_core.config import PROJECT_ROOT


def load(name):
  spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


tpu = load("launch_tpu")
slurm = load("launch_slurm")

TRAIN = [
  "--config=configs/lra/listops/transformer.py",
  "--workdir=/mnt/shared/runs/listops",
  "--config.optim.lr=4e-4",
  "--config.data.dir=/mnt/data/list ops",
]
TRAIN_QUOTED = (
  "--config=configs/lra/listops/transformer.py --workdir=/mnt/shared/runs/listops "
  "--config.optim.lr=4e-4 '--config.data.dir=/mnt/data/list ops' --distributed=on"
)
TPU = ("gcloud", "compute", "tpus", "tpu-vm")
WHERE = ("--zone=us-central2-b",)
SSH = TPU + ("ssh", "lra-v4") + WHERE + ("--worker=all",)
BASE = ["--name=lra-v4", "--zone=us-central2-b", "--accelerator_type=v4-32"]


def steps(*flags):
  return tpu.build_steps(tpu.parse_args([*BASE, *flags, "--", *TRAIN]))


def test_tpu_copy_steps_are_exact():
  got = steps()
  tarball = tpu.local_tarball("lra-v4")
  assert [(s.kind, s.argv) for s in got] == [
    ("probe", TPU + ("describe", "lra-v4") + WHERE + ("--format=value(state)",)),
    ("create", TPU + ("create", "lra-v4") + WHERE + ("--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base")),
    ("pack", ()),
    ("run", TPU + ("scp", tarball, "lra-v4:lra_core-code.tar.gz") + WHERE + ("--worker=all",)),
    (
      "run",
      SSH
      + (
        "--command=mkdir -p ~/lra_core && tar -xzf ~/lra_core-code.tar.gz -C ~/lra_core && rm ~/lra_core-code.tar.gz",
      ),
    ),
    ("run", SSH + ('--command=cd ~/lra_core && python3 -m pip install -e ".[tpu]"',)),
    ("run", SSH + (f"--command=cd ~/lra_core && python3 -m lra_core.train {TRAIN_QUOTED}",)),
  ]
  assert got[2].path == tarball


def test_tpu_git_spot_project_setup_and_remote_dir():
  got = steps(
    "--project=my-proj",
    "--spot",
    "--version=v2-alpha-tpuv5-lite",
    "--code=git",
    "--repo=https://example.org/lra_core.git",
    "--branch=dev",
    "--remote_dir=/opt/my code",
    "--extra=",
    "--setup=source ~/venv/bin/activate",
  )
  where = ("--zone=us-central2-b", "--project=my-proj")
  ssh = TPU + ("ssh", "lra-v4") + where + ("--worker=all",)
  assert [s.argv for s in got] == [
    TPU + ("describe", "lra-v4") + where + ("--format=value(state)",),
    TPU + ("create", "lra-v4") + where + ("--accelerator-type=v4-32", "--version=v2-alpha-tpuv5-lite", "--spot"),
    ssh
    + (
      "--command=if [ -d '/opt/my code'/.git ]; then cd '/opt/my code' && git fetch && git checkout dev "
      "&& git pull; else git clone --branch dev https://example.org/lra_core.git '/opt/my code'; fi",
    ),
    ssh + ("--command=source ~/venv/bin/activate && cd '/opt/my code' && python3 -m pip install -e .",),
    ssh + (f"--command=source ~/venv/bin/activate && cd '/opt/my code' && python3 -m lra_core.train {TRAIN_QUOTED}",),
  ]


@pytest.mark.parametrize(
  "flags, train, target, added",
  [
    ((), ["--workdir=gs://bucket/run"], '".[tpu,gcs]"', "gcs"),
    ((), ["--workdir", "s3://bucket/run"], '".[tpu,s3]"', "s3"),
    (("--extra=",), ["--workdir=gs://bucket/run", "--config.data.dir=s3://bucket/data"], '".[gcs,s3]"', "gcs, s3"),
    (("--extra=gcs,tpu",), ["--workdir=gs://bucket/run"], '".[gcs,tpu]"', None),
    ((), ["--workdir=/mnt/shared/runs/x", "--config.data.dir=/mnt/data"], '".[tpu]"', None),
    (("--extra=",), ["--workdir=runs/x"], ".", None),
  ],
)
def test_tpu_install_adds_the_extra_of_an_object_store_url(flags, train, target, added):
  """A gs:// or s3:// workdir or data dir needs gcsfs / s3fs on the workers: step 4 and R4 install it."""
  args = tpu.parse_args([*BASE, "--supervise", *flags, "--", *train])
  install = SSH + (f"--command=cd ~/lra_core && python3 -m pip install -e {target}",)
  comment = "install the package on every worker" + (
    f" ({added} added for the train arguments' object-store URLs)" if added else ""
  )
  for prefix, step in [("", tpu.build_steps(args)[-2]), ("R", tpu.supervise_steps(args)[-2])]:
    assert (step.comment, step.argv) == (f"{prefix}4. {comment}", install)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--zone=z", "--accelerator_type=v4-8", "--", "--workdir=w"], "required: --name"),
    (["--name=n", "--accelerator_type=v4-8", "--", "--workdir=w"], "required: --zone"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8"], "no train arguments"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--"], "no train arguments"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--code=git", "--", "--workdir=w"], "needs --repo"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--extra=tpu;rm", "--", "--workdir=w"], "--extra"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--", "--distributed=off"], "leave --distributed out"),
  ],
)
def test_tpu_errors(argv, message, capsys):
  with pytest.raises(SystemExit):
    tpu.parse_args(argv)
  assert message in capsys.readouterr().err


def test_tpu_dry_run_subprocess_prints_every_step():
  argv = [sys.executable, str(PROJECT_ROOT / "scripts" / "launch_tpu.py"), *BASE, "--dry-run", "--", *TRAIN]
  out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
  assert out[0] == "# 1. does the TPU VM lra-v4 exist? (reused if READY)"
  assert out[1] == "gcloud compute tpus tpu-vm describe lra-v4 --zone=us-central2-b '--format=value(state)'"
  assert out[2] == "# 2. create it (only if the describe fails)"
  assert out[3] == (
    "gcloud compute tpus tpu-vm create lra-v4 --zone=us-central2-b --accelerator-type=v4-32 "
    "--version=tpu-ubuntu2204-base"
  )
  assert out[-2] == "# 5. train: the same command on every worker"
  assert out[-1].startswith("gcloud compute tpus tpu-vm ssh lra-v4 --zone=us-central2-b --worker=all '--command=")
  assert "'\"'\"'--config.data.dir=/mnt/data/list ops'\"'\"'" in out[-1]  # quoted twice: local, remote
  assert sum(not line.startswith("#") for line in out) == 6  # pack is done by the script itself


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None, reason="needs git and bash")
def test_tpu_copy_packs_git_files_and_unpacks_remotely(tmp_path):
  repo = tmp_path / "repo"
  (repo / "pkg").mkdir(parents=True)
  (repo / ".gitignore").write_text("runs/\n")
  (repo / "pkg" / "a.py").write_text("A = 1\n")
  (repo / "gone.py").write_text("")
  (repo / "new.py").write_text("NEW = 1\n")  # untracked, not ignored: travels
  (repo / "runs").mkdir()
  (repo / "runs" / "big.bin").write_text("x")  # ignored: stays
  subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
  subprocess.run(["git", "add", ".gitignore", "pkg/a.py", "gone.py"], cwd=repo, check=True)
  (repo / "gone.py").unlink()  # tracked but deleted: skipped
  tarball = tmp_path / "code.tar.gz"
  assert tpu.pack(str(tarball), repo) == 3
  with tarfile.open(tarball) as tar:
    assert sorted(tar.getnames()) == [".gitignore", "new.py", "pkg/a.py"]
  home = tmp_path / "home"
  home.mkdir()
  shutil.copy(tarball, home / tpu.REMOTE_TARBALL)  # what the scp step does
  unpack = steps()[4].argv[-1].removeprefix("--command=")
  subprocess.run(["bash", "-c", unpack], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
  assert (home / "lra_core" / "pkg" / "a.py").read_text() == "A = 1\n"
  assert not (home / tpu.REMOTE_TARBALL).exists()


@pytest.mark.parametrize(
  "probe, ran_create, error",
  [
    (subprocess.CompletedProcess([], 0, "READY\n"), False, None),
    (subprocess.CompletedProcess([], 1, ""), True, None),
    (subprocess.CompletedProcess([], 0, "PREEMPTED\n"), False, "is PREEMPTED, not READY"),
  ],
)
def test_tpu_execute_reuses_creates_or_stops(probe, ran_create, error, monkeypatch, capsys):
  calls = []

  def fake_run(argv, **kwargs):
    calls.append(argv[4])  # describe / create / scp / ssh
    return probe if argv[4] == "describe" else subprocess.CompletedProcess(argv, 0)

  monkeypatch.setattr(tpu.subprocess, "run", fake_run)
  monkeypatch.setattr(tpu, "pack", lambda path: 0)
  if error:
    with pytest.raises(SystemExit, match=error):
      tpu.execute(steps())
    assert calls == ["describe"]
    return
  tpu.execute(steps())
  assert calls == ["describe"] + ["create"] * ran_create + ["scp", "ssh", "ssh", "ssh"]
  assert ("skipped: the TPU VM exists" in capsys.readouterr().out) != ran_create


QUEUED = ("gcloud", "compute", "tpus", "queued-resources")


@pytest.mark.parametrize(
  "accelerator_type, runtime",
  [
    ("v2-8", "tpu-ubuntu2204-base"),
    ("v3-32", "tpu-ubuntu2204-base"),
    ("v4-32", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p-8", "v2-alpha-tpuv5"),
    ("v6e-8", "v2-alpha-tpuv6e"),
  ],
)
def test_tpu_runtime_version_by_generation(accelerator_type, runtime):
  got = tpu.build_steps(
    tpu.parse_args(["--name=n", "--zone=z", f"--accelerator_type={accelerator_type}", "--spot", "--", *TRAIN])
  )
  assert got[1].argv == TPU + (
    "create",
    "n",
    "--zone=z",
    f"--accelerator-type={accelerator_type}",
    f"--version={runtime}",
    "--spot",
  )
  queued = tpu.build_steps(
    tpu.parse_args(["--name=n", "--zone=z", f"--accelerator_type={accelerator_type}", "--queued", "--", *TRAIN])
  )
  assert queued[1].argv == QUEUED + (
    "create",
    "n",
    "--node-id=n",
    "--zone=z",
    f"--accelerator-type={accelerator_type}",
    f"--runtime-version={runtime}",
  )


def test_tpu_version_flag_overrides_the_table_and_unknown_generations_are_refused(capsys):
  args = tpu.parse_args(["--name=n", "--zone=z", "--accelerator_type=v7x-8", "--version=my-runtime", "--", "--x=1"])
  assert args.version == "my-runtime"
  for bad, generation in (("v7x-8", "v7x"), ("tpu-big", "tpu-big")):
    with pytest.raises(SystemExit):
      tpu.parse_args(["--name=n", "--zone=z", f"--accelerator_type={bad}", "--", "--x=1"])
    assert (
      f"--accelerator_type={bad}: unknown TPU generation {generation!r}, choose the runtime with --version "
      "(known generations: v2, v3, v4, v5litepod, v5p, v6e)."
    ) in capsys.readouterr().err


def test_tpu_queued_steps_are_exact():
  got = steps("--queued", "--queued_resource=lra-qr", "--spot", "--project=p", "--poll_seconds=5")
  where = ("--zone=us-central2-b", "--project=p")
  describe = QUEUED + ("describe", "lra-qr") + where + ("--format=value(state.state)",)
  assert [(s.kind, s.argv) for s in got[:3]] == [
    ("probe", describe),
    (
      "create",
      QUEUED
      + ("create", "lra-qr", "--node-id=lra-v4")
      + where
      + ("--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"),
    ),
    ("wait", describe),
  ]
  assert got[2].comment == "2b. wait until it is ACTIVE (state every 5 s)"
  assert [s.kind for s in got[3:]] == ["pack", "run", "run", "run", "run"]  # code, install, train: as without
  assert [s.argv for s in got[3:]] == [s.argv for s in steps("--project=p")[2:]]


def test_tpu_supervise_steps_are_exact():
  args = tpu.parse_args([*BASE, "--supervise", "--spot", "--", *TRAIN])
  launch, got = tpu.build_steps(args), tpu.supervise_steps(args)
  create = TPU + ("create", "lra-v4") + WHERE + ("--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot")
  assert [(s.kind, s.argv) for s in got] == [
    ("state", TPU + ("describe", "lra-v4") + WHERE + ("--format=value(state)",)),
    ("delete", TPU + ("delete", "lra-v4") + WHERE + ("--quiet",)),
    ("run", create),
    *[("run", s.argv) for s in launch[3:]],  # scp, unpack, install, train: the tarball is not packed again
  ]
  assert launch[1].argv == create and got[-1].argv == launch[-1].argv
  assert [s.comment.split(".")[0] for s in got] == ["6", "R1", "R2", "R3b", "R3c", "R4", "R5"]
  queued = tpu.supervise_steps(
    tpu.parse_args([*BASE, "--supervise", "--queued", "--code=git", "--repo=u", "--", "--x=1"])
  )
  assert [(s.kind, s.argv) for s in queued[:4]] == [
    ("state", TPU + ("describe", "lra-v4") + WHERE + ("--format=value(state)",)),
    ("delete", QUEUED + ("delete", "lra-v4") + WHERE + ("--force", "--quiet")),
    (
      "run",
      QUEUED
      + ("create", "lra-v4", "--node-id=lra-v4")
      + WHERE
      + ("--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base"),
    ),
    ("wait", QUEUED + ("describe", "lra-v4") + WHERE + ("--format=value(state.state)",)),
  ]
  assert [s.comment.split(".")[0] for s in queued[4:]] == ["R3", "R4", "R5"]


def test_tpu_dry_run_supervise_prints_launch_and_recovery_and_warns():
  argv = [
    sys.executable,
    str(PROJECT_ROOT / "scripts" / "launch_tpu.py"),
    *BASE,
    "--supervise",
    "--queued",
    "--max_restarts=3",
    "--dry-run",
    "--",
    *TRAIN,
  ]
  done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
  out = done.stdout.splitlines()
  assert [line.split(".")[0] for line in out if line.startswith("#")] == [
    "# 1",
    "# 2",
    "# 2b",
    "# 3a",
    "# 3b",
    "# 3c",
    "# 4",
    "# 5",
    "# 6",
    "# R1",
    "# R2",
    "# R2b",
    "# R3b",
    "# R3c",
    "# R4",
    "# R5",
  ]
  assert out[out.index(next(line for line in out if line.startswith("# 6."))) + 1] == (
    "gcloud compute tpus tpu-vm describe lra-v4 --zone=us-central2-b '--format=value(state)'"
  )
  assert (
    "# 6. supervise, after step 5: the TPU VM's state (READY: stop with the run's exit status; PREEMPTED, "
    "TERMINATED, FAILED, SUSPENDING, SUSPENDED or not found: R1 to R5, at most 3 times)" in out
  )
  assert "gcloud compute tpus queued-resources delete lra-v4 --zone=us-central2-b --force --quiet" in out
  assert out[-1] == out[out.index("# 5. train: the same command on every worker") + 1]
  assert done.stderr == (
    "warning: --supervise with --workdir=/mnt/shared/runs/listops, not a gs:// bucket: a "
    "re-created TPU VM would not have its checkpoints unless that folder is a mount every new VM "
    "shares.\n"
  )


@pytest.mark.parametrize(
  "flags, workdir, warned",
  [
    ((), "/mnt/x", False),
    (("--spot",), "/mnt/x", True),
    (("--supervise",), "runs/x", True),
    (("--spot", "--supervise"), "gs://bucket/x", False),
    (("--spot",), None, True),
  ],
)
def test_tpu_warns_about_a_local_workdir_of_a_preemptible_run(flags, workdir, warned):
  train = [f"--workdir={workdir}"] if workdir else ["--config=c.py"]
  warning = tpu.workdir_warning(tpu.parse_args([*BASE, *flags, "--", *train]))
  assert (warning is not None) == warned
  if warned:
    assert warning.startswith(
      f"warning: {'--supervise' if '--supervise' in flags else '--spot'} with "
      f"--workdir={workdir or '(the trainer default)'}, not a gs:// bucket"
    )


@pytest.mark.parametrize(
  "states, error",
  [  # the answers of the probe, then of the wait's queries
    (["ACTIVE", "ACTIVE"], None),
    (["PROVISIONING", "PROVISIONING", "ACTIVE"], None),
    (
      ["WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "SUSPENDED"],
      "the queued resource is SUSPENDED instead of becoming ACTIVE.",
    ),
  ],
)
def test_tpu_queued_probe_waits_for_a_provisioning_resource(states, error, monkeypatch, capsys):
  calls, answers = [], iter(states)

  def fake_run(argv, **kwargs):
    calls.append(argv[4])
    if argv[4] == "describe":
      return subprocess.CompletedProcess(argv, 0, next(answers) + "\n", "")
    return subprocess.CompletedProcess(argv, 0)

  sleeps = []
  monkeypatch.setattr(tpu, "pack", lambda path: 0)
  queued = steps("--queued", "--poll_seconds=7")
  if error:
    with pytest.raises(SystemExit, match=error):
      tpu.execute(queued, 7, fake_run, sleeps.append)
    return
  tpu.execute(queued, 7, fake_run, sleeps.append)
  assert calls == ["describe"] * len(states) + ["scp", "ssh", "ssh", "ssh"]
  assert sleeps == [7] * (len(states) - 2)
  out = capsys.readouterr().out
  assert "skipped: the queued resource exists" in out
  assert ("exists and is PROVISIONING: waiting for it" in out) == (states[0] == "PROVISIONING")


FAKE_GCLOUD = r"""#!{python}
# A stand-in for gcloud: logs each call and plays a TPU VM / queued resource kept in state.json.
import json, pathlib, shlex, sys

here = pathlib.Path(__file__).parent
args = sys.argv[1:]
with open(here / "calls.log", "a") as f:
  f.write(shlex.join(["gcloud", *args]) + "\n")
state_file = here / "state.json"
state = json.loads(state_file.read_text())
group, verb, name = args[2], args[3], args[4]


def done(code=0):
  state_file.write_text(json.dumps(state))
  sys.exit(code)


def missing():
  print(f"ERROR: (gcloud.compute.tpus.{{group}}.{{verb}}) NOT_FOUND: {{name}} was not found", file=sys.stderr)
  done(1)


if group == "tpu-vm":
  if verb == "describe":
    if state["node"] is None:
      missing()
    print(state["node"])
  elif verb == "create":
    state["node"] = "READY"
  elif verb == "delete":
    if state["node"] is None:
      missing()
    state["node"] = None
  elif verb == "ssh" and "lra_core.train" in args[-1]:
    code = state["train_exits"].pop(0)
    if code in (255, "saved"):  # the slice is preempted under the run ("saved": the trainer checkpointed, exit 75)
      state["node"] = "PREEMPTED"
      state["queued"] = state["queued"] and "SUSPENDED"
    if code == "gone":  # the slice was deleted under the run
      state["node"], code = None, 255
    done(75 if code == "saved" else code)
elif group == "queued-resources":
  if verb == "describe":
    if state["queued"] is None:
      missing()
    print(state["queued"])
    if state["queued"] == "WAITING_FOR_RESOURCES":  # provisioned by the next query
      state["queued"], state["node"] = "ACTIVE", "READY"
  elif verb == "create":
    state["queued"] = "WAITING_FOR_RESOURCES"
  elif verb == "delete":
    if state["queued"] is None:
      missing()
    state["queued"] = state["node"] = None
done()
"""


def run_with_fake_gcloud(tmp_path, flags, train_exits, node=None, queued=None):
  """Runs scripts/launch_tpu.py in a subprocess with the fake gcloud first on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True)
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
  gcloud.chmod(0o755)
  (bin_dir / "state.json").write_text(json.dumps({"node": node, "queued": queued, "train_exits": train_exits}))
  argv = [
    sys.executable,
    str(PROJECT_ROOT / "scripts" / "launch_tpu.py"),
    *BASE,
    *flags,
    "--poll_seconds=0",
    "--",
    *TRAIN[:1],
    "--workdir=gs://bucket/run",
  ]
  env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
  done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
  calls = (bin_dir / "calls.log").read_text().splitlines()
  return done, calls, json.loads((bin_dir / "state.json").read_text())


@pytest.mark.skipif(sys.platform == "win32", reason="the fake gcloud is an executable script")
@pytest.mark.parametrize("queued", [False, True])
def test_tpu_supervise_recovers_from_a_preemption_through_a_fake_gcloud(queued, tmp_path, monkeypatch):
  flags = ["--supervise", "--spot"] + (["--queued", "--code=git", "--repo=https://example.org/r.git"] if queued else [])
  done, calls, state = run_with_fake_gcloud(tmp_path, flags, train_exits=[255, 0])
  assert done.returncode == 0, done.stderr
  args = tpu.parse_args([*BASE, *flags, "--poll_seconds=0", "--", *TRAIN[:1], "--workdir=gs://bucket/run"])
  monkeypatch.setattr(tpu.tempfile, "tempdir", str(tmp_path))  # the launcher ran with TMPDIR=tmp_path
  launch, recovery = tpu.build_steps(args), tpu.supervise_steps(args)
  by_comment = {s.comment.split(".")[0]: shlex.join(s.argv) for s in launch + recovery if s.argv}
  if queued:  # each wait sees WAITING_FOR_RESOURCES, then ACTIVE
    expected = ["1", "2", "2b", "2b", "3", "4", "5", "6", "R1", "R2", "R2b", "R2b", "R3", "R4", "R5", "6"]
  else:
    expected = ["1", "2", "3b", "3c", "4", "5", "6", "R1", "R2", "R3b", "R3c", "R4", "R5", "6"]
  assert calls == [by_comment[k] for k in expected]
  assert state == {"node": "READY", "queued": "ACTIVE" if queued else None, "train_exits": []}
  # the literal commands of the recovery, in case the step builders and the log agree on a mistake
  zone = "--zone=us-central2-b"
  if queued:
    assert calls[7:11] == [
      f"gcloud compute tpus tpu-vm describe lra-v4 {zone} '--format=value(state)'",
      f"gcloud compute tpus queued-resources delete lra-v4 {zone} --force --quiet",
      f"gcloud compute tpus queued-resources create lra-v4 --node-id=lra-v4 {zone} --accelerator-type=v4-32 "
      "--runtime-version=tpu-ubuntu2204-base --spot",
      f"gcloud compute tpus queued-resources describe lra-v4 {zone} '--format=value(state.state)'",
    ]
  else:
    assert calls[6:9] == [
      f"gcloud compute tpus tpu-vm describe lra-v4 {zone} '--format=value(state)'",
      f"gcloud compute tpus tpu-vm delete lra-v4 {zone} --quiet",
      f"gcloud compute tpus tpu-vm create lra-v4 {zone} --accelerator-type=v4-32 --version=tpu-ubuntu2204-base --spot",
    ]
    assert done.stdout.count("packed ") == 1  # the recovery copies the tarball of the first launch
  assert calls[-2] == by_comment["5"]  # the identical train command
  events = [line for line in done.stdout.splitlines() if line.startswith("supervise:")]
  assert events == [
    "supervise: preempted: the run exited with status 255 and the TPU VM lra-v4 is PREEMPTED",
    "supervise: re-creating lra-v4",
    "supervise: relaunching #1: the run resumes from its workdir's latest checkpoint",
    "supervise: the run finished",
  ]
  assert done.stderr == ""  # the workdir is in a bucket: no warning


@pytest.mark.skipif(sys.platform == "win32", reason="the fake gcloud is an executable script")
def test_tpu_supervise_failure_restart_limit_and_clean_exit_on_a_preempted_slice(tmp_path):
  done, calls, _ = run_with_fake_gcloud(tmp_path / "a", ["--supervise", "--code=git", "--repo=u"], [3], node="READY")
  assert done.returncode == 3
  assert [c.split()[4] for c in calls] == ["describe", "ssh", "ssh", "ssh", "describe"]  # no delete
  assert "supervise: the run failed with exit status 3 on a READY TPU VM, not a preemption: stopping" in done.stdout
  done, calls, _ = run_with_fake_gcloud(
    tmp_path / "b", ["--supervise", "--code=git", "--repo=u", "--max_restarts=1"], [255, 255], node="READY"
  )
  assert done.returncode == 255
  assert [c.split()[4] for c in calls] == [
    "describe",
    "ssh",
    "ssh",
    "ssh",
    "describe",
    "delete",
    "create",
    "ssh",
    "ssh",
    "ssh",
    "describe",
  ]
  assert done.stdout.splitlines()[-1] == "supervise: stopping after 1 relaunches (--max_restarts=1)"
  # a run that saved and exited 75 on the preemption notice: the slice is gone all the same
  done, calls, _ = run_with_fake_gcloud(
    tmp_path / "c", ["--supervise", "--code=git", "--repo=u"], ["saved", 0], node="READY"
  )
  assert done.returncode == 0
  assert [c.split()[4] for c in calls] == [
    "describe",
    "ssh",
    "ssh",
    "ssh",
    "describe",
    "delete",
    "create",
    "ssh",
    "ssh",
    "ssh",
    "describe",
  ]
  assert "supervise: preempted: the run exited with status 75 and the TPU VM lra-v4 is PREEMPTED" in done.stdout
  # a run that saved at a preemption notice (exit 75) on a VM that stays READY: relaunched there, not re-created
  done, calls, _ = run_with_fake_gcloud(
    tmp_path / "e", ["--supervise", "--code=git", "--repo=u"], [75, 0], node="READY"
  )
  assert done.returncode == 0
  assert [c.split()[4] for c in calls] == ["describe", "ssh", "ssh", "ssh", "describe", "ssh", "describe"]
  assert calls[5] == calls[3]  # the identical train command
  assert [line for line in done.stdout.splitlines() if line.startswith("supervise:")] == [
    "supervise: the run saved at a preemption notice (exit status 75) and the TPU VM is READY",
    "supervise: relaunching #1 on the same TPU VM from the workdir's latest checkpoint",
    "supervise: the run finished",
  ]
  # a slice that is gone: nothing to delete, created again
  done, calls, _ = run_with_fake_gcloud(
    tmp_path / "d", ["--supervise", "--code=git", "--repo=u"], ["gone", 0], node="READY"
  )
  assert done.returncode == 0
  assert [c.split()[4] for c in calls] == [
    "describe",
    "ssh",
    "ssh",
    "ssh",
    "describe",
    "delete",
    "create",
    "ssh",
    "ssh",
    "ssh",
    "describe",
  ]
  assert "supervise: preempted: the run exited with status 255 and the TPU VM lra-v4 is gone" in done.stdout
  assert "not found: nothing to delete" in done.stdout


def test_tpu_supervise_stops_when_the_state_cannot_be_read(capsys):
  args = tpu.parse_args([*BASE, "--supervise", "--code=git", "--repo=u", "--poll_seconds=9", "--", "--x=1"])
  calls, sleeps = [], []

  def fake_run(argv, **kwargs):
    calls.append(argv[4])
    if argv[4] == "describe" and len(calls) > 1:  # the state query after the run
      return subprocess.CompletedProcess(argv, 1, "", "ERROR: (gcloud) PERMISSION_DENIED: no\n")
    if argv[4] == "describe":
      return subprocess.CompletedProcess(argv, 0, "READY\n", "")
    return subprocess.CompletedProcess(argv, 7 if "lra_core.train" in argv[-1] else 0)

  assert tpu.supervise(args, tpu.build_steps(args), tpu.supervise_steps(args), fake_run, sleeps.append) == 7
  assert calls == ["describe", "ssh", "ssh", "ssh", "describe", "describe", "describe"]  # asked 3 times
  assert sleeps == [9, 9]
  assert capsys.readouterr().out.splitlines()[-1] == (
    "supervise: the run exited with status 7 and the TPU VM's state could not be read (ERROR: (gcloud) "
    "PERMISSION_DENIED: no): stopping"
  )


def test_tpu_remote_path_keeps_tilde_outside_quotes():
  assert tpu.remote_path("~/lra_core") == "~/lra_core"
  assert tpu.remote_path("~/my code") == "~/'my code'"
  assert tpu.remote_path("/srv/x") == "/srv/x"


SLURM_EXAMPLE = [
  "--nodes=2",
  "--gpus_per_node=8",
  "--cpus_per_task=8",
  "--time=24:00:00",
  "--chdir=/shared/lra_core",
  "--setup=source /shared/lra_core/.venv/bin/activate",
  "--requeue",
  "--",
  "--config=configs/enwik8/transformer_vq.py",
  "--config.data.dir=/shared/data/enwik8",
  "--workdir=/shared/runs/enwik8_vq",
]
SLURM_SRUN = (
  "srun python -m lra_core.train --config=configs/enwik8/transformer_vq.py "
  "--config.data.dir=/shared/data/enwik8 --workdir=/shared/runs/enwik8_vq --distributed=on"
)


SBATCH_LINES = [
  "#SBATCH --job-name=lra_core",
  "#SBATCH --nodes=2",
  "#SBATCH --ntasks-per-node=8",
  "#SBATCH --gpus-per-node=8",
  "#SBATCH --cpus-per-task=8",
  "#SBATCH --time=24:00:00",
  "#SBATCH --output=/shared/runs/enwik8_vq/slurm-%j.out",
  "#SBATCH --chdir=/shared/lra_core",
]
STOP_LINES = [
  "# USR1 comes 120 s before the time limit (--signal above): srun passes SIGTERM on to",
  "# every training process, which finishes the step in flight, saves a checkpoint and exits.",
  "stop_run() {",
  '  echo "USR1: the time limit is near; stopping the run with a checkpoint" >&2',
  "  stopping=1",
  '  kill -TERM "$srun_pid" 2>/dev/null || true',
  "}",
  "stopping=0",
  "trap stop_run USR1",
  SLURM_SRUN + " &",
  "srun_pid=$!",
  "while :; do  # the trap ends `wait` early: wait again while srun is still stopping the run",
  "  status=0",
  '  wait "$srun_pid" || status=$?',
  '  if [ "$status" -le 128 ] || ! kill -0 "$srun_pid" 2>/dev/null; then break; fi',
  "done",
]
REQUEUE_LINES = [
  "# back to the queue after the stop, or after a SIGTERM from elsewhere (the trainer saved and exited with",
  "# status 75): the same command resumes from the checkpoint",
  'if [ "$stopping" = 1 ] || [ "$status" = 75 ]; then',
  '  echo "requeueing job $SLURM_JOB_ID" >&2',
  '  scontrol requeue "$SLURM_JOB_ID"',
  "fi",
]


def test_slurm_script_lines_and_srun_command():
  lines = slurm.render(slurm.parse_args(SLURM_EXAMPLE)).splitlines()
  assert lines[0] == "#!/bin/bash"
  assert [line for line in lines if line.startswith("#SBATCH")] == SBATCH_LINES + [
    "#SBATCH --signal=B:USR1@120",
    "#SBATCH --requeue",
    "#SBATCH --open-mode=append",
  ]
  setup = lines.index("set -e")
  assert lines[setup:] == [
    "set -e",
    "source /shared/lra_core/.venv/bin/activate",
    *STOP_LINES,
    *REQUEUE_LINES,
    'exit "$status"',
  ]


@pytest.mark.parametrize(
  "flags, sbatch, tail",
  [
    ([], ["#SBATCH --signal=B:USR1@120"], [*STOP_LINES, 'exit "$status"']),
    (
      ["--signal_seconds=300"],
      ["#SBATCH --signal=B:USR1@300"],
      [STOP_LINES[0].replace("120 s", "300 s"), *STOP_LINES[1:], 'exit "$status"'],
    ),
    (["--signal_seconds=0"], [], [SLURM_SRUN]),
    (["--signal_seconds=0", "--requeue"], ["#SBATCH --requeue", "#SBATCH --open-mode=append"], [SLURM_SRUN]),
  ],
)
def test_slurm_signal_and_requeue_options(flags, sbatch, tail):
  example = [a for a in SLURM_EXAMPLE if a != "--requeue"]
  lines = slurm.render(slurm.parse_args(flags + example)).splitlines()
  assert [line for line in lines if line.startswith("#SBATCH")] == SBATCH_LINES + sbatch
  assert lines[lines.index("set -e") + 2 :] == tail


def test_slurm_static_example_is_what_the_launcher_renders():
  static = (PROJECT_ROOT / "scripts" / "slurm" / "train.sbatch").read_text()
  assert static == slurm.render(slurm.parse_args(SLURM_EXAMPLE))
  assert SLURM_SRUN + " &" in static.splitlines()


def test_slurm_optional_lines_quoting_and_script_path(tmp_path):
  args = slurm.parse_args(
    [
      "--nodes=1",
      "--gpus_per_node=4",
      "--partition=gpu",
      "--account=lab",
      "--job_name=vq",
      f"--chdir={tmp_path}",
      "--",
      "--workdir",
      "runs/a",
      "--config.data.dir=/data/a b",
    ]
  )
  lines = slurm.render(args).splitlines()
  assert "#SBATCH --partition=gpu" in lines and "#SBATCH --account=lab" in lines
  assert "#SBATCH --output=runs/a/slurm-%j.out" in lines  # relative to --chdir
  assert not any(line.startswith(("#SBATCH --time", "#SBATCH --cpus-per-task")) for line in lines)
  assert "srun python -m lra_core.train --workdir runs/a '--config.data.dir=/data/a b' --distributed=on &" in lines
  assert slurm.script_path(args) == tmp_path / "runs/a" / "launch.sbatch"
  with pytest.raises(SystemExit, match="cut at its whitespace"):
    slurm.render(slurm.parse_args(["--nodes=1", "--gpus_per_node=1", "--", "--workdir=runs/a b"]))
  args = slurm.parse_args(["--nodes=1", "--gpus_per_node=1", f"--script_out={tmp_path}/s.sbatch", "--", "--x=1"])
  assert slurm.script_path(args) == tmp_path / "s.sbatch"
  assert "#SBATCH --output=slurm-%j.out" in slurm.render(args).splitlines()


def test_slurm_passes_an_object_store_workdir_through_untouched(tmp_path, monkeypatch):
  """A gs:// workdir is the trainer's business: the script and the log stay local, no folder is made."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(slurm.tempfile, "tempdir", str(tmp_path / "tmp"))
  monkeypatch.setattr(slurm.subprocess, "run", lambda argv, check: None)  # sbatch
  slurm.main(["--nodes=1", "--gpus_per_node=2", f"--chdir={tmp_path}", "--", "--workdir=gs://bucket/run"])
  script = (tmp_path / "tmp" / "lra_core.sbatch").read_text().splitlines()
  assert "#SBATCH --output=slurm-%j.out" in script
  assert any(line.startswith("srun python -m lra_core.train --workdir=gs://bucket/run ") for line in script)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # no folder named gs:


@pytest.mark.parametrize(
  "train, have, warning",
  [
    (["--workdir=gs://bucket/run"], (), 'gs:// URLs and this Python has no gcsfs; {env} ".[gcs]".'),
    (["--workdir", "s3://bucket/run"], ("gcsfs",), 's3:// URLs and this Python has no s3fs; {env} ".[s3]".'),
    (
      ["--workdir=gs://b/run", "--config.data.dir=s3://b/data"],
      (),
      'gs:// / s3:// URLs and this Python has no gcsfs / s3fs; {env} ".[gcs,s3]".',
    ),
    (["--workdir=gs://b/run", "--config.data.dir=s3://b/data"], ("tensorflow",), None),
    (["--workdir=gs://bucket/run"], ("gcsfs",), None),
    (["--workdir=/shared/runs/x", "--config.data.dir=/shared/data"], (), None),
  ],
)
def test_slurm_warns_when_this_python_cannot_reach_an_object_store_url(train, have, warning):
  env = "the job's environment (--setup, or the python on the PATH sbatch passes on) needs pip install -e"
  expected = warning and "warning: the train arguments name " + warning.format(env=env)
  assert slurm.store_warning(train, have=lambda m: m in have) == expected


def test_slurm_dry_run_warns_about_a_missing_gcsfs_before_writing_anything(tmp_path, monkeypatch, capsys):
  find_spec = slurm.importlib.util.find_spec
  monkeypatch.setattr(
    slurm.importlib.util, "find_spec", lambda m, *a: None if m in ("gcsfs", "tensorflow") else find_spec(m, *a)
  )
  out_file = tmp_path / "s.sbatch"
  slurm.main(["--nodes=1", "--gpus_per_node=2", f"--script_out={out_file}", "--dry-run", "--", "--workdir=gs://b/r"])
  captured = capsys.readouterr()
  assert captured.err == (
    "warning: the train arguments name gs:// URLs and this Python has no gcsfs; the job's environment (--setup, or "
    'the python on the PATH sbatch passes on) needs pip install -e ".[gcs]".\n'
  )
  assert captured.out.splitlines()[-1] == f"sbatch {out_file}"
  assert not out_file.exists()


def test_slurm_dry_run_prints_script_and_submits_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  slurm.main(["--nodes=2", "--gpus_per_node=8", "--dry-run", "--", f"--workdir={workdir}"])
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"# {workdir}/launch.sbatch"
  assert out[1] == "#!/bin/bash"
  assert f"srun python -m lra_core.train --workdir={workdir} --distributed=on &" in out
  assert out[-1] == f"sbatch {workdir}/launch.sbatch"
  assert not workdir.exists()


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--gpus_per_node=8", "--", "--workdir=w"], "required: --nodes"),
    (["--nodes=2", "--", "--workdir=w"], "required: --gpus_per_node"),
    (["--nodes=2", "--gpus_per_node=8"], "no train arguments"),
    (["--nodes=0", "--gpus_per_node=8", "--", "--workdir=w"], "at least 1"),
    (["--nodes=2", "--gpus_per_node=8", "--", "--workdir=w", "--distributed=off"], "leave --distributed out"),
    (["--nodes=2", "--gpus_per_node=8", "--signal_seconds=-1", "--", "--workdir=w"], "must not be negative"),
  ],
)
def test_slurm_errors(argv, message, capsys):
  with pytest.raises(SystemExit):
    slurm.parse_args(argv)
  assert message in capsys.readouterr().err


FAKE_SRUN = """#!/bin/bash
# A stand-in for srun: a training run of FAKE_SECONDS that, on SIGTERM, takes a moment to save and exits 75.
echo "$*" > "$FAKE_DIR/srun.args"
on_term() {
  echo TERM >> "$FAKE_DIR/events"
  kill "$sleeper" 2>/dev/null
  sleep 0.5
  echo saved >> "$FAKE_DIR/events"
  exit 75
}
trap on_term TERM
touch "$FAKE_DIR/srun.started"
sleep "$FAKE_SECONDS" & sleeper=$!
wait "$sleeper"
echo finished >> "$FAKE_DIR/events"
exit "$FAKE_EXIT"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/events"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
  "flags, signal, exit_code, status, events",
  [
    (["--requeue"], True, 0, 75, ["TERM", "saved", "scontrol requeue 4242"]),
    ([], True, 0, 75, ["TERM", "saved"]),
    (["--requeue"], False, 0, 0, ["finished"]),
    (["--requeue"], False, 3, 3, ["finished"]),
    # preempted by a SIGTERM that did not come through the script (the trainer saved, exit 75): requeued
    (["--requeue"], False, 75, 75, ["finished", "scontrol requeue 4242"]),
  ],
)
def test_slurm_script_stops_the_run_and_requeues_on_usr1(flags, signal, exit_code, status, events, tmp_path):
  """The rendered script under bash, srun and scontrol faked: USR1 (what SLURM sends before the time
  limit) reaches the run as SIGTERM, the script waits for the run to save, then requeues the job."""
  fake = tmp_path / "bin"
  fake.mkdir()
  for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
    (fake / name).write_text(text)
    (fake / name).chmod(0o755)
  script = tmp_path / "job.sbatch"
  script.write_text(
    slurm.render(
      slurm.parse_args(["--nodes=1", "--gpus_per_node=2", *flags, "--", "--workdir=/shared/run", "--config.x=a b"])
    )
  )
  env = {
    **os.environ,
    "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
    "FAKE_DIR": str(fake),
    "SLURM_JOB_ID": "4242",
    "FAKE_SECONDS": "30" if signal else "0.2",
    "FAKE_EXIT": str(exit_code),
  }
  job = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
  try:
    if signal:
      deadline = time.monotonic() + 20
      while not (fake / "srun.started").exists():
        assert time.monotonic() < deadline and job.poll() is None, "the fake srun did not start"
        time.sleep(0.05)
      job.send_signal(signal_lib.SIGUSR1)
    _, err = job.communicate(timeout=30)
  finally:
    job.kill()
  assert job.returncode == status
  assert (fake / "events").read_text().splitlines() == events
  assert (fake / "srun.args").read_text() == (
    "python -m lra_core.train --workdir=/shared/run --config.x=a b --distributed=on\n"
  )
  assert ("USR1: the time limit is near" in err) == signal


def test_docs_dry_run_examples_print_what_the_launchers_print():
  """Every `$ python scripts/launch_*.py ... --dry-run` block of docs/launching.md, run as written."""
  text = (PROJECT_ROOT / "docs" / "launching.md").read_text()
  blocks = re.findall(r"```\n(\$ python scripts/launch_.*?)```", text, re.S)
  assert len(blocks) == 4
  for block in blocks:
    lines = block.splitlines()
    end = next(i for i, line in enumerate(lines) if not line.endswith("\\"))
    argv = shlex.split(" ".join(line.removeprefix("$ ").removesuffix("\\") for line in lines[: end + 1]))
    assert argv[0] == "python" and "--dry-run" in argv
    done = subprocess.run(
      [sys.executable, *argv[1:]],
      capture_output=True,
      text=True,
      cwd=PROJECT_ROOT,
      timeout=60,
      env={**os.environ, "TMPDIR": "/tmp"},
    )  # the tarball's folder in the printed commands
    assert done.returncode == 0, done.stderr
    assert done.stdout == "\n".join(lines[end + 1 :]) + "\n", argv[1]


def test_the_launchers_read_the_trainers_preempted_exit_status():
  assert tpu.EXIT_PREEMPTED == slurm.EXIT_PREEMPTED == cli.EXIT_PREEMPTED
