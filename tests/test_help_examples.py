"""Every command ends its --help with worked examples of that command (lra_core.cli.doc_parser's, from
the module docstring; cli.parse's, from the command's EXAMPLE; the launchers' own): each example
line that runs python or an lra-* program runs this command, and every flag it passes is one the
same --help lists (a subcommand's, where the example names one). --help only: nothing trains or
compiles."""

import importlib
import importlib.util
import pathlib
import re
import shlex
import sys

import pytest

from lra_core import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent

COMMANDS = [  # the module (or script) whose main() parses the command line, the program its --help names
  ("lra_core.reproduce.cli", "python scripts/reproduce.py"),
  ("lra_core.sweep", "python scripts/sweep.py"),
  ("lra_core.data.tokenizer", "python -m lra_core.data.tokenizer"),
  ("lra_core.data.datasets.lra.imdb", "python -m lra_core.data.datasets.lra.imdb"),
  ("lra_core.data.datasets.lra.cifar10", "python -m lra_core.data.datasets.lra.cifar10"),
  ("lra_core.data.datasets.lra.pathfinder", "python -m lra_core.data.datasets.lra.pathfinder"),
  ("lra_core.data.datasets.lra.listops", "python -m lra_core.data.datasets.lra.listops"),
  ("lra_core.bench.train_step", "python scripts/bench.py"),
  ("lra_core.bench.decode", "python scripts/bench_decode.py"),
  ("lra_core.bench.generate", "python scripts/bench_generate.py"),
  ("lra_core.bench.loop", "python scripts/bench_loop.py"),
  ("lra_core.bench.kernel_run", "python scripts/run_kernels.py"),
  ("lra_core.bench.lowering", "python scripts/check_lowering.py"),
  ("lra_core.bench.side_by_side", "python scripts/peer_bench.py"),
  ("lra_core.soak", "python scripts/soak.py"),
  ("lra_core.bench.shardings", "python scripts/shardings.py"),
  ("lra_core.bench.param_counts", "python scripts/param_counts.py"),
  ("scripts/tpu_variants.py", "python scripts/tpu_variants.py"),
  ("scripts/authors_vq_bench.py", "python scripts/authors_vq_bench.py"),
  ("scripts/plot.py", "python scripts/plot.py"),
  ("scripts/launch_tpu.py", "python scripts/launch_tpu.py"),
  ("scripts/launch_slurm.py", "python scripts/launch_slurm.py"),
  ("lra_core.train", "python -m lra_core.train"),
  ("lra_core.evaluate", "python -m lra_core.evaluate"),
  ("lra_core.sample", "python -m lra_core.sample"),
  ("lra_core.aot", "python -m lra_core.aot"),
  ("lra_core.data.stats", "python -m lra_core.data.stats"),
]
INSTALLED = {"lra_core.sweep": "lra-sweep", "lra_core.bench.train_step": "lra-bench"}  # pyproject's [project.scripts]


def load_main(target: str):
  if target.endswith(".py"):
    spec = importlib.util.spec_from_file_location(f"help_of_{pathlib.Path(target).stem}", ROOT / target)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.main
  return importlib.import_module(target).main


def help_of(main, argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_:
    main([*argv, "--help"])
  assert exit_.value.code == 0
  return capsys.readouterr().out


def examples(out: str) -> list[list[str]]:
  """The words of each example command in a --help (continuation lines joined, comments dropped),
  leading VAR=value assignments left out."""
  section = out.partition("\nexamples:\n")[2]
  commands = []
  for line in section.splitlines():
    if line.startswith("   ") and commands:  # a continuation line
      commands[-1] = commands[-1].removesuffix("\\") + " " + line.strip()
    elif line.strip():
      commands.append(line.strip())
  words = [shlex.split(c, comments=True) for c in commands]
  return [w[next(i for i, x in enumerate(w) if not re.match(r"\w+=", x)) :] for w in words]


@pytest.mark.parametrize("target, prog", COMMANDS, ids=[t for t, _ in COMMANDS])
def test_help_ends_with_examples_of_its_own_command(target, prog, capsys):
  main = load_main(target)
  out = help_of(main, [], capsys)
  assert out.startswith(f"usage: {prog} ") and "\nexamples:\n  " in out
  programs = [prog.split(), [INSTALLED.get(target)]]
  subcommands = re.search(r"\{([\w,-]+)\}", out)
  runs = [w for w in examples(out) if w[0] == "python" or w[0].startswith("lra-")]
  assert runs, "no example runs a command"
  for words in runs:
    program = next((p for p in programs if words[: len(p)] == p), None)
    assert program, f"{' '.join(words)!r} does not run {prog}"
    args = words[len(program) :]
    args = args[: args.index("--")] if "--" in args else args  # the launchers pass what follows to the trainer
    listed = out
    if subcommands and args and args[0] in subcommands[1].split(","):
      listed = help_of(main, [args[0]], capsys)
    listed = listed.partition("\nexamples:\n")[0]
    for arg in args:
      flag = re.match(r"\[?(--[\w.-]+)", arg)
      if flag is None:
        continue
      flag = "--config.KEY" if flag[1].startswith("--config.") else flag[1]  # a config override
      assert re.search(re.escape(flag) + r"(?![\w-])", listed), f"{prog} --help lists no {flag}"
  if target in INSTALLED:
    assert any(w[0] == INSTALLED[target] for w in runs), f"no example runs {INSTALLED[target]}"


def test_examples_are_the_first_indented_paragraph_that_runs_a_command():
  doc = """Does a thing.

  a table  not a command

Run it:

  python -m thing --a=1 \\
      --b=2   # comment
  VAR=x python -m thing --c
  lra-thing --d

  python -m thing --later
"""
  assert cli.examples_epilog(doc) == (
    "examples:\n  python -m thing --a=1 \\\n      --b=2   # comment\n  VAR=x python -m thing --c\n  lra-thing --d"
  )
  assert cli.examples_epilog("Does a thing.\n\n  a table\n") is None
  parser = cli.doc_parser("python -m thing", doc)
  assert parser.description == "Does a thing." and parser.epilog == cli.examples_epilog(doc)
