"""Compiles every Pallas kernel for a TPU slice (Mosaic, with libtpu) and for an NVIDIA GPU (Triton and ptxas,
with the CUDA plugin), on any host, without either device.

The code, what it reports and examples (also in --help): lra_core/bench/lowering.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.lowering")()
