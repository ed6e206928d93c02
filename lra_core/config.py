"""Config loading: `load_config("configs/<data>/<model>.py:arg", overrides)`.

A config file defines `get_config(arg=None)` returning an ml_collections ConfigDict built on
`base_config()`. Overrides are `key=value` strings with dotted keys, parsed with the type of the
existing field; unknown keys, wrong types and inconsistent values raise `ConfigError` with one
sentence, before anything is built or compiled.

Reading back the config a run saved in its workdir (older layouts upgraded, the resume checks) is
lra_core.checkpoints.saved_config's, above this module.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import pathlib
from collections.abc import Iterable, Sequence

import ml_collections

from lra_core import registry, task_kinds
from lra_core.errors import ConfigError
from lra_core.kernels.softmax.library import IMPLS as ATTENTION_IMPLS
from lra_core.layer_stacks import MODEL_DEFAULTS, REMAT_POLICIES
from lra_core.registry import package_dir
from lra_core.run import optim_settings as optim_lib
from lra_core.run.trackers import TRACKERS
from lra_core.sharding import MESH_AXES, SLICE_AXES

DTYPES = ("float32", "bfloat16", "float16")
PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent  # a checkout's root (tests read files there)

# Logical axis name -> mesh axes. Parameters carry logical names (see models/layers/core.py);
# these rules give data parallelism over `data`, ZeRO-3 style sharding of the `embed` dimension
# over `fsdp`, Megatron-style splitting of heads / MLP width / vocabulary over `tensor`, and the
# time steps of activations and batches over `sequence` (docs/long_context.md).
DEFAULT_RULES = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("length", "sequence"),
  ("head_dim", None),
  ("layers", None),  # the leading axis of scanned layer stacks (model.scan_layers): never split
)


def base_config(
  *,
  task: str,
  model: ml_collections.ConfigDict,
  data: ml_collections.ConfigDict,
  optim: ml_collections.ConfigDict | None = None,
) -> ml_collections.ConfigDict:
  """The fields every experiment has; config files fill in model, data and sizes."""
  c = ml_collections.ConfigDict()
  c.task = task
  c.model = model
  add_model_defaults(c)
  c.data = data
  with c.data.unlocked():
    if "num_threads" not in c.data:
      c.data.num_threads = 2  # host threads reading and batching examples
    if "prefetch" not in c.data:
      c.data.prefetch = 4  # batches read ahead of the train step
  c.train = ml_collections.ConfigDict(
    dict(
      steps=1000,
      batch_size=32,  # global batch, in sequences
      eval_batch_size=0,  # 0 -> batch_size
      seq_len=512,
      update_len=0,  # lm: optimizer step per window of this many tokens; 0 -> seq_len
      grad_accum_steps=1,  # micro-batches per optimizer step
      seed=0,
      log_every=50,  # 0 -> about 10 logs per run (steps // 10)
      eval_every=500,  # 0 -> only at the end
      eval_batches=0,  # 0 -> the whole validation split
      checkpoint_every=500,  # 0 -> only at the end
      keep_checkpoints=3,
      # Also every this many steps, each process's shards to its host's own disk (a local SSD, /dev/shm):
      # a restart takes the newest step every process holds there (lra_core/checkpoints/local_tier.py).
      local_checkpoint_every=0,  # 0 -> off
      local_checkpoint_dir="",
      test_at_end=True,  # evaluate the test split after the last step
      nan_check=True,  # stop at the first non-finite loss / gradient / parameter
      skip_nonfinite=False,  # instead, skip such an update and count it (metric skipped_steps)
      max_skipped_fraction=0.1,  # with skip_nonfinite: a run that skipped more of its steps fails at the end
      # A checkpoint still being written this long after it began stops the run (0: no limit); once a save
      # has completed, min(this, max(90 s, 10 x the slowest)): lra_core/checkpoints/save_limit.py.
      save_timeout_s=1800.0,
      # No step for max(watchdog_min_s, watchdog_factor x the median step): every thread's stack to the
      # log, exit status 75 (restarted by the supervisors; lra_core/runtime/watchdog.py). Factor 0: off.
      watchdog_factor=20.0,
      watchdog_min_s=1800.0,
      # a workdir whose latest parameters start a fresh run (uptraining), or hf:<folder> (docs/checkpoints.md)
      init_from="",
      memory_limit_gib=0.0,  # per-device budget the compiled train step must fit; 0 -> the device's
      profile_steps="",  # "a:b": a jax.profiler trace of steps a..b-1 into <workdir>/tensorboard
      compile_cache="auto",  # persistent compilation cache: auto ($LRA_CORE_CACHE, else next to the
      # workdir), off, or a folder (local or gs://)
      peak_flops=0.0,  # MFU denominator per device; 0 -> lra_core.cost.chips (CPU: measured matmul peak)
      sample_every=0,  # image tasks: a sample grid in TensorBoard every this many steps; 0 -> off
      tracker="none",  # none | wandb | trackio: mirror config, metrics and images to a tracker
      tracker_project="lra_core",
    )
  )
  c.optim = optim if optim is not None else optim_lib.default_config()
  c.mesh = ml_collections.ConfigDict(
    dict(
      data=-1,
      fsdp=1,
      sequence=1,
      tensor=1,
      # TPU slices joined over the data-center network (or, on CPU and GPU, processes): slice_axis spans
      # them and every other axis stays inside one (lra_core/layout.py). 1: one slice.
      slices=1,
      slice_axis="data",
    )
  )
  c.sharding = ml_collections.ConfigDict(dict(rules=DEFAULT_RULES))
  c.mlm = ml_collections.ConfigDict(
    dict(
      mask_rate=0.15,  # BERT: 15% of tokens are predicted ...
      replace_mask=0.8,  # ... of which 80% become [MASK],
      replace_random=0.1,  # 10% a random token, the rest stay unchanged
      mask_id=-1,  # -1 -> model.vocab_size - 1
    )
  )
  return c


def add_model_defaults(config: ml_collections.ConfigDict) -> None:
  """Adds the MODEL_DEFAULTS fields a config.model lacks (also after a config file replaced it)."""
  with config.model.unlocked():
    for key, value in MODEL_DEFAULTS.items():
      if key not in config.model:
        config.model[key] = value


def tiny_train(config: ml_collections.ConfigDict, seq_len: int) -> None:
  """The `tiny` training settings: a few steps on short sequences, one device, seconds on a CPU."""
  config.train.update(
    dict(steps=4, batch_size=8, seq_len=seq_len, log_every=0, eval_every=0, eval_batches=2, checkpoint_every=0)
  )
  config.optim.warmup_steps = min(config.optim.warmup_steps, 2)
  config.mesh.data = 1


def log_interval(train: ml_collections.ConfigDict) -> int:
  """Steps between logs: train.log_every, or for 0 about 10 logs per run whatever train.steps is."""
  return train.log_every or max(1, train.steps // 10)


def config_arg(arg: str | None, allowed: Sequence[str]) -> set[str]:
  """Splits a config arg like 'tiny,plus' into parts, each of which must be in `allowed`."""
  parts = {p for p in (arg or "").split(",") if p}
  unknown = parts - set(allowed)
  if unknown:
    raise ConfigError(
      f"config arg {sorted(unknown)[0]!r} is not known; expected a comma-separated subset of {list(allowed)}."
    )
  return parts


def resolve_path(path: str) -> pathlib.Path:
  """A config path as given; a `configs/...` path that is not there is read from the lra_core.configs
  package instead, so specs work from any folder."""
  p = pathlib.Path(path).expanduser()
  if p.exists() or p.is_absolute() or p.parts[:1] != ("configs",):
    return p
  return package_dir("configs").joinpath(*p.parts[1:])


def split_spec(spec: str) -> tuple[str, str | None]:
  path, sep, arg = spec.rpartition(":")
  if sep and path.endswith(".py"):
    return path, arg
  return spec, None


def load_config(spec: str, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path[:arg]`, applies `key=value` overrides, validates, and returns a locked config."""
  path, arg = split_spec(spec)
  file = resolve_path(path)
  if not file.is_file():
    packaged = file != pathlib.Path(path).expanduser()
    where = f" here nor in the lra_core.configs package ({str(file)!r})" if packaged else ""
    raise ConfigError(f"config file {path!r} does not exist{where}.")
  module_name = "lra_core_config_" + hashlib.md5(str(file).encode()).hexdigest()[:12]
  module_spec = importlib.util.spec_from_file_location(module_name, file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path!r} defines no get_config(arg).")
  config = module.get_config(arg) if arg is not None else module.get_config()
  config = ml_collections.ConfigDict(config)  # a copy: never mutate what the file returned
  if "model" in config:
    add_model_defaults(config)
  apply_overrides(config, overrides)
  validate(config)
  config.lock()
  return config


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for k, v in config.items():
    if isinstance(v, ml_collections.ConfigDict):
      keys += flat_keys(v, prefix + k + ".")
    else:
      keys.append(prefix + k)
  return keys


# Names other frameworks give fields of ours: an unknown key ending in one is pointed at our field first
# (difflib alone would suggest optim.decay_rate for optim.learning_rate).
ALIASES = {
  "learning_rate": "lr",
  "lr_schedule": "schedule",
  "num_train_steps": "steps",
  "train_steps": "steps",
  "max_steps": "steps",
  "total_steps": "steps",
  "warmup": "warmup_steps",
  "num_warmup_steps": "warmup_steps",
  "seq_length": "seq_len",
  "max_seq_len": "seq_len",
  "sequence_length": "seq_len",
  "hidden_size": "d_model",
  "emb_dim": "d_model",
  "n_layers": "num_layers",
  "num_hidden_layers": "num_layers",
  "n_heads": "num_heads",
  "num_attention_heads": "num_heads",
  "intermediate_size": "d_ff",
  "mlp_dim": "d_ff",
  "dropout_rate": "dropout",
}


def suggestions(key: str, config: ml_collections.ConfigDict) -> list[str]:
  """Up to 3 valid keys for the unknown `key`: our field for a common alias (ALIASES; in the same section
  first), then the closest spellings."""
  keys = flat_keys(config)
  section, _, leaf = key.rpartition(".")
  ours = ALIASES.get(leaf)
  aliased = [k for k in keys if ours and k.rpartition(".")[2] == ours]
  aliased.sort(key=lambda k: k.rpartition(".")[0] != section)
  close = [k for k in difflib.get_close_matches(key, keys, n=3, cutoff=0.5) if k not in aliased]
  return (aliased + close)[:3]


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
  for item in overrides:
    key, sep, text = item.partition("=")
    key = key.strip().removeprefix("--config.").removeprefix("config.")
    if not sep or not key:
      raise ConfigError(f"override {item!r} is not of the form key=value.")
    *parents, leaf = key.split(".")
    node = config
    for i, name in enumerate(parents + [leaf]):
      if not isinstance(node, ml_collections.ConfigDict) or name not in node:
        close = suggestions(key, config)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}.")
      if i < len(parents):
        node = node[name]
    current = node[leaf]
    if isinstance(current, ml_collections.ConfigDict):
      raise ConfigError(f"config key {key!r} is a section; set one of its fields instead.")
    with node.unlocked():
      node[leaf] = parse_value(key, text, current)


def parse_value(key: str, text: str, current):
  """Parses `text` with the type of the field's current value."""
  text = text.strip()
  kind = type(current)
  try:
    if isinstance(current, bool):
      lowered = text.lower()
      if lowered in ("true", "1", "yes"):
        return True
      if lowered in ("false", "0", "no"):
        return False
      raise ValueError
    if isinstance(current, int):
      return int(text.replace("_", ""))
    if isinstance(current, float):
      return float(text)
    if isinstance(current, str):
      if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
      return text
    value = ast.literal_eval(text)
    if isinstance(current, (tuple, list)):
      if not isinstance(value, (tuple, list)):
        value = (value,)
      return kind(value)
    return value
  except (ValueError, SyntaxError):
    article = "an" if kind.__name__[0] in "aeiou" else "a"
    raise ConfigError(f"config key {key!r} expects {article} {kind.__name__}, got {text!r}.") from None


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """train.profile_steps "a:b" -> (a, b): trace steps a..b-1 (counted from 0, as the loop counts); "" -> None."""
  if not spec:
    return None
  a, sep, b = spec.partition(":")
  try:
    first, stop = int(a), int(b)
  except ValueError:
    first = stop = -1
  if not sep or first < 0 or stop <= first:
    raise ConfigError(f"train.profile_steps {spec!r} is not 'a:b' with 0 <= a < b (e.g. '10:15').")
  return first, stop


def _positive(config, *keys: str) -> None:
  for key in keys:
    section, name = key.split(".")
    value = config[section][name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ConfigError(f"{key} must be a positive integer, got {value!r}.")


def validate(config: ml_collections.ConfigDict) -> None:
  """Cross-field checks shared by all configs, then the optimizer's and the model's."""
  for section in ("model", "data", "train", "optim", "mesh"):
    if section not in config:
      raise ConfigError(f"config has no {section!r} section; build it with lra_core.config.base_config.")
  task_kinds.kind(config.task)  # an unknown task is one sentence here
  _positive(
    config,
    "train.steps",
    "train.batch_size",
    "train.seq_len",
    "train.grad_accum_steps",
    "train.keep_checkpoints",
  )
  train = config.train
  for key in (
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "eval_batch_size",
    "update_len",
    "memory_limit_gib",
    "peak_flops",
    "sample_every",
    "watchdog_factor",
    "local_checkpoint_every",
  ):
    if train[key] < 0:
      raise ConfigError(f"train.{key} must be >= 0, got {train[key]}.")
  if train.local_checkpoint_every and not train.local_checkpoint_dir:
    raise ConfigError(
      "train.local_checkpoint_every needs train.local_checkpoint_dir, a folder on each host's own disk "
      "(a local SSD, or a RAM disk such as /dev/shm)."
    )
  if "://" in train.local_checkpoint_dir:
    raise ConfigError(
      f"train.local_checkpoint_dir {train.local_checkpoint_dir!r} is an object store; the local tier is each "
      "host's own disk (a local SSD, or a RAM disk such as /dev/shm)."
    )
  if train.watchdog_factor and not train.watchdog_min_s > 0:
    raise ConfigError(
      f"train.watchdog_min_s must be > 0 with the watchdog on (train.watchdog_factor {train.watchdog_factor}), "
      f"got {train.watchdog_min_s}; it is the least time a run may go without a step."
    )
  parse_profile_steps(train.profile_steps)
  if train.sample_every and not task_kinds.kind(config.task).image:
    image_tasks = " and ".join(task_kinds.names(image=True))
    raise ConfigError(f"train.sample_every draws images, for tasks {image_tasks}, not task {config.task!r}.")
  if train.tracker not in TRACKERS:
    raise ConfigError(f"train.tracker {train.tracker!r} is not one of {list(TRACKERS)}.")
  if train.batch_size % train.grad_accum_steps:
    raise ConfigError(
      f"train.batch_size {train.batch_size} is not a multiple of train.grad_accum_steps {train.grad_accum_steps}."
    )
  if train.update_len:
    if not task_kinds.kind(config.task).causal:
      raise ConfigError(f"train.update_len applies to autoregressive tasks only, not task {config.task!r}.")
    if train.seq_len % train.update_len:
      raise ConfigError(f"train.seq_len {train.seq_len} is not a multiple of train.update_len {train.update_len}.")
  for axis in MESH_AXES:
    size = config.mesh.get(axis)
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ConfigError(f"mesh.{axis} must be a positive integer or -1 (all remaining devices), got {size!r}.")
  if [config.mesh.get(axis) for axis in MESH_AXES].count(-1) > 1:
    raise ConfigError("at most one mesh axis may be -1.")
  slices = config.mesh.get("slices", 1)
  if not isinstance(slices, int) or slices < 1:
    raise ConfigError(f"mesh.slices must be a positive integer, got {slices!r}.")
  if config.mesh.get("slice_axis", "data") not in SLICE_AXES:
    raise ConfigError(
      f"mesh.slice_axis must be one of {list(SLICE_AXES)}, got {config.mesh.slice_axis!r}: the other axes' "
      "collectives run every layer and stay inside a slice."
    )
  if config.model.remat not in REMAT_POLICIES:
    raise ConfigError(f"model.remat {config.model.remat!r} is not one of {list(REMAT_POLICIES)}.")
  if config.model.attention_impl not in ATTENTION_IMPLS:
    raise ConfigError(f"model.attention_impl {config.model.attention_impl!r} is not one of {list(ATTENTION_IMPLS)}.")
  if not isinstance(config.model.scan_layers, bool):
    raise ConfigError(f"model.scan_layers must be True or False, got {config.model.scan_layers!r}.")
  if config.model.get("dtype", "float32") not in DTYPES:
    raise ConfigError(f"model.dtype {config.model.dtype!r} is not one of {DTYPES}.")

  optim_lib.validate_config(config)
  # Only the name here: the dataset's own checks look at files, which a config that is loaded
  # to count parameters or to build a model need not have; the trainer runs them before compiling.
  registry.dataset_module(config.data.name)
  family = registry.family(config.model.get("name"))
  if config.task not in family.tasks:
    raise ConfigError(f"model {family.name} is not built for task {config.task!r}; its tasks are {list(family.tasks)}.")
  family.validate_config(config)
  _validate_sequence_split(config, family)


def _validate_sequence_split(config, family) -> None:
  """mesh.sequence > 1 splits every update window's time steps into that many equal slices, one per
  chip, for the families whose record says how (Family.context_parallel)."""
  n = config.mesh.sequence
  if n == -1:
    raise ConfigError("mesh.sequence must be a positive integer: it cuts each sequence, so it is never 'all devices'.")
  if n == 1:
    return
  if family.context_parallel is None:
    able = [name for name in registry.family_names() if registry.family(name).context_parallel is not None]
    raise ConfigError(
      f"model {family.name} cannot split a sequence over chips (mesh.sequence={n}): {family.cannot_split}; "
      f"the families that can: {able}."
    )
  window = config.train.update_len or config.train.seq_len
  if window % n:
    key = "train.update_len" if config.train.update_len else "train.seq_len"
    raise ConfigError(f"{key} {window} does not split into mesh.sequence={n} equal slices.")
  family.context_parallel(config, n)
