"""Attention cores as pure functions: a jnp reference beside each fast form (docs/kernels.md)."""

from lra_core.kernels.attention import dot_product_attention, local_attention
from lra_core.kernels.flash import linear_attention, mixed_chunk_attention, relu2_attention
from lra_core.kernels.latte import bidirectional_latte, causal_latte
from lra_core.kernels.library_attention import self_attention
from lra_core.kernels.vq import vq_attention

__all__ = [
  "bidirectional_latte",
  "causal_latte",
  "dot_product_attention",
  "linear_attention",
  "local_attention",
  "mixed_chunk_attention",
  "relu2_attention",
  "self_attention",
  "vq_attention",
]
