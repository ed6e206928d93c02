"""The Block Transformer's fast batched generation: the block decoder reads the prompt blocks in one pass,
then every new block costs one block-decoder step and L_B token-decoder steps over a cache of R + L_B - 1
slots that never holds the prompt: the inference cost the paper measures."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core import decoding
from lra_core.errors import DecodingError

Array = jax.Array


def generate(
  model: nnx.Module,
  prompt: Array,
  *,
  max_new_tokens: int,
  key: Array,
  prompt_lengths=None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int | None = None,
) -> Array:
  """Samples continuations of prompts of any length; returns the new tokens int32[B,N].

  Row b's prompt is prompt[b, :prompt_lengths[b]] (default: the whole row). Each is left-padded
  with pad tokens to end on the same block boundary: whole blocks of padding are absent, so a row
  generates the same as it would alone. The block decoder reads the prompt blocks in one pass, then
  runs once per generated block with a KV cache over blocks; the token decoder starts each block
  with a fresh cache of R + L_B - 1 slots and never sees the prompt (no prefill). Greedy output
  equals repeated full-forward argmax over the left-padded prompt. A row that emits eos_id gets
  pad_id afterwards. Sampling settings as `lra_core.decoding.generate`.
  """
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer) or 0 in prompt.shape:
    raise DecodingError(f"prompt has shape {prompt.shape} and dtype {prompt.dtype}; expected int[B,P], P >= 1.")
  b, p = prompt.shape
  lengths = jnp.full((b,), p, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
  if lengths.shape != (b,) or int(lengths.min()) < 0 or int(lengths.max()) > p:
    raise DecodingError(f"prompt_lengths must be {b} values in [0, {p}], got {prompt_lengths}.")
  if int(prompt.min()) < 0 or int(prompt.max()) >= model.vocab_size:
    raise DecodingError(
      f"prompt token ids must lie in [0, {model.vocab_size}), got [{int(prompt.min())}, {int(prompt.max())}]."
    )
  max_new_tokens = decoding.check_int("max_new_tokens", max_new_tokens, minimum=1)
  eos_id = None if eos_id is None else decoding.check_int("eos_id", eos_id)
  decoding.check_key(key)
  sampling = decoding.Sampling.of(temperature, top_k, top_p)
  graphdef, params = nnx.split(model)  # the graph is static for jit, so one trace serves every call
  return _generate(
    graphdef, params, prompt.astype(jnp.int32), lengths, key, sampling, max_new_tokens=max_new_tokens, eos_id=eos_id
  )


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "eos_id"))
def _generate(
  graphdef, params, prompt, lengths, key, sampling: decoding.Sampling, *, max_new_tokens: int, eos_id: int | None
) -> Array:
  model = nnx.merge(graphdef, params)
  model.eval()
  L, pad, lead = model.block_len, model.pad_id, model.lead
  b, p = prompt.shape
  prompt_blocks, new_blocks = -(-p // L), -(-max_new_tokens // L)
  width = prompt_blocks * L
  # Right-align every prompt at `width`: left padding up to a block boundary.
  index = jnp.arange(width)[None] - (width - lengths[:, None])
  aligned = jnp.where(index >= 0, jnp.take_along_axis(prompt, jnp.clip(index, 0, p - 1), axis=1), pad)

  blocks = aligned.reshape(b, prompt_blocks, L)
  valid = (blocks != pad).any(-1)  # whole pad blocks are absent, so the left padding changes nothing
  block_valid = jnp.zeros((b, prompt_blocks + new_blocks), bool).at[:, :prompt_blocks].set(valid)
  caches = model.block_decoder.init_cache(b, prompt_blocks + new_blocks, model.dtype)
  # The prompt's blocks in one pass; its tokens never reach the token decoder (no prefill there).
  h, caches = model.block_decoder.decode_block(
    model.embedder(blocks), caches, jnp.arange(prompt_blocks), 0, k_valid=block_valid
  )
  context = model.contexts(h[:, -1], valid[:, -1])

  def sample(key, logits):
    return sampling.draw(key, logits[:, 0].astype(jnp.float32))

  def one_block(carry, xs):
    caches, block_valid, context, done = carry
    keys, k = xs
    logits, token_state = model.start_block(context, b)
    tokens = []
    for j in range(L):  # L_B is small and static: unrolled, each step a one-token decoder call
      if j:  # the token decoder reads the previous token at position lead + j - 1
        x = model.token_inputs(context, tokens[-1][:, None], j - 1)
        # The block so far, padded to L - 1: its pad keys are masked as in training.
        written = jnp.concatenate([jnp.stack(tokens, axis=1), jnp.full((b, L - 1 - j), pad, jnp.int32)], axis=1)
        y, token_caches = model.token_decoder.decode_block(
          x,
          token_state["caches"],
          jnp.array([lead + j - 1]),
          lead + j - 1,
          memory=token_state["memory"],
          k_valid=model.key_mask(written),
        )
        token_state = dict(token_state, caches=token_caches)
        logits = model.head(y)
      token = sample(keys[j], logits)
      if eos_id is not None:  # a finished row emits pads, which later blocks then treat as absent
        token = jnp.where(done, pad, token)
        done = done | (token == eos_id)
      tokens.append(token)
    block = jnp.stack(tokens, axis=1)
    valid = (block != pad).any(-1)
    block_valid = jax.lax.dynamic_update_slice_in_dim(block_valid, valid[:, None], k, 1)
    h, caches = model.block_decoder.decode_block(
      model.embedder(block[:, None]), caches, k[None], k, k_valid=block_valid
    )
    return (caches, block_valid, model.contexts(h[:, 0], valid), done), block

  keys = jax.random.split(key, new_blocks * L).reshape(new_blocks, L)  # one key per new token, in order
  carry = (caches, block_valid, context, jnp.zeros((b,), bool))
  _, out = jax.lax.scan(one_block, carry, (keys, prompt_blocks + jnp.arange(new_blocks)))
  return out.transpose(1, 0, 2).reshape(b, new_blocks * L)[:, :max_new_tokens]
