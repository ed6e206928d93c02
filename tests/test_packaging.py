"""The package installs and imports models/, kernels/ and configs/ only as lra_core.models,
lra_core.kernels and lra_core.configs: a folder holding unrelated packages of those names changes
nothing, with the editable install of this checkout or with a plain install elsewhere."""

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

import lra_core
from lra_core.config import PROJECT_ROOT
from lra_core.errors import MissingExtra, optional_import

SPEC = "configs/lra/listops/transformer.py:tiny"
MAPPED = {
  "lra_core": "lra_core",
  "lra_core.models": "models",
  "lra_core.kernels": "kernels",
  "lra_core.configs": "configs",
}


def test_pyproject_lists_every_package_folder():
  setuptools = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  assert setuptools["package-dir"] == {k: v for k, v in MAPPED.items() if k != "lra_core"}
  folders = {
    name + "".join("." + part for part in init.parent.relative_to(PROJECT_ROOT / folder).parts)
    for name, folder in MAPPED.items()
    for init in (PROJECT_ROOT / folder).rglob("__init__.py")
  }
  assert sorted(setuptools["packages"]) == sorted(folders)


def test_the_top_level_layout_with_a_setup_py_shim_beside_pyproject():
  for folder in ("lra_core", "models", "kernels", "configs", "scripts", "tests", "docs"):
    assert (PROJECT_ROOT / folder).is_dir(), folder
  shim = (PROJECT_ROOT / "setup.py").read_text()
  assert "setup()" in shim and "name=" not in shim  # no metadata of its own: pyproject.toml is the source
  run = subprocess.run(
    [sys.executable, "setup.py", "--name", "--version"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
  )
  project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
  assert run.stdout.split()[-2:] == [project["name"], project["version"]]


def test_an_uninstalled_checkout_maps_its_folders():
  finder = lra_core._CheckoutFolders()
  for name in ("models", "kernels", "configs"):
    spec = finder.find_spec(f"lra_core.{name}", None)
    assert spec.origin == str(PROJECT_ROOT / name / "__init__.py")
    assert spec.submodule_search_locations == [str(PROJECT_ROOT / name)]
  assert finder.find_spec("models", None) is None and finder.find_spec("lra_core.scripts", None) is None
  # The whole import, the install's own finder taken away: lra_core's first imports already need the folders
  # (config reads the kernels' names), so the finder is in place before them (it once came after: an
  # uninstalled checkout could not import lra_core at all).
  program = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
    "import lra_core, lra_core.kernels, lra_core.models; print(lra_core.kernels.__file__, lra_core.models.__file__)"
  )
  run = subprocess.run(
    [sys.executable, "-c", program], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, check=False
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.split() == [
    str(PROJECT_ROOT / "kernels" / "__init__.py"),
    str(PROJECT_ROOT / "models" / "__init__.py"),
  ]


def test_a_missing_optional_package_names_its_extra():
  with pytest.raises(
    MissingExtra,
    match=r'^lra_core_absent is not installed; install the plot extra: '
    r'pip install -e "\.\[plot\]"\.$',
  ):
    optional_import("lra_core_absent.image", "plot")


@pytest.fixture
def decoys(tmp_path):
  """A folder with unrelated top-level packages models, kernels and configs that fail on import."""
  folder = tmp_path / "elsewhere"
  for name in ("models", "kernels", "configs"):
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(f"raise ImportError('the unrelated {name} package was imported')\n")
  return folder


def run(args, cwd, **env):
  proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=dict(os.environ, **env), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def train_tiny(folder, **env):
  """A tiny ListOps run started in `folder`; returns the file of the lra_core imported there."""
  where = run([sys.executable, "-c", "import lra_core.models; print(lra_core.__file__)"], folder, **env)
  out = run(
    [
      sys.executable,
      "-m",
      "lra_core.train",
      f"--config={SPEC}",
      f"--workdir={folder / 'run'}",
      "--config.train.steps=2",
    ],
    folder,
    **env,
  )
  assert "test_accuracy=" in out and (folder / "run" / "summary.json").is_file()
  return where.strip()


@pytest.mark.slow
def test_train_beside_unrelated_packages_with_the_editable_install(decoys):
  assert train_tiny(decoys) == str(PROJECT_ROOT / "lra_core" / "__init__.py")


@pytest.mark.slow
def test_train_and_console_script_after_a_plain_install(decoys, tmp_path):
  source, site = tmp_path / "source", tmp_path / "site"
  # A copy, so the build leaves no build/ or egg-info in the checkout.
  shutil.copytree(
    PROJECT_ROOT,
    source,
    ignore=shutil.ignore_patterns(
      ".git",
      "build",
      "dist",
      "*.egg-info",
      "__pycache__",
      ".pytest_cache",
      ".hypothesis",
      ".jax_cache",
      "runs",
      "workdirs",
      ".venv",
      "venv",
    ),
  )
  run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--quiet",
      "--no-deps",
      "--no-build-isolation",
      "--target",
      str(site),
      str(source),
    ],
    tmp_path,
  )
  assert not {"models", "kernels", "configs"} & {p.name for p in site.iterdir()}
  assert (site / "lra_core" / "configs" / "lra" / "listops" / "transformer.py").is_file()
  where = train_tiny(decoys, PYTHONPATH=str(site))
  assert where == str(site / "lra_core" / "__init__.py")
  out = run(
    [str(site / "bin" / "lra-eval"), f"--config={SPEC}", f"--workdir={decoys / 'run'}", "--split=test"],
    decoys,
    PYTHONPATH=str(site),
  )
  assert "split=test" in out
