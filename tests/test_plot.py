"""scripts/plot.py draws curves from metrics.jsonl files."""

import importlib.util
import json

import pytest

from lra_core.config import PROJECT_ROOT

spec = importlib.util.spec_from_file_location("plot", PROJECT_ROOT / "scripts" / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def write_run(folder, losses):
  folder.mkdir()
  lines = [json.dumps({"step": 10 * (i + 1), "train_loss": v, "note": "x"}) for i, v in enumerate(losses)]
  lines.append(json.dumps({"step": 30, "val_accuracy": 0.5}))
  (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_two_workdirs(tmp_path):
  write_run(tmp_path / "a", [3.0, 2.0, 1.5])
  write_run(tmp_path / "b", [3.2, 2.5, 2.0])
  assert plot.curves(tmp_path / "a")["train_loss"] == ([10, 20, 30], [3.0, 2.0, 1.5])
  out = tmp_path / "curves.png"
  drawn = plot.plot([str(tmp_path / "a"), str(tmp_path / "b")], None, str(out))
  assert drawn == ["train_loss"]  # logged once only: not drawn unless asked for
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert plot.plot([str(tmp_path / "a")], ["train_loss", "val_accuracy"], str(out)) == ["train_loss", "val_accuracy"]


def test_plot_refuses_empty_workdir(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(SystemExit, match="no metrics.jsonl"):
    plot.plot([str(tmp_path / "empty")], None, str(tmp_path / "x.png"))
