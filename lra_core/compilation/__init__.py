"""Compiling a run's steps: ahead of time from shapes with the memory checked first (step_compile),
the persistent compilation cache (compile_cache), and the compile-only targets and report that
`python -m lra_core.aot` prints (aot_targets, aot_report). Above the run whose steps it compiles.
"""
