"""What the benchmarks share: named variants of a config, timing, out-of-memory and XLA cost helpers, and
how a benchmark command reports (a machine line, the command, a markdown table, --out / --json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from lra_core import cli
from lra_core.cost import hlo_cost
from lra_core.errors import ConfigError

MiB = 2**20


class Variant(NamedTuple):
  """A named set of config overrides, compared against the other variants."""

  name: str
  overrides: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
  """'NAME:key=value,key=value' -> Variant; commas inside a value (tuples) stay with it."""
  name, _, rest = text.partition(":")
  if not name:
    raise ConfigError(f"variant {text!r} has no name; expected NAME:key=value[,key=value...].")
  # Split only at commas that start another `key=`, so 'a=(1,2),b=3' gives two overrides.
  items = [s.strip() for s in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", rest) if s.strip()]
  for item in items:
    if "=" not in item:
      raise ConfigError(f"variant {name!r} override {item!r} is not of the form key=value.")
  return Variant(name, tuple(items))


def variant_config(spec: str, variant: Variant) -> tuple[str, list[str]]:
  """(config spec, overrides) of a variant: an override `config=<spec>` replaces the --config."""
  specs = [o.partition("=")[2].strip() for o in variant.overrides if o.partition("=")[0].strip() == "config"]
  rest = [o for o in variant.overrides if o.partition("=")[0].strip() != "config"]
  return (specs[-1] if specs else spec), rest


def is_oom(error: BaseException) -> bool:
  """XLA's resource-exhausted error (at compile or at run time), or the host running out."""
  if isinstance(error, MemoryError):
    return True
  text = str(error)
  return isinstance(error, jax.errors.JaxRuntimeError) and (
    "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
  )


def cost_flops(compiled) -> float | None:
  """Matrix-product FLOPs of one call of `compiled`, every loop counted by its trip count
  (`lra_core.cost.hlo_cost.step_flops`, what the trainer's MFU uses). XLA's own cost analysis counts a
  loop's body once: a step that scans its blocks or layers would look cheaper than it is."""
  try:
    text = compiled.as_text()
  except Exception:  # noqa: BLE001  (a backend without HLO text)
    return None
  flops, _ = hlo_cost.step_flops(text)
  return float(flops) if flops > 0 else None


def xla_memory_bytes(compiled) -> int | None:
  """Arguments + outputs + temporaries - donated buffers, as XLA planned them for one call."""
  try:
    m = compiled.memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def median_seconds(fn: Callable[[], object], *, steps: int, warmup: int) -> tuple[float, list[float]]:
  """(median, every time) of `steps` calls of `fn` after `warmup` untimed ones, each waited for."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def ints(text: str) -> list[int]:
  """'1,2_048' -> [1, 2048]: a flag's comma-separated positive integers."""
  try:
    values = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
  except ValueError:
    raise ConfigError(f"{text!r} is not a comma-separated list of integers.") from None
  if not values or min(values) < 1:
    raise ConfigError(f"{text!r}: expected positive integers.")
  return values


def machine_line(peak_flops: float | None = None, matmul_size: int = 0) -> str:
  """Platform, device kind, CPU count and versions: tables from different machines never mix."""
  device = jax.devices()[0]
  line = (
    f"machine: {device.platform} ({device.device_kind}), {jax.device_count()} device(s) of which 1 used, "
    f"{os.cpu_count()} CPUs, {platform.machine()}, jax {jax.__version__}, "
    f"Python {platform.python_version()}"
  )
  if peak_flops:
    n = matmul_size or (2048 if device.platform == "cpu" else 8192)
    line += f"; float32 {n}x{n} matmul: {peak_flops / 1e9:,.1f} GFLOP/s"
  return line


def markdown_section(title: str, machine: str, command: str, table: str) -> str:
  return f"### {title}\n\n{machine}  \ncommand: `{command}`\n\n{table}\n"


def output_flags(parser: argparse.ArgumentParser) -> None:
  """--title / --out / --json, as every benchmark command writes its table."""
  parser.add_argument("--title", default="", help="heading of the --out section (default: the config)")
  parser.add_argument("--out", default="", help="markdown file to append the table to")
  parser.add_argument("--json", default="", help="file to write the raw rows to")


def parse_command(
  argv: Sequence[str] | None,
  *,
  prog: str,
  doc: str,
  variant_help: str,
  flags: Callable[[argparse.ArgumentParser], None],
  repeats: int,
) -> tuple[list[str], argparse.Namespace, list[Variant]]:
  """(argv, args, variants) of a generation benchmark's command line: --config / --override /
  --variant, the command's own `flags`, --repeats / --warmup, and --title / --out / --json."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.doc_parser(prog, doc)
  parser.add_argument("--config", required=True, help="config file[:arg] of an autoregressive model")
  parser.add_argument(
    "--override",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override (repeatable); --config.KEY=VALUE, as lra_core.train takes it, too",
  )
  parser.add_argument(
    "--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]", help=variant_help
  )
  flags(parser)
  parser.add_argument("--repeats", type=int, default=repeats)
  parser.add_argument("--warmup", type=int, default=1)
  output_flags(parser)
  args = cli.parse_overriding(parser, argv)
  cli.setup_logging()
  return argv, args, [parse_variant(v) for v in args.variant] or [Variant("default")]


def publish(
  script: str,
  argv: Sequence[str],
  table: str,
  rows: Sequence[dict],
  args,
  *,
  peak: float | None = None,
  matmul_size: int = 0,
  title: str = "",
) -> None:
  """Prints the table under the machine line (with the matmul yardstick's FLOP/s `peak`, if any)
  and the command; appends it to --out as a section (heading `title`, else --title, else --config)
  and writes the rows to --json."""
  machine = machine_line(peak, matmul_size)
  command = shlex.join(["python", script, *argv])
  print(f"{machine}\ncommand: {command}\n\n{table}")
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.read_text() if out.exists() else ""
    sep = "" if not previous else ("\n" if previous.endswith("\n") else "\n\n")
    with out.open("a") as f:
      f.write(sep + markdown_section(args.title or title or args.config, machine, command, table))
  if args.json:
    raw = {"machine": machine, "command": command, "rows": list(rows)}
    if peak is not None:
      raw["matmul_flops_per_s"] = peak
    pathlib.Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
