"""The papers' tables, reproduced: the command behind scripts/reproduce.py and one module per paper.

cli                the table registry, the command line and the markdown sections --out replaces
common             what every table shares: its Context and Result, markdown, plots, training runs
params             parameter counts of every paper config (all five papers)
transformer_vq     Transformer-VQ: throughput, codebook size, compressive cache
flash              FLASH: train-step latency, quality against training cost
latte              Latte: attention core time and memory, LRA
fit                FIT: scaling with the image, interleave patterns
block_transformer  Block Transformer: generation throughput
context_extension  Latte Table 4's form: perplexity past the trained length, RoPE scalings, passkey retrieval
tpu                every paper config compiled for its TPU slice
gpu                the GPU papers' configs compiled for their GPUs
"""
