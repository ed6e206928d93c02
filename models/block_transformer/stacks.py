"""The Block Transformer's two decoders (Section 2): causal Pythia / GPT-NeoX stacks over blocks and
over the tokens of one block, and the layer settings they share with the vanilla model they can be
uptrained from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.models import transformer
from lra_core.models.layers import stack
from lra_core.models.layers.attention import CrossAttention, empty_cache, head_width
from lra_core.models.layers.core import make_norm

Array = jax.Array


def token_sizes(m) -> tuple[int, int, int, int]:
  """(width, layers, heads, MLP width) of the token decoder: each 0 in the config means the block decoder's."""
  d = m.token_d_model or m.d_model
  return d, m.token_num_layers or m.num_layers, m.token_num_heads or m.num_heads, m.token_d_ff or 4 * d


def stack_config(m, width: int, heads: int, d_ff: int) -> ml_collections.ConfigDict:
  """transformer.Block settings of one Pythia-style stack."""
  return transformer.model_config(
    "transformer",
    d_model=width,
    num_heads=heads,
    d_ff=d_ff,
    position="none",  # positions enter through RoPE only, as in Pythia
    rope=True,
    rope_fraction=m.rope_fraction,
    rope_max_wavelength=m.rope_max_wavelength,
    norm=m.norm,
    norm_eps=m.norm_eps,
    activation=m.activation,
    use_bias=m.use_bias,
    parallel_residual=m.parallel_residual,
    dropout=m.dropout,
    attention_impl=m.attention_impl,
  )


class Stack(nnx.Module):
  """Causal Pythia-style layers and a final norm; with `memory_width`, each layer first
  cross-attends to a memory (the cross-attention token decoder). With `scan`, the layers (and the
  cross-attentions) are one scanned stack (models/layers/stack.py)."""

  def __init__(
    self, s, num_layers: int, *, memory_width: int = 0, scan: bool = False, remat: str = "none", dtype, rngs: nnx.Rngs
  ):
    self.layers = stack.make_layers(
      lambda: transformer.Block(s, causal=True, dtype=dtype, rngs=rngs), num_layers, scan=scan
    )
    self.cross = (
      stack.make_layers(
        lambda: CrossAttention(
          s.d_model,
          memory_width,
          heads=s.num_heads,
          width=s.d_model,
          use_bias=s.use_bias,
          dtype=dtype,
          rngs=rngs,
          impl=s.attention_impl,
        ),
        num_layers,
        scan=scan,
      )
      if memory_width
      else None
    )
    self.final_norm = make_norm(s.norm, s.d_model, eps=s.norm_eps, rngs=rngs)
    self.heads, self.head_dim, self.remat = s.num_heads, head_width(s), remat

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    memory: Array | None = None,
    fresh_memory: Array | None = None,
    fresh: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x [B,S,D] -> [B,S,D]. positions int[S] or [B,S] (default 0..S-1); mask bool[B,S]: False
    for keys no query reads (padding); segments int[B,S]: document ids, keys of another document
    are masked. Cross-attention reads memory [B,M,Dm], and fresh_memory where fresh bool[B,S]."""
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    seg = {} if segments is None else {"segments": segments}
    block = lambda layer, x, r: layer(x, positions=positions, mask=mask, rngs=r, **seg)
    if self.cross is None:
      return self.final_norm(stack.apply(self.layers, x, block, remat=self.remat, rngs=rngs))

    def cross(layer, x):
      y = layer(x, memory)
      return y if fresh is None else jnp.where(fresh[..., None], layer(x, fresh_memory), y)

    x = stack.apply(
      (self.cross, self.layers), x, lambda pair, x, r: block(pair[1], cross(pair[0], x), r), remat=self.remat, rngs=rngs
    )
    return self.final_norm(x)

  def init_cache(self, batch_size: int, size: int, dtype) -> list[dict]:
    return [empty_cache(batch_size, size, self.heads, self.head_dim, dtype) for _ in range(len(self.layers))]

  def decode_block(
    self,
    x: Array,
    caches: list[dict],
    positions: Array,
    slot,
    *,
    k_valid: Array | None = None,
    memory: Array | None = None,
  ) -> tuple[Array, list[dict]]:
    """x [B,S,D] at `positions` written to cache slots slot..slot+S-1 (S = 1 is one decode step)."""
    kw = {} if k_valid is None else {"k_valid": k_valid}
    out = []
    for i, (layer, cache) in enumerate(zip(self.layers, caches)):
      x, cache = layer.decode_block(x if self.cross is None else self.cross[i](x, memory), cache, positions, slot, **kw)
      out.append(cache)
    return self.final_norm(x), out
