"""Attention cores as pure functions: a jnp reference beside each fast form (see CONTRACT.md)."""

from kernels.attention import dot_product_attention
from kernels.vq import vq_attention

__all__ = ["dot_product_attention", "vq_attention"]
