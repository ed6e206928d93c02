"""Launch a training run on TPU slices of a GKE cluster as a JobSet.

  python scripts/launch_gke.py --name=NAME --topology=v5e:4x4 [--slices=2] --image=IMAGE \
      [--namespace=default] [--max_restarts=20] [--dry-run] \
      -- --config=configs/... --workdir=gs://bucket/run [--config.<key>=<value> ...]

Everything after `--` goes to `python -m lra_core.train` unchanged, with `--distributed=on` added
(and `--config.mesh.slices=N` for several slices, unless given). The image must hold the project
installed with its `tpu` and `gcs` extras; the workdir must be a bucket (it outlives every pod).

The manifest (`manifest`, compared exactly by tests/test_launchers.py; --dry-run prints it):
  - one JobSet whose replicated job `slice` has --slices replicas, each an indexed Job of one pod
    per host of a --topology slice, one slice per node pool (JobSet's exclusive-topology annotation),
    on the nodes GKE labels with the slice's accelerator and topology (`cloud.google.com/gke-tpu-*`),
    each pod asking for its host's chips (`google.com/tpu`), on the host's network as the DCN
    collectives want;
  - for several slices, the MEGASCALE_* variables JAX's GKE cluster detection reads: the
    coordinator is the first pod of slice 0 (JobSet's DNS names), the slice id the Job's index;
    GKE's TPU webhook gives each pod TPU_WORKER_ID and TPU_WORKER_HOSTNAMES;
  - restarts as the trainer's exit statuses ask (docs/reliability.md): 75 (saved at a preemption
    notice) or a lost pod or node fails the Job and restarts the whole JobSet, at most --max_restarts
    times, and the run resumes from its last checkpoint; 2 (a bad config, data or workdir: one
    sentence) fails the Job by its pod failure policy, which fails the JobSet without a restart.

--dry-run prints the manifest and, as YAML comments, the commands. Without it the steps run one by
one (each an argv list, `steps`): `kubectl apply` of the manifest on stdin, a wait for process 0's pod,
and `kubectl logs -f` of it (process 0 logs the metrics), then the JobSet's final state. See
docs/launching.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

from launch_tpu import split_argv

EXIT_USER_ERROR = 2  # lra_core.cli.EXIT_USER_ERROR (tests/test_launchers.py checks that they agree)
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"
CONTAINER = "trainer"
# GKE's node label for each TPU generation (cloud.google.com/gke-tpu-accelerator), and the chips of a
# host in a slice of several hosts: GKE's TPU documentation, "Plan TPUs in GKE".
ACCELERATORS = {
  "v4": ("tpu-v4-podslice", 4),
  "v5e": ("tpu-v5-lite-podslice", 4),
  "v5p": ("tpu-v5p-slice", 4),
  "v6e": ("tpu-v6e-slice", 4),
}
# v5e and v6e slices of up to 8 chips are one host with all of them.
SINGLE_HOST = {"v5e": 8, "v6e": 8}


def slice_shape(topology: str) -> tuple[str, str, int, int]:
  """(node label, topology, chips per host, hosts) of a --topology slice such as v5e:4x4 or v5p:2x2x2."""
  generation, _, shape = topology.partition(":")
  if generation not in ACCELERATORS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
    raise ValueError(
      f"--topology={topology}: expected <generation>:<chips per side>, with generation one of "
      f"{', '.join(ACCELERATORS)} (e.g. v5e:4x4, v5p:2x2x2)."
    )
  label, per_host = ACCELERATORS[generation]
  chips = 1
  for side in shape.split("x"):
    chips *= int(side)
  if chips <= SINGLE_HOST.get(generation, 0):
    per_host = chips
  if chips % per_host:
    raise ValueError(f"--topology={topology}: {chips} chips do not fill hosts of {per_host}.")
  return label, shape, per_host, chips // per_host


def train_command(train_args: list[str], slices: int) -> list[str]:
  command = ["python", "-m", "lra_core.train", *train_args, "--distributed=on"]
  if slices > 1 and not any(a.startswith("--config.mesh.slices") for a in train_args):
    command.append(f"--config.mesh.slices={slices}")
  return command


def manifest(args: argparse.Namespace, train_args: list[str]) -> dict:
  label, shape, per_host, hosts = slice_shape(args.topology)
  env = []
  if args.slices > 1:
    env = [
      {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{args.name}-{REPLICATED_JOB}-0-0.{args.name}"},
      {"name": "MEGASCALE_NUM_SLICES", "value": str(args.slices)},
      {
        "name": "MEGASCALE_SLICE_ID",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}},
      },
    ]
  container = {
    "name": CONTAINER,
    "image": args.image,
    "command": train_command(train_args, args.slices),
    "env": env,
    "resources": {"limits": {"google.com/tpu": per_host}},
    "securityContext": {"privileged": True},  # the TPU runtime maps the chips' device files
  }
  pod = {
    "restartPolicy": "Never",
    "hostNetwork": True,
    "dnsPolicy": "ClusterFirstWithHostNet",
    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": label, "cloud.google.com/gke-tpu-topology": shape},
    "containers": [container],
  }
  job = {
    "parallelism": hosts,
    "completions": hosts,
    "completionMode": "Indexed",
    "backoffLimit": 0,
    "podFailurePolicy": {
      "rules": [
        {
          "action": "FailJob",
          "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [EXIT_USER_ERROR]},
        }
      ]
    },
    "template": {"spec": pod},
  }
  return {
    "apiVersion": JOBSET_API,
    "kind": "JobSet",
    "metadata": {
      "name": args.name,
      "namespace": args.namespace,
      "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
    },
    "spec": {
      # A Job failed by its pod failure policy (status 2) ends the JobSet; any other failure (75, a lost
      # pod or node) restarts every slice, as a multi-host JAX run cannot take one process back alone.
      "failurePolicy": {
        "maxRestarts": args.max_restarts,
        "rules": [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
      },
      "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": args.slices, "template": {"spec": job}}],
    },
  }


def to_yaml(value, indent: int = 0) -> str:
  """Block YAML of dicts, lists, strings, numbers and booleans; strings double-quoted (JSON's quoting
  is YAML's), so that no value is read as another type."""
  pad = " " * indent
  if isinstance(value, dict):
    if not value:
      return "{}"
    lines = []
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 2)}")
      else:
        lines.append(f"{pad}{key}: {to_yaml(item)}")
    return "\n".join(lines)
  if isinstance(value, list):
    if not value:
      return "[]"
    lines = []
    for item in value:
      text = to_yaml(item, indent + 2) if isinstance(item, (dict, list)) and item else to_yaml(item)
      lines.append(f"{pad}- {text.lstrip()}" if isinstance(item, (dict, list)) and item else f"{pad}- {text}")
    return "\n".join(lines)
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return str(value)
  return json.dumps(str(value), ensure_ascii=False)


def steps(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
  """(what, argv) of each command the launch runs; the first reads the manifest on stdin."""
  kubectl = ["kubectl", "--namespace", args.namespace]
  process_0 = (
    f"jobset.sigs.k8s.io/jobset-name={args.name},jobset.sigs.k8s.io/job-index=0,"
    "batch.kubernetes.io/job-completion-index=0"
  )
  return [
    ("apply the JobSet", [*kubectl, "apply", "-f", "-"]),
    ("wait for process 0's pod", [*kubectl, "wait", "--for=condition=Ready", "pod", "-l", process_0, "--timeout=30m"]),
    ("follow process 0's log", [*kubectl, "logs", "-f", "-l", process_0, "--tail=-1"]),
    ("the JobSet's final state", [*kubectl, "get", "jobset", args.name, "-o", "jsonpath={.status.terminalState}"]),
  ]


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python scripts/launch_gke.py",
    description="Writes the JobSet of a training run on TPU slices of a GKE cluster and applies it with kubectl.",
  )
  parser.add_argument("--name", required=True, help="the JobSet's name (also the pods' DNS domain)")
  parser.add_argument("--topology", required=True, help="one slice: <generation>:<shape>, e.g. v5e:4x4, v5p:2x2x2")
  parser.add_argument("--slices", type=int, default=1, help="slices joined over the data-center network")
  parser.add_argument("--image", required=True, help="a container image with lra_core installed (extras tpu, gcs)")
  parser.add_argument("--namespace", default="default")
  parser.add_argument(
    "--max_restarts", type=int, default=20, help="restarts of the whole JobSet (status 75, a lost pod)"
  )
  parser.add_argument("--dry-run", action="store_true", help="print the manifest and the commands; run nothing")
  return parser


def main(argv: list[str] | None = None) -> None:
  own, train_args = split_argv(sys.argv[1:] if argv is None else argv)
  parser = make_parser()
  args = parser.parse_args(own)
  if not train_args:
    parser.error("give the train arguments after `--` (at least --config and --workdir).")
  if args.slices < 1:
    parser.error(f"--slices must be at least 1, got {args.slices}.")
  try:
    text = to_yaml(manifest(args, train_args)) + "\n"
  except ValueError as e:
    parser.error(str(e))
  if args.dry_run:  # the manifest, and the commands as YAML comments: `--dry-run | kubectl apply -f -` works
    print(text, end="")
    for what, command in steps(args):
      print(f"# {what}: {' '.join(command)}")
    return
  for i, (what, command) in enumerate(steps(args)):
    print(f"# {what}", file=sys.stderr, flush=True)
    done = subprocess.run(command, input=text if i == 0 else None, text=True)
    if done.returncode and i < 2:
      sys.exit(done.returncode)


if __name__ == "__main__":
  main()
