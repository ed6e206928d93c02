"""What every reproduced table shares: its context, its result, markdown, plots and training runs.

A table is a function `run(ctx: Context) -> Result` registered in `lra_core/reproduce/cli.py`. It reads
`ctx.full` to pick the paper's sizes (accelerators) or the default ones (a CPU in minutes),
`ctx.data_dir` for the tables that train on real data, and writes its scratch runs under
`ctx.workdir` and its plots through `save_plot`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import subprocess
from collections.abc import Callable, Sequence

from lra_core import train as train_lib
from lra_core.checkpoints.saved_config import upgrade_config
from lra_core.config import PROJECT_ROOT as ROOT
from lra_core.config import load_config
from lra_core.errors import DataError, optional_import
from lra_core.run.metrics import read_metrics


@dataclasses.dataclass
class Context:
  """Where and how big a table runs."""

  full: bool = False  # the paper's sizes instead of the CPU default
  data_dir: pathlib.Path | None = None  # the folder with enwik8/, c4/, lra/, imagenet64/ ...
  workdir: pathlib.Path = pathlib.Path("runs/reproduce")  # training runs, one folder each
  img_dir: pathlib.Path = ROOT / "docs" / "img"  # where plots are written
  log: Callable[[str], None] = print  # progress lines (stderr in the CLI)


@dataclasses.dataclass
class Result:
  """What a table prints: the setting, the markdown (paper beside ours), its plots and at most one
  comparison line. Why ours differs from the paper is not computed: it is the hand-written discussion
  under the table's section in docs/results.md, which --out leaves as it is."""

  setting: str  # a paragraph: models, sizes, what was timed or trained
  markdown: str  # one or more markdown tables
  plots: list[pathlib.Path] = dataclasses.field(default_factory=list)
  comparison: str = ""  # one line from the numbers, e.g. "ours / paper: 0.98x"

  def __post_init__(self) -> None:
    if "\n" in self.comparison.strip():
      raise ValueError(
        f"comparison {self.comparison!r} is more than one line; discussion belongs in "
        "docs/results.md, under the table's section."
      )


def commit() -> str:
  """The checked-out commit, with '+changes' when the work tree differs from it."""

  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

  head = git("rev-parse", "--short=10", "HEAD")
  if head.returncode != 0:
    return "unknown (not a git checkout)"
  dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  return head.stdout.strip() + ("+changes" if dirty else "")


def fmt(value: float | None, spec: str = ",.2f") -> str:
  """A number for a table cell; None and NaN become '-'."""
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "-"
  return format(value, spec)


def ratio(a: float | None, b: float | None) -> str:
  """'a / b' as '3.2x', or '-' where either is missing."""
  if not a or not b:
    return "-"
  return f"{a / b:.2f}x"


def data_path(ctx: Context, relative: str) -> pathlib.Path:
  """`ctx.data_dir / relative`, which must exist; else one sentence saying what to pass."""
  if ctx.data_dir is None:
    raise DataError(f"this table trains on real data: pass --data_dir=<folder with {relative}>.")
  path = pathlib.Path(ctx.data_dir) / relative
  if not path.exists():
    raise DataError(f"{path} does not exist; --data_dir must be the folder that holds {relative}.")
  return path


@functools.cache
def pyplot():
  """matplotlib's pyplot drawing to files (Agg), or MissingExtra naming the plot extra. Imported when a
  table first plots, not with this module: listing the tables, or a table without plots, needs no matplotlib."""
  optional_import("matplotlib", "plot").use("Agg")
  return optional_import("matplotlib.pyplot", "plot")


def figure(ncols: int = 1, nrows: int = 1, *, width: float = 5.0, height: float = 3.6):
  """A matplotlib figure and its axes (always a flat list)."""
  fig, axes = pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
  return fig, list(axes.flat)


def save_plot(ctx: Context, fig, name: str) -> pathlib.Path:
  """Writes `fig` to `ctx.img_dir/<name>.png` and closes it; returns the path."""
  ctx.img_dir.mkdir(parents=True, exist_ok=True)
  path = ctx.img_dir / f"{name}.png"
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot().close(fig)
  return path


def train(ctx: Context, name: str, spec: str, overrides: Sequence[str] = ()) -> dict:
  """Trains `spec` with `overrides` in `ctx.workdir/name` and returns the trainer's summary.

  A finished run with the same config is not trained again (the trainer resumes from its last
  checkpoint and re-evaluates); a different config in the same folder starts over.
  """
  config = load_config(spec, list(overrides))
  workdir = pathlib.Path(ctx.workdir) / name
  saved = workdir / "config.json"
  if saved.exists() and upgrade_config(json.loads(saved.read_text())) != json.loads(json.dumps(config.to_dict())):
    ctx.log(f"{workdir}: config changed, starting over")
    _clear(workdir)
  ctx.log(f"training {name}: {spec} {' '.join(overrides)}")
  return train_lib.train_and_evaluate(config, workdir)


def _clear(workdir: pathlib.Path) -> None:
  import shutil

  shutil.rmtree(workdir)


def curve(ctx: Context, name: str, metric: str) -> tuple[list[int], list[float]]:
  """(steps, values) of `metric` in the run `ctx.workdir/name` (metrics.jsonl)."""
  steps, values = [], []
  for record in read_metrics(pathlib.Path(ctx.workdir) / name):
    value = record.get(metric)
    if isinstance(value, (int, float)) and math.isfinite(value):
      steps.append(int(record["step"]))
      values.append(float(value))
  return steps, values
