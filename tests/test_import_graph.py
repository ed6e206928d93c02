"""The package's import graph: layered, without cycles, without imports hidden in functions, and
without reaches into another module's private names.

Every file of lra_core (with models/, kernels/ and configs/ as lra_core.models, .kernels, .configs)
is parsed; an edge runs from a module to each project module it imports, at any depth. Model and
kernel code never reaches the trainer (and kernels nothing outside kernels/), a private module
(`_name.py`) is imported only from its own package, no two files import each other (directly or round a
longer loop), no project import sits inside a function, where it would hide such a loop, and no
module uses another's `_private` names (`from m import _x` or `m._x`): what a module shares it
makes public.
Imports of optional third-party packages inside functions stay allowed (they keep a missing
extra from breaking unrelated commands).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {
  "lra_core": ROOT / "lra_core",
  "lra_core.models": ROOT / "models",
  "lra_core.kernels": ROOT / "kernels",
  "lra_core.configs": ROOT / "configs",
}


def project_modules() -> dict[str, pathlib.Path]:
  """module name -> file, for every .py file of the package."""
  out = {}
  for package, folder in PACKAGES.items():
    for path in folder.rglob("*.py"):
      parts = path.relative_to(folder).with_suffix("").parts
      name = ".".join((package, *parts))
      out[name.removesuffix(".__init__")] = path
  return out


def imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
  """Candidate module names an import statement names (resolved later against the project)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = node.module or ""
  if node.level:
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - node.level + 1]
    base = ".".join(anchor + ([base] if base else []))
  return [f"{base}.{alias.name}" for alias in node.names] + [base]


def graph() -> tuple[dict[str, set[str]], list[str]]:
  """(module -> project modules it imports, 'file:line module' for project imports in functions)."""
  modules = project_modules()
  edges, hidden = {name: set() for name in modules}, []
  for name, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    nested = {
      id(n)
      for f in ast.walk(tree)
      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
      for n in ast.walk(f)
      if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      targets = []
      for candidate in imported_names(node, name, path.name == "__init__.py"):
        while candidate and candidate not in modules:
          candidate = candidate.rpartition(".")[0]
        if candidate and candidate != name:
          targets.append(candidate)
      # `from pkg import sub` names the submodule; the package itself is only an edge when nothing
      # more specific was found.
      specific = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
      edges[name] |= specific
      if id(node) in nested and specific:
        hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(specific)}")
  return edges, hidden


def private_reaches() -> list[str]:
  """'file:line name' for each use of another project module's `_private` name: imported by name,
  or read as an attribute of an imported project module."""
  modules = project_modules()
  return [
    f"{path.relative_to(ROOT)}:{use}"
    for name, path in modules.items()
    for use in private_uses(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
  ]


def private_uses(tree: ast.AST, name: str, is_package: bool, modules) -> list[str]:
  """'line name' for each private name of another project module that module `name` uses."""
  found, module_aliases = [], {}  # local name -> the project module it is bound to
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      for alias in node.names:
        target = imported_names(ast.ImportFrom(module=node.module, names=[alias], level=node.level), name, is_package)[
          0
        ]
        if target in modules:
          module_aliases[alias.asname or alias.name] = target
        elif _is_private(alias.name):
          found.append(f"{node.lineno} {alias.name}")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.asname and alias.name in modules:
          module_aliases[alias.asname] = alias.name
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and _is_private(node.attr)
      and module_aliases.get(node.value.id, name) != name
    ):
      found.append(f"{node.lineno} {node.value.id}.{node.attr}")
  return found


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for w in edges[todo.pop()] - seen:
      seen.add(w)
      todo.append(w)
  return seen


def test_no_import_cycles():
  assert cycles(graph()[0]) == []


def test_no_project_imports_inside_functions():
  assert graph()[1] == []


def test_no_module_uses_another_modules_private_names():
  assert private_reaches() == []


# The run machinery and the commands above the models: a model imports its layers, kernels and the
# small shared facts below it (errors, the protocol, model-facing sharding, layer stacks), never these.
TRAINER = (
  "lra_core.aot",
  "lra_core.bench",
  "lra_core.checkpoints",
  "lra_core.cli",
  "lra_core.compilation",
  "lra_core.config",
  "lra_core.cost",
  "lra_core.data",
  "lra_core.evaluate",
  "lra_core.layout",
  "lra_core.registry",
  "lra_core.reproduce",
  "lra_core.run",
  "lra_core.sample",
  "lra_core.sweep",
  "lra_core.tasks",
  "lra_core.train",
)


def in_package(module: str, packages) -> bool:
  return any(module == p or module.startswith(p + ".") for p in packages)


def test_models_and_kernels_do_not_reach_the_trainer():
  edges, _ = graph()
  for name in edges:
    if in_package(name, ("lra_core.models", "lra_core.kernels")):
      assert not [m for m in reachable(edges, name) if in_package(m, TRAINER)], name


def test_kernels_import_nothing_of_the_project_but_kernels():
  edges, _ = graph()
  for name in edges:
    if in_package(name, ("lra_core.kernels",)):
      assert not [m for m in reachable(edges, name) if not in_package(m, ("lra_core.kernels",))], name


# lra_core's groups, bottom to top: the process's runtime (start-up, peers, signals, the step watchdog, the
# run lock, files and stores, exit statuses) imports only itself and the error types; the cost estimates
# read compiled programs and the kernels' declared costs, never a run; a run (state, optimizer, steps,
# data setup, outputs) is priced and compiled by the groups above it, never the other way; the
# checkpointer sits below the train state it saves (it reads the layer-stack key from layer_stacks).
GROUPS_BELOW = {  # group -> the groups (and top-level modules) it may never reach
  "lra_core.runtime": ("lra_core.cost", "lra_core.run", "lra_core.compilation", "lra_core.checkpoints"),
  "lra_core.cost": ("lra_core.runtime", "lra_core.run", "lra_core.compilation", "lra_core.checkpoints"),
  "lra_core.run": ("lra_core.cost", "lra_core.compilation", "lra_core.checkpoints", "lra_core.train"),
  "lra_core.compilation": ("lra_core.checkpoints", "lra_core.train", "lra_core.evaluate", "lra_core.aot"),
  "lra_core.checkpoints.checkpointer": ("lra_core.run", "lra_core.cost", "lra_core.compilation"),
}


def test_lra_core_s_groups_import_one_way():
  edges, _ = graph()
  for group, above in GROUPS_BELOW.items():
    for name in (n for n in edges if in_package(n, (group,))):
      assert not [m for m in reachable(edges, name) if in_package(m, above)], name
  for name in (n for n in edges if in_package(n, ("lra_core.runtime",))):
    assert all(in_package(m, ("lra_core.runtime", "lra_core.errors")) for m in reachable(edges, name)), name


def test_lra_core_s_top_level_holds_the_commands_and_the_contracts():
  """At most 20 modules at lra_core's top level; the rest sit in its subpackages, and no project file
  imports a module by the old path it keeps for outside code (lra_core.MOVED)."""
  import lra_core

  top = list(PACKAGES["lra_core"].glob("*.py"))
  assert len(top) <= 20, sorted(p.name for p in top)
  modules = project_modules()
  for old, new in lra_core.MOVED.items():
    assert old not in modules and new in modules, (old, new)
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        assert not [n for n in names if n in lra_core.MOVED], f"{path.relative_to(ROOT)}:{node.lineno}"
      elif isinstance(node, ast.Import):
        assert not [a.name for a in node.names if a.name in lra_core.MOVED], f"{path.relative_to(ROOT)}:{node.lineno}"


def test_a_moved_module_s_old_path_imports_the_same_module():
  import importlib

  import lra_core

  for old, new in lra_core.MOVED.items():
    assert importlib.import_module(old) is importlib.import_module(new), old
    assert importlib.import_module(new).__spec__.name == new, old  # its own spec still: its folder found by name
  from lra_core.checkpoint import Checkpointer  # the old paths docs/api.md's readers may hold
  from lra_core.checkpoints.checkpointer import Checkpointer as moved

  assert Checkpointer is moved


def private_module_imports(edges: dict[str, set[str]]) -> list[str]:
  """'importer -> module' for each import of a private module (`_name.py`) from outside its package."""
  return sorted(
    f"{name} -> {target}"
    for name, targets in edges.items()
    for target in targets
    if _is_private(target.rpartition(".")[2]) and name.rpartition(".")[0] != target.rpartition(".")[0]
  )


def test_private_modules_are_imported_only_inside_their_package():
  assert private_module_imports(graph()[0]) == []


def test_the_checker_sees_cycles_and_resolves_relative_imports():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  node = ast.parse("from .layers import core").body[0]
  assert "lra_core.models.layers.core" in imported_names(node, "lra_core.models.fit", False)
  edges, _ = graph()
  assert "lra_core.models.layers.core" in edges["lra_core.models.transformer"]
  assert "lra_core.registry" in edges["lra_core.config"]
  modules = project_modules()
  reaching = ast.parse(
    "from lra_core import decoding\nfrom lra_core.runtime.fs import _x, y\n"
    "import lra_core.run.optim as opt\ndecoding._mode(opt._y, _z)\n"
  )
  assert private_uses(reaching, "lra_core.models.fit", False, modules) == ["2 _x", "4 decoding._mode", "4 opt._y"]
  edges = {
    "lra_core.models.a": {"lra_core.models._b"},
    "lra_core.sharding": {"lra_core.models._b"},
    "lra_core.models._b": set(),
  }
  assert private_module_imports(edges) == ["lra_core.sharding -> lra_core.models._b"]
  assert in_package("lra_core.data.datasets.lra.listops", TRAINER) and not in_package(
    "lra_core.datasets", ("lra_core.data",)
  )
