"""Config loading: every config file, tiny sizes, overrides and one-sentence errors."""

import pathlib

import jax
import numpy as np
import pytest

import lra_core
from lra_core.config import PROJECT_ROOT, load_config

CONFIG_FILES = sorted(
  str(p.relative_to(PROJECT_ROOT))
  for p in (PROJECT_ROOT / "configs").rglob("*.py")
  if "def get_config" in p.read_text()
)


def test_there_are_configs():
  assert "configs/lra/listops/transformer.py" in CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_config_loads_full_and_tiny(path):
  full = load_config(path)
  tiny = load_config(path + ":tiny")
  assert tiny.model.name == full.model.name and tiny.task == full.task
  assert tiny.train.seq_len <= 256 and tiny.train.steps <= 10
  model = lra_core.build_model(tiny, seed=0)
  from flax import nnx

  num = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert 0 < num <= 2_000_000
  # The docstring holds the command that launches it.
  assert "python -m lra_core.train" in pathlib.Path(PROJECT_ROOT / path).read_text()


def test_overrides_are_parsed_with_the_field_type():
  c = load_config(
    "configs/enwik8/transformer.py:tiny",
    [
      "train.steps=7",
      "optim.lr=3e-4",
      "model.rope=true",
      "data.split_fractions=(0.8, 0.1, 0.1)",
      "model.variant=transformer++",
      "train.batch_size=1_6",
    ],
  )
  assert (c.train.steps, c.optim.lr, c.model.rope, c.train.batch_size) == (7, 3e-4, True, 16)
  assert c.data.split_fractions == (0.8, 0.1, 0.1)
  assert c.model.variant == "transformer++"
  with pytest.raises(AttributeError):
    c.new_field = 1  # the result is locked


def test_load_config_works_from_any_directory(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  assert load_config("configs/lra/listops/transformer.py:tiny").task == "classify"


@pytest.mark.parametrize(
  "overrides,message",
  [
    (["train.stepz=3"], "unknown config key 'train.stepz'; did you mean 'train.steps'"),
    (["modell.d_model=3"], "unknown config key 'modell.d_model'; did you mean 'model.d_model'"),
    # other frameworks' names point at ours first
    (["optim.learning_rate=3e-4"], "unknown config key 'optim.learning_rate'; did you mean 'optim.lr'"),
    (["train.num_train_steps=9"], "unknown config key 'train.num_train_steps'; did you mean 'train.steps'"),
    (["train.steps=ten"], "config key 'train.steps' expects an int, got 'ten'."),
    (["model.rope=maybe"], "config key 'model.rope' expects a bool, got 'maybe'."),
    (["train=3"], "config key 'train' is a section"),
    (["train.steps"], "is not of the form key=value"),
    (["train.seq_len=100", "train.update_len=32"], "train.seq_len 100 is not a multiple of train.update_len 32."),
    (
      ["train.batch_size=6", "train.grad_accum_steps=4"],
      "train.batch_size 6 is not a multiple of train.grad_accum_steps 4.",
    ),
    (["model.num_heads=3"], "model.d_model 64 is not a multiple of model.num_heads 3"),
    (["model.name=nonexistent"], "model.name 'nonexistent' is not a module in models/"),
    (["task=translate"], "task 'translate' is not one of"),
    (["train.steps=0"], "train.steps must be a positive integer, got 0."),
    (["mesh.data=0"], "mesh.data must be a positive integer or -1"),
    (["optim.schedule=exp"], "optim.schedule"),
    (["model.dtype=float8"], "model.dtype 'float8' is not one of"),
  ],
)
def test_config_errors_are_one_clear_sentence(overrides, message):
  with pytest.raises(lra_core.ConfigError) as info:
    load_config("configs/enwik8/transformer.py:tiny", overrides)
  text = str(info.value)
  assert message in text
  assert "\n" not in text and text.endswith(".")


def test_bad_spec_and_arg():
  with pytest.raises(lra_core.ConfigError, match="does not exist"):
    load_config("configs/nope.py")
  with pytest.raises(lra_core.ConfigError, match="config arg 'huge' is not known"):
    load_config("configs/lra/listops/transformer.py:huge")


def test_update_len_only_for_autoregressive_tasks():
  with pytest.raises(lra_core.ConfigError, match="autoregressive tasks only"):
    load_config("configs/lra/listops/transformer.py:tiny", ["train.update_len=32"])
