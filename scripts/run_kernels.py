"""Runs every Pallas kernel on this machine's device beside its XLA form: outputs, gradients, times.

  python scripts/run_kernels.py                                # B 2, T 1024, 2 heads of 64; float32, bfloat16
  python scripts/run_kernels.py --paper=all --seq_len=8192     # each kernel at its paper model's widths
  JAX_DEFAULT_MATMUL_PRECISION=highest python scripts/run_kernels.py   # float32 matmuls without TF32 on a GPU

The code and what it reports: lra_core/bench/kernel_run.py.
"""

from lra_core.cli import as_command

if __name__ == "__main__":
  as_command("lra_core.bench.kernel_run")()
