"""Reproduces the papers' tables: one command per table, the paper's numbers beside ours.

  python scripts/reproduce.py --list
  python scripts/reproduce.py --table vq_throughput                  # CPU size, minutes
  python scripts/reproduce.py --table vq_codebook --data_dir=/data   # tables that train read data
  python scripts/reproduce.py --table flash_latency --full           # the paper's size (TPU / GPU)
  python scripts/reproduce.py --table params --out=docs/results.md   # replace its section there

The same command as `python -m lra_core.reproduce.cli`.

Each table prints a markdown section: the setting, the machine, the commit and the command, the
table and at most one line comparing ours with the paper; plots go to img/ beside --out (docs/img/
for docs/results.md; without --out, <workdir>/img; or --img_dir). With
--out the section replaces the table's previous section in that file (or is appended), so
docs/results.md is rebuilt one table at a time; the hand-written discussion that follows each
section there, between its own markers, is left as it is. Training runs go under --workdir/<table>/<run> and are reused
when their config has not changed.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import re
import shlex
import sys
import time
from collections.abc import Sequence

from lra_core import cli
from lra_core.errors import ConfigError
from lra_core.reproduce.common import Context, Result, commit, pyplot
from lra_core.runtime import quiet_start


@dataclasses.dataclass(frozen=True)
class Table:
  name: str
  module: str  # lra_core.reproduce.<module>, holding a function named like the table
  paper: str  # which table / figure of which paper
  summary: str
  data: str = ""  # what under --data_dir it trains on ("" for none)
  plots: bool = False  # whether it draws plots (needs the plot extra, checked before it runs)


TABLES = (
  Table(
    "params",
    "params",
    "all five papers' size tables",
    "parameter counts of every paper config, from shapes, against the papers",
  ),
  Table(
    "vq_throughput",
    "transformer_vq",
    "Transformer-VQ Tables 6-9",
    "train-step throughput of full vs VQ attention: reductions, head types, sequence lengths",
    plots=True,
  ),
  Table(
    "vq_codebook",
    "transformer_vq",
    "Transformer-VQ Table 1",
    "codebook size ablation: small enwik8 runs",
    data="enwik8",
  ),
  Table(
    "vq_cache",
    "transformer_vq",
    "Transformer-VQ Table 2",
    "compressive cache ablation: small enwik8 runs",
    data="enwik8",
  ),
  Table(
    "flash_latency",
    "flash",
    "FLASH Table 11",
    "train-step latency of FLASH, FLASH-Quad and Transformer++ by context length",
    plots=True,
  ),
  Table(
    "flash_quality",
    "flash",
    "FLASH Figure 6 (small)",
    "quality against training cost of FLASH, FLASH-Quad and Transformer++ on C4 bytes",
    data="c4",
    plots=True,
  ),
  Table(
    "latte_runtime",
    "latte",
    "Latte Figures 8-10",
    "attention core time and memory of Latte vs softmax attention by sequence length",
    plots=True,
  ),
  Table(
    "latte_lra",
    "latte",
    "Latte Table 3",
    "LRA rows on the available LRA data: Latte, Latte-Macchiato, Transformer",
    data="lra",
  ),
  Table(
    "fit_scaling",
    "fit",
    "FIT Table 2b",
    "train-step time and memory of FIT vs ViT as the image grows",
    plots=True,
  ),
  Table(
    "fit_interleave",
    "fit",
    "FIT Table 6 (small)",
    "local/global interleaving patterns: small FIT runs on LRA Image (CIFAR-10 pixels)",
    data="lra/cifar10",
    plots=True,
  ),
  Table(
    "block_throughput",
    "block_transformer",
    "Block Transformer Table 2, Figure 2",
    "generation throughput of Block Transformer vs vanilla, and the Pareto plot",
    plots=True,
  ),
  Table(
    "tpu_fit",
    "tpu",
    "every paper's hardware (TPU v3 / v4; GPU papers on TPU v5p)",
    "paper configs compiled for their TPU slices on this host: memory, fit, estimated step time and MFU",
  ),
  Table(
    "long_context",
    "long_context",
    "the longest sequence on a TPU slice, with and without the sequence axis",
    "PG-19 configs compiled for a v5p-64 and a v3-32 at power-of-two lengths: the longest that fits",
  ),
  Table(
    "context_extension",
    "context_extension",
    "Latte Table 4 (the form, small), and passkey retrieval",
    "a RoPE transformer read at 1x, 2x, 4x its trained length: as trained, each RoPE scaling, a fine-tuned extension",
  ),
  Table(
    "gpu_fit",
    "gpu",
    "the GPU papers' hardware (Latte: 4 x A100; Block Transformer: 8 x A100 40GB, 8 x H100; FLASH Table 11: V100)",
    "GPU papers' configs compiled for their GPUs on this host: memory, fit, estimated step time and MFU",
  ),
)
BY_NAME = {t.name: t for t in TABLES}


def table_function(table: Table):
  return getattr(importlib.import_module(f"lra_core.reproduce.{table.module}"), table.name)


def machine() -> str:
  import platform

  import jax

  device = jax.devices()[0]
  return (
    f"{device.platform} ({device.device_kind}), {jax.device_count()} device(s), {os.cpu_count()} CPUs, "
    f"{platform.machine()}, jax {jax.__version__}, Python {platform.python_version()}"
  )


def begin_marker(name: str) -> str:
  return f"<!-- table: {name} -->"


def end_marker(name: str) -> str:
  return f"<!-- /table: {name} -->"


def discussion_block(name: str) -> str:
  """An empty hand-written discussion for the table `name`, appended after its first section."""
  return f"<!-- discussion: {name} -->\n### Discussion\n\n<!-- /discussion: {name} -->\n"


def section(
  table: Table,
  result: Result,
  *,
  command: str,
  seconds: float,
  machine_text: str,
  commit_text: str,
  relative_to: pathlib.Path,
) -> str:
  """The markdown section of one table, between markers that --out replaces it by."""
  lines = [
    begin_marker(table.name),
    f"## `{table.name}`: {table.paper}",
    "",
    result.setting.strip(),
    "",
    f"machine: {machine_text}  ",
    f"commit: `{commit_text}`  ",
    f"command: `{command}` ({seconds / 60:.1f} min)",
    "",
    result.markdown.strip(),
    "",
  ]
  for path in result.plots:
    rel = os.path.relpath(path, relative_to)
    lines += [f"![{path.stem}]({rel})", ""]
  if result.comparison.strip():
    lines += [result.comparison.strip(), ""]
  lines.append(end_marker(table.name))
  return "\n".join(lines) + "\n"


def replace_section(text: str, name: str, new: str) -> str:
  """`text` with the section of `name` replaced by `new`; everything outside its markers, the
  discussion after it included, stays. Where it has none, `new` and an empty discussion are appended."""
  pattern = re.compile(re.escape(begin_marker(name)) + r".*?" + re.escape(end_marker(name)) + r"\n?", re.S)
  if pattern.search(text):
    return pattern.sub(lambda _: new, text, count=1)
  sep = "" if not text or text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
  return text + sep + new + "\n" + discussion_block(name)


def without_out(argv: Sequence[str]) -> list[str]:
  """The arguments minus --out (where the section is pasted is not part of how it was made)."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == "--out":
      skip = True
    elif not arg.startswith("--out="):
      out.append(arg)
  return out


def list_tables() -> str:
  width = max(len(t.name) for t in TABLES)
  lines = []
  for t in TABLES:
    data = f" [--data_dir: {t.data}/]" if t.data else ""
    lines.append(f"{t.name:<{width}}  {t.paper}: {t.summary}{data}")
  return "\n".join(lines)


def default_img_dir(out: str, workdir: str) -> pathlib.Path:
  """Plots go beside the markdown they are written into (img/ next to --out), else under the workdir."""
  return pathlib.Path(out).parent / "img" if out else pathlib.Path(workdir) / "img"


def main(argv: Sequence[str] | None = None) -> str:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.doc_parser("python scripts/reproduce.py", __doc__)
  parser.add_argument("--list", action="store_true", help="list the tables and exit")
  parser.add_argument("--table", default="", help="the table to reproduce (see --list)")
  parser.add_argument(
    "--full", action="store_true", help="the paper's sizes (for TPU / GPU) instead of the CPU default"
  )
  parser.add_argument("--data_dir", default="", help="folder holding enwik8/, c4/, lra/ ... (training tables)")
  parser.add_argument("--workdir", default="runs/reproduce", help="where training runs go, one folder each")
  parser.add_argument(
    "--img_dir",
    default="",
    help="where plots are written (default: img/ beside --out, so docs/img/ for docs/results.md; "
    "without --out, <workdir>/img: a reproduction never overwrites the project's own plots)",
  )
  parser.add_argument(
    "--out", default="", help="markdown file whose section for this table is replaced (appended if it has none)"
  )
  args = parser.parse_args(argv)
  if args.list:
    text = list_tables()
    print(text)
    return text
  if args.table not in BY_NAME:
    raise ConfigError(f"--table {args.table!r} is not a table; expected one of {', '.join(BY_NAME)}.")
  table = BY_NAME[args.table]
  data_dir = pathlib.Path(args.data_dir) if args.data_dir else None
  if table.data and data_dir is None:
    raise ConfigError(f"table {table.name} trains on real data: pass --data_dir=<folder holding {table.data}/>.")
  if data_dir is not None and table.data and not (data_dir / table.data).exists():
    raise ConfigError(f"{data_dir / table.data} does not exist; --data_dir must hold {table.data}/.")
  if table.plots:
    pyplot()  # without the plot extra, its one sentence now rather than after the table has run for minutes
  cli.setup_logging()
  quiet_start.start_backends()  # the accelerator plugins start here, not in the table: their noise dropped
  log = lambda s: print(s, file=sys.stderr, flush=True)
  ctx = Context(
    full=args.full,
    data_dir=data_dir,
    workdir=pathlib.Path(args.workdir) / table.name,
    img_dir=pathlib.Path(args.img_dir) if args.img_dir else default_img_dir(args.out, args.workdir),
    log=log,
  )
  start = time.perf_counter()
  result = table_function(table)(ctx)
  seconds = time.perf_counter() - start
  command = shlex.join(["python", "scripts/reproduce.py", *without_out(argv)])
  out = pathlib.Path(args.out) if args.out else None
  text = section(
    table,
    result,
    command=command,
    seconds=seconds,
    machine_text=machine(),
    commit_text=commit(),
    relative_to=(out.parent if out else pathlib.Path.cwd()).resolve(),
  )
  print(text)
  if out is not None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(replace_section(out.read_text() if out.exists() else "", table.name, text))
  return text


if __name__ == "__main__":
  cli.run(main)
