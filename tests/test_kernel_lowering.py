"""Every Pallas kernel compiles for a TPU slice (Mosaic, with libtpu) and for an H100 (Triton and ptxas, with
the CUDA plugin) from this CPU host (scripts/check_lowering.py; lowered only without them), and shapes those
backends cannot take are reported, not hidden; scripts/run_kernels.py runs them beside their XLA forms."""

import json

import pytest

from lra_core import kernels
from lra_core.bench import kernel_run
from lra_core.bench import lowering as check_lowering
from lra_core.kernels import catalog

SIZES = dict(seq_len=256, width=128, latents=128, block=128, codes=128, chunk=0, flash_chunk=128)  # chunk 0: per target


@pytest.mark.slow
def test_every_kernel_builds_for_tpu_and_gpu():
  """The script's rows, in bfloat16 (the paper runs' dtype), for a training step's program (the value and
  gradient: the forward kernel and the custom_vjp's backward ones). Forward-only programs and float32 builds
  of every kernel: tests/test_tpu_kernels.py (a TPU mesh) and tests/test_gpu_kernels.py (an H100)."""
  rows = check_lowering.check(["tpu", "gpu"], dtype="bfloat16", passes=("grad",), **SIZES)
  assert len(rows) == 8  # 4 kernels, TPU and GPU
  assert all(r["ok"] and r["how"] == "compiled" for r in rows), [r for r in rows if not r["ok"]]
  assert all(r["seconds"] is not None for r in rows)
  gpu = [r for r in rows if r["platform"] == "gpu"]
  assert all(r["target"] == "NVIDIA H100 80GB HBM3" and 0 < r["shared_kib"] <= 227 for r in gpu)
  assert all(r["registers"] is None or 0 < r["registers"] <= 255 for r in gpu)  # None: no ptxas found


def test_shapes_a_backend_cannot_take_are_reported():
  rows = check_lowering.check(["gpu", "tpu"], passes=("forward",), **dict(SIZES, seq_len=200, width=96, block=100))
  errors = {(r["kernel"], r["platform"]): r["error"] for r in rows}
  assert "power of 2" in errors["vq_attention", "gpu"]
  assert "divisible by 8 and 128" in errors["vq_attention", "tpu"]
  assert not any(r["ok"] for r in rows if r["kernel"] == "vq_attention")


def test_a_program_without_the_kernel_is_a_failure(monkeypatch):
  """A kernel left in interpret mode (or an XLA form) compiles too; the row must still fail."""
  fn, args = catalog.kernels_at(**SIZES)["causal_latte"]
  xla = lambda q, k, v: kernels.causal_latte(q, k, v, impl="xla")
  monkeypatch.setattr(check_lowering, "kernels_at", lambda **sizes: {"causal_latte": (xla, args)})
  rows = check_lowering.check(["tpu", "gpu"], passes=("forward",), **SIZES)
  assert len(rows) == 2 and not any(r["ok"] for r in rows)
  assert all(r["error"].startswith("no ") for r in rows)


def test_run_kernels_compares_each_kernel_with_its_xla_form(tmp_path, capsys):
  """scripts/run_kernels.py on this host (interpret mode): every kernel's output and gradients equal
  its XLA form's to float32 rounding, and the table names each kernel and how it ran."""
  rows = kernel_run.main(
    [
      "--seq_len=64",
      "--width=16",
      "--latents=8",
      "--block=16",
      "--codes=16",
      "--flash_chunk=16",
      "--batch=1",
      "--heads=1",
      "--dtypes=float32",
      "--steps=1",
      f"--json={tmp_path / 'rows.json'}",
    ]
  )
  assert [r["kernel"] for r in rows] == list(
    catalog.kernels_at(seq_len=64, width=16, latents=8, block=16, codes=16, chunk=0, flash_chunk=16)
  )
  for r in rows:
    assert r["call"] == "interpret" and max(r["out_rel"], r["dq_rel"], r["dv_rel"]) < 1e-5, r
    assert r["forward_ms_xla"] > 0 and r["step_ms_pallas"] > 0
  printed = capsys.readouterr().out
  assert all(f"| {r['kernel']} |" in printed for r in rows)
  assert json.loads((tmp_path / "rows.json").read_text()) == rows
  with pytest.raises(SystemExit):
    kernel_run.main(["--paper=nope"])
  with pytest.raises(SystemExit):  # Pallas lowers to Triton from compute capability 8.0
    kernel_run.main(["--estimate=v100"])
