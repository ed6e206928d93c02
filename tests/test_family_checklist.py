"""The README's "Adding a model family" checklist, kept true for every family the registry finds.

`family_checklist(root)` reads a checkout as the registry does (every public module of models/ at the top
is a family, and every module deeper that declares FAMILY: a family's package, or a second family in it)
and lists each item a family lacks; the throwaway test below shows it names a family added without them,
item by item, and passes once they are there.
"""

import ast
import pathlib
import re

from lra_core import registry
from lra_core.config import PROJECT_ROOT as ROOT


def tour(readme: str) -> str:
  """The README's *Tour* section: the layout block where every module of the framework is named."""
  match = re.search(r"^## Tour\n(.*?)^## ", readme, flags=re.S | re.M)
  return match.group(1) if match else ""


def defines_family(path: pathlib.Path) -> bool:
  tree = ast.parse(path.read_text(), str(path))
  return any(
    isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FAMILY" for t in node.targets)
    for node in tree.body
  )


def family_checklist(root: pathlib.Path = ROOT) -> list[str]:
  """'<family>: <missing item>' for each checklist item a family of `root` lacks."""
  readme_tour = tour((root / "README.md").read_text())
  tests = {p.name: p.read_text() for p in (root / "tests").glob("test_*.py")}
  missing = []
  for name, path in registry.family_files(root / "models").items():
    where = path.relative_to(root).as_posix()
    dotted = ".".join(path.relative_to(root / "models").with_suffix("").parts).removesuffix(".__init__")
    parent, _, leaf = dotted.rpartition(".")
    if not defines_family(path):
      missing.append(f"{name}: {where} defines no FAMILY record")
    if not list((root / "configs").glob(f"**/{name}.py")):
      missing.append(f"{name}: no config file configs/<dataset>/{name}.py")
    imports = re.compile(rf"models{'.' + parent if parent else ''} import (\w+, )*{leaf}\b|models\.{dotted}\b")
    if not any(imports.search(text) for text in tests.values()):
      missing.append(f"{name}: no test module of its own imports it (tests/test_{name}.py)")
    named = rf"\b{leaf}/" if path.name == "__init__.py" else rf"\b{leaf}\.py\b"
    if not re.search(named, readme_tour):
      missing.append(
        f"{name}: the README's Tour does not name {where.removeprefix('models/').removesuffix('__init__.py')}"
      )
  return missing


def test_every_family_follows_the_checklist():
  assert family_checklist() == []


def test_a_family_added_without_the_checklist_is_named_until_it_follows_it(tmp_path):
  for folder in ("models", "configs/enwik8", "tests"):
    (tmp_path / folder).mkdir(parents=True)
  readme = "# x\n\n## Tour\n\n```\nmodels/\n  transformer.py  the baseline\n```\n\n## Next\n"
  (tmp_path / "README.md").write_text(readme)
  (tmp_path / "models" / "_helpers.py").write_text("X = 1\n")  # private modules are no family
  (tmp_path / "models" / "throwaway.py").write_text("class Model:\n  pass\n")
  assert family_checklist(tmp_path) == [
    "throwaway: models/throwaway.py defines no FAMILY record",
    "throwaway: no config file configs/<dataset>/throwaway.py",
    "throwaway: no test module of its own imports it (tests/test_throwaway.py)",
    "throwaway: the README's Tour does not name throwaway.py",
  ]
  (tmp_path / "models" / "throwaway.py").write_text("class Model:\n  pass\n\n\nFAMILY = Family(name='throwaway')\n")
  (tmp_path / "configs" / "enwik8" / "throwaway.py").write_text("def get_config(arg=None): ...\n")
  (tmp_path / "tests" / "test_throwaway.py").write_text("from lra_core.models import throwaway\n")
  (tmp_path / "README.md").write_text(readme.replace("the baseline\n", "the baseline\n  throwaway.py  new\n"))
  assert family_checklist(tmp_path) == []
