"""lra_core: one trainer, many efficient long-sequence transformers (JAX, Flax NNX).

  cfg = lra_core.load_config("configs/lra/listops/transformer.py:tiny", ["train.steps=10"])
  model = lra_core.build_model(cfg, seed=0)
  summary = lra_core.train.train_and_evaluate(cfg, workdir="/tmp/run")

The folders models/, kernels/ and configs/ beside lra_core/ are the subpackages lra_core.models,
lra_core.kernels and lra_core.configs: an install maps them so (pyproject.toml), and in a checkout
that is not installed `_CheckoutFolders` does. Modules that moved into the subpackages keep their old
import paths (`MOVED`; `_MovedModules`), so outside code that imports `lra_core.checkpoint` still runs.
"""

import importlib.abc
import importlib.util
import pathlib
import sys

from lra_core.runtime import quiet_start

with quiet_start.prepare():  # a command starts JAX without accelerator plugin noise (lra_core/runtime/quiet_start.py)
  import jax  # noqa: F401


__all__ = [
  "load_config",
  "build_model",
  "UserError",
  "ConfigError",
  "DataError",
  "CheckpointError",
  "DecodingError",
  "TrainingDiverged",
]
__version__ = "0.1.0"


class _CheckoutFolders(importlib.abc.MetaPathFinder):
  """Finds lra_core.models / .kernels / .configs in a checkout's folders when nothing else does."""

  root = pathlib.Path(__file__).resolve().parent.parent

  def find_spec(self, fullname, path, target=None):
    if (
      fullname not in ("lra_core.models", "lra_core.kernels", "lra_core.configs")
      or not (self.root / "pyproject.toml").is_file()
    ):
      return None
    folder = self.root / fullname.removeprefix("lra_core.")
    return importlib.util.spec_from_file_location(
      fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )


# Old import path -> the module's home since lra_core/ was grouped into subpackages, kernels/ into one
# folder per core and models/ into family packages (README, "Moved").
MOVED = {
  "lra_core.data.bytes": "lra_core.data.datasets.bytes",
  "lra_core.data.c4": "lra_core.data.datasets.c4",
  "lra_core.data.imagenet64": "lra_core.data.datasets.imagenet64",
  "lra_core.data.lra": "lra_core.data.datasets.lra",
  "lra_core.data.lra.cifar10": "lra_core.data.datasets.lra.cifar10",
  "lra_core.data.lra.imdb": "lra_core.data.datasets.lra.imdb",
  "lra_core.data.lra.listops": "lra_core.data.datasets.lra.listops",
  "lra_core.data.lra.pathfinder": "lra_core.data.datasets.lra.pathfinder",
  "lra_core.data.lra.pathfinder_generator": "lra_core.data.datasets.lra.pathfinder_generator",
  "lra_core.data.lra.retrieval": "lra_core.data.datasets.lra.retrieval",
  "lra_core.data.pg19": "lra_core.data.datasets.pg19",
  "lra_core.bench.peer": "lra_core.bench.side_by_side",
  "lra_core.bench.peer_lm1b": "lra_core.bench.plain_jax_lm1b",
  "lra_core.bench.peer_vq": "lra_core.bench.plain_jax_vq",
  "lra_core.runtime.startup": "lra_core.runtime.quiet_start",
  "lra_core.tables": "lra_core.markdown",
  "lra_core.aot_report": "lra_core.compilation.aot_report",
  "lra_core.aot_targets": "lra_core.compilation.aot_targets",
  "lra_core.checkpoint": "lra_core.checkpoints.checkpointer",
  "lra_core.chips": "lra_core.cost.chips",
  "lra_core.compile_cache": "lra_core.compilation.compile_cache",
  "lra_core.data_setup": "lra_core.run.data_setup",
  "lra_core.distributed": "lra_core.runtime.distributed",
  "lra_core.exit_codes": "lra_core.runtime.exit_codes",
  "lra_core.fs": "lra_core.runtime.fs",
  "lra_core.hlo_cost": "lra_core.cost.hlo_cost",
  "lra_core.hlo_flops": "lra_core.cost.hlo_flops",
  "lra_core.hlo_text": "lra_core.cost.hlo_text",
  "lra_core.host_memory": "lra_core.runtime.host_memory",
  "lra_core.init_from": "lra_core.checkpoints.init_from",
  "lra_core.kernels.attention": "lra_core.kernels.softmax.reference",
  "lra_core.kernels.context": "lra_core.kernels.context_parallel",
  "lra_core.kernels.flash": "lra_core.kernels.mixed_chunk",
  "lra_core.kernels.flash_grid": "lra_core.kernels.mixed_chunk.tpu_grid",
  "lra_core.kernels.flash_pallas": "lra_core.kernels.mixed_chunk.pallas",
  "lra_core.kernels.flash_parallel": "lra_core.kernels.mixed_chunk.gpu_parallel",
  "lra_core.kernels.flash_xla": "lra_core.kernels.mixed_chunk.reference",
  "lra_core.kernels.latte_grid": "lra_core.kernels.latte.tpu_grid",
  "lra_core.kernels.latte_loop": "lra_core.kernels.latte.gpu_loop",
  "lra_core.kernels.latte_pallas": "lra_core.kernels.latte.pallas",
  "lra_core.kernels.latte_xla": "lra_core.kernels.latte.reference",
  "lra_core.kernels.library_attention": "lra_core.kernels.softmax.library",
  "lra_core.kernels.ring_attention": "lra_core.kernels.softmax.ring",
  "lra_core.kernels.segments": "lra_core.kernels.packed_documents",
  "lra_core.kernels.splash_lists": "lra_core.kernels.softmax.splash_lists",
  "lra_core.kernels.vq_grid": "lra_core.kernels.vq.tpu_grid",
  "lra_core.kernels.vq_pallas": "lra_core.kernels.vq.pallas",
  "lra_core.kernels.vq_parallel": "lra_core.kernels.vq.gpu_parallel",
  "lra_core.kernels.vq_xla": "lra_core.kernels.vq.reference",
  "lra_core.metrics": "lra_core.run.metrics",
  "lra_core.models._block_embedders": "lra_core.models.block_transformer.embedders",
  "lra_core.models._block_generation": "lra_core.models.block_transformer.generation",
  "lra_core.models._block_stacks": "lra_core.models.block_transformer.stacks",
  "lra_core.models._block_uptraining": "lra_core.models.block_transformer.uptraining",
  "lra_core.models._fit_groups": "lra_core.models.fit.groups",
  "lra_core.models._vq_unit": "lra_core.models.transformer_vq.unit",
  "lra_core.models.blocks": "lra_core.models.layers",
  "lra_core.models.blocks.attention": "lra_core.models.layers.attention",
  "lra_core.models.blocks.heads": "lra_core.models.layers.heads",
  "lra_core.models.blocks.layers": "lra_core.models.layers.core",
  "lra_core.models.blocks.positions": "lra_core.models.layers.positions",
  "lra_core.models.blocks.stack": "lra_core.models.layers.stack",
  "lra_core.models.fit_denoiser": "lra_core.models.fit.denoiser",
  "lra_core.optim": "lra_core.run.optim",
  "lra_core.pallas_costs": "lra_core.cost.pallas_costs",
  "lra_core.preemption": "lra_core.runtime.preemption",
  "lra_core.profiler": "lra_core.run.profiler",
  "lra_core.read_fallout": "lra_core.checkpoints.read_failures",
  "lra_core.run_lock": "lra_core.runtime.run_lock",
  "lra_core.startup": "lra_core.runtime.quiet_start",
  "lra_core.state": "lra_core.run.state",
  "lra_core.step_compile": "lra_core.compilation.step_compile",
  "lra_core.steps": "lra_core.run.steps",
  "lra_core.throughput": "lra_core.cost.throughput",
  "lra_core.trackers": "lra_core.run.trackers",
  "lra_core.watchdog": "lra_core.runtime.watchdog",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports a moved module under its old name too: the same module object, not a copy, so a
  monkeypatch or an isinstance check through either path sees the one module."""

  def find_spec(self, fullname, path, target=None):
    return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

  def create_module(self, spec):
    module = importlib.import_module(MOVED[spec.name])
    spec.loader_state = module.__spec__
    return module

  def exec_module(self, module):
    # Already run, under its new name. The import system has just set the module's __spec__ to the old
    # name's: put its own back, or importlib.util.find_spec of the new name (the registry's way to find a
    # folder) would answer with the old name's spec, which has no folder.
    module.__spec__ = module.__spec__.loader_state


# First: a submodule of a moved package (lra_core.models.blocks.attention) would otherwise be found again in
# the new package's folder and run a second time, as a second module.
sys.meta_path.insert(0, _MovedModules())
sys.meta_path.append(_CheckoutFolders())  # last: an install's own mapping comes first

# After the finders: config imports lra_core.kernels, which a checkout that is not installed finds only through
# _CheckoutFolders.
from lra_core.config import load_config  # noqa: E402
from lra_core.errors import CheckpointError, ConfigError, DataError, DecodingError, TrainingDiverged, UserError  # noqa: E402
from lra_core.registry import build_model  # noqa: E402
