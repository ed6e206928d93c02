"""Compiles every Pallas kernel for a TPU slice (Mosaic, with libtpu) and for an NVIDIA GPU (Triton and ptxas,
with the CUDA plugin), on any host, without either device.

  python scripts/check_lowering.py                                  # T 2048: TPU v5e and H100 compiles
  python scripts/check_lowering.py --platforms=tpu --seq_len=8192 --dtype=bfloat16
  python scripts/check_lowering.py --platforms=gpu --gpu=a100 --segments   # packed documents, on an A100
  python scripts/check_lowering.py --paper=all --topology=v3:2x2 --dtype=bfloat16   # the paper models' widths

The code and what it reports: lra_core/bench/lowering.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.lowering")()
