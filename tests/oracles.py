"""Oracles shared by the autoregressive model tests (the protocol in docs/api.md) and the kernel tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Called eagerly, a model or a kernel compiles each of its operations as a program of its own (15-25 ms
# each on a 2-core host, a hundred and more per model): a 2-layer FLASH decoder's first forward took 3.7 s
# of CPU time eagerly against 0.6 s compiled as one program. The tests run what they compare compiled;
# a program is kept per function (model structure), shapes and settings, so an oracle's repeated calls
# and the next test's same sizes reuse it. What a function reads from a context when traced (e.g.
# `toolkit.target`) is not part of that key: enter the context inside the compiled function, with the
# choice as a setting (tests/test_attention.py's `attention_on`).


def _split(kwargs):
  """(array arguments, settings): keyword values that are Python scalars become settings of the program."""
  settings = {k: v for k, v in kwargs.items() if isinstance(v, bool | int | float | str)}
  return {k: v for k, v in kwargs.items() if k not in settings}, tuple(sorted(settings.items()))


@nnx.jit(static_argnums=(1, 4))
def _compiled_method(model, method, args, arrays, settings):
  return getattr(model, method)(*args, **arrays, **dict(settings))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _compiled_function(fn, args, arrays, settings):
  return fn(*args, **arrays, **dict(settings))


def forward(model, *args, method: str = "__call__", **kwargs):
  """model(*args, **kwargs) (or model.<method>(...)) compiled: arrays traced, Python scalars settings."""
  return _compiled_method(model, method, args, *_split(kwargs))


def compiled(fn, *args, **kwargs):
  """fn(*args, **kwargs) compiled: arrays traced, Python scalars settings (fn: a function, not a model)."""
  return _compiled_function(fn, args, *_split(kwargs))


def assert_no_future_leakage(model, tokens, logits, cuts, *, vocab: int, shift: int, changed_atol: float):
  """Changing tokens after t leaves the logits at <= t unchanged (atol 1e-6) and changes later ones.
  `model`: a model (run compiled) or any function of the tokens."""
  apply = (lambda x: forward(model, x)) if isinstance(model, nnx.Module) else model
  for t in cuts:
    perturbed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + shift) % vocab)
    out = apply(perturbed)
    np.testing.assert_allclose(out[:, : t + 1], logits[:, : t + 1], atol=1e-6)
    assert not np.allclose(out[:, t + 1 :], logits[:, t + 1 :], atol=changed_atol)


def assert_decode_matches_forward(model, tokens, logits, atol: float = 1e-4):
  """Stepping decode_step through the tokens one at a time reproduces the full forward pass."""
  b, t = tokens.shape
  step = nnx.jit(lambda m, tok, st: m.decode_step(tok, st))
  state = model.init_decode_state(b, t)
  outs = []
  for i in range(t):
    out, state = step(model, tokens[:, i : i + 1], state)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), logits, atol=atol)


def packed_pair(doc_a, doc_b, length: int, *, pad_id: int = 0):
  """Two documents (int arrays [La], [Lb]) packed into one row of `length` tokens, and each alone
  at the start of a row: -> (rows int32[3,T], segment_ids int32[3,T]); row 0 packed, 1 = a, 2 = b.
  Padding gets segment 0, as the data pipeline writes it."""
  la, lb = len(doc_a), len(doc_b)
  assert la + lb <= length, "the two documents must fit the row"
  rows = np.full((3, length), pad_id, np.int32)
  segs = np.zeros((3, length), np.int32)
  rows[0, :la], rows[0, la : la + lb] = doc_a, doc_b
  segs[0, :la], segs[0, la : la + lb] = 1, 2
  rows[1, :la], segs[1, :la] = doc_a, 1
  rows[2, :lb], segs[2, :lb] = doc_b, 1
  return jnp.asarray(rows), jnp.asarray(segs)


def assert_documents_independent(apply, doc_a, doc_b, length: int, *, atol: float = 1e-5, pad_id: int = 0):
  """The document-boundary oracle: in a packed row each document's outputs equal those it gets
  alone at the start of a row. `apply(rows, segment_ids)` -> [3,T,...] (one call for the three rows,
  so batch-wide statistics cannot tell them apart)."""
  rows, segs = packed_pair(doc_a, doc_b, length, pad_id=pad_id)
  out = np.asarray(apply(rows, segs), np.float64)
  la, lb = len(doc_a), len(doc_b)
  np.testing.assert_allclose(out[0, :la], out[1, :la], atol=atol, err_msg="first document")
  np.testing.assert_allclose(out[0, la : la + lb], out[2, :lb], atol=atol, err_msg="second document")
  # Without the mask the second document reads the first: the oracle can fail.
  plain = np.asarray(apply(rows, None), np.float64)
  assert not np.allclose(plain[0, la : la + lb], plain[2, :lb], atol=atol), "the model ignores the packing"


def assert_documents_isolated(apply, doc_a, doc_b, length: int, *, vocab: int, atol: float = 1e-5, pad_id: int = 0):
  """The weaker oracle for models whose numbers depend on where a document starts relative to
  their chunks (FLASH chunks, FIT groups, Block Transformer blocks) at unaligned boundaries: in a
  packed row, changing every token of one document leaves the other document's outputs as they
  were. `apply(rows, segment_ids)` -> [B,T,...]."""
  rows, segs = packed_pair(doc_a, doc_b, length, pad_id=pad_id)
  rows, segs = rows[:1], segs[:1]
  la, lb = len(doc_a), len(doc_b)
  out = np.asarray(apply(rows, segs), np.float64)
  new_a = rows.at[0, :la].set((rows[0, :la] + 1 + jnp.arange(la)) % vocab)
  new_b = rows.at[0, la : la + lb].set((rows[0, la : la + lb] + 1 + jnp.arange(lb)) % vocab)
  out_a = np.asarray(apply(new_a, segs), np.float64)
  out_b = np.asarray(apply(new_b, segs), np.float64)
  np.testing.assert_allclose(out_a[0, la : la + lb], out[0, la : la + lb], atol=atol, err_msg="second reads first")
  np.testing.assert_allclose(out_b[0, :la], out[0, :la], atol=atol, err_msg="first reads second")
  assert not np.allclose(out_a[0, :la], out[0, :la], atol=atol), "changing a document must change its outputs"


def _count(jaxpr, name: str) -> int:
  """The equations of primitive `name` in a jaxpr and the jaxprs it calls, those inside Pallas kernels left out."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    if eqn.primitive.name == "pallas_call":
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
          count += _count(inner, name)
  return count


def products_outside_kernels(jaxpr) -> int:
  """The matrix products (dot_general) of a jaxpr and the jaxprs it calls, those inside Pallas kernels left out."""
  return _count(jaxpr, "dot_general")


def kernel_calls(jaxpr) -> int:
  """The Pallas calls of a jaxpr and the jaxprs it calls (each once, however it prints)."""
  return _count(jaxpr, "pallas_call")
