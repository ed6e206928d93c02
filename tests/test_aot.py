"""Ahead-of-time compilation: the memory estimate and the refusal of a step that cannot fit."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lra_core
from lra_core import aot, chips
from lra_core.errors import ResourceError
from lra_core.train import train_and_evaluate
import fixtures
from fixtures import listops

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _step():
  return jax.jit(lambda w, x: (w - 0.1 * x.T @ jnp.tanh(x @ w), jnp.sum(x @ w)), donate_argnums=0)


ARGS = (jax.ShapeDtypeStruct((256, 256), jnp.float32), jax.ShapeDtypeStruct((64, 256), jnp.float32))


def test_estimate_counts_arguments_outputs_and_donation():
  compiled = aot.compile_step(_step(), *ARGS, name="step")
  estimate = aot.MemoryEstimate.of(compiled)
  assert estimate.arguments == (256 * 256 + 64 * 256) * 4
  assert estimate.outputs >= 256 * 256 * 4 and estimate.aliased == 256 * 256 * 4
  assert estimate.peak >= estimate.arguments
  w, x = jnp.ones((256, 256)), jnp.full((64, 256), 0.01)
  expected = _step()(jnp.ones((256, 256)), x)
  np.testing.assert_allclose(compiled(w, x)[1], expected[1], rtol=1e-6)


def test_a_step_over_the_budget_is_refused_with_the_estimate():
  with pytest.raises(ResourceError, match=r"needs about 0\.\d+ MiB per device .* more than the 0\.00 MiB available "
                                          r"\(train.memory_limit_gib\)"):
    aot.compile_step(_step(), *ARGS, name="step", limit_gib=1e-9)


def test_device_memory_limit_on_cpu_shares_the_host():
  limit, source = aot.device_memory_limit()
  assert 0 < limit * jax.local_device_count() <= 2**50 and "CPU" in source


def test_trainer_stops_before_allocating_state(tmp_path):
  config = lra_core.load_config(listops.SPEC, listops.build(tmp_path / "data") + ["train.memory_limit_gib=1e-6"])
  with pytest.raises(ResourceError, match="the train step needs about"):
    train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


# ----------------------------------------------------------------------------- batches without data

@pytest.mark.parametrize("name", ["enwik8", "listops", "retrieval", "pg19", "c4", "c4_mlm", "imagenet64", "imdb",
                                  "cifar10", "pathfinder"])
def test_the_config_batch_is_the_batch_the_data_gives(tmp_path, name):
  """lra_core.aot compiles for shapes read off the config alone; they are exactly the real batches'."""
  from lra_core import data as data_lib, sharding
  from lra_core.data import pipeline
  fixture = fixtures.load(name)
  extra = ["train.update_len=8"] if name == "enwik8" else []  # two update windows per sequence
  (tmp_path / "data").mkdir()
  config = lra_core.load_config(fixture.SPEC, fixture.build(tmp_path / "data") + extra)
  reader = pipeline.BatchReader(config, data_lib.make_source(config, "train"), train=True,
                                batch_size=config.train.batch_size)
  real = {k: (np.shape(v), np.asarray(v).dtype) for k, v in reader(1).items()}
  assert pipeline.batch_fields(config, config.train.batch_size) == real
  mesh = sharding.make_mesh(config.mesh)
  rules = config.sharding.rules
  from lra_core import experiment
  assert experiment.config_batch(config, mesh, rules) == experiment.abstract_batch(reader(1), mesh, rules)


# ----------------------------------------------------------------------------- python -m lra_core.aot

needs_libtpu = pytest.mark.skipif(not chips.libtpu_installed(), reason="libtpu is not installed")


def _aot(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "lra_core.aot", *args], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=600)


@needs_libtpu
def test_cli_compiles_for_a_tpu_slice_and_writes_the_report(tmp_path):
  out = _aot("--config=configs/enwik8/transformer_vq.py:tiny", "--topology=v5e:2x2", "--config.mesh.data=4",
             f"--json={tmp_path / 'r.json'}", f"--hlo={tmp_path / 'train.hlo.gz'}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "4 x TPU v5 lite" in out.stdout and "fits" in out.stdout and "estimated MFU" in out.stdout
  report = json.loads((tmp_path / "r.json").read_text())
  assert list(report)[:10] == list(aot.Report.JSON_FIELDS)
  assert report["num_devices"] == 4 and report["device_kind"] == "TPU v5 lite" and report["hbm_gib"] == 16.0
  assert report["fits"] and 0 < report["peak_gib"] < 16 and report["flops_per_device"] > 0
  assert 0 < report["est_mfu"] <= 1 and report["est_tokens_per_s"] > 0
  # The kept HLO gives the same estimate again without a compile (what tpu_fit reuses).
  again = aot.estimate_from_hlo(aot.Report.from_json(report), aot.read_hlo(tmp_path / "train.hlo.gz")).to_json()
  assert again == report and report["tokens_per_step"] > 0


@needs_libtpu
@pytest.mark.slow
def test_cli_exit_status_says_whether_it_fits_and_names_bad_input():
  base = ["--config=configs/lra/listops/transformer.py:tiny", "--config.mesh.data=4"]
  over = _aot(*base, "--topology=v5e:2x2", "--config.train.memory_limit_gib=1e-6")
  assert over.returncode == aot.EXIT_DOES_NOT_FIT and re.search(r"^fits +NO$", over.stdout, re.M)
  unknown = _aot(*base, "--topology=v9:2x2")
  assert unknown.returncode == 2 and "v3:2x2" in unknown.stderr and "v5e:2x2" in unknown.stderr
  bad_key = _aot(*base, "--topology=v5e:2x2", "--config.train.batch_sise=8")
  assert bad_key.returncode == 2 and "batch_sise" in bad_key.stderr
  uneven = _aot("--config=configs/lra/listops/transformer.py:tiny", "--topology=v5e:2x2", "--config.mesh.data=3")
  assert uneven.returncode == 2 and "error: micro-batch size 8" in uneven.stderr


@needs_libtpu
def test_a_step_the_tpu_compiler_refuses_for_memory_is_a_does_not_fit_answer(tmp_path):
  """Full attention over 65,536 tokens needs 136 GiB of temporaries: the compiler refuses it, and
  that refusal is the answer (exit 3, the needed bytes), not a crash."""
  out = _aot("--config=configs/enwik8/transformer.py:tiny", "--topology=v5e:2x2", "--config.mesh.data=4",
             "--config.train.seq_len=65536", "--config.train.batch_size=4", f"--json={tmp_path / 'r.json'}")
  assert out.returncode == aot.EXIT_DOES_NOT_FIT, out.stderr[-2000:]
  assert "the TPU compiler's out-of-memory refusal" in out.stdout
  report = json.loads((tmp_path / "r.json").read_text())
  assert not report["fits"] and report["peak_gib"] > 16 and report["est_mfu"] is None


@needs_libtpu
@pytest.mark.parametrize("spec, overrides", [
    # Mosaic tiles are 8 x 128: the VQ kernel's code blocks span whole 128-token tiles.
    pytest.param("configs/enwik8/transformer_vq.py:tiny", ["model.impl=pallas", "model.block_len=128",
                                                         "train.seq_len=256", "train.update_len=256"],
                 marks=pytest.mark.slow),
    ("configs/c4/latte.py:tiny", ["model.impl=pallas", "model.chunk=0"]),  # 0: the chunk the target takes
    ("configs/c4/latte.py:tiny", ["model.impl=pallas", "model.chunk=0", "model.scan_layers=True",
                                  "model.remat=full"]),
    ("configs/lra/listops/latte.py:tiny", ["model.impl=pallas"]),
    ("configs/c4/flash.py:tiny", ["model.impl=pallas", "model.chunk=128", "train.seq_len=256", "model.max_len=256"]),
])
@pytest.mark.usefixtures("no_persistent_compile_cache")
def test_tiny_train_steps_with_pallas_kernels_compile_for_tpu(spec, overrides):
  """The trainer's step with each kernel family's Pallas kernel, through the real TPU compiler:
  the kernels follow the mesh's devices (Mosaic), not the CPU host (interpret mode)."""
  config = lra_core.load_config(spec, overrides + ["mesh.data=4"])
  devices = chips.tpu_devices("v5e:2x2")
  report = aot.compile_config(config, "v5e:2x2", devices=devices)
  assert report.fits and report.flops_per_device > 0
  assert report.mosaic_kernels > 0, "the train step holds no Mosaic kernel: the Pallas kernels were interpreted"
