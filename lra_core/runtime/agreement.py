"""The processes of one run agree at start on what they run: the same config and the same code.

Started with different flags (one host given `--config.optim.lr=0.5`) or different code (one host's
checkout a commit behind), the processes of a multi-process run would still train together: one
workdir, a mixed run, and config.json recording process 0's config. So once joined (before the
backends start and long before the first step), every process publishes its config, a value per key,
and a digest of each source file of the package in the coordination service's key-value store, and
compares them with process 0's; process 0 compares with each of the others. A difference is a
ConfigError on each process that finds it, naming the first differing key or file, and
lra_core.cli.run ends every process with that sentence and status 2.

Where each host keeps its own copy of the data or its own cache, those paths may differ
(`PER_HOST_KEYS`): they name where the same bytes are, not what is computed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import pathlib

import jax

from lra_core.errors import ConfigError
from lra_core.runtime import process_end

KEY = "lra_core/agreement"
WAIT_MS = 120_000  # every process has passed jax.distributed.initialize (a barrier): they publish in seconds
PER_HOST_KEYS = (
  "data.dir",
  "data.cache_dir",
  "data.num_threads",
  "data.prefetch",
  "train.compile_cache",
  "train.local_checkpoint_dir",
)
# The packages whose files are the code a run executes (models/ and kernels/ install as lra_core's).
PACKAGES = ("lra_core", "lra_core.models", "lra_core.kernels")


def config_table(config) -> dict[str, str]:
  """`key: value as JSON` for every setting of `config` that every process must share."""
  flat = {}

  def walk(tree: dict, prefix: str) -> None:
    for k, v in tree.items():
      if isinstance(v, dict):
        walk(v, f"{prefix}{k}.")
      elif not f"{prefix}{k}".startswith(PER_HOST_KEYS):
        flat[prefix + k] = json.dumps(v, sort_keys=True, default=str)

  walk(config.to_dict(), "")
  return flat


def code_table() -> dict[str, str]:
  """`path: digest` of every Python file of the package (paths relative to each package's folder)."""
  table = {}
  for package in PACKAGES:
    spec = importlib.util.find_spec(package)
    for folder in spec.submodule_search_locations or ():
      root = pathlib.Path(folder)
      for path in sorted(root.rglob("*.py")):
        name = f"{package.replace('.', '/')}/{path.relative_to(root).as_posix()}"
        table[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
  return table


def first_difference(mine: dict, theirs: dict, other: int) -> str | None:
  """Where this process's tables (`config_table`, `code_table`) differ from process `other`'s, in words."""
  for key in sorted(set(mine["config"]) | set(theirs["config"])):
    here, there = mine["config"].get(key, "<absent>"), theirs["config"].get(key, "<absent>")
    if here != there:
      return f"config key {key} is {here} here and {there} on process {other}"
  for name in sorted(set(mine["code"]) | set(theirs["code"])):
    here, there = mine["code"].get(name), theirs["code"].get(name)
    if here != there:
      what = "is missing here" if here is None else "is missing there" if there is None else "differs"
      return f"source file {name} {what} (against process {other})"
  return None


def check(config) -> None:
  """In a multi-process run, ConfigError where this process's config or code differs from process 0's
  (process 0: from any other's). Does nothing in one process."""
  client = process_end.coordination_client()
  if client is None or jax.process_count() < 2:
    return
  me = jax.process_index()
  mine = {"config": config_table(config), "code": code_table()}
  client.key_value_set(f"{KEY}/{me}", json.dumps(mine))
  for other in range(1, jax.process_count()) if me == 0 else (0,):
    try:
      theirs = json.loads(client.blocking_key_value_get(f"{KEY}/{other}", WAIT_MS))
    except Exception as e:  # noqa: BLE001  (a peer that failed first is reported by the watchdog, not here)
      logging.warning("process %d published no config within %d s (%s): not compared", other, WAIT_MS // 1000, e)
      continue
    difference = first_difference(mine, theirs, other)
    if difference is not None:
      raise ConfigError(
        f"process {me} was not started like process {other}: {difference}; start every process of a run "
        "with the same flags and the same code."
      )
