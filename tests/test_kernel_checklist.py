"""docs/kernels.md's "Adding a kernel" checklist, kept true by `checklist` over the real tree: every module of
kernels/ that calls pallas_call belongs to a core of kernels/catalog.py, and every core there has its
folder's modules, the drivers its kernel takes, its kernels in `kernels_at`, its GPU tiles, its row in the docs'
table and its tests/test_<core>_pallas.py. A throwaway kernel added without the checklist is reported by
name."""

import ast
import pathlib
import shutil

from lra_core.kernels import catalog, toolkit

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS, DOCS, TESTS = ROOT / "kernels", ROOT / "docs" / "kernels.md", ROOT / "tests"
SIZES = dict(seq_len=64, width=16, latents=8, block=16, codes=16, chunk=0, flash_chunk=16)


def calls_pallas(tree: ast.Module) -> bool:
  """Whether a module calls pallas_call (as `pl.pallas_call` or imported by name)."""
  return any(
    isinstance(node, ast.Call)
    and (getattr(node.func, "attr", None) == "pallas_call" or getattr(node.func, "id", None) == "pallas_call")
    for node in ast.walk(tree)
  )


def declared_drivers(tree: ast.Module) -> tuple[str, ...] | None:
  """The literal `DRIVERS = (...)` of a module, or None."""
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DRIVERS" for t in node.targets):
      return tuple(ast.literal_eval(node.value))
  return None


def core_table(text: str) -> list[str]:
  """The rows of docs/kernels.md's table of cores (the one whose header starts `| core |`)."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("| core |")), None)
  if start is None:
    return []
  rows = []
  for line in lines[start + 2 :]:  # past the header and its |---| line
    if not line.startswith("|"):
      break
    rows.append(line)
  return rows


def checklist(
  kernels: pathlib.Path,
  docs: pathlib.Path,
  tests: pathlib.Path,
  cores=catalog.CORES,
  kernel_names=None,
  gpu_tiles=toolkit.GPU_TILES,
) -> list[str]:
  """What the tree lacks of the checklist, one sentence each (empty: complete). kernel_names: the names
  `catalog.kernels_at` gives, by default its own."""
  kernel_names = set(catalog.kernels_at(**SIZES)) if kernel_names is None else set(kernel_names)
  modules = {  # by path under kernels/ without .py: vq/pallas
    p.relative_to(kernels).with_suffix("").as_posix(): ast.parse(p.read_text(), str(p))
    for p in sorted(kernels.rglob("*.py"))
  }
  owner = {stem: core.name for core in cores for stem in core.modules}
  problems = [
    f"kernels/{stem}.py calls pallas_call but is the module of no core in kernels/catalog.py's CORES"
    for stem, tree in modules.items()
    if calls_pallas(tree) and stem not in owner
  ]
  rows = core_table(docs.read_text())
  for core in cores:
    name, kernel = core.name, f"{core.name}/pallas"
    problems += [f"core {name}: kernels/{stem}.py is missing" for stem in core.modules if stem not in modules]
    for driver, stem in core.drivers.items():
      stem = f"{name}/{stem}"
      if stem in modules and not calls_pallas(modules[stem]):
        problems.append(f"core {name}: its {driver} driver kernels/{stem}.py calls no pallas_call")
    if kernel in modules and declared_drivers(modules[kernel]) != tuple(core.drivers):
      problems.append(f"core {name}: kernels/{kernel}.py's DRIVERS are not the catalog's {tuple(core.drivers)}")
    problems += [f"core {name}: kernel {k} is not in catalog.kernels_at" for k in core.kernels if k not in kernel_names]
    problems += [f"core {name}: no toolkit.GPU_TILES[{key!r}]" for key in core.gpu_tiles if key not in gpu_tiles]
    if not any(f"`kernels/{kernel}.py`" in row for row in rows):
      problems.append(f"core {name}: no row of the table in {docs.name} names `kernels/{kernel}.py`")
    test = tests / f"test_{name}_pallas.py"
    if not test.exists():
      problems.append(f"core {name}: tests/{test.name} is missing")
      continue
    text = test.read_text()
    every_driver = ("pallas.DRIVERS",)  # a test parametrized over them, or each by name
    for what, words in (
      ("its kernel module", (f"lra_core.kernels.{name} import pallas",)),
      ("interpret mode", ("interpret",)),
      ("gradients", ("grad",)),
      ("every driver", every_driver if every_driver[0] in text else tuple(f'"{d}"' for d in core.drivers)),
    ):
      if not all(word in text for word in words):
        problems.append(f"core {name}: tests/{test.name} does not test {what} ({', '.join(words)})")
  named = {k for core in cores for k in core.kernels}
  problems += [f"catalog.kernels_at's {k} belongs to no core" for k in sorted(kernel_names - named)]
  return problems


def test_the_tree_keeps_the_checklist():
  assert checklist(KERNELS, DOCS, TESTS) == []


def test_a_kernel_added_without_the_checklist_is_reported(tmp_path):
  """A copy of kernels/ with a throwaway rope_pallas.py calling pallas_call: reported by name, nothing else."""
  folder = tmp_path / "kernels"
  shutil.copytree(KERNELS, folder, ignore=shutil.ignore_patterns("__pycache__"))
  (folder / "rope_pallas.py").write_text(
    "from jax.experimental import pallas as pl\n\n\ndef rope(x):\n"
    "  return pl.pallas_call(lambda x_ref, o_ref: None, out_shape=x)(x)\n"
  )
  problems = checklist(folder, DOCS, TESTS)
  assert len(problems) == 1 and problems[0].startswith("kernels/rope_pallas.py calls pallas_call"), problems


def test_a_core_in_the_catalog_without_its_files_is_reported():
  """A catalog entry for a core with no modules, tests, docs row or tiles: each missing item named."""
  rope = catalog.Core("rope", kernels=("rope",), drivers={"grid": "tpu_grid"}, gpu_tiles=("rope",))
  problems = checklist(KERNELS, DOCS, TESTS, cores=catalog.CORES + (rope,))
  missing = ["rope/__init__.py", "rope/reference.py", "rope/pallas.py", "rope/tpu_grid.py"]
  assert [p for p in problems if p.endswith("is missing")][:4] == [
    f"core rope: kernels/{m} is missing" for m in missing
  ]
  for text in ("kernel rope is not in catalog.kernels_at", "GPU_TILES['rope']", "`kernels/rope/pallas.py`"):
    assert any(text in p for p in problems), (text, problems)
  assert "core rope: tests/test_rope_pallas.py is missing" in problems
  assert not [p for p in problems if not p.startswith("core rope")], problems


def test_drivers_the_kernel_takes_must_be_the_catalogs(tmp_path):
  """A kernel module whose DRIVERS drift from its catalog entry (a driver added to one only) is reported."""
  folder = tmp_path / "kernels"
  shutil.copytree(KERNELS, folder, ignore=shutil.ignore_patterns("__pycache__"))
  path = folder / "latte" / "pallas.py"
  text = path.read_text()
  assert 'DRIVERS = ("grid", "loop")' in text
  path.write_text(text.replace('DRIVERS = ("grid", "loop")', 'DRIVERS = ("grid", "loop", "parallel")'))
  assert checklist(folder, DOCS, TESTS) == [
    "core latte: kernels/latte/pallas.py's DRIVERS are not the catalog's ('grid', 'loop')"
  ]
