"""The kernel modules import each other without cycles: each jnp reference (`*_xla.py`) imports no
Pallas code, each Pallas module builds on its reference and dispatches to its drivers, each driver
module belongs to one core, and each public module dispatches between the two; no import hides inside a
function to dodge a cycle. The cores and their modules are kernels/catalog.py's."""

import ast
import pathlib

import lra_core.kernels
from lra_core.kernels import catalog

KERNELS = pathlib.Path(lra_core.kernels.__file__).resolve().parent
PACKAGE = "lra_core.kernels"
OPS = tuple(core.name for core in catalog.CORES)


def _modules() -> dict[str, ast.Module]:
  return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(KERNELS.glob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
  """Absolute names of what an import statement loads (`from p import x` gives p.x)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  base = node.module or ""
  if node.level:
    base = ".".join(PACKAGE.split(".")[: len(PACKAGE.split(".")) - node.level + 1] + ([base] if base else []))
  return [f"{base}.{a.name}" for a in node.names]


def _imports(tree: ast.Module) -> set[str]:
  return {name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for name in _imported(node)}


def _kernel_deps(tree: ast.Module, modules) -> set[str]:
  """The files of kernels/ that a module imports; a name of the package itself counts as __init__."""
  deps = set()
  for name in _imports(tree):
    if name == PACKAGE:
      deps.add("__init__")
    elif name.startswith(PACKAGE + "."):
      stem = name[len(PACKAGE) + 1 :].split(".")[0]
      deps.add(stem if stem in modules else "__init__")
  return deps


def test_no_import_inside_a_function():
  found = []
  for stem, tree in _modules().items():
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found += [
          f"kernels/{stem}.py:{n.lineno} in {fn.name}"
          for n in ast.walk(fn)
          if isinstance(n, (ast.Import, ast.ImportFrom))
        ]
  assert not found, found


def test_references_import_no_pallas_code():
  modules = _modules()
  for core in catalog.CORES:
    op = core.name
    pallas = sorted(name for name in _imports(modules[f"{op}_xla"]) if "pallas" in name)
    assert not pallas, (f"kernels/{op}_xla.py", pallas)
    kernel = sorted(_kernel_deps(modules[f"{op}_xla"], modules) & {f"{op}_pallas", *core.drivers.values()})
    assert not kernel, (f"kernels/{op}_xla.py", kernel)


def test_each_op_is_reference_kernel_drivers_and_dispatch():
  modules = _modules()
  for core in catalog.CORES:
    op = core.name
    assert {f"{op}_xla", *core.drivers.values()} <= _kernel_deps(modules[f"{op}_pallas"], modules), op
    assert {f"{op}_xla", f"{op}_pallas"} <= _kernel_deps(modules[op], modules)


def test_a_driver_reaches_no_other_core_and_not_its_dispatch():
  """A driver module builds on its own core's reference (and its other driver's block steps) and the toolkit,
  never on another core or on the modules above it (its kernel's public function, the dispatch)."""
  modules = _modules()
  owner = {stem: core.name for core in catalog.CORES for stem in core.modules}
  for core in catalog.CORES:
    for stem in core.drivers.values():
      deps = _kernel_deps(modules[stem], modules)
      assert not deps & {core.name, f"{core.name}_pallas", "catalog", "__init__"}, (stem, deps)
      assert {owner.get(d, core.name) for d in deps} == {core.name}, (stem, deps)


def test_no_cycle_between_kernel_modules():
  modules = _modules()
  deps = {stem: _kernel_deps(tree, modules) - {stem} for stem, tree in modules.items()}
  done, path = set(), []

  def visit(stem):
    if stem in path:
      raise AssertionError(f"import cycle: {' -> '.join(path[path.index(stem) :] + [stem])}")
    if stem in done:
      return
    path.append(stem)
    for dep in sorted(deps[stem]):
      visit(dep)
    path.pop()
    done.add(stem)

  for stem in deps:
    visit(stem)
