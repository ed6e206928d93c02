"""Measurements that need no training run: the commands behind scripts/bench*.py, check_lowering.py,
shardings.py and param_counts.py.

  train_step    the trainer's train step: tokens/s, compile time, memory, FLOP/s (scripts/bench.py)
  cores         attention cores alone, forward or forward + backward (scripts/bench.py --cores)
  decode        milliseconds per decoded token by context length (scripts/bench_decode.py)
  generate      generated tokens/s of whole generate calls (scripts/bench_generate.py)
  lowering      Pallas kernels compiled for TPU and lowered for GPU on any host (scripts/check_lowering.py)
  shardings     how a config's parameters split over a mesh, without devices (scripts/shardings.py)
  param_counts  parameter counts of the paper configs beside the papers' (scripts/param_counts.py)
  common        what they share: variants, timing, out-of-memory and XLA cost helpers, reporting
"""
