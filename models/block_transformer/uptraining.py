"""Uptraining (Section 3.7, Appendix N): a Block Transformer initialised from a vanilla Pythia-style
Transformer's parameters, each vanilla layer going to the block or the token decoder."""

from __future__ import annotations

import jax.numpy as jnp

from lra_core.errors import ConfigError
from lra_core.layer_stacks import restack_like, unscan_params
from lra_core.models.block_transformer.stacks import token_sizes


def uptrain_params(params: dict, vanilla: dict, config) -> dict:
  """Block Transformer parameters initialised from a vanilla Transformer's (pure dicts).

  The vanilla layers split in half: the lower ones become the block decoder, the upper ones the
  token decoder (Appendix N (1)). The lookup embedder reads the vanilla embedding (embed_width =
  d_model) and its projection averages the block's L_B embeddings (N (2)); the prefix map copies
  the context embedding into every prefix vector (N (3)); the token decoder's embedding, final
  norm and output head are the vanilla ones. Everything else keeps its fresh initialisation.
  """
  m = config.model
  d, (dt, nt, _, _) = m.d_model, token_sizes(m)
  out, vanilla = unscan_params(params), unscan_params(vanilla)
  if not {"blocks", "embed", "final_norm", "head"} <= set(vanilla):
    raise ConfigError(
      "the source model is not a vanilla transformer; uptraining starts from one "
      "(e.g. configs/c4/block_transformer.py:<size>,vanilla)."
    )
  layers = len(vanilla["blocks"])
  if m.embedder != "lookup" or m.token_decoder != "prefix" or (m.embed_width or 0) != d or dt != d:
    raise ConfigError(
      "uptraining needs the lookup embedder with model.embed_width = model.d_model, the prefix "
      "token decoder and equal block / token decoder widths."
    )
  if layers != m.num_layers + nt or vanilla["embed"]["embedding"].shape != (m.vocab_size, d):
    raise ConfigError(
      f"the vanilla model ({layers} layers, embedding {vanilla['embed']['embedding'].shape}) does "
      f"not split into {m.num_layers} + {nt} layers of width {d} over {m.vocab_size} tokens."
    )
  for i in range(m.num_layers):
    out["block_decoder"]["layers"][i] = vanilla["blocks"][i]
  for i in range(nt):
    out["token_decoder"]["layers"][i] = vanilla["blocks"][m.num_layers + i]
  out["token_decoder"]["final_norm"] = vanilla["final_norm"]  # the block decoder's stays fresh, as the authors'
  out["embedder"]["table"] = out["token_embed"] = vanilla["embed"]
  out["head"] = vanilla["head"]
  average = jnp.tile(jnp.eye(d), (m.block_len, 1)) / m.block_len  # [L*D, D]
  out["embedder"]["proj"]["kernel"] = average.astype(params["embedder"]["proj"]["kernel"].dtype)
  copies = jnp.broadcast_to(jnp.eye(d)[:, None, :], (d, m.prefix_len, d))  # [D, R, D]
  out["context_proj"]["kernel"] = copies.astype(params["context_proj"]["kernel"].dtype)
  if "bias" in out["context_proj"]:
    out["context_proj"]["bias"] = jnp.zeros_like(params["context_proj"]["bias"])
  return restack_like(out, params)  # back to the stacks `params` holds (model.scan_layers)
