"""Evaluation from a trained workdir alone: the run's config.json with overrides on top, parameters
restored without the optimizer state, local and gs:// workdirs."""

import json

import jax
import numpy as np
import pytest

import lra_core
from lra_core import evaluate, fs, optim, sharding
from lra_core.checkpoint import restore_params
from lra_core.errors import CheckpointError
from lra_core.state import make_state_spec
from lra_core.train import train_and_evaluate

LISTOPS = "configs/lra/listops/transformer.py:tiny"


def _printed(capsys) -> dict:
  """evaluate.main's line `step=4, split=test, accuracy=0.0750, ...` as a dict of strings."""
  line = capsys.readouterr().out.strip().splitlines()[-1]
  return dict(item.split("=") for item in line.split(", "))


@pytest.fixture(scope="module")
def listops_run(tmp_path_factory):
  """(config, workdir, summary) of a tiny ListOps run."""
  root = tmp_path_factory.mktemp("listops")
  config = lra_core.load_config(LISTOPS, [f"data.cache_dir={root / 'cache'}"])
  summary = train_and_evaluate(config, root / "run")
  return config, root / "run", summary


def test_evaluate_reads_the_workdirs_config(listops_run, capsys):
  config, workdir, summary = listops_run
  explicit = evaluate.evaluate(config, workdir, "test")
  assert explicit["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
  evaluate.main([f"--workdir={workdir}"])  # no --config
  printed = _printed(capsys)
  assert printed == {"step": "4", "split": "test", "accuracy": f"{explicit['accuracy']:.4f}",
                     "loss": f"{explicit['loss']:.4f}"}
  saved = json.loads((workdir / "eval_test_4.json").read_text())
  assert saved == pytest.approx(explicit)


def test_overrides_apply_on_top_of_the_workdirs_config(listops_run, capsys):
  config, workdir, _ = listops_run
  explicit = evaluate.evaluate(config, workdir, "validation")
  # Another eval batch and another optimizer: the optimizer state is never read.
  evaluate.main(["--workdir", str(workdir), "--split", "validation", "--config.train.eval_batch_size", "16",
                 "--config.optim.name=sgd"])
  printed = _printed(capsys)
  assert float(printed["loss"]) == pytest.approx(explicit["loss"], abs=1e-4)
  assert printed["accuracy"] == f"{explicit['accuracy']:.4f}"


def test_restore_params_reads_params_and_model_state_only(listops_run):
  config, workdir, _ = listops_run
  mesh = sharding.make_mesh(config.mesh)
  spec = make_state_spec(config, mesh, optim.make_optimizer(config)[0])
  state, step = restore_params(workdir, spec.abstract)
  assert step == 4 and set(state) == {"params", "model_state"}
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(state["params"]) == shapes(spec.abstract["params"])
  with pytest.raises(CheckpointError, match=r"^no checkpoint of step 3 in .*checkpoints; it has steps \[4\]\.$"):
    restore_params(workdir, spec.abstract, 3)
  with pytest.raises(CheckpointError, match=r"^no checkpoint in .*; train first with `python -m lra_core.train"):
    restore_params(workdir.parent / "elsewhere", spec.abstract)


@pytest.mark.parametrize("override,message", [
    ("model.scan_layers=True", r"was written with model\.scan_layers=False and this config has "
                               r"model\.scan_layers=True; set --config\.model\.scan_layers=False\.$"),
    ("model.num_layers=1", r"does not match this model \(ValueError: "),  # a layer left over in the checkpoint
    ("model.d_model=64", r"does not match this model \("),
])
def test_a_checkpoint_of_another_model_is_one_sentence(listops_run, override, message):
  _, workdir, _ = listops_run
  with pytest.raises(CheckpointError, match=r"^checkpoint .*checkpoints/4 " + message):
    evaluate.main([f"--workdir={workdir}", f"--config.{override}"])


def test_evaluate_a_gcs_workdir(listops_run, fake_gcs, capsys):
  config, workdir, _ = listops_run
  remote = fs.path(fake_gcs("run"))
  fs.upload_tree(workdir, remote)  # the workdir as a pod's run leaves it in a bucket
  evaluate.main([f"--workdir={remote}"])
  printed = _printed(capsys)
  explicit = evaluate.evaluate(config, workdir, "test")
  assert printed["loss"] == f"{explicit['loss']:.4f}" and printed["accuracy"] == f"{explicit['accuracy']:.4f}"
  assert json.loads((remote / "eval_test_4.json").read_text())["loss"] == pytest.approx(explicit["loss"])
