"""The process's runtime, below everything that runs a command: start-up without accelerator noise
(quiet_start), joining a multi-process run (distributed), its processes ending together when one fails or
is lost (process_end, coordinator_watch), signals (preemption), the step watchdog, the run lock, files and
object stores (fs), host memory and the commands' exit statuses (exit_codes).
It imports nothing of the project but itself and the error types (tests/test_import_graph.py).
"""
