"""What one run is made of, below the commands: the train state and its spec (state), the optimizer
(optim) and its settings (optim_settings), the jitted steps (steps), the data setup and checks
(data_setup), the host batches laid on the devices (batches), and its outputs: metrics and summaries
(metrics), experiment trackers (trackers) and the profiler (profiler).
"""
