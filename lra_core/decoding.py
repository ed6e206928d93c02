"""Sampling from autoregressive models: logit filters and a compiled generation loop.

Any model that follows the decode protocol (lra_core.protocol.Decoder; docs/api.md) works here:

  logits = model(tokens)                                  # int32[B,T] -> float[B,T,V]
  state = model.init_decode_state(batch_size, max_len)    # pytree of arrays
  logits_t, state = model.decode_step(tokens[:, t:t+1], state)   # float[B,1,V], new state

and optionally a parallel prompt prefill (protocol.Prefiller), equal to P decode steps up to float rounding:

  logits_last, state = model.prefill(tokens[:, :P], state)   # float[B,1,V] of position P-1

`generate` uses it where the model's `can_prefill` is true (a transformer whose subclass keeps
plain softmax attention); otherwise it prefills with decode_step.

`filter_logits` and `sample_token` are pure functions on logits; `generate` runs the prefill
(one `prefill` call, or a `lax.scan` of decode_step) and sampling (a `lax.scan`) inside one
jitted program, cached per shapes and sampling mode.

Shapes: B batch, P prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.errors import DecodingError
from lra_core.protocol import Decoder, Prefiller

__all__ = ["DecodingError", "Sampling", "check_int", "check_key", "filter_logits", "sample_token", "generate"]


# ---------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------


def check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
  """Returns `value` as a Python int (numpy integers welcome, bools and floats not), or raises
  DecodingError naming `name`."""
  if isinstance(value, bool):
    raise DecodingError(f"{name} {value!r} must be an integer{hint}")
  try:
    value = operator.index(value)
  except TypeError:
    raise DecodingError(f"{name} {value!r} must be an integer{hint}") from None
  if minimum is not None and value < minimum:
    raise DecodingError(f"{name} {value} must be >= {minimum}{hint}")
  return value


def check_key(key: Any) -> None:
  """Raises DecodingError unless `key` is one PRNG key (typed, or a raw uint32 threefry / rbg key)."""
  if not isinstance(key, jax.Array):
    raise DecodingError(f"key {key!r} is not a PRNG key; pass e.g. jax.random.key(0)")
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  raw = not typed and key.dtype == jnp.uint32 and key.ndim == 1  # (2,) threefry, (4,) rbg
  if not (typed and key.shape == () or raw):
    raise DecodingError(
      f"key has dtype {key.dtype} and shape {key.shape}; expected a single PRNG key "
      "(jax.random.key(seed) or jax.random.PRNGKey(seed))"
    )


def _as_number(name: str, value: Any) -> float:
  try:
    return float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise DecodingError(f"{name} {value!r} is not a Python number") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
  """Checked sampling settings (see `filter_logits`), built with `Sampling.of`.

  A pytree: passed into a jitted function, temperature, top_k and top_p travel traced (a sweep
  over their values compiles once) and `mode` stays static, since it changes the program:
  "greedy" (temperature 0), "plain" (no top-k / top-p filter) or "filtered".
  """

  temperature: Any
  top_k: Any
  top_p: Any
  mode: str = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def of(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """Validates the settings (DecodingError names the bad one) as plain Python numbers."""
    temperature = _as_number("temperature", temperature)
    if not math.isfinite(temperature) or temperature < 0:
      raise DecodingError(f"temperature {temperature} must be finite and >= 0 (0 = greedy)")
    top_k = check_int("top_k", top_k, minimum=0, hint=" (0 disables top-k)")
    top_k = min(top_k, 2**31 - 1)  # it travels as int32; any k >= V means keep all anyway
    top_p = _as_number("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
      raise DecodingError(f"top_p {top_p} must be in (0, 1] (1 disables nucleus filtering)")
    if temperature == 0.0:
      mode = "greedy"
    elif top_k == 0 and top_p >= 1.0:
      mode = "plain"
    else:
      mode = "filtered"
    return cls(temperature, top_k, top_p, mode)

  def filter(self, logits: jax.Array) -> jax.Array:
    """float[..., V] -> the filtered logits (at least float32); works traced."""
    return _filter_logits(_as_float(logits), self)

  def draw(self, key: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row of float[..., V] logits -> int32[...]; works traced."""
    return _sample_token(key, _as_float(logits), self)


def _as_float(logits: jax.Array) -> jax.Array:
  # Sampling resolution matters more than memory here: bf16 logits would merge close
  # probabilities, so work in at least float32.
  logits = jnp.asarray(logits)
  return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


# ---------------------------------------------------------------------------------------
# Pure functions on logits
# ---------------------------------------------------------------------------------------


def filter_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Applies temperature, then top-k, then nucleus (top-p) filtering.

  Args:
    logits: float[..., V].
    temperature: logits are divided by it; 0 keeps only the argmax (the T -> 0 limit).
    top_k: keep the k largest logits; 0 (or k >= V) keeps all.
    top_p: keep the smallest set of most likely tokens whose probability (after temperature
      and top-k) reaches top_p; the argmax is always kept. 1 keeps all.

  Ties are broken toward the lower token id, so the kept set is deterministic and top-k
  keeps exactly min(k, V) tokens. Filtered entries get the smallest finite value of the
  dtype rather than -inf, so a softmax over them never produces NaN.

  Returns:
    float[..., V] (at least float32).
  """
  return Sampling.of(temperature, top_k, top_p).filter(logits)


@jax.jit
def _filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """filter_logits with traced settings; `sampling.mode` picks the program."""
  mode, temperature, top_k, top_p = sampling.mode, sampling.temperature, sampling.top_k, sampling.top_p
  if mode == "greedy":
    temperature, top_k, top_p = 1.0, 1, 1.0
  logits = logits / temperature
  if mode == "plain":
    return logits

  vocab = logits.shape[-1]
  fill = jnp.finfo(logits.dtype).min
  # A stable descending sort gives every token a distinct rank, ties going to the lower id.
  order = jnp.argsort(logits, axis=-1, descending=True, stable=True)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  keep_sorted = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
  probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_logits, fill), axis=-1)
  # Mass strictly before each token: a token is needed while that mass is below top_p.
  # It is exactly 0 at rank 0, so the argmax survives any rounding. top_p == 1 must skip
  # the test: rounding can push the mass before a rare last token to 1.0.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = keep_sorted & ((mass_before < top_p) | (top_p >= 1.0))
  keep = jnp.put_along_axis(jnp.zeros(keep_sorted.shape, dtype=bool), order, keep_sorted, axis=-1, inplace=False)
  return jnp.where(keep, logits, fill)


def sample_token(
  key: jax.Array,
  logits: jax.Array,
  *,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """Draws one token per row from the filtered distribution.

  Args:
    key: a PRNG key (unused when temperature == 0).
    logits: float[B,V] (any leading shape [...,V] works).
    temperature, top_k, top_p: as in `filter_logits`; temperature 0 is greedy argmax.

  Returns:
    int32[B]: token ids.
  """
  return Sampling.of(temperature, top_k, top_p).draw(key, logits)


@jax.jit
def _sample_token(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
  if sampling.mode == "greedy":
    # argmax returns the first maximum: the same tie rule as filter_logits.
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = _filter_logits(logits, sampling)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "eos_id", "pad_id"))
def _generate_compiled(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt: jax.Array,
  key: jax.Array,
  sampling: Sampling,
  *,
  max_new_tokens: int,
  eos_id: int | None,
  pad_id: int,
) -> jax.Array:
  """prompt int32[B,P] -> int32[B,P+N]: the prompt and its sampled continuation."""
  model = nnx.merge(graphdef, params)
  # Only this traced copy is switched to eval mode; the caller's module keeps its mode.
  model.eval()
  batch, prompt_len = prompt.shape
  # The last sampled token is never fed back: the model sees P + N - 1 positions.
  state = model.init_decode_state(batch, prompt_len + max_new_tokens - 1)

  def step(state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
    """tokens int32[B] -> logits float[B,V], next state."""
    logits, state = model.decode_step(tokens[:, None], state)
    if logits.ndim != 3 or logits.shape[:2] != (batch, 1):
      raise DecodingError(
        f"{type(model).__name__}.decode_step returned logits of shape {logits.shape}; expected [B,1,V] with B={batch}"
      )
    return _as_float(logits[:, 0]), state

  def sample(key: jax.Array, logits: jax.Array) -> jax.Array:
    return sampling.draw(key, logits)

  state, logits = _prefill(model, state, prompt, step)

  # Sampling. The first token comes from the prefill logits, so the model sees
  # P + N - 1 tokens and the last sampled token is never fed back.
  keys = jax.random.split(key, max_new_tokens)
  first = sample(keys[0], logits)
  if eos_id is None:
    done = jnp.zeros((batch,), dtype=bool)
  else:
    done = first == eos_id

  def decode_body(carry, step_key):
    state, prev, done = carry
    logits, state = step(state, prev)
    token = sample(step_key, logits)
    if eos_id is not None:
      # Finished rows keep decoding (the batch moves in lockstep) but emit padding, which
      # is also what they are fed: their later tokens never reach the output.
      token = jnp.where(done, pad_id, token)
      done = done | (token == eos_id)
    return (state, token, done), token

  _, rest = jax.lax.scan(decode_body, (state, first, done), keys[1:])
  return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)


def _prefill(
  model: nnx.Module,
  state: Any,
  prompt: jax.Array,
  step: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
) -> tuple[Any, jax.Array]:
  """Feeds the whole prompt (`step` is one decode step) -> (state, float logits[B,V] of its
  last position)."""
  batch = prompt.shape[0]
  if isinstance(model, Prefiller) and model.can_prefill:
    logits, new_state = model.prefill(prompt, state)
    if logits.ndim != 3 or logits.shape[:2] != (batch, 1):
      raise DecodingError(
        f"{type(model).__name__}.prefill returned logits of shape {logits.shape}; expected [B,1,V] with B={batch}"
      )
    return new_state, _as_float(logits[:, 0])

  # Only the last position's logits are needed, so they ride in the carry instead of
  # stacking [P,B,V] outputs.
  logits_spec, _ = jax.eval_shape(step, state, prompt[:, 0])

  def body(carry, tokens):
    state, _ = carry
    logits, state = step(state, tokens)
    return (state, logits), None

  init_logits = jnp.zeros(logits_spec.shape, logits_spec.dtype)
  (state, logits), _ = jax.lax.scan(body, (state, init_logits), prompt.T)
  return state, logits


def generate(
  model: nnx.Module,
  prompt: jax.Array,
  *,
  max_new_tokens: int,
  key: jax.Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int | None = None,
  pad_id: int = 0,
) -> jax.Array:
  """Samples a continuation of `prompt` from an autoregressive model.

  The prompt is fed through `model.prefill` in one call if the model's `can_prefill` is
  true, else through `model.decode_step` token by token; then `max_new_tokens`
  tokens are sampled, each fed back for the next step. Both prefills give the same logits
  up to float rounding, so greedy outputs agree unless two top logits are within that
  rounding. All prompts in a batch share the length P: there is no per-row prompt length,
  so pad or bucket prompts of different lengths before calling. The model runs in eval
  mode (on a traced copy; `model` itself is not changed).

  The whole loop is one jitted program, compiled once per model structure, B, P,
  max_new_tokens, eos_id, pad_id and sampling mode (greedy, unfiltered, or with top-k /
  top-p); new parameters, keys, or values of temperature, top_k and top_p reuse it.

  Args:
    model: an nnx.Module with `init_decode_state(batch_size, max_len)` and
      `decode_step(tokens[B,1], state) -> (logits[B,1,V], state)`, optionally `can_prefill`
      and `prefill(tokens[B,P], state) -> (logits[B,1,V], state)`; max_len is P + N - 1.
    prompt: int[B,P] token ids, P >= 1.
    max_new_tokens: N >= 0.
    key: a PRNG key; the same key gives the same samples.
    temperature, top_k, top_p: as in `filter_logits`; temperature 0 is greedy.
    eos_id: if set, a row that emits eos_id keeps it and gets pad_id at every later
      position (pad_id is also what that row's model copy is fed, so it must be a valid id).
    pad_id: padding token after EOS.

  Returns:
    int32[B, P + N]: the prompt followed by the generated tokens.
  """
  if not isinstance(model, Decoder):
    raise DecodingError(
      f"model {type(model).__name__} does not decode; generate needs the decode protocol "
      "(lra_core.protocol.Decoder: init_decode_state, decode_step)"
    )
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise DecodingError(f"prompt has shape {prompt.shape} and dtype {prompt.dtype}; expected int[B,P]")
  if prompt.shape[0] < 1 or prompt.shape[1] < 1:
    raise DecodingError(f"prompt shape {prompt.shape} needs B >= 1 and P >= 1 tokens")
  max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
  eos_id = None if eos_id is None else check_int("eos_id", eos_id)
  pad_id = check_int("pad_id", pad_id)
  check_key(key)
  sampling = Sampling.of(temperature, top_k, top_p)
  prompt = prompt.astype(jnp.int32)
  if max_new_tokens == 0:
    return prompt

  graphdef, params = nnx.split(model)
  return _generate_compiled(
    graphdef, params, prompt, key, sampling, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id
  )
