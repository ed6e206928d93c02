"""The process's runtime, below everything that runs a command: start-up without accelerator noise
(quiet_start), peers of a multi-process run (distributed), signals (preemption), the step watchdog, the
run lock, files and object stores (fs), host memory and the commands' exit statuses (exit_codes).
It imports nothing of the project but itself and the error types (tests/test_import_graph.py).
"""
