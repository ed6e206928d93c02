"""scripts/plot.py draws curves from metrics.jsonl files."""

import importlib.util
import json
import sys

import pytest

from lra_core import cli
from lra_core.config import PROJECT_ROOT
from lra_core.errors import ConfigError, DataError

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


def test_each_run_keeps_its_colour_in_every_panel_and_is_named_once(tmp_path):
  write_run(tmp_path / "a", [3.0, 2.0, 1.5])
  write_run(tmp_path / "b", [3.2, 2.5, 2.0])
  (tmp_path / "c").mkdir()  # logged only val_accuracy: absent from the train_loss panel
  (tmp_path / "c" / "metrics.jsonl").write_text(
    '{"step": 10, "val_accuracy": 0.4}\n{"step": 20, "val_accuracy": 0.6}\n'
  )
  runs = [str(tmp_path / name) for name in "abc"]
  fig = plot.figure({w: plot.curves(w) for w in runs}, ["train_loss", "val_accuracy"])
  loss, accuracy = fig.axes[:2]
  assert [len(loss.lines), len(accuracy.lines)] == [2, 3]
  colours = [line.get_color() for line in accuracy.lines]
  assert len(set(colours)) == 3
  assert [line.get_color() for line in loss.lines] == colours[:2]  # a and b as in the other panel
  assert all(ax.get_legend() is None for ax in fig.axes)
  (legend,) = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "c"]
  assert [h.get_color() for h in legend.legend_handles] == colours
  plot.pyplot().close(fig)
  assert plot.labels(["runs/x/seed", "other/seed"]) == ["runs/x/seed", "other/seed"]


def test_plot_refuses_empty_workdir(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(DataError, match="no metrics.jsonl"):
    plot.plot([str(tmp_path / "empty")], None, str(tmp_path / "x.png"))


def test_a_metric_no_workdir_logged_is_one_sentence_naming_the_nearest(tmp_path):
  write_run(tmp_path / "a", [3.0, 2.0, 1.5])
  with pytest.raises(ConfigError, match=r"^no workdir logged 'train_losss'; did you mean 'train_loss'\? they logged"):
    plot.plot([str(tmp_path / "a")], ["train_losss"], str(tmp_path / "x.png"))
  assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_command_is_one_sentence(tmp_path, capsys, monkeypatch):
  write_run(tmp_path / "a", [3.0, 2.0, 1.5])
  plot.pyplot.cache_clear()
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it fails as when it is not installed
  with pytest.raises(SystemExit) as exit_:
    cli.run(lambda: plot.main([str(tmp_path / "a"), f"--out={tmp_path / 'x.png'}"]))
  plot.pyplot.cache_clear()
  err = capsys.readouterr().err
  assert exit_.value.code == cli.EXIT_USER_ERROR and "Traceback" not in err
  assert err.startswith("error: matplotlib is not installed; install the plot extra")


def test_long_run_names_stay_inside_the_figure(tmp_path):
  runs = []
  for i in range(4):
    run = tmp_path / f"sweep_optim.lr=1e-3_model.num_layers={i}_model.d_model=256_train.seed={i}"
    write_run(run, [3.0, 2.0, 1.5])
    runs.append(str(run))
  fig = plot.figure({w: plot.curves(w) for w in runs}, ["train_loss"])
  fig.canvas.draw()
  box, legend = fig.bbox, fig.legends[0].get_window_extent()
  assert box.x0 <= legend.x0 and legend.x1 <= box.x1, (legend, box)
  plot.pyplot().close(fig)
