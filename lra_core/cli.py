"""Command-line parsing shared by train / evaluate / sample.

  --config=<file>[:arg]   a config file and its argument (ml_collections style)
  --config.<key>=<value>  overrides, parsed with the field's type (as config_flags does);
  --config.<key> <value>  the same, space separated as absl users type it
  --workdir=<dir>
  --list_configs          every config file with the args it accepts (also `python -m lra_core.configs`)
  --distributed / --coordinator_address / --num_processes / --process_id
                          multi-process runs (lra_core/runtime/distributed.py, docs/launching.md)

Every flag also takes its value after a space. Overrides go through `lra_core.load_config`, so
the command line and the Python API give the same one-sentence errors (an unknown key names the
closest valid keys). A `UserError` ends the program with that sentence and exit status 2, not a
traceback. Tools that read a run (evaluate, sample) take the config from `<workdir>/config.json`
when --config is not given, with the overrides on top.

The console scripts lra-train, lra-eval, lra-sample and lra-aot (pyproject.toml) run those modules
as `python -m` does; lra-sweep and lra-bench run lra_core.sweep and lra_core.bench.train_step, the
commands of scripts/sweep.py and scripts/bench.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import logging
import os
import re
import runpy
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from lra_core.config import load_config
from lra_core.errors import ConfigError, UserError, brief
from lra_core.registry import package_dir
from lra_core.runtime import (
  agreement,
  coordinator_watch,
  distributed,
  host_memory,
  preemption,
  process_end,
  quiet_start,
)
from lra_core.runtime.exit_codes import (  # noqa: F401  (re-exported: the commands' statuses, cli.EXIT_*)
  EXIT_CRASH,
  EXIT_FINISHED,
  EXIT_INTERRUPTED,
  EXIT_PREEMPTED,
  EXIT_USER_ERROR,
)

PREFIX = "--config."

EXAMPLE = (
  "python -m lra_core.train --config configs/lra/listops/transformer.py:tiny \\\n"
  "      --config.train.steps 100 --config.optim.lr=3e-4 --workdir runs/listops_tiny"
)


@dataclasses.dataclass
class Args:
  config: object
  workdir: str
  spec: str
  overrides: list[str]
  extra: argparse.Namespace


def setup_logging() -> None:
  logging.basicConfig(
    level=os.environ.get("LRA_CORE_LOG", "INFO"),
    format="%(asctime)s %(levelname)s %(message)s",
    datefmt="%H:%M:%S",
    force=True,
  )
  for noisy in ("absl", "orbax", "jax._src", "grain"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(`key=value` overrides, the other arguments): `--config.KEY=VALUE` and `--config.KEY VALUE`
  are overrides; a VALUE that starts with "--" must be given with "="."""
  overrides, rest = [], []
  args = list(argv)
  i = 0
  while i < len(args):
    a = args[i]
    if not a.startswith(PREFIX):
      rest.append(a)
    elif "=" in a:
      overrides.append(a[len(PREFIX) :])
    elif i + 1 < len(args) and not args[i + 1].startswith("--"):
      overrides.append(f"{a[len(PREFIX) :]}={args[i + 1]}")
      i += 1
    else:
      raise ConfigError(f"{a} needs a value: {a}=VALUE or {a} VALUE.")
    i += 1
  return overrides, rest


def parse_known(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace:
  """parser.parse_args, where an argument the command does not know is one sentence naming the nearest
  option (or the --config.KEY it looks like), not argparse's usage dump."""
  ns, unknown = parser.parse_known_args(args)
  if unknown:
    flag, _, value = unknown[0].partition("=")
    head, dot, key = flag.partition(".")
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    if dot and difflib.get_close_matches(head, [PREFIX.rstrip(".")], n=1, cutoff=0.6):
      near = [f"{PREFIX}{key}" + (f"={value}" if value else "")]
    else:
      near = difflib.get_close_matches(flag, options, n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; {parser.prog} --help lists its options."
    raise ConfigError(f"{unknown[0]} is not an option of {parser.prog}{hint}")
  return ns


def parse_overriding(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
  """parser.parse_args for a command with an `--override KEY=VALUE` flag that also takes the
  trainer's `--config.KEY=VALUE` / `--config.KEY VALUE` (added to args.override, after the others).
  Such a command (the benchmarks) joins no multi-process run, so its backends start here."""
  overrides, rest = split_overrides(argv)
  args = parser.parse_args(rest)
  args.override += overrides
  quiet_start.start_backends()  # with the accelerator plugins' noise dropped, before the command's first device use
  return args


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose epilog (the config folders) is only built when help is shown."""

  def __init__(self, *args, epilog_fn: Callable[[], str], **kwargs):
    super().__init__(*args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    self.epilog_fn = epilog_fn

  def format_help(self) -> str:
    self.epilog = self.epilog_fn()
    return super().format_help()


class _ListConfigs(argparse.Action):
  def __init__(self, option_strings, dest, **kwargs):
    super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

  def __call__(self, parser, namespace, values, option_string=None):
    print(list_configs())
    parser.exit()


def help_epilog(example: str) -> str:
  folders = sorted({f.rpartition("/")[0] for f in config_files()})
  return (
    textwrap.dedent("""\
      config overrides:
        --config.KEY=VALUE or --config.KEY VALUE
                              set one field of the config (KEY dotted, e.g. train.steps); VALUE is
                              parsed with the field's type; a VALUE starting with -- needs the = form

      config files:
        configs/<dataset>/<model>.py[:ARG[,ARG...]]   with <dataset> one of
      """)
    + textwrap.fill(", ".join(folders), width=96, initial_indent="    ", subsequent_indent="    ")
    + (
      "\n  (read from the lra_core.configs package when not under the current folder);\n"
      "  `python -m lra_core.configs` or --list_configs lists every file with its args\n\n"
      f"examples:\n  {example}\n"
    )
  )


_RUNS_A_COMMAND = re.compile(r" +(\w+=\S* +)*(python|lra-)")  # "  python ...", "  VAR=x python ...", "  lra-sweep ..."


def examples_epilog(doc: str) -> str | None:
  """The worked examples of a command's docstring under "examples:": its first indented paragraph with
  a line that runs a command (python or lra-..., maybe after VAR=value), as written; None if none."""
  for paragraph in doc.split("\n\n"):
    lines = paragraph.strip("\n").splitlines()
    if all(line.startswith(" ") for line in lines) and any(_RUNS_A_COMMAND.match(line) for line in lines):
      return "examples:\n" + textwrap.indent(textwrap.dedent("\n".join(lines)), "  ")
  return None


def doc_parser(prog: str, doc: str, **kwargs) -> argparse.ArgumentParser:
  """The ArgumentParser of a command documented by `doc` (its module docstring): --help shows the
  docstring's first paragraph, the flags, then its worked examples (examples_epilog)."""
  return argparse.ArgumentParser(
    prog=prog,
    description=doc.split("\n\n")[0],
    epilog=examples_epilog(doc),
    formatter_class=argparse.RawDescriptionHelpFormatter,
    **kwargs,
  )


def parse(
  argv: Sequence[str] | None,
  *,
  default_config: str | None = None,
  default_workdir: str | None = None,
  extra: Callable[[argparse.ArgumentParser], None] | None = None,
  prog: str | None = None,
  workdir: bool = True,
  description: str | None = None,
  config_from_workdir: Callable[[str, Sequence[str]], Any] | None = None,
  example: str | None = None,
) -> Args:
  """The shared flags (`workdir=False` leaves out --workdir, for tools that write no run).

  config_from_workdir: without --config, the config this reads from the workdir and the overrides
  (lra_core.checkpoints.saved_config.load_workdir_config: `<workdir>/config.json`, the one the trainer
  saved, overrides on top); the commands that take it pass it in, so that the flags every dataset's
  command shares stay below the checkpoints. `example` is the worked example --help shows.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _Parser(prog=prog, description=description, epilog_fn=lambda: help_epilog(example or EXAMPLE))
  optional = default_config is not None or config_from_workdir is not None
  parser.add_argument(
    "--config",
    default=default_config,
    required=not optional,
    help="config file, optionally followed by :ARG (e.g. configs/lra/listops/transformer.py:tiny)"
    + ("; default: the workdir's config.json" if config_from_workdir is not None else ""),
  )
  if workdir:
    parser.add_argument(
      "--workdir",
      default=default_workdir,
      required=default_workdir is None,
      help="output folder: checkpoints, metrics.jsonl, TensorBoard events, summary.json",
    )
  parser.add_argument("--list_configs", action=_ListConfigs, help="list every config file with its args, then exit")
  distributed.add_flags(parser)
  if extra is not None:
    extra(parser)
  overrides, rest = split_overrides(argv)
  ns = parse_known(parser, rest)
  setup_logging()
  # Processes 1 and up run the command as a child, whose abort by JAX's client when the coordinator is
  # lost becomes one sentence (lra_core/runtime/coordinator_watch.py); nothing has joined yet.
  coordinator_watch.start(ns.process_id, ns.coordinator_address, quiet_start.in_command())
  try:
    if ns.config is None:
      config = config_from_workdir(ns.workdir, overrides)
      spec = f"{ns.workdir}/config.json"
    else:
      config, spec = load_config(ns.config, overrides), ns.config
  except UserError as e:
    _join_to_report(ns, e)
    raise
  # After the config (a typo fails at once) and before anything uses a device.
  distributed.initialize_from_args(ns)
  agreement.check(config)  # every process runs the same config and code, or none runs
  quiet_start.start_backends()
  return Args(config=config, workdir=getattr(ns, "workdir", None), spec=spec, overrides=overrides, extra=ns)


def _join_to_report(ns: argparse.Namespace, e: UserError) -> None:
  """A process whose config is refused still joins its multi-process run where the flags ask for one,
  so that lra_core.cli.run can hand its sentence to the others: they would otherwise wait for it in
  their own start for JAX's timeout (5 minutes) and then abort without a word. Its sentence is said
  first: where the others never start, the join itself ends in that abort (a native stack, no word)."""
  try:
    if distributed.settings_from_args(ns) is None:
      return
  except UserError:  # flags at odds as well: the config's error is the one to say
    return
  process_end.claim_end(f"error: {e}", EXIT_USER_ERROR)  # before joining: printed, nothing claimed
  e.said = True
  try:
    distributed.initialize_from_args(ns)
  except Exception:  # noqa: BLE001  (the config's error is the one to say)
    pass


def run(main: Callable[[], None]) -> None:
  """Calls `main`, turning a UserError into its one sentence on stderr and exit status 2, and a
  Ctrl-C outside the training loop (or a second one inside it) into one line and status 130.

  In a multi-process run an error on this process ends every process at once
  (lra_core.runtime.process_end.report_failure): the others print its line and exit with its status.
  Freed host memory is kept for reuse from the start (lra_core.runtime.host_memory)."""
  host_memory.keep_freed_memory()
  try:
    with preemption.ctrl_c_latched():
      main()
  except Exception as e:
    lost = process_end.lost_peer(e)  # a peer gone: one line naming it, not the error it caused here
    if lost is not None:
      process_end.stop_for_lost_peer(lost)
    _failed(e)
  except KeyboardInterrupt:
    if not process_end.claim_end("aborted (Ctrl-C).", EXIT_INTERRUPTED):
      process_end.leave(EXIT_INTERRUPTED)  # a peer's failure ends this process already, its line said
    process_end.report_failure("aborted (Ctrl-C)", EXIT_INTERRUPTED)
    if quiet_start.in_command():  # a compile may still be running in XLA's threads (lra_core/runtime/quiet_start.py)
      quiet_start.leave_now(EXIT_INTERRUPTED)
    sys.exit(EXIT_INTERRUPTED)


def _failed(e: Exception) -> None:
  """A UserError's one sentence and status 2; anything else a crash: the traceback and status 1."""
  # In a multi-process run the watchdog may be ending this process for a peer's failure at this moment
  # (this error often its consequence): then its line stands, and this process leaves with its status.
  if isinstance(e, UserError):
    said = getattr(e, "said", False)  # by a process that joined only to report it (_join_to_report)
    if not process_end.claim_end(None if said else f"error: {e}", EXIT_USER_ERROR):
      process_end.leave(EXIT_USER_ERROR)
    process_end.report_failure(str(e), EXIT_USER_ERROR)
    if getattr(e, "leave_at_once", False):  # threads stuck on a failing store would hold the exit
      quiet_start.leave_now(EXIT_USER_ERROR)
    sys.exit(EXIT_USER_ERROR)
  if not process_end.claim_end(None, EXIT_CRASH):
    process_end.leave(EXIT_CRASH)
  process_end.report_failure(f"{type(e).__name__}: {brief(e)}", EXIT_CRASH, traceback_of=e)
  raise e  # Python prints the traceback and exits with status 1 (EXIT_CRASH)


def as_command(module: str) -> Callable[[], None]:
  """A console script that runs `module` as `python -m <module>` does (its exit status included)."""

  def command() -> None:
    runpy.run_module(module, run_name="__main__", alter_sys=True)

  return command


train_command = as_command("lra_core.train")
evaluate_command = as_command("lra_core.evaluate")
sample_command = as_command("lra_core.sample")
aot_command = as_command("lra_core.aot")
sweep_command = as_command("lra_core.sweep")
bench_command = as_command("lra_core.bench.train_step")


# ------------------------------------------------------------------------------- Config listing


@functools.cache
def config_files() -> tuple[str, ...]:
  """Every config file, as its path under configs/ ("lra/listops/transformer.py"): the modules of
  the lra_core.configs package that define get_config at their top level."""
  root = package_dir("configs")
  out = []
  for file in sorted(root.rglob("*.py")):
    tree = ast.parse(file.read_text(), str(file))
    if any(isinstance(node, ast.FunctionDef) and node.name == "get_config" for node in tree.body):
      out.append(file.relative_to(root).as_posix())
  return tuple(out)


def config_args(file: str) -> tuple[str, ...] | None:
  """The args config file `file` (a path under configs/) accepts, in the order it declares them:
  the `allowed` of the `lra_core.config.config_arg` call that checks get_config's arg, found in
  get_config's source or in a function get_config passes its arg to. None if there is no such call."""
  module = importlib.import_module("lra_core.configs." + file.removesuffix(".py").replace("/", "."))
  return _checked_args(module.get_config)


def _checked_args(func, param: str | None = None, depth: int = 0) -> tuple[str, ...] | None:
  tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
  fn = tree.body[0]
  param = param or fn.args.args[0].arg

  def value(node):  # an expression of `func`'s source, evaluated where `func` was defined
    return eval(compile(ast.Expression(node), "<config args>", "eval"), func.__globals__)  # noqa: S307

  for node in ast.walk(fn):
    if not isinstance(node, ast.Call):
      continue
    at = [i for i, a in enumerate(node.args) if isinstance(a, ast.Name) and a.id == param]
    keywords = [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == param]
    if not at and not keywords:
      continue
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    if name == "config_arg" and at == [0]:
      allowed = node.args[1] if len(node.args) > 1 else next(k.value for k in node.keywords if k.arg == "allowed")
      return tuple(dict.fromkeys(value(allowed)))
    callee = value(node.func)
    if inspect.isfunction(callee) and depth < 4:
      target = list(inspect.signature(callee).parameters)[at[0]] if at else keywords[0]
      found = _checked_args(callee, target, depth + 1)
      if found is not None:
        return found
  return None


def list_configs() -> str:
  """One line per config file: `lra/listops/transformer.py: tiny, default, plus, plusplus`."""
  lines = [
    "config files under configs/, each with the args it accepts (--config=configs/<file>[:ARG[,ARG...]];",
    "without ARG the file's full setting):",
  ]
  for file in config_files():
    args = config_args(file)
    lines.append(f"  {file}: {', '.join(args) if args else '(none)' if args == () else '(not declared)'}")
  return "\n".join(lines)
