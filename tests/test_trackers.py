"""lra_core.run.trackers: the no-op tracker, the sentence for a missing package, and W&B (offline) and
Trackio (its local database) runs, read back from what they wrote.

Each tracked run is a fresh process, as a resumed training run is: W&B and Trackio read their
settings from the environment once per process. The environment keeps them off the network (W&B
offline, the Hugging Face Hub offline, no Space or server) and their files under tmp_path.
"""

import glob
import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from lra_core.config import load_config
from lra_core.errors import MissingExtra
from lra_core.run import trackers
from lra_core.run.metrics import read_metrics

SPEC = "configs/lra/listops/transformer.py:tiny"
PROJECT = "lra-test"

# One tracked run: the calls the trainer makes, at steps START and START+1.
RUN = f"""
import sys
import numpy as np
from lra_core.config import load_config
from lra_core.run.trackers import make_tracker

kind, workdir, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = load_config({SPEC!r}, [f"train.tracker={{kind}}", "train.tracker_project={PROJECT}"])
tracker = make_tracker(config, workdir, enabled=True)
tracker.log_config(config.to_dict())
for step in (start, start + 1):
  tracker.log(step, {{"train_loss": 1.0 / step, "lr": np.float32(0.5), "tokens": np.int64(7 * step),
                     "label": "ignored", "hist": [1, 2]}})
tracker.log_images(start + 1, "samples", np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3))
tracker.close()
"""

IMAGES = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)


def offline_env(tmp_path: pathlib.Path) -> dict:
  """os.environ with both trackers kept local and off the network."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("WANDB_", "TRACKIO_")) and k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
  }
  home = tmp_path / "home"
  env.update(
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    WANDB_DISABLE_CODE="true",
    WANDB_DISABLE_GIT="true",
    WANDB_CONFIG_DIR=str(home / "wandb_config"),
    WANDB_CACHE_DIR=str(home / "wandb_cache"),
    WANDB_DATA_DIR=str(home / "wandb_data"),
    WANDB_ARTIFACT_DIR=str(home / "wandb_artifacts"),
    TRACKIO_DIR=str(tmp_path / "trackio"),
    HF_HOME=str(home / "hf"),
    HF_HUB_OFFLINE="1",
    HF_HUB_DISABLE_TELEMETRY="1",
    JAX_PLATFORMS="cpu",
  )
  return env


def python(env: dict, *args: str) -> str:
  proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def config(tracker: str):
  return load_config(SPEC, [f"train.tracker={tracker}"])


def test_the_none_tracker_does_nothing(tmp_path):
  tracker = trackers.make_tracker(config("none"), str(tmp_path / "run"), enabled=True)
  assert type(tracker) is trackers.Tracker
  tracker.log_config({"a": 1})
  tracker.log(1, {"train_loss": 0.5})
  tracker.log_images(1, "samples", IMAGES)
  tracker.close()
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["wandb", "trackio"])
@pytest.mark.parametrize("enabled", [True, False])
def test_a_missing_package_names_its_extra(kind, enabled, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, kind, None)  # `import wandb` now fails as if it were not installed
  sentence = rf'^{kind} is not installed; install the {kind} extra: pip install -e "\.\[{kind}\]"\.$'
  with pytest.raises(MissingExtra, match=sentence):  # on every process, not only the tracking one
    trackers.make_tracker(config(kind), str(tmp_path / "run"), enabled=enabled)


def test_other_processes_get_the_no_op_tracker(tmp_path):
  for kind in ("wandb", "trackio"):
    assert type(trackers.make_tracker(config(kind), str(tmp_path / "run"), enabled=False)) is trackers.Tracker
  assert not any(tmp_path.iterdir())


def test_metrics_and_images_are_normalized():
  assert trackers.scalars(
    {
      "a": np.float32(0.5),
      "b": np.int64(3),
      "c": np.array(2.0),
      "d": "x",
      "e": [1],
      "f": np.zeros(2),
      "g": float("nan"),
    }
  ) == {"a": 0.5, "b": 3, "c": 2.0, "g": pytest.approx(np.nan, nan_ok=True)}
  assert [i.shape for i in trackers.image_list(np.zeros((2, 5, 6, 1), np.uint8))] == [(5, 6), (5, 6)]
  assert [i.shape for i in trackers.image_list(np.zeros((5, 6, 3), np.uint8))] == [(5, 6, 3)]
  for bad in (np.zeros((5, 6, 3)), np.zeros((5, 6), np.uint8), np.zeros((1, 5, 6, 2), np.uint8)):
    with pytest.raises(ValueError, match="images must be uint8"):
      trackers.image_list(bad)
  grid = trackers.tile(trackers.image_list(np.ones((3, 4, 5, 3), np.uint8)))
  assert grid.shape == (2 * 5 + 1, 2 * 6 + 1, 3)
  assert (grid[1:5, 1:6] == 1).all() and (grid[0] == 255).all() and (grid[6:10, 7:12] == 255).all()


def wandb_records(path: pathlib.Path) -> list:
  """The protobuf records of a .wandb file: W&B's transaction log, which `wandb sync` uploads.
  It is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of chunks, each with a
  7-byte header (checksum, length, kind: 1 whole record, 2 first, 3 middle, 4 last part)."""
  from wandb.proto import wandb_internal_pb2

  data, block, records, parts, pos = path.read_bytes(), 32768, [], b"", 7
  assert data[:4] == b":W&B"
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if kind == 0:
      break
    parts += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(parts))
      parts = b""
  return records


def key(item) -> str:
  """The name of a W&B history or config item (a flat key, or the parts of a nested one)."""
  return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_is_read_back_and_resumed(tmp_path):
  env = offline_env(tmp_path)
  workdir = tmp_path / "runs" / "listops-tiny"
  python(env, "-c", RUN, "wandb", str(workdir), "1")
  python(env, "-c", RUN, "wandb", str(workdir), "3")  # the run resumed: the same W&B run goes on
  folders = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*")))
  assert len(folders) == 2  # W&B keeps one folder per process; `wandb sync` joins them by id
  histories = []
  for folder in map(pathlib.Path, folders):
    records = {}
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
      records.setdefault(record.WhichOneof("record_type"), []).append(record)
    run = records["run"][0].run
    assert (run.run_id, run.display_name, run.project) == (trackers.run_id(str(workdir)), "listops-tiny", PROJECT)
    config = {key(item): json.loads(item.value_json) for r in records["config"] for item in r.config.update}
    assert config["train"]["tracker"] == "wandb" and config["model"]["num_layers"] >= 1
    rows = [{key(item): json.loads(item.value_json) for item in r.history.item} for r in records["history"]]
    histories.append([{k: v for k, v in row.items() if not k.startswith("_")} for row in rows])
    files = sorted((folder / "files").glob("media/images/samples_*.png"))
    assert sorted(np.asarray(Image.open(f)).tobytes() for f in files) == sorted(i.tobytes() for i in IMAGES)
  for history, start in zip(histories, (1, 3)):
    image = history[2]
    assert history[:2] == [
      {"step": s, "train_loss": pytest.approx(1 / s), "lr": 0.5, "tokens": 7 * s} for s in (start, start + 1)
    ]
    assert (image["step"], image["samples/count"], image["samples/_type"]) == (start + 1, 2, "images/separated")


def test_trackio_local_run_is_read_back_and_resumed(tmp_path):
  env = offline_env(tmp_path)
  workdir = tmp_path / "runs" / "listops-tiny"
  python(env, "-c", RUN, "trackio", str(workdir), "1")
  python(env, "-c", RUN, "trackio", str(workdir), "3")
  read = (
    "import json, sys, trackio\n"
    "from trackio.sqlite_storage import SQLiteStorage\n"
    "runs = trackio.Api().runs(sys.argv[1])\n"
    "print(json.dumps([dict(name=r.name, config=r.config,"
    " logs=SQLiteStorage.get_logs(sys.argv[1], r.name, run_id=r.id)) for r in runs], default=str))\n"
  )
  (run,) = json.loads(python(env, "-c", read, PROJECT))  # one run: the second process resumed it
  assert run["name"] == f"listops-tiny-{trackers.run_id(str(workdir))[:6]}"
  assert run["config"]["train"]["tracker"] == "trackio" and run["config"]["model"]["num_layers"] >= 1
  logs = [{k: v for k, v in log.items() if k != "timestamp"} for log in run["logs"]]
  scalars = [log for log in logs if "train_loss" in log]
  assert scalars == [{"step": s, "train_loss": pytest.approx(1 / s), "lr": 0.5, "tokens": 7 * s} for s in (1, 2, 3, 4)]
  images = [log for log in logs if "samples" in log]
  assert [(log["step"], log["samples"]["_type"]) for log in images] == [(2, "trackio.image"), (4, "trackio.image")]
  for log in images:
    grid = np.asarray(Image.open(tmp_path / "trackio" / "media" / log["samples"]["file_path"]).convert("RGB"))
    np.testing.assert_array_equal(grid, trackers.tile(list(IMAGES)))


@pytest.mark.slow
def test_a_training_run_mirrors_its_metrics_to_wandb(tmp_path):
  env = offline_env(tmp_path)
  workdir = tmp_path / "run"
  python(
    env,
    "-m",
    "lra_core.train",
    f"--config={SPEC}",
    "--config.train.tracker=wandb",
    f"--config.train.tracker_project={PROJECT}",
    f"--config.data.cache_dir={tmp_path / 'cache'}",
    f"--workdir={workdir}",
  )
  (folder,) = glob.glob(str(workdir / "wandb" / "offline-run-*"))
  records = {}
  for record in wandb_records(next(pathlib.Path(folder).glob("run-*.wandb"))):
    records.setdefault(record.WhichOneof("record_type"), []).append(record)
  config = {key(item): json.loads(item.value_json) for r in records["config"] for item in r.config.update}
  assert config["train"]["tracker"] == "wandb"
  rows = [{key(item): json.loads(item.value_json) for item in r.history.item} for r in records["history"]]
  tracked = [(row["step"], row["train_loss"]) for row in rows if "train_loss" in row]
  logged = [(r["step"], r["train_loss"]) for r in read_metrics(workdir) if "train_loss" in r]
  assert tracked == [(s, pytest.approx(v)) for s, v in logged] and len(logged) == 4  # tiny: every step of 4
  assert any("mfu" in row for row in rows)
