"""The exit statuses of the project's commands, for supervisors.

scripts/launch_tpu.py --supervise relaunches on EXIT_PREEMPTED and the SLURM script requeues on it;
docs/reliability.md lists them. They live apart from the command line (lra_core.cli re-exports them)
so that the runtime modules that end a process (preemption, process_end) need nothing above them.
"""

EXIT_FINISHED = 0
EXIT_CRASH = 1  # an unexpected error, on this process or on another process of the run
EXIT_USER_ERROR = 2  # bad config, data, checkpoint or workdir: one sentence on stderr
EXIT_PREEMPTED = 75  # saved at a SIGTERM (a scheduler's notice): the same command continues (sysexits' TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C (inside the training loop: saved first), as shells report it
