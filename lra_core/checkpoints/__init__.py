"""A run's checkpoints: the checkpointer (orbax), quieting the fallout of a failed read
(read_failures), train.init_from's warm starts (init_from), what a workdir's contents allow a run
(workdir), and the config a run saved there read back, upgraded and checked for a resume (saved_config).
"""
