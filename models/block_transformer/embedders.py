"""The Block Transformer's embedders (Appendix F.1): L_B tokens -> one block embedding [D]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.models import transformer
from lra_core.models.layers import stack
from lra_core.models.layers.core import Dense, Embed, make_norm, param
from lra_core.models.layers.positions import AbsolutePositions

Array = jax.Array


class LookupEmbedder(nnx.Module):
  """Concatenated token embeddings of width `width` (D / L_B in the paper); a projection to D
  when L_B * width != D (uptraining from a vanilla model, Appendix G.8)."""

  def __init__(self, vocab: int, block_len: int, width: int, d_model: int, *, dtype, rngs: nnx.Rngs):
    self.table = Embed(vocab, width, dtype=dtype, rngs=rngs)
    self.proj = (
      Dense(block_len * width, d_model, axes=(None, "embed"), dtype=dtype, rngs=rngs)
      if block_len * width != d_model
      else None
    )

  def __call__(self, blocks: Array, *, rngs: nnx.Rngs | None = None) -> Array:
    """blocks int[B,N,L] -> [B,N,D]."""
    e = self.table(blocks)
    e = e.reshape(*blocks.shape[:-1], -1)  # the L_B embeddings side by side: [B,N,L*width]
    return e if self.proj is None else self.proj(e)


class EncoderEmbedder(nnx.Module):
  """A small bidirectional transformer over each block (Appendix F.1): the token outputs
  (`encoder`) or `num_cls` CLS outputs (`cls`) concatenated and projected to D.

  Pads are masked as keys (`cls` always; `encoder` with `model.mask_pads`), so no real token's output
  reads a pad. The `encoder` projection reads the pads' own outputs too, as the authors' embedder
  does; with `model.zero_pad_outputs` they are zeroed first, so that a block's embedding does not
  depend on what the pad token embeds to.
  """

  def __init__(self, m, *, dtype, rngs: nnx.Rngs):
    w = m.encoder_width
    self.num_cls = m.num_cls if m.embedder == "cls" else 0
    self.pad_id, self.mask_pads = m.pad_id, m.mask_pads
    self.zero_pad_outputs = m.zero_pad_outputs
    s = transformer.model_config(
      "transformer",
      d_model=w,
      num_heads=m.encoder_heads,
      d_ff=4 * w,
      norm=m.norm,
      norm_eps=m.norm_eps,
      activation=m.activation,
      use_bias=m.use_bias,
      attention_impl=m.attention_impl,
    )
    self.embed = Embed(m.vocab_size, w, dtype=dtype, rngs=rngs)
    self.positions = AbsolutePositions("learned", w, m.block_len + self.num_cls, dtype=dtype, rngs=rngs)
    self.cls = (
      param(rngs, jax.nn.initializers.normal(1.0), (self.num_cls, w), (None, "embed")) if self.num_cls else None
    )
    self.layers = stack.make_layers(
      lambda: transformer.Block(s, causal=False, dtype=dtype, rngs=rngs),
      m.encoder_layers,
      scan=m.scan_layers,
    )
    self.remat = m.remat
    self.final_norm = make_norm(m.norm, w, eps=m.norm_eps, rngs=rngs)
    read = self.num_cls or m.block_len
    self.proj = Dense(read * w, m.d_model, axes=(None, "embed"), use_bias=m.use_bias, dtype=dtype, rngs=rngs)

  def __call__(self, blocks: Array, *, rngs: nnx.Rngs | None = None) -> Array:
    """blocks int[B,N,L] -> [B,N,D]."""
    lead = blocks.shape[:-1]
    tokens = blocks.reshape(-1, blocks.shape[-1])  # every block is its own short sequence [B*N, L]
    real = tokens != self.pad_id
    x, mask = self.embed(tokens), (real if self.mask_pads else None)
    if self.cls is not None:
      cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], *self.cls.shape))
      x = jnp.concatenate([cls, x], axis=1)
      # CLS reads through the pad mask always: a CLS output must not depend on the pad token's embedding.
      mask = jnp.concatenate([jnp.ones((x.shape[0], self.num_cls), bool), real], axis=1)
    positions = jnp.arange(x.shape[1])
    x = x + self.positions(positions)
    x = self.final_norm(
      stack.apply(
        self.layers,
        x,
        lambda layer, x, r: layer(x, positions=positions, mask=mask, rngs=r),
        remat=self.remat,
        rngs=rngs,
      )
    )
    if self.cls is not None:
      x = x[:, : self.num_cls]
    elif self.zero_pad_outputs:  # the projection below reads every slot, pads included
      x = jnp.where(real[..., None], x, 0)
    return self.proj(x.reshape(*lead, -1))
