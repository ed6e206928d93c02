"""Linear Transformer (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax attention with
exp(q.k) replaced by phi(q).phi(k), phi = elu + 1, so attention is linear in T and a causal model
decodes as an RNN whose state per head is S = sum phi(k) v^T and z = sum phi(k) (eqs. 6, 16-20).

The transformer stack of models/transformer.py keeps everything else; this module is also the
README's example of adding a family: a token mixer, a Model and a FAMILY record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lra_core.kernels import context_parallel as sequence_split
from lra_core.kernels.packed_documents import segment_starts
from lra_core.models import transformer
from lra_core.models.layers.attention import head_width
from lra_core.models.layers.core import Dense
from lra_core.protocol import Capabilities, Family, Smoke

Array = jax.Array


def _running_sum(x: Array, starts: Array | None, *, reverse: bool = False) -> Array:
  """Inclusive prefix sum of x [B,T,H,...] over T (suffix sum if `reverse`) that restarts where
  starts bool[B,T] is True (None: never), per chip where a sequence is split (kernels/context_parallel.py)."""
  keep = jnp.ones(x.shape[:2], x.dtype) if starts is None else (~starts).astype(x.dtype)
  keep = keep.reshape(keep.shape + (1,) * (x.ndim - 2))
  return sequence_split.linear_recurrence(keep, x, reverse=reverse, dims="bth" + "." * (x.ndim - 3))


def elu_linear_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool,
  mask: Array | None = None,
  segments: Array | None = None,
  eps: float = 1e-6,
) -> Array:
  """q, k [B,T,H,Dk], v [B,T,H,Dv], mask bool[B,T] (False = padding), segments int[B,T] (packed
  documents: the sums of phi(k) v^T and phi(k) hold the query's document only; causal, they
  restart at each document's first token) -> [B,T,H,Dv]."""
  q, k = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
  if mask is not None:
    k = k * mask[:, :, None, None]
  kv_t = jnp.einsum("bthd,bthe->bthde", k, v)
  starts = None if segments is None else segment_starts(segments)
  if causal:  # prefix sums of phi(k) v^T and phi(k): position t reads keys <= t
    kv, z = _running_sum(kv_t, starts), _running_sum(k, starts)
    num, den = jnp.einsum("bthd,bthde->bthe", q, kv), jnp.einsum("bthd,bthd->bth", q, z)
  elif segments is None:
    kv, z = kv_t.sum(axis=1), k.sum(axis=1)
    num, den = jnp.einsum("bthd,bhde->bthe", q, kv), jnp.einsum("bthd,bhd->bth", q, z)
  else:  # each token's whole document: the sum up to it, plus the sum after it
    ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
    document = lambda x: _running_sum(x, starts) + _running_sum(x, ends, reverse=True) - x
    kv, z = document(kv_t), document(k)
    num, den = jnp.einsum("bthd,bthde->bthe", q, kv), jnp.einsum("bthd,bthd->bth", q, z)
  return (num / (den[..., None] + eps)).astype(v.dtype)


class LinearAttention(nnx.Module):
  """The token mixer: heads of linear attention, with a constant-size decode state."""

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs):
    h, dh = m.num_heads, head_width(m)
    kw = dict(axes=("embed", "heads", "head_dim"), use_bias=m.use_bias, dtype=dtype, rngs=rngs)
    self.query, self.key, self.value = (Dense(m.d_model, (h, dh), **kw) for _ in range(3))
    self.out = Dense(
      (h, dh), m.d_model, axes=("heads", "head_dim", "embed"), use_bias=m.use_bias, dtype=dtype, rngs=rngs
    )
    self.causal, self.shape = causal, (h, dh)

  def __call__(self, x: Array, *, positions=None, mask=None, segments=None, rngs=None) -> Array:
    """x [B,T,D]; mask bool[B,T]; segments int[B,T]: packed documents, each summed on its own."""
    return self.out(
      elu_linear_attention(self.query(x), self.key(x), self.value(x), causal=self.causal, mask=mask, segments=segments)
    )

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    h, dh = self.shape
    return {"kv": jnp.zeros((batch_size, h, dh, dh), jnp.float32), "z": jnp.zeros((batch_size, h, dh), jnp.float32)}

  def decode(self, x: Array, cache: dict, position: Array) -> tuple[Array, dict]:
    """One token x [B,1,D]: the RNN form, S += phi(k) v^T, z += phi(k), y = phi(q) S / phi(q).z."""
    phi = lambda proj: jax.nn.elu(proj(x)[:, 0]) + 1.0
    q, k, v = phi(self.query), phi(self.key), self.value(x)[:, 0]
    kv, z = cache["kv"] + jnp.einsum("bhd,bhe->bhde", k, v), cache["z"] + k
    y = jnp.einsum("bhd,bhde->bhe", q, kv) / (jnp.einsum("bhd,bhd->bh", q, z)[..., None] + 1e-6)
    return self.out(y[:, None].astype(x.dtype)), {"kv": kv, "z": z}


class Model(transformer.Model):
  mixer = staticmethod(LinearAttention)


def context_parallel(config, n: int) -> None:
  """Any setting splits over chips: the running sums carry across them (kernels/context_parallel.py)."""


FAMILY = Family(
  name="linear_transformer",
  context_parallel=context_parallel,
  model=Model,
  tasks=transformer.TASKS,
  capabilities=Capabilities(decode=True),
  validate_config=transformer.validate_config,
  upgrades=transformer.UPGRADES,
  smoke=Smoke(
    config="configs/enwik8/linear_transformer.py:tiny",
    data="enwik8",
    causal="configs/enwik8/linear_transformer.py:tiny",
    light=("model.num_layers=1",),
    fuzz={"model.num_heads": ["1", "2", "3", "0"], "model.d_model": ["16", "30"]},
  ),
)
