"""FLASH (Hua et al. 2022, "Transformer Quality in Linear Time") and its comparison models.

The transformer stack of models/transformer.py (embeddings, scaled-sinusoid positions, pre-norm
residual blocks, task heads, decoding) with other token mixers. Variants:

  flash_quad        FLASH-Quad: a stack of gated attention units (GAU, Section 2), no MLP
  flash             FLASH: GAUs with mixed chunk attention (Section 3.2), linear in T
  flash_local       FLASH (Local Only), Figure 7: the per-chunk quadratic part alone
  flash_global      FLASH (Global Only), Figure 7: the cross-chunk linear part alone
  mc_transformer++  MC-TFM++ (Figure 7, Table 5): Transformer++ whose attention is mixed chunk,
                    multi-head softmax inside chunks plus multi-head linear attention across them
  performer         Performer with the ReLU kernel and RoPE (Tables 8-9), causal by prefix sums

A GAU (Code 6 / Code 8 of the paper): norm, one dense layer to u, v (width e = expansion x d) and
z (width s = 128), all through SiLU; per-dim scale and offset of z give quad_q, quad_k (and lin_q,
lin_k for FLASH), gamma ~ N(0, .02), beta = 0; RoPE on all of them at absolute positions;
  local   relu(quad_q quad_k^T / n + rel_bias)^2 v   inside a chunk (causal mask when causal)
  global  lin_q (sum over chunks of lin_k^T v / n)   all chunks, or only earlier ones when causal
out = dense(u * (local + global)) + x. Weight init N(0, .02), biases 0.

Normalisation, fixed by design: n is the chunk size C for the chunked variants and the model's
max_len (the training length) for FLASH-Quad, never the length of the batch at hand. Code 6
divides by the current length, which changes every score when a sequence is evaluated at another
length than it was trained at, padded, or decoded one token at a time (the pitfall of
JunnYu/FLASHQuad_pytorch#1). With n fixed, decoding equals the forward pass and padding does not
move the real tokens. The relative bias is T5-free: Code 4's Toeplitz table for n < 512 and its
RoPE-built bias otherwise, over positions inside a chunk.

Cross-chunk normalisation, `model.global_norm`: "mean" (default; Codes 7-8 divide each chunk's
cross-chunk sum by the number of chunks summed) or "sum" (eqs. 7-8); docs/flash.md says why.
FLASH (Global Only) uses chunks of 64 (GLOBAL_ONLY_CHUNK), as the paper's ablation.

Packed documents (`segments`, from Model.encode's segment_ids): every part reads the query's
document only; the cross-chunk sums restart per document (kernels/mixed_chunk/reference.py). Exact against a
document alone when it starts on a chunk boundary (FLASH-Quad: anywhere), isolated otherwise.

Decoding with constant memory per token (chunked variants): the global sum over finished chunks,
the current chunk's partial sum and its keys and values (kernels.mixed_chunk.chunk_step).
`model.impl = "pallas"` runs the forward pass's attention core as one Pallas kernel
(kernels/mixed_chunk/pallas.py); decoding stays XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.kernels import mixed_chunk
from lra_core.models import transformer
from lra_core.models.layers.attention import Attention, config_attention
from lra_core.models.layers.core import Dense, param, silu
from lra_core.models.layers.positions import RelativePositionBias, apply_rope
from lra_core.protocol import PaperRow, RunInfo, Smoke

Array = jax.Array

# gau: GAU blocks (no MLP); local / linear: the two parts of mixed chunk attention; chunked:
# False = one chunk of max_len (FLASH-Quad's quadratic attention).
VARIANTS = {
  "flash_quad": dict(gau=True, local=True, linear=False, chunked=False),
  "flash": dict(gau=True, local=True, linear=True, chunked=True),
  "flash_local": dict(gau=True, local=True, linear=False, chunked=True),
  "flash_global": dict(gau=True, local=False, linear=True, chunked=True),
  "mc_transformer++": dict(gau=False, local=True, linear=True, chunked=True),
  "performer": dict(gau=False, local=False, linear=True, chunked=True),
}
GAU_INIT = jax.nn.initializers.normal(0.02)
# FLASH (Global Only) of Figure 7 uses chunks of 64, not 256: "more local summaries for the global
# linear attention" (Section 4.4).
GLOBAL_ONLY_CHUNK = 64


def model_config(variant: str = "flash", **overrides) -> ml_collections.ConfigDict:
  """The `config.model` section (Table 8 sizes at d 768 by default)."""
  if variant not in VARIANTS:
    raise ConfigError(f"flash variant {variant!r} is not one of {sorted(VARIANTS)}.")
  gau = VARIANTS[variant]["gau"]
  c = transformer.model_config("transformer++" if variant == "mc_transformer++" else "transformer+")
  c.update(
    dict(
      name="flash",
      variant=variant,
      vocab_size=32128,
      d_model=768,
      num_layers=24 if gau else 12,  # GAUs, or attention + MLP blocks
      num_heads=12,  # multi-head variants
      d_ff=2 * 3072 // 3 if variant == "mc_transformer++" else 3072,
      mlp="none" if gau else c.mlp,
      activation="silu" if gau else "gelu",
      expansion=2,  # GAU: e = expansion x d_model
      qk_dim=128,  # GAU: s, the shared width of z, q and k
      chunk=GLOBAL_ONLY_CHUNK if variant == "flash_global" else 256,  # C (Table 6: 256; PG-19: 512)
      rel_bias="auto",  # GAU relative bias: auto | toeplitz | rope | none
      global_norm="mean",  # cross-chunk sum divided by the chunks summed (Codes 7-8), or "sum"
      impl="xla",  # attention core: one of kernels.mixed_chunk.IMPLS
      tie_embeddings=True,
    )
  )
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m = config.model
  if m.variant not in VARIANTS:
    raise ConfigError(f"model.variant {m.variant!r} is not one of {sorted(VARIANTS)}.")
  if m.impl not in mixed_chunk.IMPLS:
    raise ConfigError(f"model.impl {m.impl!r} is not one of {list(mixed_chunk.IMPLS)}.")
  if m.global_norm not in mixed_chunk.GLOBAL_NORMS:
    raise ConfigError(f"model.global_norm {m.global_norm!r} is not one of {list(mixed_chunk.GLOBAL_NORMS)}.")
  v = VARIANTS[m.variant]
  if v["chunked"] and m.chunk <= 0:
    raise ConfigError(f"model.chunk must be positive for variant {m.variant!r}, got {m.chunk}.")
  if v["gau"]:
    if m.mlp != "none":
      raise ConfigError(
        f"model.mlp must be 'none' for GAU variants (a GAU is attention and MLP in one), got {m.mlp!r}."
      )
    if m.expansion <= 0 or m.qk_dim <= 0 or m.qk_dim % 2:
      raise ConfigError(
        f"model.expansion must be positive and model.qk_dim positive and even (RoPE), got {m.expansion} and {m.qk_dim}."
      )
    if m.rel_bias not in RelativePositionBias.KINDS + ("none",):
      raise ConfigError(f"model.rel_bias {m.rel_bias!r} is not one of {list(RelativePositionBias.KINDS + ('none',))}.")
  elif m.num_kv_heads not in (0, m.num_heads):
    raise ConfigError(f"variant {m.variant!r} needs multi-head attention: model.num_kv_heads must be 0.")
  c = ml_collections.ConfigDict(config.to_dict())  # the shared fields, checked by the transformer's rules
  c.model.variant = "transformer++" if m.mlp == "glu" else "transformer+"
  if v["gau"]:  # a GAU has one head of width qk_dim and no MLP
    c.model.update(dict(mlp="mlp", num_heads=1, head_dim=0, num_kv_heads=0))
  transformer.validate_config(c)


class GAU(nnx.Module):
  """Gated attention unit over [B,T,D]; mixed chunk attention for the chunked variants."""

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs):
    v = VARIANTS[m.variant]
    d, e, s = m.d_model, m.expansion * m.d_model, m.qk_dim
    self.causal, self.local, self.linear, self.e, self.s = causal, v["local"], v["linear"], e, s
    self.chunked, self.impl, self.global_norm = v["chunked"], m.impl, m.global_norm
    self.chunk = m.chunk if self.chunked else m.max_len
    self.scale = 1.0 / self.chunk  # the fixed n of relu^2(q k / n + b) and of lin_k^T v / n
    kw = dict(use_bias=True, kernel_init=GAU_INIT, dtype=dtype, rngs=rngs)
    self.proj = Dense(d, 2 * e + s, axes=("embed", "mlp"), **kw)
    self.out = Dense(e, d, axes=("mlp", "embed"), **kw)
    heads = 2 * self.local + 2 * self.linear  # quad_q, quad_k, lin_q, lin_k
    self.gamma = param(rngs, GAU_INIT, (heads, s), (None, None))
    self.beta = param(rngs, jax.nn.initializers.zeros, (heads, s), (None, None))
    self.rel_bias = (
      RelativePositionBias(self.chunk, kind=m.rel_bias, width=s, rngs=rngs)
      if self.local and m.rel_bias != "none"
      else None
    )

  def _project(self, x: Array, positions: Array) -> tuple[Array, Array, list[Array | None]]:
    """-> u, v [B,T,1,E] and quad_q, quad_k, lin_q, lin_k [B,T,1,S] (None where unused)."""
    uvz = silu(self.proj(x))
    u, v, z = jnp.split(uvz, [self.e, 2 * self.e], axis=-1)
    heads = z[..., None, :] * self.gamma[...].astype(z.dtype) + self.beta[...].astype(z.dtype)  # [B,T,n,S]
    heads = apply_rope(heads, positions)
    parts = [heads[..., i : i + 1, :] for i in range(heads.shape[-2])]
    qk = (parts[:2] if self.local else [None, None]) + (parts[-2:] if self.linear else [None, None])
    return u[..., None, :], v[..., None, :], qk

  def _bias(self, length: int) -> Array | None:
    if self.rel_bias is None:
      return None
    pos = jnp.arange(length)
    return self.rel_bias(pos, pos)

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x [B,T,D]; positions int[T] consecutive, or int[B,T] counted from each document's start;
    mask bool[B,T], False = padding; segments int[B,T]: packed documents, each read on its own
    (kernels.mixed_chunk.mixed_chunk_attention). The relative bias depends on i - j only, which inside
    one document is the difference of its per-document positions."""
    del rngs
    t = x.shape[1]
    positions = jnp.arange(t) if positions is None else positions
    u, v, (qq, qk, lq, lk) = self._project(x, positions)
    y = mixed_chunk.mixed_chunk_attention(
      qq,
      qk,
      lq,
      lk,
      v,
      chunk=self.chunk,
      causal=self.causal,
      quad_scale=self.scale,
      lin_scale=self.scale,
      bias=self._bias(min(self.chunk, t)),
      mask=mask,
      segments=segments,
      global_norm=self.global_norm,
      impl=self.impl,
    )
    return self.out((u * y)[..., 0, :])

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    if not self.causal:
      raise ValueError("decoding needs a causal GAU; this layer is bidirectional.")
    if not self.chunked and max_len > self.chunk:
      raise ValueError(f"max_len {max_len} exceeds the model's max_len {self.chunk} (FLASH-Quad attends to all of it).")
    return mixed_chunk.init_chunk_state(
      batch_size, 1, self.chunk, self.s, self.e, local=self.local, linear=self.linear, dtype=dtype
    )

  def decode(self, x: Array, cache: dict, position: Array) -> tuple[Array, dict]:
    """One step. x [B,1,D] at `position` -> y [B,1,D], next cache (constant size when chunked)."""
    u, v, qk = self._project(x, position[None])
    row = None
    if self.rel_bias is not None:
      row = self.rel_bias((position % self.chunk)[None], jnp.arange(self.chunk))[0]
    y, cache = mixed_chunk.chunk_step(
      *(None if a is None else a[:, 0] for a in qk),
      v[:, 0],
      cache,
      position,
      chunk=self.chunk,
      quad_scale=self.scale,
      lin_scale=self.scale,
      bias_row=row,
      global_norm=self.global_norm,
    )
    return self.out((u * y[:, None])[:, :, 0]), cache


class ChunkedAttention(Attention):
  """Multi-head attention in chunks (heads, projections and RoPE of blocks.Attention):

  mc_transformer++  softmax(q k^T / sqrt(Dh)) inside each chunk plus linear attention across
                    chunks with lin_q, lin_k a per-head scale and offset of q and k (FLASH's
                    recipe applied to MHSA; gamma ~ N(0, .02), beta 0) and the fixed 1 / C;
  performer         normalised linear attention with ReLU features (kernels.mixed_chunk.linear_attention).
  """

  def __init__(self, m, *, causal: bool, dtype, rngs: nnx.Rngs):
    super().__init__(**config_attention(m), causal=causal, dtype=dtype, rngs=rngs)
    head_dim = self.head_dim
    self.chunk, self.performer, self.impl, self.global_norm = m.chunk, m.variant == "performer", m.impl, m.global_norm
    if not self.performer:
      self.gamma = param(rngs, GAU_INIT, (2, m.num_heads, head_dim), (None, "heads", "head_dim"))
      self.beta = param(rngs, jax.nn.initializers.zeros, (2, m.num_heads, head_dim), (None, "heads", "head_dim"))

  def _linear_qk(self, q: Array, k: Array) -> tuple[Array, Array]:
    gamma, beta = self.gamma[...].astype(q.dtype), self.beta[...].astype(q.dtype)
    return q * gamma[0] + beta[0], k * gamma[1] + beta[1]

  def __call__(
    self,
    x: Array,
    *,
    positions: Array | None = None,
    mask: Array | None = None,
    segments: Array | None = None,
    rngs: nnx.Rngs | None = None,
  ) -> Array:
    """x [B,T,D]; positions, mask and segments as in GAU.__call__."""
    del rngs
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    q, k, v = self._qkv(x, positions)
    if self.performer:  # normalised per query: global_norm would cancel, so it does not apply
      return self.out(
        mixed_chunk.linear_attention(
          q, k, v, causal=self.causal, chunk=self.chunk, mask=mask, segments=segments, impl=self.impl
        )
      )
    lq, lk = self._linear_qk(q, k)
    y = mixed_chunk.mixed_chunk_attention(
      q,
      k,
      lq,
      lk,
      v,
      chunk=self.chunk,
      causal=self.causal,
      quad_scale=self.head_dim**-0.5,
      lin_scale=1.0 / self.chunk,
      mask=mask,
      segments=segments,
      global_norm=self.global_norm,
      kernel="softmax",
      impl=self.impl,
    )
    return self.out(y)

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    if not self.causal:
      raise ValueError("decoding needs causal attention; this layer is bidirectional.")
    h, dh = self.num_heads, self.head_dim
    return mixed_chunk.init_chunk_state(batch_size, h, self.chunk, dh, dh + self.performer, dtype=dtype)

  def decode(self, x: Array, cache: dict, position: Array) -> tuple[Array, dict]:
    q, k, v = (a[:, 0] for a in self._qkv(x, position[None]))
    if self.performer:
      y, cache = mixed_chunk.linear_step(q, k, v, cache, position, chunk=self.chunk)
    else:
      lq, lk = self._linear_qk(q, k)
      y, cache = mixed_chunk.chunk_step(
        q,
        k,
        lq,
        lk,
        v,
        cache,
        position,
        chunk=self.chunk,
        quad_scale=self.head_dim**-0.5,
        lin_scale=1.0 / self.chunk,
        kernel="softmax",
        global_norm=self.global_norm,
      )
    return self.out(y[:, None]), cache


def token_mixer(m, *, causal: bool, dtype, rngs: nnx.Rngs) -> nnx.Module:
  mixer = GAU if VARIANTS[m.variant]["gau"] else ChunkedAttention
  return mixer(m, causal=causal, dtype=dtype, rngs=rngs)


class Model(transformer.Model):
  """The transformer stack with GAU or chunked multi-head mixers (see the module docstring)."""

  mixer = staticmethod(token_mixer)

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    if not m.max_len:  # FLASH-Quad's fixed n is the training length
      m = ml_collections.ConfigDict(m.to_dict())
      m.max_len = run.seq_len
    super().__init__(m, run, rngs=rngs)


# -- family record --------------------------------------------------------------------------------


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices (kernels/mixed_chunk/__init__.py): the chunked variants with whole chunks per chip,
  FLASH-Quad's one chunk over all of them (each chip's queries read the gathered keys)."""
  m, local = config.model, (config.train.update_len or config.train.seq_len) // n
  if not VARIANTS[m.variant]["chunked"]:
    return
  if local % m.chunk:
    raise ConfigError(f"model.chunk {m.chunk} does not divide the {local} steps each of mesh.sequence={n} chips holds.")


FAMILY = transformer.mixer_family(
  "flash",
  Model,
  validate_config=validate_config,
  context_parallel=context_parallel,
  smoke=Smoke(
    config="configs/c4/flash.py:tiny",
    data="c4",
    causal="configs/c4/flash.py:tiny,lm",
    light=("model.num_layers=1",),
    fuzz={
      "model.chunk": ["4", "16", "5", "0"],
      "model.expansion": ["1", "2", "0"],
      "model.qk_dim": ["8", "16", "0"],
      "model.variant": ["flash", "flash_quad", "flash_local", "nope"],
      "mlm.mask_rate": ["0.15", "0.0", "1.5"],
    },
  ),
  # Tables 8 (C4 masked LM, d 768) and 10 (PG-19, d 1024)
  paper_rows=(
    PaperRow("configs/c4/flash.py", 112e6, "FLASH Table 8, FLASH (C4 MLM)", tolerance=0.03),
    PaperRow("configs/c4/flash_quad.py", 112e6, "FLASH Table 8, FLASH-Quad (C4 MLM)", tolerance=0.03),
    PaperRow("configs/c4/flash.py:performer", 110e6, "FLASH Table 8, Performer (C4 MLM)", tolerance=0.03),
    PaperRow("configs/pg19/flash.py", 496e6, "FLASH Table 10, FLASH (PG-19)", tolerance=0.03),
    PaperRow("configs/pg19/flash.py:flash_quad", 496e6, "FLASH Table 10, FLASH-Quad (PG-19)", tolerance=0.03),
  ),
)
