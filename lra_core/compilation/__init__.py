"""Compiling a run's steps: ahead of time from shapes with the memory checked first (step_compile),
the persistent compilation cache (compile_cache), the devices of a TPU slice or of NVIDIA GPUs that this
host does not have, to compile for (topologies), and the compile-only targets and report that
`python -m lra_core.aot` prints (aot_targets, aot_report). Above the run whose steps it compiles.
"""
