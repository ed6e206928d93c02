"""scripts/launch_gke.py writes the exact JobSet it documents (no cluster needed): the manifest is
compared whole, read back by a YAML parser, and printed by --dry-run (docs/launching.md's example runs
in tests/test_launchers.py)."""

import argparse
import subprocess
import sys

import pytest
from test_launchers import load

from lra_core import cli
from lra_core.config import PROJECT_ROOT

gke = load("launch_gke")
TRAIN = ["--config=configs/pg19/transformer.py:flash,plusplus", "--workdir=gs://bucket/runs/pg19"]


def args(**kw):
  values = dict(name="pg19", topology="v5e:4x4", slices=2, image="img:1", namespace="research", max_restarts=20)
  return argparse.Namespace(**(values | kw))


def test_two_slices_of_a_multi_host_v5e_slice_make_this_jobset():
  pod_index = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
  assert gke.manifest(args(), TRAIN) == {
    "apiVersion": "jobset.x-k8s.io/v1alpha2",
    "kind": "JobSet",
    "metadata": {
      "name": "pg19",
      "namespace": "research",
      "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
    },
    "spec": {
      "failurePolicy": {
        "maxRestarts": 20,
        "rules": [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
      },
      "replicatedJobs": [
        {
          "name": "slice",
          "replicas": 2,
          "template": {
            "spec": {
              "parallelism": 4,  # 16 chips, 4 a host
              "completions": 4,
              "completionMode": "Indexed",
              "backoffLimit": 0,
              "podFailurePolicy": {
                "rules": [
                  {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}}
                ]
              },
              "template": {
                "spec": {
                  "restartPolicy": "Never",
                  "hostNetwork": True,
                  "dnsPolicy": "ClusterFirstWithHostNet",
                  "nodeSelector": {
                    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                    "cloud.google.com/gke-tpu-topology": "4x4",
                  },
                  "containers": [
                    {
                      "name": "trainer",
                      "image": "img:1",
                      "command": [
                        "python",
                        "-m",
                        "lra_core.train",
                        *TRAIN,
                        "--distributed=on",
                        "--config.mesh.slices=2",
                      ],
                      "env": [
                        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": "pg19-slice-0-0.pg19"},
                        {"name": "MEGASCALE_NUM_SLICES", "value": "2"},
                        {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": pod_index}}},
                      ],
                      "resources": {"limits": {"google.com/tpu": 4}},
                      "securityContext": {"privileged": True},
                    }
                  ],
                }
              },
            }
          },
        }
      ],
    },
  }


@pytest.mark.parametrize(
  "topology, label, hosts, chips",
  [("v5e:2x4", "tpu-v5-lite-podslice", 1, 8), ("v5p:2x2x2", "tpu-v5p-slice", 2, 4), ("v6e:2x2", "tpu-v6e-slice", 1, 4)],
)
def test_one_slice_has_no_megascale_settings_and_a_host_per_pod(topology, label, hosts, chips):
  job = gke.manifest(args(topology=topology, slices=1), [*TRAIN, "--config.mesh.slices=1"])["spec"]["replicatedJobs"][0]
  spec = job["template"]["spec"]
  container = spec["template"]["spec"]["containers"][0]
  assert job["replicas"] == 1 and spec["parallelism"] == spec["completions"] == hosts
  assert spec["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == label
  assert container["resources"]["limits"]["google.com/tpu"] == chips and container["env"] == []
  assert container["command"][-2:] == ["--config.mesh.slices=1", "--distributed=on"]  # the user's setting stands


def test_the_printed_manifest_reads_back_as_the_same_jobset():
  yaml = pytest.importorskip("yaml")
  manifest = gke.manifest(args(), TRAIN)
  assert yaml.safe_load(gke.to_yaml(manifest)) == manifest


def test_dry_run_prints_a_jobset_kubectl_can_read_and_runs_nothing():
  yaml = pytest.importorskip("yaml")
  done = subprocess.run(
    [sys.executable, "scripts/launch_gke.py", "--name=pg19", "--topology=v5e:4x4", "--slices=2", "--image=img:1"]
    + ["--dry-run", "--", *TRAIN],
    capture_output=True,
    text=True,
    cwd=PROJECT_ROOT,
    timeout=60,
  )
  assert done.returncode == 0, done.stderr
  assert yaml.safe_load(done.stdout)["kind"] == "JobSet"  # the commands are YAML comments
  assert "# apply the JobSet: kubectl --namespace default apply -f -" in done.stdout


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--topology=v3:2x2"], "expected <generation>:<chips per side>"),
    (["--topology=v5p:2x2x1", "--slices=0"], "--slices must be at least 1"),
    (["--topology=v5e:4x4"], "give the train arguments after `--`"),
  ],
)
def test_bad_launcher_arguments_are_one_line_and_status_2(argv, message):
  rest = [] if "`--`" in message else ["--", *TRAIN]
  done = subprocess.run(
    [sys.executable, "scripts/launch_gke.py", "--name=x", "--image=i", "--dry-run", *argv, *rest],
    capture_output=True,
    text=True,
    cwd=PROJECT_ROOT,
    timeout=60,
  )
  assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_jobset_fails_at_once_on_the_trainers_user_error_status():
  assert gke.EXIT_USER_ERROR == cli.EXIT_USER_ERROR
