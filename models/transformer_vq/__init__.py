"""Transformer-VQ (Lingle 2024): a decoder of gated attention units whose keys are vector-quantized,
so that dense softmax attention runs in linear time with a compressive cache.

Each unit (GAU, Remark 3.2): x~ = RMSNorm(x); q = RMS(x~ W_q) Dk^-1/4; k likewise; v = silu(x~ W_v);
g = silu(x~ W_g); out = (VQAttn(q, STVQ(k), v) * g) W_o, added to x. There is no MLP: N units of
width Dv = 2 Dm replace N/2 transformer layers. The attention core is `kernels.vq_attention`.

  attention   'vq' (the paper) | 'full' (unquantized quadratic attention, the paper's baseline)
  head_type   'shga' (single-head GAU) | 'mha' | 'mqa' (Dv split across heads; mqa shares k, v)
  reduction   'serial' | 'matmul' | 'assoc' (cache variables across blocks); 'serial' scans the
              attention over the blocks, `chunk_blocks` at a time (1: one block's scores and position
              terms at a time, which stay in a CPU's cache, so the time per token stays flat as the
              length grows; 0: all blocks at once, which on TPU holds 20% fewer temporaries; -1, the
              default: 1 when the step is traced for CPU devices, else 0; when scanned, the
              quantizer's distances go as many blocks at a time and the codebook statistics are
              summed by scatter, not by a one-hot matmul); 'matmul' and 'assoc' compute all
              blocks at once
  input_scan  True runs the whole stack one block at a time (lax.scan over blocks, each unit's
              cache carried with its gradient): every activation is one block's; the same outputs,
              gradients and dropout masks as the whole window at once
  compressive False: sliding window over the last block_len keys only (the Table 2 ablation)
  grad_through_cache  False: the state passed from block to block (the compressive cache and the
                      previous block's keys and values) gets no gradient (the authors' grad_thru_cache=0)

Codebooks are EMA k-means (rate `ema_rate`), updated in the training forward pass from
statistics summed over the (global) batch and all blocks of the update window; keys get a
straight-through estimator and a commitment loss (coefficient `commit_coef`). With update
windows the model carries each unit's cache (previous block + per-code counts and means) to the
next window with a stop-gradient; LayerDrop and sinusoid-dropout masks are drawn once per sequence
and reused across its windows, residual dropout per window.

Packed documents (`segment_ids`, kernels/packed_documents.py): a token reads only keys of its own document,
in the exact part and in the compressive cache, which restarts at each document (see
`kernels.vq.reference.document_plan`); absolute positions count from each document's start (relative
biases depend only on distances). Padding (mask False, segment id 0) is left out of the codebook
statistics, the commitment loss and the codebook usage metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from lra_core.errors import ConfigError
from lra_core.kernels import packed_documents as seg_lib
from lra_core.kernels import vq
from lra_core.layer_stacks import MODEL_DEFAULTS
from lra_core.models.layers import stack
from lra_core.models.layers.core import EMBEDDINGS, Dense, Embed, RMSNorm, next_key, param
from lra_core.models.layers.positions import sinusoid
from lra_core.models.transformer_vq.unit import (
  GAU,
  PROJ_INIT,
  Codebook,
  codebook_usage,
  dropout,
  residual_mask,
  residual_masks,
)
from lra_core.protocol import Capabilities, Family, PaperRow, RunInfo, Smoke
from lra_core.sharding import constrain

Array = jax.Array
HEAD_TYPES = ("shga", "mha", "mqa")
ATTENTIONS = ("vq", "full")


def model_config(**overrides) -> ml_collections.ConfigDict:
  """The `config.model` section (defaults: a small enwik8-style model)."""
  c = ml_collections.ConfigDict(
    dict(
      name="transformer_vq",
      vocab_size=256,
      d_model=256,
      d_k=128,  # key width (per head)
      d_v=512,  # value / gate width (all heads together); the paper uses 2 d_model
      num_layers=4,  # number of GAUs (the paper's N; two GAUs ~ one transformer layer)
      num_heads=1,
      head_type="shga",  # shga | mha | mqa
      attention="vq",  # vq | full
      n_code=512,  # codebook size S
      block_len=512,  # L; also the local window of exact attention and XL biases
      reduction="serial",  # serial | matmul | assoc
      chunk_blocks=-1,  # serial: blocks per step of the attention's scan; 0: all at once; -1: 1 on CPU, else 0
      input_scan=False,  # process the stack one block at a time
      compressive=True,  # False: sliding window only (no codebook cache)
      grad_through_cache=True,  # False: cache and previous block held constant in the backward (grad_thru_cache)
      rel_bias=True,  # Transformer-XL relative biases inside the local window
      abs_position=False,  # scaled sinusoid added to embeddings (image models)
      wavelength=1e5,  # sinusoid maximum wavelength (appendix C.2)
      commit_coef=1e-4,  # beta
      ema_rate=0.99,  # gamma
      dropsin=0.0,  # dropout on the XL sinusoids (per sequence)
      dropres=0.0,  # dropout on each unit's residual branch
      droplyr=0.0,  # LayerDrop per unit and sequence row
      final_norm=False,  # RMSNorm before the classifier (large models)
      tie_embeddings=False,  # tied classifier: logits = (x E^T + b) * output_scale (large models)
      # The tied classifier's scale: the authors' e_scale for their tied models; 0: logits / d_model, no bias.
      output_scale=0.005,
      embedding="plain",  # what the table stores: "plain" E (the authors') | "scaled" E / sqrt(d_model)
      impl="xla",  # attention core implementation: one of kernels.vq.IMPLS
      dtype="float32",
    )
  )
  c.update(MODEL_DEFAULTS)  # the layer-stacking switches every model section has
  c.update(overrides)
  return c


def validate_config(config) -> None:
  m, t = config.model, config.train
  for key in ("vocab_size", "d_model", "d_k", "d_v", "num_layers", "num_heads", "n_code", "block_len"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}.")
  choices = {
    "head_type": HEAD_TYPES,
    "attention": ATTENTIONS,
    "reduction": vq.REDUCTIONS,
    "impl": vq.IMPLS,
    "embedding": EMBEDDINGS,
  }
  for key, allowed in choices.items():
    if m[key] not in allowed:
      raise ConfigError(f"model.{key} {m[key]!r} is not one of {list(allowed)}.")
  if m.output_scale < 0:
    raise ConfigError(
      f"model.output_scale must be positive (or 0, the tied form before it existed), got {m.output_scale}."
    )
  if m.impl == "pallas" and (m.attention != "vq" or m.reduction != "serial"):
    raise ConfigError(
      f"model.impl 'pallas' is the VQ kernel, a serial scan over blocks: it needs attention 'vq' "
      f"and reduction 'serial', got {m.attention!r} and {m.reduction!r}."
    )
  if m.head_type == "shga" and m.num_heads != 1:
    raise ConfigError(f"head_type 'shga' is single-head; model.num_heads is {m.num_heads}.")
  if m.d_v % m.num_heads:
    raise ConfigError(f"model.d_v {m.d_v} is not a multiple of model.num_heads {m.num_heads}.")
  window = t.update_len or t.seq_len
  if window % m.block_len:
    raise ConfigError(
      f"update window {window} (train.update_len or train.seq_len) is not a multiple of model.block_len {m.block_len}."
    )
  chunk = m.chunk_blocks
  if chunk < -1 or (chunk > 0 and (window // m.block_len) % chunk):
    raise ConfigError(
      f"model.chunk_blocks {chunk} must be -1 (by platform), 0 (all blocks at once) or divide the "
      f"{window // m.block_len} blocks of the update window."
    )
  if m.input_scan and m.attention != "vq":
    raise ConfigError("model.input_scan needs attention 'vq' (full attention has no per-block cache).")
  if m.input_scan and m.impl == "pallas":
    raise ConfigError(
      "model.input_scan needs impl 'xla': the Pallas kernel's carry has no gradient, so a stack run one "
      "block at a time would not train through the previous block and the cache."
    )
  for key in ("dropsin", "dropres", "droplyr"):
    if not 0.0 <= m[key] < 1.0:
      raise ConfigError(f"model.{key} must be in [0, 1), got {m[key]}.")


class Model(nnx.Module):
  """tokens int32[B,T] -> logits float32[B,T,V]; with `carry`, also the state for the next window."""

  def __init__(self, m: ml_collections.ConfigDict, run: RunInfo, *, rngs: nnx.Rngs):
    m = self.m = ml_collections.FrozenConfigDict(m)
    self.dtype = jnp.dtype(m.dtype)
    self.deterministic = False  # set by .train() / .eval(): EMA updates and dropout only in training
    self.embed = Embed(m.vocab_size, m.d_model, dtype=self.dtype, rngs=rngs, parameterisation=m.embedding)
    self.pos_scale = param(rngs, jax.nn.initializers.zeros, (), ()) if m.abs_position else None
    self.units = stack.make_layers(lambda: GAU(m, dtype=self.dtype, rngs=rngs), m.num_layers, scan=m.scan_layers)
    self.final_norm = RMSNorm(m.d_model, use_bias=True, rngs=rngs) if m.final_norm else None
    self.classifier = (
      None
      if m.tie_embeddings
      else Dense(m.d_model, m.vocab_size, axes=("embed", "vocab"), use_bias=True, rngs=rngs, **PROJ_INIT)
    )
    # The tied classifier's output bias (the authors' bias_out); output_scale 0, the form before the
    # scale existed (configs saved then are upgraded to it), has none and divides by d_model instead.
    self.output_bias = (
      param(rngs, jax.nn.initializers.zeros, (m.vocab_size,), ("vocab",))
      if m.tie_embeddings and m.output_scale > 0
      else None
    )

  # -- carried state -------------------------------------------------------------------------------

  def init_carry(self, batch_size: int) -> dict:
    """Cache carried across update windows; only VQ attention has one (the record's carry_if)."""
    m = self.m
    if m.attention != "vq":
      raise ValueError("full attention carries no state between update windows.")
    units = [vq.init_carry(batch_size, m.block_len, u.hk, m.n_code, m.d_k, u.dv_head, self.dtype) for u in self.units]
    return {
      "units": units,
      "offset": jnp.zeros((batch_size,), jnp.int32),
      "doc_position": jnp.zeros((batch_size,), jnp.int32),
      "seq_key": jnp.zeros((batch_size, 2), jnp.uint32),
    }

  # -- forward -------------------------------------------------------------------------------------

  def _embed(self, tokens: Array, positions: Array) -> Array:
    x = self.embed(tokens)
    if self.pos_scale is not None:
      pe = sinusoid(positions, self.m.d_model, self.m.wavelength) * self.pos_scale[...]
      x = x + pe.astype(x.dtype)
    return x

  def _logits(self, x: Array) -> Array:
    if self.final_norm is not None:
      x = self.final_norm(x)
    if self.classifier is None:
      logits = self.embed.attend(x).astype(jnp.float32)
      return (
        logits * self.m.d_model**-1.0
        if self.output_bias is None
        else (logits + self.output_bias[...]) * self.m.output_scale
      )
    return self.classifier(x.astype(jnp.float32)).astype(jnp.float32)

  def _stack(
    self,
    x: Array,
    carries: list,
    seq_key: Array | None,
    res_key: Array | None,
    weights: Array,
    segments: Array | None,
    res_masks: Array | None = None,
  ):
    """All units over x [B,T,D]; returns x, carries, the commit loss summed over units and tokens
    (weights [B,T]) and the EMA statistics (k_sum [N,...], count [N,...]) of the N units, or () with
    full attention. Residual dropout: unit i's mask drawn from fold_in(res_key, i), or res_masks[i]
    (`residual_masks`' slice for this block when the stack runs a block at a time)."""
    m = self.m

    def unit_step(unit, x, inputs, _):
      carry, i, keep = inputs
      sin_key = lyr_key = None
      if seq_key is not None:
        sin_key, lyr_key = jax.random.fold_in(seq_key, 2 * i), jax.random.fold_in(seq_key, 2 * i + 1)
      if keep is None and res_key is not None and m.dropres > 0:
        keep = residual_mask(res_key, i, m.dropres, x.shape)
      h, c, aux = unit(x, carry, sin_key=sin_key, res_keep=keep, weights=weights, segments=segments)
      x = x + dropout(h, m.droplyr, lyr_key, shape=(x.shape[0], 1, 1))
      return constrain(x, ("batch", "length", "embed")), (c, aux)

    n = len(self.units)
    xs = (None if carries[0] is None else stack.stack_trees(carries), jnp.arange(n), res_masks)
    x, (new, aux) = stack.scan(self.units, unit_step, x, xs, remat=m.remat)
    commit = jnp.zeros((), jnp.float32)
    for i in range(n if aux else 0):
      commit = commit + aux["commit"][i]
    stats = (aux["k_sum"], aux["count"]) if aux else ()
    return x, [None] * n if new is None else stack.unstack(new, n), commit, stats

  def __call__(
    self,
    inputs: Array,
    *,
    carry: dict | None = None,
    rngs: nnx.Rngs | None = None,
    mask: Array | None = None,
    segment_ids: Array | None = None,
  ):
    """inputs int32[B,T] -> logits float32[B,T,V] (and the carry after the window when `carry` is given).

    mask bool[B,T] (False on padding) and segment_ids int[B,T] (packed documents, 0 on padding):
    padding stays out of the codebook statistics, the commitment loss and the usage metrics (it
    follows the real tokens, so the causal model's outputs there never reach them); with
    segment_ids every token reads only its own document and positions restart at each document,
    continuing across carried windows of the same row.
    """
    seg_lib.check_segments(segment_ids, inputs.shape)
    m = self.m
    b, t = inputs.shape
    state = carry if carry is not None else (self.init_carry(b) if m.attention == "vq" else None)
    offset = jnp.zeros((b,), jnp.int32) if state is None else state["offset"]
    weights = jnp.ones((b, t), jnp.float32)
    if mask is not None:
      weights = weights * mask.astype(jnp.float32)
    if segment_ids is not None:
      weights = weights * (segment_ids != 0).astype(jnp.float32)
      segment_ids = segment_ids.astype(jnp.int32)
    seq_key = res_key = None
    training = not self.deterministic and rngs is not None
    if training:
      fresh = jax.random.key_data(next_key(rngs, "dropout"))
      stored = fresh if state is None else jnp.where(offset[0] == 0, fresh, state["seq_key"][0])
      seq_key, res_key = jax.random.wrap_key_data(stored), next_key(rngs, "dropout")
    positions = offset[:, None] + jnp.arange(t)[None]
    if segment_ids is not None:
      positions = self._document_positions(segment_ids, state)
    x = self._embed(inputs, positions)
    carries = [None] * len(self.units) if state is None else state["units"]

    if m.input_scan:
      x, carries, commit, stats = self._scan_blocks(x, carries, seq_key, res_key, weights, segment_ids)
    else:
      x, carries, commit, stats = self._stack(x, carries, seq_key, res_key, weights, segment_ids)

    if stats:
      self._codebook_step(stats, commit / jnp.maximum(weights.sum(), 1.0))
    logits = self._logits(x)
    if carry is None:
      return logits
    new = {
      "units": carries,
      "offset": offset + t,
      "doc_position": positions[:, -1] + 1,
      "seq_key": jnp.broadcast_to(seq_key_data(seq_key, state), state["seq_key"].shape),
    }
    return logits, jax.tree.map(jax.lax.stop_gradient, new)

  def _document_positions(self, segment_ids: Array, state: dict | None) -> Array:
    """Each token's position in its document, int32 [B,T]. With a carried state, the tokens before
    the window's first new document continue the carried block's last document."""
    if state is None:
      return seg_lib.segment_positions(segment_ids)
    last = state["units"][0]["seg"][:, -1:]  # -1 at a sequence's start
    starts = jnp.concatenate([last, segment_ids], axis=1)
    starts = starts[:, 1:] != starts[:, :-1]
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
    start = jax.lax.cummax(jnp.where(starts, t, -1), axis=1)
    return jnp.where(start >= 0, t - start, state["doc_position"][:, None] + t)

  def _scan_blocks(self, x, carries, seq_key, res_key, weights, segment_ids):
    """Input scanning: the whole stack one block at a time, carrying each unit's cache; the same
    function as the unscanned stack, residual dropout masks included."""
    b, t, d = x.shape
    l = self.m.block_len
    per_block = lambda a: a.reshape((b, t // l, l) + a.shape[2:]).swapaxes(0, 1)
    segs = None if segment_ids is None else per_block(segment_ids)
    masks = residual_masks(res_key, self.m.dropres, len(self.units), (b, t, d))
    masks = None if masks is None else jax.vmap(per_block, out_axes=1)(masks)  # [T/L, N, B, L, D]

    def body(carry, xs):
      caches, commit, stats = carry
      xb, wb, sb, mb = xs
      y, caches, c, s = self._stack(xb, caches, seq_key, res_key, wb, sb, res_masks=mb)
      stats = jax.tree.map(jnp.add, stats, s)
      return (caches, commit + c, stats), y

    n, unit = len(self.units), self.units[0]
    zero_stats = (
      jnp.zeros((n,) + unit.quantizer.c_sum[...].shape),
      jnp.zeros((n,) + unit.quantizer.c_count[...].shape),
    )
    (carries, commit, stats), ys = jax.lax.scan(
      body,
      (carries, jnp.zeros((), jnp.float32), zero_stats),
      (per_block(x), per_block(weights), segs, masks),
    )
    return ys.swapaxes(0, 1).reshape(b, t, d), carries, commit, stats

  def _codebook_step(self, stats: list, commit: Array) -> None:
    """EMA update (training only), commitment loss (mean over the real tokens, summed over units) and
    codebook usage metrics; `stats` already leave padding out."""
    k_sums, counts = stats
    usage = [codebook_usage(count) for count in counts]
    self.sow(nnx.Intermediate, "aux_loss", self.m.commit_coef * commit)
    self.sow(
      nnx.Intermediate,
      "aux_metrics",
      {
        "commit_loss": commit,
        "codebook_perplexity": jnp.mean(jnp.stack([p.mean() for p, _ in usage])),
        "codebook_unused": jnp.mean(jnp.stack([u.mean() for _, u in usage])),
      },
    )
    if self.deterministic:
      return
    if isinstance(self.units, stack.Stacked):  # one update of the stacked codebooks [N,...]
      self.units.body.quantizer.update(k_sums, counts)
    else:
      for i, unit in enumerate(self.units):
        unit.quantizer.update(k_sums[i], counts[i])

  # -- decoding ------------------------------------------------------------------------------------

  def init_decode_state(self, batch_size: int, max_len: int) -> dict:
    return {
      "index": jnp.zeros((), jnp.int32),
      "units": [u.init_decode_state(batch_size, max_len, self.dtype) for u in self.units],
    }

  def decode_step(self, tokens: Array, state: dict) -> tuple[Array, dict]:
    """tokens int32[B,1] at position state['index'] -> logits float32[B,1,V], next state."""
    position = state["index"]
    x = self._embed(tokens, position[None, None])
    new = []
    for unit, s in zip(self.units, state["units"]):
      h, s = unit.decode(x, s, position)
      x = x + h
      new.append(s)
    return self._logits(x), {"index": position + 1, "units": new}


def seq_key_data(seq_key: Array | None, state: dict) -> Array:
  return state["seq_key"][0] if seq_key is None else jax.random.key_data(seq_key)


# -- family record --------------------------------------------------------------------------------


def context_parallel(config, n: int) -> None:
  """A sequence split into n slices: the VQ attention with whole blocks per chip (kernels/vq/__init__.py), or
  the full attention as ring attention (kernels/softmax/ring.py)."""
  m, local = config.model, (config.train.update_len or config.train.seq_len) // n
  if m.input_scan:
    raise ConfigError("mesh.sequence needs model.input_scan False: the scan over update windows runs on whole rows.")
  if m.attention == "full":
    if m.rel_bias:
      raise ConfigError(
        "mesh.sequence runs full attention as ring attention, which takes no Transformer-XL position bias: "
        "set model.rel_bias=False (or model.attention='vq')."
      )
    return
  if m.attention != "vq":
    raise ConfigError(f"mesh.sequence cannot split model.attention {m.attention!r}; use 'vq' or 'full'.")
  if local % m.block_len:
    raise ConfigError(
      f"model.block_len {m.block_len} does not divide the {local} steps each of mesh.sequence={n} chips holds."
    )
  if m.chunk_blocks > 0 and (local // m.block_len) % m.chunk_blocks:
    raise ConfigError(
      f"model.chunk_blocks {m.chunk_blocks} does not divide the {local // m.block_len} blocks each of "
      f"mesh.sequence={n} chips holds."
    )


FAMILY = Family(
  name="transformer_vq",
  context_parallel=context_parallel,
  model=Model,
  tasks=("lm", "image_ar"),
  capabilities=Capabilities(decode=True, carry=True),
  carry_if=lambda config: config.model.attention == "vq",
  validate_config=validate_config,
  # What runs saved before each key built: the embedding table stored scaled, the attention over all
  # blocks at once, the gradient through the cache, and the tied classifier as logits / d_model.
  upgrades={"embedding": "scaled", "chunk_blocks": 0, "grad_through_cache": True, "output_scale": 0.0},
  counted_state=(Codebook,),
  smoke=Smoke(
    config="configs/enwik8/transformer_vq.py:tiny",
    data="enwik8",
    causal="configs/enwik8/transformer_vq.py:tiny",
    overrides=("model.droplyr=0.3", "train.seq_len=32", "train.update_len=16"),
    light=("model.num_layers=1",),
    fuzz={
      "model.block_len": ["4", "8", "5", "16", "0"],
      "model.n_code": ["8", "16", "0"],
      "train.update_len": ["0", "8", "16", "7"],
      "model.head_type": ["shga", "mqa", "mha", "xyz"],
      "model.num_heads": ["1", "2", "3"],
      "model.reduction": ["serial", "matmul", "assoc", "bogus"],
      "model.vocab_size": ["256", "100"],
    },
  ),
  # Table 10: trainable parameters plus the codebooks' EMA statistics
  paper_rows=(
    PaperRow("configs/enwik8/transformer_vq.py", 190e6, "Transformer-VQ Table 10, Enwik8"),
    PaperRow("configs/pg19/transformer_vq.py", 1.3e9, "Transformer-VQ Table 10, PG-19"),
    PaperRow("configs/imagenet64/transformer_vq.py", 190e6, "Transformer-VQ Table 10, ImageNet64 (small)"),
    PaperRow("configs/imagenet64/transformer_vq.py:large", 1.2e9, "Transformer-VQ Table 10, ImageNet64 (large)"),
  ),
)
