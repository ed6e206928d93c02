"""Plot metric curves of one or more workdirs to a PNG.

  python scripts/plot.py runs/a runs/b --metrics=train_loss,val_accuracy --out=curves.png

One panel per metric, one line per workdir (labelled by its folder name), x = step. Without
--metrics, every metric that any workdir logged more than once is drawn.
"""

from __future__ import annotations

import argparse
import math
import pathlib

from lra_core.errors import optional_import
from lra_core.metrics import read_metrics

optional_import("matplotlib", "plot").use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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


def plot(workdirs: list[str], metrics: list[str] | None, out: str) -> list[str]:
  """Draws the curves; returns the metrics drawn."""
  data = {str(w): curves(w) for w in workdirs}
  missing = [w for w, c in data.items() if not c]
  if missing:
    raise SystemExit(f"error: no metrics.jsonl with numbers in {', '.join(missing)}.")
  if not metrics:
    metrics = sorted({k for c in data.values() for k, (s, _) in c.items() if len(s) > 1})
  if not metrics:
    raise SystemExit("error: no metric was logged more than once; name some with --metrics.")
  cols = min(3, len(metrics))
  rows = math.ceil(len(metrics) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
  for ax, metric in zip(axes.flat, metrics):
    for workdir, c in data.items():
      if metric in c:
        steps, values = c[metric]
        ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=pathlib.Path(workdir).name)
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(metrics) :]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return metrics


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--metrics", default="", help="comma-separated metric names")
  parser.add_argument("--out", default="curves.png")
  args = parser.parse_args(argv)
  drawn = plot(args.workdirs, [m for m in args.metrics.split(",") if m], args.out)
  print(f"wrote {args.out} ({', '.join(drawn)})")


if __name__ == "__main__":
  main()
