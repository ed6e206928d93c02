"""Attention cores as pure functions: a jnp reference beside each fast form (docs/kernels.md).

One folder per core, its files named by role and backend: vq/ (Transformer-VQ's cached attention),
latte/ (Latte's latent recurrence), mixed_chunk/ (FLASH's mixed chunk, quadratic and linear attention;
not FlashAttention) and softmax/ (the softmax core, with the platforms' flash kernels and ring
attention). In vq/, latte/ and mixed_chunk/ the package itself checks the arguments and dispatches on
`impl`; reference.py is the jnp reference, pallas.py the kernel's public function and gradient, and
tpu_grid.py / gpu_parallel.py / gpu_loop.py its drivers (catalog.py lists them). Beside the folders:
toolkit.py (targets, tiles, named refs), per_device.py (a kernel per device under a mesh),
context_parallel.py (a sequence split over chips), packed_documents.py (packed documents) and catalog.py.
"""

from lra_core.kernels.latte import bidirectional_latte, causal_latte
from lra_core.kernels.mixed_chunk import linear_attention, mixed_chunk_attention, relu2_attention
from lra_core.kernels.softmax.library import self_attention
from lra_core.kernels.softmax.reference import dot_product_attention, local_attention
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
