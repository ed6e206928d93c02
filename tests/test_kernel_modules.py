"""The kernel modules import each other without cycles: each core's jnp reference (`<core>/reference.py`)
imports no Pallas code, its Pallas module builds on the reference and dispatches to its drivers, each
driver module belongs to one core, and the core's package (`<core>/__init__.py`) dispatches between the
two; no import hides inside a function to dodge a cycle. The cores and their modules are
kernels/catalog.py's. A module is named by its path under kernels/ without .py (`vq/reference`)."""

import ast
import pathlib

import lra_core.kernels
from lra_core.kernels import catalog

KERNELS = pathlib.Path(lra_core.kernels.__file__).resolve().parent
PACKAGE = "lra_core.kernels"
OPS = tuple(core.name for core in catalog.CORES)


def _modules() -> dict[str, ast.Module]:
  return {
    p.relative_to(KERNELS).with_suffix("").as_posix(): ast.parse(p.read_text(), str(p))
    for p in sorted(KERNELS.rglob("*.py"))
  }


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


def _module_of(name: str, modules) -> str:
  """The file of kernels/ an absolute name lives in: the longest module path it starts with, a package
  standing for its __init__ (`lra_core.kernels.vq.reference.MASK` -> vq/reference, `lra_core.kernels.vq`
  -> vq/__init__, a name of the package itself -> __init__)."""
  parts = name[len(PACKAGE) + 1 :].split(".") if name != PACKAGE else []
  for n in range(len(parts), 0, -1):
    path = "/".join(parts[:n])
    if path in modules:
      return path
    if f"{path}/__init__" in modules:
      return f"{path}/__init__"
  return "__init__"


def _kernel_deps(tree: ast.Module, modules) -> set[str]:
  """The files of kernels/ that a module imports."""
  return {_module_of(name, modules) for name in _imports(tree) if name == PACKAGE or name.startswith(PACKAGE + ".")}


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
    reference, kernel, *drivers = core.modules[1:]
    pallas = sorted(name for name in _imports(modules[reference]) if "pallas" in name)
    assert not pallas, (f"kernels/{reference}.py", pallas)
    above = sorted(_kernel_deps(modules[reference], modules) & {kernel, *drivers})
    assert not above, (f"kernels/{reference}.py", above)


def test_each_op_is_reference_kernel_drivers_and_dispatch():
  modules = _modules()
  for core in catalog.CORES:
    dispatch, reference, kernel, *drivers = core.modules
    assert set(drivers) <= _kernel_deps(modules[kernel], modules), core.name
    # the kernel builds on its reference, itself or through its drivers (a kernel whose backward is kernels
    # too need not import the reference for a VJP)
    below = set().union(*(_kernel_deps(modules[stem], modules) for stem in (kernel, *drivers)))
    assert reference in below, core.name
    assert {reference, kernel} <= _kernel_deps(modules[dispatch], modules), core.name


def test_a_driver_reaches_no_other_core_and_not_its_dispatch():
  """A driver module builds on its own core's reference (and its other driver's block steps) and the toolkit,
  never on another core or on the modules above it (its kernel's public function, the dispatch)."""
  modules = _modules()
  owner = {stem: core.name for core in catalog.CORES for stem in core.modules}
  for core in catalog.CORES:
    dispatch, _, kernel, *drivers = core.modules
    for stem in drivers:
      deps = _kernel_deps(modules[stem], modules)
      assert not deps & {dispatch, kernel, "catalog", "__init__"}, (stem, deps)
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
