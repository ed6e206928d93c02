"""Plot metric curves of one or more workdirs to a PNG.

  python scripts/plot.py runs/a runs/b --metrics=train_loss,val_accuracy --out=curves.png

One panel per metric, one line per workdir, x = step. Each workdir keeps its colour in every panel
and is named once, in a legend above the panels (by its folder name, or its path where two folder
names are the same). Without --metrics, every metric that any workdir logged more than once is drawn.
"""

from __future__ import annotations

import difflib
import functools
import math
import pathlib

from lra_core import cli
from lra_core.errors import ConfigError, DataError, optional_import
from lra_core.run.metrics import read_metrics


@functools.cache
def pyplot():
  """matplotlib's pyplot drawing to files (Agg), or MissingExtra (one sentence) naming the plot extra."""
  optional_import("matplotlib", "plot").use("Agg")
  return optional_import("matplotlib.pyplot", "plot")


def curves(workdir: str | pathlib.Path) -> dict[str, tuple[list[int], list[float]]]:
  """metric -> (steps, values) from a workdir's metrics.jsonl."""
  out: dict[str, tuple[list[int], list[float]]] = {}
  for record in read_metrics(workdir):
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        steps, values = out.setdefault(key, ([], []))
        steps.append(record["step"])
        values.append(float(value))
  return out


def labels(workdirs: list[str]) -> list[str]:
  """Folder names, or the paths as given where two folder names are the same."""
  names = [pathlib.Path(w).name or str(w) for w in workdirs]
  return names if len(set(names)) == len(names) else [str(w) for w in workdirs]


def figure(data: dict[str, dict], metrics: list[str]):
  """The panels of `metrics` for data (workdir -> curves): one colour per workdir, one legend."""
  plt = pyplot()
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colours = {w: palette[i % len(palette)] for i, w in enumerate(data)}
  cols = min(3, len(metrics))
  rows = math.ceil(len(metrics) / cols)
  names = labels(list(data))
  # At 8 points a character is about 0.07 inch, a legend key and its gap 0.5: the figure is at least as
  # wide as the widest name, and the legend takes as many columns as fit, so no name is cut off.
  widest = 0.07 * max(len(n) for n in names) + 0.5
  fig, axes = plt.subplots(rows, cols, figsize=(max(4.5 * cols, widest + 0.2), 3.2 * rows + 0.4), squeeze=False)
  for ax, metric in zip(axes.flat, metrics):
    for workdir, c in data.items():
      if metric in c:
        steps, values = c[metric]
        ax.plot(steps, values, color=colours[workdir], marker="." if len(steps) < 30 else None)
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(metrics) :]:
    ax.axis("off")
  keys = [plt.Line2D([], [], color=colours[w]) for w in data]
  ncol = max(1, min(4, len(data), int(fig.get_figwidth() // widest)))
  fig.legend(keys, names, loc="upper center", ncol=ncol, fontsize=8, frameon=False)
  legend_rows = math.ceil(len(data) / ncol)
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 * legend_rows / fig.get_figheight()))
  return fig


def plot(workdirs: list[str], metrics: list[str] | None, out: str) -> list[str]:
  """Draws the curves; returns the metrics drawn."""
  data = {str(w): curves(w) for w in workdirs}
  missing = [w for w, c in data.items() if not c]
  if missing:
    raise DataError(f"no metrics.jsonl with numbers in {', '.join(missing)}.")
  logged = sorted({k for c in data.values() for k in c})
  unknown = [m for m in metrics or () if m not in logged]
  if unknown:
    near = difflib.get_close_matches(unknown[0], logged, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ConfigError(f"no workdir logged {unknown[0]!r}; {hint}they logged {', '.join(logged)}.")
  if not metrics:
    metrics = sorted({k for c in data.values() for k, (s, _) in c.items() if len(s) > 1})
  if not metrics:
    raise ConfigError("no metric was logged more than once; name some with --metrics.")
  fig = figure(data, metrics)
  fig.savefig(out, dpi=120)
  pyplot().close(fig)
  return metrics


def main(argv=None) -> None:
  parser = cli.doc_parser("python scripts/plot.py", __doc__)
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--metrics", default="", help="comma-separated metric names")
  parser.add_argument("--out", default="curves.png")
  args = parser.parse_args(argv)
  drawn = plot(args.workdirs, [m for m in args.metrics.split(",") if m], args.out)
  print(f"wrote {args.out} ({', '.join(drawn)})")


if __name__ == "__main__":
  cli.run(main)
