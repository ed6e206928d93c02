"""Hugging Face model folders: read into our models, and written back.

A folder is what `save_pretrained` writes (no hub access here: a local path): `config.json`, the
weights in `model.safetensors` (or shards listed by `model.safetensors.index.json`) and the tokenizer's
files. Each architecture maps onto one of our families' config options, not a model of its own:

  GPT-NeoX (Pythia), GPTNeoXForCausalLM -> the transformer family (lra_core/hf/gpt_neox.py)
  Gemma 2, Gemma2ForCausalLM             -> the transformer family (lra_core/hf/gemma2.py)

  section, model = hf.load_model("checkpoints/pythia-160m")     # config.model and the built model
  hf.save_folder("export/", section, model)                      # back to config.json + safetensors

and a run starts from one with `train.init_from=hf:<folder>` (lra_core/checkpoints/init_from.py), its
config.model matching the folder's (`check_folder`, before the run writes or compiles anything, names
every setting that does not): a transformer run as the folder's model, a Latte run as Latte-Macchiato
around the folder's weights (lra_core/hf/macchiato.py: Gemma 2 into Latte's Section 4.5).

A config.json is read in either of Hugging Face's layouts of the rotary settings (transformers 4's
top-level keys and rope_scaling, transformers 5's rope_parameters: lra_core/hf/fields.py) and written in
one (`layout`, by default the one the installed transformers reads). What cannot be read is one sentence
naming the file, key or tensor.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx, traverse_util

from lra_core.errors import CheckpointError, ConfigError
from lra_core.hf import fields, gemma2, gpt_neox, macchiato, safetensors
from lra_core.layer_stacks import STACKED
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width
from lra_core.protocol import RunInfo

ARCHITECTURES = {module.ARCHITECTURE: module for module in (gpt_neox, gemma2)}
PREFIX = "hf:"  # train.init_from=hf:<folder>
# The settings of config.model a run must share with the folder's model to start from its weights.
# (the embedding table's parameterisation is converted, not matched: `as_run_holds`)
MATCHED = (
  *("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff", "position", "rope"),
  *("rope_fraction", "rope_max_wavelength", "mlp", "activation", "norm", "norm_eps", "parallel_residual"),
  *("tie_embeddings", "tied_scale", "use_bias", "post_norms", "attn_soft_cap", "logit_soft_cap", "score_scale_dim"),
  *("window", "global_every", "embed_normaliser"),
)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


class _Reads(dict):
  """A checkpoint's tensors, remembering which were read (what is left over is named)."""

  def __init__(self, tensors: dict):
    super().__init__(tensors)
    self.read: set[str] = set()

  def __getitem__(self, name):
    if name not in self:
      raise CheckpointError(f"the checkpoint lacks tensor {name!r}, which its config.json implies.")
    self.read.add(name)
    return super().__getitem__(name)


def read_config(folder: str | os.PathLike) -> dict:
  """A Hugging Face model folder's config.json, as a dict (one sentence where it is not a JSON object)."""
  folder = pathlib.Path(folder).expanduser()
  config = folder / "config.json"
  if not config.is_file():
    raise ConfigError(f"{folder} is not a Hugging Face model folder: it has no config.json.")
  try:
    hf = json.loads(config.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{config} cannot be read as JSON ({e}).") from e
  return fields.check_object(hf, str(config))


def read_folder(folder: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json as a dict, every weight tensor {name: array}) of a Hugging Face model folder."""
  hf = read_config(folder)
  folder = pathlib.Path(folder).expanduser()
  if (folder / INDEX).is_file():
    shards = safetensors.read_index(folder / INDEX)
  elif (folder / WEIGHTS).is_file():
    shards = [WEIGHTS]
  else:
    raise ConfigError(f"{folder} holds no {WEIGHTS} (nor {INDEX}); only safetensors weights are read.")
  tensors = {}
  for shard in shards:
    if not (folder / shard).is_file():
      raise CheckpointError(f"{folder / INDEX} names the shard {shard!r}, which {folder} lacks.")
    tensors.update(safetensors.read(folder / shard))
  return hf, tensors


def architecture(hf: dict):
  """The module (gpt_neox, ...) that maps this config.json's architecture."""
  fields.check_object(hf, "a config.json")
  names = hf.get("architectures") or [hf.get("model_type", "?")]
  name = names[0] if isinstance(names, list) else names
  module = ARCHITECTURES.get(name) if isinstance(name, str) else None
  if module is None:
    raise ConfigError(f"architecture {name!r} cannot be read; the ones that can: {sorted(ARCHITECTURES)}.")
  return module


def read(folder: str | os.PathLike) -> tuple[ml_collections.ConfigDict, dict[tuple[str, ...], np.ndarray]]:
  """(our config.model, our parameters {path: array}) of a Hugging Face model folder."""
  hf, tensors = read_folder(folder)
  module = architecture(hf)
  section = module.model_section(hf)
  reads = _Reads(tensors)
  params = module.to_params(reads, section)
  extra = sorted(n for n in tensors if n not in reads.read and not n.endswith(module.BUFFERS))
  if extra:
    raise CheckpointError(
      f"{folder} holds {len(extra)} tensor(s) its config.json does not account for ({extra[0]!r} first): "
      "another architecture or a different layer count."
    )
  return section, params


def load_model(folder: str | os.PathLike, *, dtype: str = "float32") -> tuple[ml_collections.ConfigDict, nnx.Module]:
  """(our config.model, the model built from it holding the folder's weights, float32 parameters)."""
  section, params = read(folder)
  section.dtype = dtype
  model = transformer.Model(section, RunInfo(task="lm", seq_len=section.max_len), rngs=nnx.Rngs(params=0))
  set_params(model, params)
  return section, model


def set_params(model: nnx.Module, params: dict[tuple[str, ...], np.ndarray]) -> None:
  """Gives `model` the parameters {path: array}, each of its parameter's shape, as float32."""
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  for path, var in flat:
    key = tuple(str(p) for p in path)
    if key not in params:
      raise CheckpointError(f"no tensor maps to the model's parameter {'.'.join(key)}.")
    value, shape = np.asarray(params[key]), var.get_value().shape
    if value.shape != shape:
      raise CheckpointError(
        f"parameter {'.'.join(key)} has shape {list(shape)} in the model and {list(value.shape)} in the checkpoint."
      )
    var.set_value(jnp.asarray(value, var.get_value().dtype))
  nnx.update(model, nnx.from_flat_state(flat))


def get_params(model: nnx.Module) -> dict[tuple[str, ...], np.ndarray]:
  return {
    tuple(str(p) for p in path): np.asarray(var.get_value())
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def save_folder(
  folder: str | os.PathLike,
  section: ml_collections.ConfigDict,
  model: nnx.Module,
  *,
  seq_len: int = 0,
  layout: str | None = None,
) -> None:
  """Writes `model` (of the transformer family with config.model `section`, as `read` builds it or a run
  trains it) as a Hugging Face folder, its rotary settings in `layout` ("v5" or "v4"; None: the one the
  installed transformers reads). What `section` leaves to the model is written as the model has it: a
  norm_eps of 0 as the norm kind's epsilon, a max_len of 0 as `seq_len` (the run's train.seq_len; one
  sentence where neither is given), a "scaled" token table as the table its lookups read; scanned
  layers one by one. A setting the architecture's config.json cannot hold is one sentence, and nothing
  is written."""
  if section.get("name", "transformer") != "transformer":
    raise ConfigError(f"a Hugging Face folder holds a transformer-family model, not model.name {section.name!r}.")
  module = gemma2 if gemma2.describes(section) else gpt_neox
  hf = module.config_json(section, layout, seq_len)
  _check_holds(section, module.model_section(hf), module.NAME)
  params = {}
  for key, value in get_params(model).items():
    if key[:2] == ("blocks", STACKED):  # scanned layers: one array, layer first
      params.update({("blocks", str(i), *key[2:]): layer for i, layer in enumerate(value)})
    else:
      params[key] = value
  if section.get("embedding", "scaled") == "scaled":  # the table stores E / sqrt(D) (`as_run_holds`); a folder's is E
    params[("embed", "embedding")] = params[("embed", "embedding")] * np.float32(np.sqrt(section.d_model))
  folder = pathlib.Path(folder).expanduser()
  folder.mkdir(parents=True, exist_ok=True)
  safetensors.write(folder / WEIGHTS, module.to_tensors(params, section), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def _check_holds(section: ml_collections.ConfigDict, back: ml_collections.ConfigDict, name: str) -> None:
  """One sentence naming the first setting of MATCHED the written config.json reads `back` other than
  `section` has it (each as the model resolves a 0: its own epsilon, key-value heads, head width)."""
  resolve = {
    "norm_eps": fields.norm_eps,
    "num_kv_heads": lambda m: m.num_kv_heads or m.num_heads,
    "head_dim": head_width,
  }
  for key in MATCHED:
    ours, theirs = (resolve[key](m) if key in resolve else m.get(key) for m in (section, back))
    if ours != theirs:
      raise ConfigError(f"model.{key} {ours!r} cannot be written in a {name} config.json, which would read {theirs!r}.")


def check_settings(m, section, source: str, matched: tuple[str, ...] = MATCHED, *, uptrains: str = "") -> None:
  """One sentence naming every setting of `matched` in which config.model `m` differs from the
  checkpoint's `section` (what `model_section` read from its config.json, or a run's saved
  config.model), each with both values, and the overrides that give the checkpoint's. `uptrains`: the
  family whose run derives `m` from its own settings (its record's `uptrain_source`), whose overrides
  are not `m`'s keys one for one: the sentence then names the differences only."""
  differ = [(key, m.get(key), section.get(key)) for key in matched if _plain(m.get(key)) != _plain(section.get(key))]
  if not differ:
    return
  said = "; ".join(f"model.{key} {ours!r} here, {theirs!r} there" for key, ours, theirs in differ)
  if uptrains:
    raise ConfigError(
      f"train.init_from {source}: the transformer this {uptrains} run uptrains from differs from the checkpoint in "
      f"{_settings(len(differ))}: {said}; change this run's model settings so that they give the checkpoint's."
    )
  fix = " ".join(f"--config.model.{key}={theirs}" for key, _, theirs in differ)
  if len(differ) == 1:
    key, ours, theirs = differ[0]
    said = f"model.{key} is {ours!r} here and {theirs!r} in the checkpoint"
  else:
    said = f"{_settings(len(differ))} differ from the checkpoint: {said}"
  raise ConfigError(f"train.init_from {source}: {said}; set {fix}.")


def as_run_holds(m, folder: str, matched: tuple[str, ...] = MATCHED):
  """(the folder's config.model, its parameters {path: array} as a transformer run with config.model
  `m` holds them): every setting in `matched` the same (else one sentence naming each that differs),
  the embedding table in `m`'s parameterisation ("scaled" stores E / sqrt(D): the same lookups, as
  lra_core/models/layers/core.py Embed says)."""
  section, theirs = read(folder)
  check_settings(m, section, f"{PREFIX}{folder}", matched)
  if m.get("embedding", "scaled") == "scaled":
    theirs[("embed", "embedding")] = theirs[("embed", "embedding")] / np.float32(np.sqrt(section.d_model))
  return section, theirs


def initial_params(m, params: dict, folder: str) -> dict:
  """The run's parameter tree `params` (its structure, shapes and dtypes; scanned layers stacked) filled
  with the folder's weights (`as_run_holds`); a Latte run's own latent parameters keep their values
  (lra_core/hf/macchiato.py)."""
  section, theirs = as_run_holds(m, folder, matched_settings(m, folder))
  own = lambda layer_path: False
  if m.name == "latte":
    theirs, own = macchiato.weights(m, section, theirs), macchiato.is_own
  out = {}
  for key, leaf in traverse_util.flatten_dict(params).items():
    names = tuple(str(k) for k in key)
    if names[0] == "blocks" and own(names[2:]):
      value = np.asarray(leaf)
    elif names[:2] == ("blocks", STACKED):  # scanned layers: one array, layer first
      value = np.stack([theirs[("blocks", str(i), *names[2:])] for i in range(m.num_layers)])
    else:
      value = np.asarray(theirs[names])
    if value.shape != np.shape(leaf):
      raise CheckpointError(
        f"parameter {'.'.join(names)} has shape {list(np.shape(leaf))} here and {list(value.shape)} in {folder}."
      )
    out[key] = value.astype(leaf.dtype)
  return traverse_util.unflatten_dict(out)


def source_params(m, folder: str) -> dict:
  """The folder's weights as the parameters (a pure dict, layers keyed by index) of a transformer with
  config.model `m`: what a family's `uptrain_params` starts from (the Block Transformer's uptraining)."""
  flat = {tuple(int(p) if p.isdigit() else p for p in path): v for path, v in as_run_holds(m, folder)[1].items()}
  return traverse_util.unflatten_dict(flat)


def matched_settings(m, folder: str) -> tuple[str, ...]:
  """The settings of `MATCHED` a run with config.model `m` shares with the folder's model: all of them
  for a transformer, less what Macchiato replaces for a Latte-Macchiato run (one sentence for a Latte
  run that is none); one sentence for any other family."""
  if m.name == "transformer":
    return MATCHED
  if m.name == "latte":
    macchiato.check_model(m, folder, PREFIX)
    return tuple(k for k in MATCHED if k not in macchiato.REPLACED)
  raise ConfigError(
    f"train.init_from {PREFIX}{folder}: a Hugging Face checkpoint starts a transformer or Latte run, not {m.name}."
  )


def folder_section(folder: str | os.PathLike) -> ml_collections.ConfigDict:
  """Our config.model for a Hugging Face folder from its config.json alone, no weight read: what a run's
  settings are checked against before anything is compiled or written (`check_folder`)."""
  settings = read_config(folder)
  return architecture(settings).model_section(settings)


def check_folder(m, folder: str, *, uptrains: str = "") -> None:
  """One sentence where a run with config.model `m` cannot start from the folder's weights, naming every
  setting that differs (`check_settings`); `uptrains` as there, `m` then the transformer it uptrains from
  (read whole by `source_params`, so every setting of `MATCHED`)."""
  matched = MATCHED if uptrains else matched_settings(m, folder)
  check_settings(m, folder_section(folder), f"{PREFIX}{folder}", matched, uptrains=uptrains)


def _plain(value):
  """A setting as compared: a nested section (a ConfigDict, or a saved config's dict) as a plain dict."""
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def _settings(count: int) -> str:
  return "1 setting" if count == 1 else f"{count} settings"
