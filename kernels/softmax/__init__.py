"""Softmax attention, the quadratic core every softmax model runs: reference.py (jnp, the oracle and the
CPU path; decoding's masks over explicit positions), library.py (`self_attention` / `cross_attention`:
the platforms' own flash kernels, splash on TPU and Pallas-Triton on GPU, behind one `impl` switch), ring.py
(ring attention over a sequence split across chips) and splash_lists.py (splash's block lists at any
length). The package imports none of them, so reading one loads no other.
"""
