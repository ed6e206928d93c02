"""Rules of the house that keep the code easy to read and extend, checked over the real tree:

- a task's kind (causal, classifies, image, ...) has one home, lra_core/task_kinds.py: no other
  product file spells a group of task names, except where a family or dataset declares the tasks it
  serves (`tasks=(...)`, `TASKS = (...)`);
- no product file is over 600 lines (a file that grows past that holds two ideas), and no function of
  the trainer's module over 80 lines (the loop reads on one screen; its periodic actions are a table);
- lines with a comment are at least 8% of the code lines in models/ and kernels/, where the why of
  a shape, a mask or an index map is not obvious from the line itself.
- tests/README.md, the map of the suite, names every test file and helper, and no file that is gone.

Each rule is a function over a folder, and each is also shown catching a throwaway violation.
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

from lra_core import task_kinds
from lra_core.config import PROJECT_ROOT as ROOT

PRODUCT = ("lra_core", "models", "kernels", "configs", "scripts")
MAX_LINES = 600
MIN_COMMENT_SHARE = 0.08


def product_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  return sorted(p for folder in PRODUCT for p in (root / folder).rglob("*.py"))


# -- task names --------------------------------------------------------------------------------------


def task_name_groups(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """'file:line (names)' for each tuple, list or set of two or more task names that a membership test
  (`task in (...)`) or an assignment (`CAUSAL = (...)`) uses as a kind: all but declarations of the
  tasks something serves (`tasks=(...)`, `TASKS = (...)`)."""
  tree = ast.parse(path.read_text(), str(path))
  groups = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      groups += [c for op, c in zip(node.ops, node.comparators) if isinstance(op, (ast.In, ast.NotIn))]
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if node.value is not None and not any(isinstance(t, ast.Name) and t.id == "TASKS" for t in targets):
        groups.append(node.value)
  found = []
  for node in sorted(groups, key=lambda n: n.lineno):
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
      continue
    names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if len(names) == len(node.elts) and set(names) <= set(task_kinds.TASKS):
      found.append(f"{path.relative_to(root)}:{node.lineno} {tuple(names)}")
  return found


def test_task_kinds_are_read_from_the_task_table():
  home = ROOT / "lra_core" / "task_kinds.py"
  assert [hit for p in product_files() if p != home for hit in task_name_groups(p)] == []


def test_the_task_rule_catches_a_tuple_of_task_names(tmp_path):
  (tmp_path / "m.py").write_text(
    'TASKS = ("lm", "mlm")\nF = Family(tasks=("lm", "image_ar"))\nok = {"mlm", "lm"} <= args\n'
    'causal = task in ("lm", "image_ar")\nIMAGE = ("image_ar", "diffusion")\nother = ("lm", "x")\n'
  )
  assert task_name_groups(tmp_path / "m.py", tmp_path) == [
    "m.py:4 ('lm', 'image_ar')",
    "m.py:5 ('image_ar', 'diffusion')",
  ]


# -- file sizes --------------------------------------------------------------------------------------


def long_files(files, root: pathlib.Path = ROOT) -> list[str]:
  return [f"{p.relative_to(root)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES]


def test_no_product_file_is_over_600_lines(tmp_path):
  assert long_files(product_files()) == []
  (tmp_path / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
  assert long_files([tmp_path / "big.py"], tmp_path) == [f"big.py: {MAX_LINES + 1} lines"]


MAX_TRAINER_FUNCTION = 80


def long_functions(path: pathlib.Path, limit: int) -> list[str]:
  """'name: N lines' for each function or method of `path` longer than `limit` lines."""
  return [
    f"{n.name}: {n.end_lineno - n.lineno + 1} lines"
    for n in ast.walk(ast.parse(path.read_text(), str(path)))
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit
  ]


def test_no_function_of_the_trainer_is_over_80_lines(tmp_path):
  assert long_functions(ROOT / "lra_core" / "train.py", MAX_TRAINER_FUNCTION) == []
  (tmp_path / "long.py").write_text("def f():\n" + "  x = 1\n" * 80)
  assert long_functions(tmp_path / "long.py", MAX_TRAINER_FUNCTION) == ["f: 81 lines"]


# -- comments ----------------------------------------------------------------------------------------


def comment_share(files) -> tuple[int, int]:
  """(lines holding a comment, lines of code): docstrings, blank lines and comment-only lines are not
  code lines; a comment-only line counts as a line with a comment."""
  comments = code = 0
  for path in files:
    commented, lines, docstrings = set(), set(), set()
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
      if tok.type == tokenize.COMMENT:
        commented.add(tok.start[0])
      elif tok.type == tokenize.STRING and (previous is None or previous.type in STATEMENT_START):
        docstrings.update(range(tok.start[0], tok.end[0] + 1))  # a string that is a whole statement
      elif tok.type not in LAYOUT:
        lines.update(range(tok.start[0], tok.end[0] + 1))
      if tok.type not in (tokenize.COMMENT, tokenize.NL):
        previous = tok
    comments += len(commented)
    code += len(lines - docstrings)
  return comments, code


LAYOUT = {
  tokenize.NL,
  tokenize.NEWLINE,
  tokenize.INDENT,
  tokenize.DEDENT,
  tokenize.ENDMARKER,
  tokenize.ENCODING,
  tokenize.COMMENT,
}
STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL}


@pytest.mark.parametrize("folder", ["models", "kernels"])
def test_the_why_sits_next_to_the_code(folder):
  comments, code = comment_share(sorted((ROOT / folder).rglob("*.py")))
  assert comments >= MIN_COMMENT_SHARE * code, f"{folder}/: {comments} commented of {code} code lines"


def test_comment_share_counts_comments_against_code_lines(tmp_path):
  (tmp_path / "a.py").write_text('"""Doc\nstring."""\n\n# why\nx = 1  # because\ny = (\n  2\n)\n')
  assert comment_share([tmp_path / "a.py"]) == (2, 4)


# -- the test suite's map ----------------------------------------------------------------------------


def unlisted_tests(tests: pathlib.Path) -> list[str]:
  """Test modules and shared helpers of `tests` that its README.md does not name, and `test_*.py` names
  the README gives that are no file."""
  readme = (tests / "README.md").read_text()
  named = set(re.findall(r"`(?:tests/)?(\w+\.py)`", readme))
  files = {p.name for p in tests.glob("*.py") if p.name != "conftest.py"}
  return sorted(f"not in README.md: {name}" for name in files - named) + sorted(
    f"no such file: {name}" for name in named - files if name.startswith("test_")
  )


def test_tests_readme_names_every_test_file(tmp_path):
  assert unlisted_tests(ROOT / "tests") == []
  (tmp_path / "README.md").write_text("| area | `test_a.py`, `test_gone.py` |\n- `helpers.py`: shared\n")
  for name in ("test_a.py", "test_new.py", "helpers.py", "conftest.py"):
    (tmp_path / name).write_text("")
  assert unlisted_tests(tmp_path) == ["not in README.md: test_new.py", "no such file: test_gone.py"]
