"""scripts/launch_tpu.py and scripts/launch_slurm.py build the exact commands they document.

Dry runs only: neither gcloud nor sbatch is needed. The remote shell commands of the TPU
launcher's copy step are also run here, with bash and a temporary HOME, on a throwaway repo.
"""

import importlib.util
import shutil
import subprocess
import sys
import tarfile

import pytest

from lra_core.config import PROJECT_ROOT


def load(name):
  spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


tpu = load("launch_tpu")
slurm = load("launch_slurm")

TRAIN = ["--config=configs/lra/listops/transformer.py", "--workdir=/mnt/shared/runs/listops",
         "--config.optim.lr=4e-4", "--config.data.dir=/mnt/data/list ops"]
TRAIN_QUOTED = ("--config=configs/lra/listops/transformer.py --workdir=/mnt/shared/runs/listops "
                "--config.optim.lr=4e-4 '--config.data.dir=/mnt/data/list ops' --distributed=on")
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
      ("run", SSH + ("--command=mkdir -p ~/lra_core && tar -xzf ~/lra_core-code.tar.gz -C ~/lra_core "
                     "&& rm ~/lra_core-code.tar.gz",)),
      ("run", SSH + ('--command=cd ~/lra_core && python3 -m pip install -e ".[tpu]"',)),
      ("run", SSH + (f"--command=cd ~/lra_core && python3 -m lra_core.train {TRAIN_QUOTED}",)),
  ]
  assert got[2].path == tarball


def test_tpu_git_spot_project_setup_and_remote_dir():
  got = steps("--project=my-proj", "--spot", "--version=v2-alpha-tpuv5-lite", "--code=git",
              "--repo=https://example.org/lra_core.git", "--branch=dev", "--remote_dir=/opt/my code",
              "--extra=", "--setup=source ~/venv/bin/activate")
  where = ("--zone=us-central2-b", "--project=my-proj")
  ssh = TPU + ("ssh", "lra-v4") + where + ("--worker=all",)
  assert [s.argv for s in got] == [
      TPU + ("describe", "lra-v4") + where + ("--format=value(state)",),
      TPU + ("create", "lra-v4") + where + ("--accelerator-type=v4-32", "--version=v2-alpha-tpuv5-lite", "--spot"),
      ssh + ("--command=if [ -d '/opt/my code'/.git ]; then cd '/opt/my code' && git fetch && git checkout dev "
             "&& git pull; else git clone --branch dev https://example.org/lra_core.git '/opt/my code'; fi",),
      ssh + ("--command=source ~/venv/bin/activate && cd '/opt/my code' && python3 -m pip install -e .",),
      ssh + (f"--command=source ~/venv/bin/activate && cd '/opt/my code' && python3 -m lra_core.train "
             f"{TRAIN_QUOTED}",),
  ]


@pytest.mark.parametrize("argv, message", [
    (["--zone=z", "--accelerator_type=v4-8", "--", "--workdir=w"], "required: --name"),
    (["--name=n", "--accelerator_type=v4-8", "--", "--workdir=w"], "required: --zone"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8"], "no train arguments"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--"], "no train arguments"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--code=git", "--", "--workdir=w"], "needs --repo"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--extra=tpu;rm", "--", "--workdir=w"], "--extra"),
    (["--name=n", "--zone=z", "--accelerator_type=v4-8", "--", "--distributed=off"], "leave --distributed out"),
])
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
  assert out[3] == ("gcloud compute tpus tpu-vm create lra-v4 --zone=us-central2-b --accelerator-type=v4-32 "
                    "--version=tpu-ubuntu2204-base")
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


@pytest.mark.parametrize("probe, ran_create, error", [
    (subprocess.CompletedProcess([], 0, "READY\n"), False, None),
    (subprocess.CompletedProcess([], 1, ""), True, None),
    (subprocess.CompletedProcess([], 0, "PREEMPTED\n"), False, "is PREEMPTED, not READY"),
])
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


def test_tpu_remote_path_keeps_tilde_outside_quotes():
  assert tpu.remote_path("~/lra_core") == "~/lra_core"
  assert tpu.remote_path("~/my code") == "~/'my code'"
  assert tpu.remote_path("/srv/x") == "/srv/x"


SLURM_EXAMPLE = ["--nodes=2", "--gpus_per_node=8", "--cpus_per_task=8", "--time=24:00:00",
                 "--chdir=/shared/lra_core", "--setup=source /shared/lra_core/.venv/bin/activate", "--",
                 "--config=configs/enwik8/transformer_vq.py", "--config.data.dir=/shared/data/enwik8",
                 "--workdir=/shared/runs/enwik8_vq"]
SLURM_SRUN = ("srun python -m lra_core.train --config=configs/enwik8/transformer_vq.py "
              "--config.data.dir=/shared/data/enwik8 --workdir=/shared/runs/enwik8_vq --distributed=on")


def test_slurm_script_lines_and_srun_command():
  lines = slurm.render(slurm.parse_args(SLURM_EXAMPLE)).splitlines()
  assert lines[0] == "#!/bin/bash"
  assert [line for line in lines if line.startswith("#SBATCH")] == [
      "#SBATCH --job-name=lra_core", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
      "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=8", "#SBATCH --time=24:00:00",
      "#SBATCH --output=/shared/runs/enwik8_vq/slurm-%j.out", "#SBATCH --chdir=/shared/lra_core"]
  assert lines[-3:] == ["set -e", "source /shared/lra_core/.venv/bin/activate", SLURM_SRUN]


def test_slurm_static_example_is_what_the_launcher_renders():
  static = (PROJECT_ROOT / "scripts" / "slurm" / "train.sbatch").read_text()
  assert static == slurm.render(slurm.parse_args(SLURM_EXAMPLE))
  assert SLURM_SRUN in static.splitlines()


def test_slurm_optional_lines_quoting_and_script_path(tmp_path):
  args = slurm.parse_args(["--nodes=1", "--gpus_per_node=4", "--partition=gpu", "--account=lab", "--job_name=vq",
                           f"--chdir={tmp_path}", "--", "--workdir", "runs/a", "--config.data.dir=/data/a b"])
  lines = slurm.render(args).splitlines()
  assert "#SBATCH --partition=gpu" in lines and "#SBATCH --account=lab" in lines
  assert "#SBATCH --output=runs/a/slurm-%j.out" in lines  # relative to --chdir
  assert not any(line.startswith(("#SBATCH --time", "#SBATCH --cpus-per-task")) for line in lines)
  assert lines[-1] == "srun python -m lra_core.train --workdir runs/a '--config.data.dir=/data/a b' --distributed=on"
  assert slurm.script_path(args) == tmp_path / "runs/a" / "launch.sbatch"
  with pytest.raises(SystemExit, match="cut at its whitespace"):
    slurm.render(slurm.parse_args(["--nodes=1", "--gpus_per_node=1", "--", "--workdir=runs/a b"]))
  args = slurm.parse_args(["--nodes=1", "--gpus_per_node=1", f"--script_out={tmp_path}/s.sbatch", "--", "--x=1"])
  assert slurm.script_path(args) == tmp_path / "s.sbatch"
  assert "#SBATCH --output=slurm-%j.out" in slurm.render(args).splitlines()


def test_slurm_dry_run_prints_script_and_submits_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  slurm.main(["--nodes=2", "--gpus_per_node=8", "--dry-run", "--", f"--workdir={workdir}"])
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"# {workdir}/launch.sbatch"
  assert out[1] == "#!/bin/bash"
  assert f"srun python -m lra_core.train --workdir={workdir} --distributed=on" in out
  assert out[-1] == f"sbatch {workdir}/launch.sbatch"
  assert not workdir.exists()


@pytest.mark.parametrize("argv, message", [
    (["--gpus_per_node=8", "--", "--workdir=w"], "required: --nodes"),
    (["--nodes=2", "--", "--workdir=w"], "required: --gpus_per_node"),
    (["--nodes=2", "--gpus_per_node=8"], "no train arguments"),
    (["--nodes=0", "--gpus_per_node=8", "--", "--workdir=w"], "at least 1"),
    (["--nodes=2", "--gpus_per_node=8", "--", "--workdir=w", "--distributed=off"], "leave --distributed out"),
])
def test_slurm_errors(argv, message, capsys):
  with pytest.raises(SystemExit):
    slurm.parse_args(argv)
  assert message in capsys.readouterr().err
