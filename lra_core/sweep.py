r"""Runs one config over a grid of override values and gathers the runs' summaries into one table.

  python scripts/sweep.py --config=configs/lra/listops/transformer.py:default \
      --sweep model.d_model=64,128 --sweep optim.lr=1e-4,4e-4 --config.train.steps=500 --workdir=runs/sweep
  python scripts/sweep.py ... --launcher="python scripts/launch_tpu.py --name=x --zone=y"
  lra-sweep --collect --workdir=runs/sweep     # lra-sweep: installed with the package

The same command as `lra-sweep` and `python -m lra_core.sweep`.

Runs. Each `--sweep KEY=V1,V2,...` lists values for one config key; values are split at commas
outside (), [], {} and quotes and are passed on as text, so each is parsed with the type of its
field by `lra_core.load_config`, as `--config.KEY=V` would be. The runs are the cartesian
product of the sweeps in the order given (the last key varies fastest), or with --zip the i-th
values of every sweep together (all lists of one length). The `--config.KEY=VALUE` flags are
fixed overrides, applied to every run before its swept values. Every run's config is loaded
before anything runs, so a misspelt key or a bad value stops the sweep in seconds with
load_config's sentence (exit status 2).

Names. A run works in <workdir>/<name>, the name being KEY-VALUE pairs joined with "_" in sweep
order, e.g. `d_model-64_lr-1e-4` (values as typed). KEY is the key's last component, or the full
key where two swept keys share it (`model.dropout`, `data.dropout`); in values, characters other
than letters, digits and ".+-" become "_" (`(1, 2)` -> `1_2`). Two runs with one name are refused.

Modes. By default the runs train one after another in this process with
`lra_core.train.train_and_evaluate`, which resumes a workdir from its latest checkpoint; a run
whose summary.json reports its last step and whose config.json equals its config is finished and
is skipped (--force hands it to the trainer again, which then only re-evaluates it). So running
a sweep again continues it, and adding a value to a sweep trains only the new runs. A run that
stops with a UserError (missing data, a diverged loss, ...) is recorded as failed with that
sentence and the sweep goes on; the exit status is then 1. --launcher=PREFIX trains nothing
and prints one command per run, `PREFIX -- --config=SPEC --workdir=RUN_WORKDIR --config.K=V ...`,
for a launcher that starts `python -m lra_core.train` elsewhere; --dry-run prints the local
`python -m lra_core.train ...` commands (or, with --launcher, the launcher's) and writes nothing.

Outputs. <workdir>/sweep.json records the sweep (config, fixed overrides, swept values, and every
run's name, workdir and overrides); it is written before the first run, and by --launcher, so
`--collect --workdir=DIR` can rebuild the tables later from the runs' summary.json files (the
launched runs' folders must then be under DIR). The tables, <workdir>/results.md (printed too)
and <workdir>/results.csv, have one row per run and the columns: the swept keys (values as
typed), then the summary metrics found in any run: val_*, test_*, step, num_params,
train_time_s, tokens_per_s, anything else, and param_checksum last; then a status column if
some run failed or has no summary.json. Markdown shows floats to 4 significant digits, except
param_checksum, which is a fingerprint and keeps all its digits; the CSV keeps full precision.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import pathlib
import re
import shlex
import sys
from collections.abc import Sequence
from typing import NamedTuple

from lra_core import cli, train
from lra_core.checkpoints.saved_config import upgrade_config
from lra_core.config import load_config
from lra_core.errors import ConfigError, UserError
from lra_core.markdown import markdown_table
from lra_core.runtime import preemption, quiet_start

# Metric column order: by the first matching rule (a prefix or an exact name), then alphabetical.
ORDER = ("val_", "test_", "step", "num_params", "train_time_s", "tokens_per_s", None, "param_checksum")


class Run(NamedTuple):
  """One point of the sweep."""

  name: str
  workdir: str
  values: dict[str, str]  # swept key -> value, as typed
  overrides: list[str]  # the swept `key=value`s (the fixed ones come first, see plan())
  config: object  # the loaded, validated config


def split_values(text: str) -> list[str]:
  """'1,2' -> ['1', '2']; commas inside (), [], {} or quotes stay with their value."""
  values, current, depth, quote = [], "", 0, ""
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth <= 0:
      values.append(current.strip())
      current = ""
      continue
    current += ch
  return values + [current.strip()]


def parse_sweep(item: str) -> tuple[str, list[str]]:
  """'KEY=V1,V2' -> (KEY, [V1, V2])."""
  key, sep, text = item.partition("=")
  key = key.strip().removeprefix("--config.").removeprefix("config.")
  values = split_values(text)
  if not sep or not key or not text.strip():
    raise ConfigError(f"--sweep {item!r} is not of the form KEY=V1,V2,...")
  if "" in values:
    raise ConfigError(f"--sweep {item!r} has an empty value.")
  return key, values


def grid(sweeps: dict[str, list[str]], zipped: bool) -> list[dict[str, str]]:
  """The runs' swept values: the cartesian product (last key fastest) or, zipped, the i-th values."""
  keys, lists = list(sweeps), list(sweeps.values())
  if zipped:
    if len({len(v) for v in lists}) > 1:
      lengths = ", ".join(f"{k} has {len(v)}" for k, v in sweeps.items())
      raise ConfigError(f"--zip needs the same number of values in every sweep, but {lengths}.")
    return [dict(zip(keys, combo)) for combo in zip(*lists)]
  return [dict(zip(keys, combo)) for combo in itertools.product(*lists)]


def run_name(values: dict[str, str]) -> str:
  """`d_model-64_lr-1e-4`: see "Names" in the module docstring."""
  last = [k.rsplit(".", 1)[-1] for k in values]
  parts = []
  for key, short in zip(values, last):
    label = short if last.count(short) == 1 else key
    parts.append(f"{label}-{re.sub(r'[^A-Za-z0-9.+-]+', '_', values[key]).strip('_')}")
  return "_".join(parts)


def plan(spec: str, fixed: Sequence[str], sweeps: dict[str, list[str]], zipped: bool, workdir: str) -> list[Run]:
  """Every run, its config loaded and validated (the first bad one raises its ConfigError)."""
  fixed_keys = {o.partition("=")[0].strip() for o in fixed}
  both = [k for k in sweeps if k in fixed_keys]
  if both:
    raise ConfigError(f"config key {both[0]!r} is both swept and fixed by --config.{both[0]}.")
  runs = []
  for values in grid(sweeps, zipped):
    name = run_name(values)
    if any(r.name == name for r in runs):
      raise ConfigError(f"two runs get the folder name {name!r}; give each swept value once.")
    overrides = [f"{k}={v}" for k, v in values.items()]
    config = load_config(spec, [*fixed, *overrides])
    runs.append(Run(name, f"{workdir.rstrip('/')}/{name}", values, overrides, config))
  return runs


def command(spec: str, fixed: Sequence[str], run: Run, launcher: str) -> str:
  """The shell line that trains `run`: the launcher's, or `python -m lra_core.train`'s."""
  args = [f"--config={spec}", f"--workdir={run.workdir}", *(f"--config.{o}" for o in [*fixed, *run.overrides])]
  if launcher:
    return f"{launcher} -- {shlex.join(args)}"
  return shlex.join(["python", "-m", "lra_core.train", *args])


def write_sweep(workdir: str, spec: str, fixed: Sequence[str], sweeps: dict, zipped: bool, runs: Sequence[Run]) -> None:
  record = dict(
    config=spec,
    overrides=list(fixed),
    sweep=sweeps,
    zip=zipped,
    runs=[dict(name=r.name, workdir=r.workdir, values=r.values, overrides=r.overrides) for r in runs],
  )
  folder = pathlib.Path(workdir)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")


def read_summary(workdir: str | pathlib.Path) -> dict | None:
  try:
    return json.loads((pathlib.Path(workdir) / "summary.json").read_text())
  except (OSError, ValueError):
    return None


def finished(run: Run) -> dict | None:
  """The run's summary if it finished with exactly this config, else None."""
  summary = read_summary(run.workdir)
  try:
    saved = json.loads((pathlib.Path(run.workdir) / "config.json").read_text())
  except (OSError, ValueError):
    return None
  if summary is None or summary.get("step") != run.config.train.steps:
    return None
  return summary if upgrade_config(saved) == json.loads(json.dumps(run.config.to_dict())) else None


def train_all(runs: Sequence[Run], force: bool) -> list[dict]:
  """Trains the runs one after another; a UserError fails its run only. Returns the table rows."""
  rows = []
  for i, run in enumerate(runs, 1):
    summary, status = None if force else finished(run), "ok"
    if summary is not None:
      logging.info("run %d/%d %s: finished already, skipped (--force evaluates it again)", i, len(runs), run.name)
    else:
      logging.info("run %d/%d %s: %s", i, len(runs), run.name, " ".join(run.overrides))
      try:
        summary = train.train_and_evaluate(run.config, run.workdir)
      except UserError as e:
        logging.error("run %s failed: %s", run.name, e)
        summary, status = {}, f"failed: {e}"
      if summary.get("interrupted") or summary.get("preempted"):  # Ctrl-C or SIGTERM: the sweep stops too
        raise SweepStopped(f"run {run.name} saved at step {summary['stopped_at']}", bool(summary.get("interrupted")))
    # A Ctrl-C whose KeyboardInterrupt was raised where it is only printed (a garbage-collection hook)
    # as the run ended: the sweep stops all the same.
    if preemption.ctrl_c_seen():
      raise SweepStopped(f"Ctrl-C as run {run.name} ended", interrupted=True)
    rows.append({**run.values, **summary, "status": status})
  return rows


class SweepStopped(Exception):
  """A Ctrl-C or a SIGTERM stopped the sweep (its run saved): it starts no other run."""

  def __init__(self, what: str, interrupted: bool):
    self.interrupted = interrupted
    super().__init__(what)


def collect(workdir: str) -> tuple[list[str], list[dict]]:
  """(swept keys, rows) from <workdir>/sweep.json and the summary.json of each run under workdir."""
  path = pathlib.Path(workdir) / "sweep.json"
  if not path.is_file():
    raise UserError(f"{path} does not exist; --collect needs the --workdir of a sweep.")
  record = json.loads(path.read_text())
  rows = []
  for run in record["runs"]:
    summary = read_summary(path.parent / run["name"])
    status = "ok" if summary is not None else "no summary.json"
    rows.append({**run["values"], **(summary or {}), "status": status})
  return list(record["sweep"]), rows


def columns(keys: Sequence[str], rows: Sequence[dict]) -> list[str]:
  """Swept keys, metrics in ORDER, then status if any run is not ok."""
  metrics = list(dict.fromkeys(k for r in rows for k in r if k not in keys and k != "status"))

  def rank(metric: str) -> int:
    for i, rule in enumerate(ORDER):
      if rule == metric or (rule or "").endswith("_") and metric.startswith(rule):
        return i
    return ORDER.index(None)

  metrics.sort(key=lambda m: (rank(m), m))
  return [*keys, *metrics] + (["status"] if any(r["status"] != "ok" for r in rows) else [])


def _cell(column: str, value) -> str:
  if value is None:
    return ""
  if isinstance(value, float) and column != "param_checksum":
    return f"{value:.4g}"
  return str(value).replace("|", "\\|")


def markdown(cols: Sequence[str], rows: Sequence[dict]) -> str:
  return markdown_table(cols, [[_cell(c, r.get(c)) for c in cols] for r in rows]) + "\n"


def csv_text(cols: Sequence[str], rows: Sequence[dict]) -> str:
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(cols)
  writer.writerows([["" if r.get(c) is None else r[c] for c in cols] for r in rows])
  return out.getvalue()


def write_tables(workdir: str, keys: Sequence[str], rows: Sequence[dict]) -> str:
  """Writes results.md and results.csv; returns the markdown."""
  cols = columns(keys, rows)
  folder = pathlib.Path(workdir)
  folder.mkdir(parents=True, exist_ok=True)
  table = markdown(cols, rows)
  (folder / "results.md").write_text(table)
  (folder / "results.csv").write_text(csv_text(cols, rows))
  return table


def main(argv: Sequence[str] | None = None) -> int:
  """Returns the exit status: 0, or 1 if a run failed or (--collect) has no summary.json."""
  argv = list(sys.argv[1:] if argv is None else argv)
  fixed = [a[len("--config.") :] for a in argv if a.startswith("--config.")]
  parser = cli.doc_parser("python scripts/sweep.py", __doc__)
  parser.add_argument(
    "--config",
    default="",
    help="config file[:arg], as for lra_core.train; --config.KEY=VALUE sets a field in every run",
  )
  parser.add_argument(
    "--sweep",
    action="append",
    default=[],
    metavar="KEY=V1,V2,...",
    help="values of one config key (repeatable); runs = the product of all sweeps",
  )
  parser.add_argument("--zip", action="store_true", help="pair the i-th values of every sweep instead")
  parser.add_argument("--workdir", default="runs/sweep", help="sweep folder: one subfolder per run, tables")
  parser.add_argument("--launcher", default="", help="print `LAUNCHER -- <train args>` per run, train nothing")
  parser.add_argument(
    "--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the commands, write nothing"
  )
  parser.add_argument("--force", action="store_true", help="hand finished runs to the trainer again")
  parser.add_argument("--collect", action="store_true", help="only rebuild the tables from <workdir>")
  args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
  cli.setup_logging()
  if args.collect:
    if args.config or args.sweep or fixed:
      raise ConfigError("--collect takes only --workdir: the sweep is read from its sweep.json.")
    keys, rows = collect(args.workdir)
  else:
    if not args.config or not args.sweep:
      raise ConfigError("a sweep needs --config and at least one --sweep KEY=V1,V2,...")
    sweeps = {}
    for key, values in map(parse_sweep, args.sweep):
      if key in sweeps:
        raise ConfigError(f"config key {key!r} is swept twice.")
      sweeps[key] = values
    runs = plan(args.config, fixed, sweeps, args.zip, args.workdir)
    if not args.dry_run:
      write_sweep(args.workdir, args.config, fixed, sweeps, args.zip, runs)
    if args.launcher or args.dry_run:
      print("\n".join(command(args.config, fixed, r, args.launcher) for r in runs))
      return 0
    quiet_start.start_backends()
    try:
      keys, rows = list(sweeps), train_all(runs, args.force)
    except SweepStopped as stop:  # as the trainer ends at Ctrl-C or SIGTERM: 130 or 75, the same command continues
      why = "interrupted" if stop.interrupted else "preempted"
      print(f"{why}: {stop}; the sweep starts no other run; run the same command again to continue")
      return cli.EXIT_INTERRUPTED if stop.interrupted else cli.EXIT_PREEMPTED
  print(write_tables(args.workdir, keys, rows), end="")
  bad = [r for r in rows if r["status"] != "ok"]
  if bad:
    logging.error("%d of %d runs have no results; see the status column", len(bad), len(rows))
  return 1 if bad else 0


if __name__ == "__main__":
  cli.run(lambda: sys.exit(main()))
