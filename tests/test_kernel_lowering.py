"""Every Pallas kernel lowers for TPU (Mosaic) and GPU (Triton) from this CPU host
(scripts/check_lowering.py), and shapes those backends cannot take are reported, not hidden."""

from scripts import check_lowering

SIZES = dict(seq_len=256, width=128, latents=128, block=128, codes=128, chunk=0)  # chunk 0: per platform


def test_every_kernel_lowers_for_tpu_and_gpu_in_float32_and_bfloat16():
  for dtype in ("float32", "bfloat16"):
    rows = check_lowering.check(["tpu", "gpu"], dtype=dtype, **SIZES)
    assert len(rows) == 8
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_shapes_a_backend_cannot_take_are_reported():
  rows = check_lowering.check(["gpu", "tpu"], **dict(SIZES, width=96, block=100))
  errors = {(r["kernel"], r["platform"]): r["error"] for r in rows}
  assert "power of 2" in errors["vq_attention", "gpu"]
  assert "divisible by 8 and 128" in errors["vq_attention", "tpu"]
  assert not any(r["ok"] for r in rows if r["kernel"] == "vq_attention")
