"""A run's checkpoints: the checkpointer (orbax), quieting the fallout of a failed read
(read_failures), and train.init_from's warm starts (init_from).
"""
