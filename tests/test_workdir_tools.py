"""Evaluation and sampling from a trained workdir alone: the run's config.json with overrides on
top, parameters restored without the optimizer state, local and gs:// workdirs, diffusion grids."""

import io
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import fixtures.imagenet64
import lra_core
from lra_core import evaluate, layout, sample
from lra_core.checkpoints.checkpointer import restore_params
from lra_core.errors import CheckpointError, ConfigError
from lra_core.run import evaluation, image_samples, optim
from lra_core.run.state import make_state_spec
from lra_core.run.steps import make_eval_step
from lra_core.runtime import fs
from lra_core.train import train_and_evaluate

LISTOPS = "configs/lra/listops/transformer.py:tiny"
pytestmark = pytest.mark.usefixtures("collect_garbage")  # restores made to fail here: see conftest.py
DENOISER = "configs/imagenet64/fit_denoiser.py:tiny"


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
  assert printed == {
    "step": "4",
    "split": "test",
    "accuracy": f"{explicit['accuracy']:.4f}",
    "loss": f"{explicit['loss']:.4f}",
  }
  saved = json.loads((workdir / "eval_test_4.json").read_text())
  assert saved == pytest.approx(explicit)


def test_evaluate_prints_its_metrics_even_where_the_workdir_cannot_take_them(listops_run, tmp_path, capsys):
  """The result file cannot be written (a folder already has its name, as a read-only or full workdir
  would refuse it): the metrics are printed, and the failed write is one warning."""
  _, workdir, summary = listops_run
  (workdir / "eval_validation_4.json").mkdir()
  try:
    evaluate.main([f"--workdir={workdir}", "--split=validation"])
  finally:
    (workdir / "eval_validation_4.json").rmdir()
  out, err = capsys.readouterr()  # the command's own log lines go to stderr
  assert "split=validation" in out.strip().splitlines()[-1]
  said = [line.split(" WARNING ")[1] for line in err.splitlines() if " WARNING could not write " in line]
  assert said == [
    f"could not write {workdir / 'eval_validation_4.json'} (Is a directory); the metrics are only printed"
  ]


def test_overrides_apply_on_top_of_the_workdirs_config(listops_run, capsys):
  config, workdir, _ = listops_run
  explicit = evaluate.evaluate(config, workdir, "validation")
  # Another eval batch and another optimizer: the optimizer state is never read.
  evaluate.main(
    [
      "--workdir",
      str(workdir),
      "--split",
      "validation",
      "--config.train.eval_batch_size",
      "16",
      "--config.optim.name=sgd",
    ]
  )
  printed = _printed(capsys)
  assert float(printed["loss"]) == pytest.approx(explicit["loss"], abs=1e-4)
  assert printed["accuracy"] == f"{explicit['accuracy']:.4f}"


def test_restore_params_reads_params_and_model_state_only(listops_run, caplog):
  config, workdir, _ = listops_run
  mesh = layout.make_mesh(config.mesh)
  spec = make_state_spec(config, mesh, optim.make_optimizer(config)[0])
  with caplog.at_level(logging.INFO):
    state, step = restore_params(workdir, spec.abstract)
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # orbax's read-only notes
  assert step == 4 and set(state) == {"params", "model_state"}
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(state["params"]) == shapes(spec.abstract["params"])
  with pytest.raises(CheckpointError, match=r"^no checkpoint of step 3 in .*checkpoints; it has steps \[4\]\.$"):
    restore_params(workdir, spec.abstract, 3)
  with pytest.raises(CheckpointError, match=r"^no checkpoint in .*; train first with `python -m lra_core.train"):
    restore_params(workdir.parent / "elsewhere", spec.abstract)


@pytest.mark.parametrize(
  "override,message",
  [
    (
      "model.scan_layers=True",
      r"was written with model\.scan_layers=False and this config has "
      r"model\.scan_layers=True; set --config\.model\.scan_layers=False\.$",
    ),
    ("model.num_layers=1", r"does not match this model \(ValueError: "),  # a layer left over in the checkpoint
    ("model.d_model=64", r"does not match this model \("),
  ],
)
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


def test_text_sampling_refuses_image_flags(listops_run):
  _, workdir, _ = listops_run
  with pytest.raises(
    ConfigError,
    match=r"^--sampler, --steps and --label apply to diffusion models; this "
    r"config's task is 'classify'\.$",
  ):
    sample.main([f"--workdir={workdir}", "--sampler=ddim"])
  with pytest.raises(ConfigError, match=r"^guidance applies to diffusion models trained with diffusion\.cond_dropout"):
    sample.main([f"--workdir={workdir}", "--guidance", "2"])


# -- images ------------------------------------------------------------------------------------------------


def test_grid_lays_images_out_with_one_pixel_gaps(tmp_path):
  images = np.arange(5 * 2 * 3 * 3, dtype=np.uint8).reshape(5, 2, 3, 3)
  out = image_samples.grid(images)
  assert out.shape == (2 * 3 + 1, 3 * 4 + 1, 3) and out.dtype == np.uint8  # 3 columns, 2 rows
  np.testing.assert_array_equal(out[1:3, 1:4], images[0])
  np.testing.assert_array_equal(out[4:6, 5:8], images[4])
  assert (out[0] == 255).all() and (out[:, 4] == 255).all() and (out[4:6, 9:12] == 255).all()  # gaps, empty cell
  assert image_samples.grid(images, columns=5, scale=2).shape == (2 * 2 + 2, 5 * 7 + 1, 3)
  assert image_samples.grid(images[..., :1]).shape == (7, 13, 1)
  image_samples.save_grid(images[..., :1], tmp_path / "gray.png", scale=2)
  assert np.asarray(Image.open(tmp_path / "gray.png")).shape == (2 * 5 + 1, 3 * 7 + 1)
  with pytest.raises(ConfigError, match=r"needs images \[N,S,S,C\]"):
    image_samples.grid(images[0])


def test_a_saved_grid_is_drawn_at_least_256_pixels_wide_unless_a_scale_is_given(tmp_path):
  tiny = np.zeros((16, 8, 8, 3), np.uint8)  # a 4x4 grid of 8x8 images: 37 pixels wide at scale 1
  assert image_samples.grid_scale(tiny) == 8 and image_samples.grid(tiny, scale=7).shape[1] < 256
  image_samples.save_grid(tiny, tmp_path / "tiny.png")
  assert np.asarray(Image.open(tmp_path / "tiny.png")).shape == (4 * 65 + 1, 4 * 65 + 1, 3)
  wide = np.zeros((16, 64, 64, 3), np.uint8)  # ImageNet64: 261 pixels at scale 1
  assert (
    image_samples.grid_scale(wide) == 1
    and image_samples.grid_scale(wide[:1]) == 4
    and image_samples.grid_scale(tiny, 16) == 2
  )
  image_samples.save_grid(tiny, tmp_path / "given.png", scale=1)
  assert np.asarray(Image.open(tmp_path / "given.png")).shape == (37, 37, 3)


@pytest.fixture(scope="module")
def denoiser_run(tmp_path_factory):
  """(config, workdir) of a tiny class-conditional FIT denoiser run (its EMA on), logging every step
  and drawing a sample grid every 2, checked by every test below that reads a diffusion workdir."""
  root = tmp_path_factory.mktemp("denoiser")
  config = lra_core.load_config(
    DENOISER, [*fixtures.imagenet64.build(root), "train.log_every=1", "train.sample_every=2"]
  )
  train_and_evaluate(config, root / "run")
  return config, root / "run"


@pytest.mark.slow
def test_a_diffusion_run_logs_every_step_draws_its_grids_and_evaluates_its_checkpoint(denoiser_run):
  from tensorboard.backend.event_processing import event_accumulator

  config, workdir = denoiser_run
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["step"] == 4 and np.isfinite(summary["val_loss"]) and np.isfinite(summary["test_loss"])
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["train_loss"] for r in logged if "train_loss" in r]
  assert len(losses) == 4 and np.all(np.isfinite(losses))
  # TensorBoard's sample grids at steps 2 and 4: 16 samples, 4 x 4 with 1-pixel gaps.
  acc = event_accumulator.EventAccumulator(str(workdir / "tensorboard"), size_guidance={event_accumulator.IMAGES: 0})
  acc.Reload()
  grids = acc.Images("samples")
  side = 4 * (config.data.image_size + 1) + 1
  assert [g.step for g in grids] == [2, 4] and (grids[0].height, grids[0].width) == (side, side)
  # Round trip: the restored checkpoint gives the same test loss (evaluation draws fixed t and noise).
  again = evaluate.evaluate(config, workdir, "test")
  assert again["step"] == 4 and again["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)


@pytest.mark.slow
def test_sample_a_diffusion_workdir_to_a_png_grid(denoiser_run, capsys):
  config, workdir = denoiser_run
  sample.main([f"--workdir={workdir}", "--num_samples=5", "--seed=3"])  # no --config
  assert "wrote 5 samples of step 4 to" in capsys.readouterr().out
  png = workdir / "samples_step4.png"
  picture = np.asarray(Image.open(png))
  assert picture.shape == (2 * 89 + 1, 3 * 89 + 1, 3)  # 8x8 RGB images drawn 11x, 3 columns, 2 rows
  # The same draw as training_samples gives from the restored model.
  model, _ = sample.load_model(config, workdir)
  images = image_samples.training_samples(config, model, jax.random.key(3), 5)
  assert images.shape == (5, 8, 8, 3) and images.dtype == np.uint8
  np.testing.assert_array_equal(picture, image_samples.grid(images, scale=11))


@pytest.mark.slow
def test_sample_a_gcs_workdir(denoiser_run, fake_gcs, capsys):
  config, workdir = denoiser_run
  remote = fs.path(fake_gcs("run"))
  fs.upload_tree(workdir, remote)
  (remote / "samples_step4.png").unlink(missing_ok=True)  # the local run's grid, if an earlier test wrote it
  sample.main([f"--workdir={remote}", "--num_samples=5", "--seed=3"])
  assert f"to {remote}/samples_step4.png" in capsys.readouterr().out
  picture = np.asarray(Image.open(io.BytesIO((remote / "samples_step4.png").read_bytes())))
  model, _ = sample.load_model(config, workdir)
  images = image_samples.training_samples(config, model, jax.random.key(3), 5)
  np.testing.assert_array_equal(picture, image_samples.grid(images, scale=image_samples.grid_scale(images)))


@pytest.mark.slow
def test_diffusion_sampler_steps_and_label_flags(denoiser_run, tmp_path):
  config, workdir = denoiser_run
  model, _ = sample.load_model(config, workdir)
  key = jax.random.key(0)
  default = image_samples.training_samples(config, model, key, 2)
  labels = np.array([3, 3])
  ddim = image_samples.training_samples(config, model, key, 2, sampler="ddim", steps=2, labels=labels)
  assert ddim.shape == default.shape and not np.array_equal(ddim, default)
  np.testing.assert_array_equal(
    ddim, image_samples.training_samples(config, model, key, 2, sampler="ddim", steps=2, labels=labels)
  )
  out = tmp_path / "grid.png"
  sample.main(
    [
      f"--workdir={workdir}",
      "--sampler",
      "ddim",
      "--steps",
      "2",
      "--label",
      "3",
      "--num_samples",
      "2",
      "--png",
      str(out),
      "--png_scale",
      "2",
    ]
  )
  np.testing.assert_array_equal(np.asarray(Image.open(out)), image_samples.grid(ddim, scale=2))
  with pytest.raises(ConfigError, match=r"^--label 1000 is not a class of this model \(model\.num_classes=1000\)\.$"):
    sample.main([f"--workdir={workdir}", "--label=1000"])
  guided = image_samples.training_samples(config, model, key, 2, sampler="ddim", steps=2, labels=labels, guidance=3.0)
  assert not np.array_equal(guided, ddim)  # the tiny config trains with a null class (diffusion.cond_dropout)
  with pytest.raises(
    ConfigError,
    match=r"^guidance 3 needs a class-conditional denoiser trained with "
    r"diffusion\.cond_dropout > 0 \(the null class\); this fit_denoiser has none\.$",
  ):
    sample.main([f"--workdir={workdir}", "--guidance=3", "--config.diffusion.cond_dropout=0.0"])


@pytest.mark.slow
def test_training_samples_from_a_model_in_memory():
  """What the trainer calls every train.sample_every steps: uint8 [N,S,S,C], fixed by the key. The
  denoiser's are checked above on denoiser_run's model (its grids drawn in training, uint8 [5,8,8,3], the
  same key's images twice), without compiling its initializer again: here the autoregressive image model's."""
  config = lra_core.load_config("configs/imagenet64/transformer.py:tiny")
  mesh = layout.make_mesh(config.mesh)
  spec = make_state_spec(config, mesh, optim.make_optimizer(config)[0])
  state = spec.init()
  model = nnx.merge(spec.eval_graphdef, state["params"], state["model_state"])
  images = image_samples.training_samples(config, model, jax.random.key(1), 3)
  assert images.shape == (3, 8, 8, 3) and images.dtype == np.uint8
  np.testing.assert_array_equal(images, image_samples.training_samples(config, model, jax.random.key(1), 3))
  assert image_samples.grid(images).shape == (2 * 9 + 1, 2 * 9 + 1, 3)


def test_the_evaluator_keeps_at_most_two_steps_in_flight(listops_run, monkeypatch):
  """Each eval step is started while the one before it runs, and waited for before the next: dispatched
  all at once (a whole test split), XLA:CPU's devices, which share one thread pool, deadlock in their
  collectives past a few hundred queued programs and abort. Here every step ends in matrix products that
  keep the devices busy far longer than the host takes to start it, so without the wait each call would
  find all the earlier steps still running."""
  config, workdir, _ = listops_run
  overrides = [f"data.cache_dir={workdir.parent / 'cache'}", "train.eval_batch_size=8", "mesh.data=2", "mesh.fsdp=4"]
  config = lra_core.load_config(LISTOPS, overrides)

  def slowed(step):
    def slow_step(*args):
      metrics, carry = step(*args)
      busy = jnp.full((384, 384), 1e-3) * jnp.sum(jax.tree.leaves(metrics)[0])
      for _ in range(8):
        busy = jnp.tanh(busy @ busy)
      return jax.tree.map(lambda m: m + (0 * jnp.sum(busy)).astype(m.dtype), metrics), carry

    return slow_step

  running, started = [], []
  real_init = evaluation.Evaluator.__init__

  def init(self, *args):
    real_init(self, *args)
    step = self.step

    def counted(*args):
      running.append(sum(not all(x.is_ready() for x in jax.tree.leaves(out)) for out in started))
      out = step(*args)
      started.append(out)
      return out

    self.step = counted

  monkeypatch.setattr(evaluation, "make_eval_step", lambda *a: slowed(make_eval_step(*a)))
  monkeypatch.setattr(evaluation.Evaluator, "__init__", init)
  evaluate.evaluate(config, workdir, "test", write=False)
  assert len(running) == 5 and max(running) <= 1, running  # 40 examples, 8 a step
