"""FLASH's mixed chunk attention, its gradient on the grid driver (TPU; interpret mode): walks over the chunks
of one (batch, head), as the forward's (kernels/mixed_chunk/tpu_grid.py), from the forward's inputs only: no
per-chunk state and no [C,C] scores reach HBM. kernels/mixed_chunk/pallas.py wires it into `jax.custom_vjp`;
the XLA form's VJP is the tests' oracle.

The global part is a running sum read by later chunks: chunk g reads X_g and, after its use, the walk carries
X_{g+1} = keep_g X_g + K_g, with K_g = lin_scale sum_j col_j lk_j^T v_j over the chunk's keys and keep_g the
chunk's carry factor (0 where a document starts inside it). Chunk g's share of the output is
read_i lq_i X_g, so with dout_i = g_i

  dlq_i = read_i g_i X_g^T                     needs X_g: a walk in the forward's direction;
  A_g = sum_i read_i lq_i^T g_i                the sum's direct adjoint, and its total adjoint
  T_g = A_g + keep_g T_{g+1 in the walk}       a walk in the other direction, where chunk g's keys read
  dlk_j = col_j lin_scale v_j T^T,  dv_j += col_j lin_scale lk_j T    the T of the chunk after them.

Both walks have the forward's shape: use the carried [S,Et] state, then state = keep state + this chunk's
sum. Causal is a forward walk (the state X: dlq) and a reverse one (the adjoint T: dlk, dv). Non-causal with
documents carries two sums, from the left and from the right: each walk then carries one sum's X and the
other's T. Non-causal without documents reads the total, and its adjoint is the total of A: both XLA's, read
by one walk that carries nothing (`_walks`).

The local part and the own-chunk term of non-causal documents are chunk-local, in the first walk: with
dW_ij = g_i . v_j summed over every value tile (scratch; the last tile takes the step) and w(s) the weights
of the scores s = quad_scale qq_i . qk_j + bias_ij,

  dS = dW w'(s)  (relu^2: 2 relu(s), linear: 1, softmax: w (dW - sum_j w dW)),
  dqq = quad_scale dS qk,   dqk = quad_scale dS^T qq,   dbias = sum dS,   dv_j += sum_i w_ij g_i;

the own-chunk term, oscale_i lin_scale lq_i . lk_j v_j inside the query's document, is the linear kernel's.

The grid is (B, H, G, J): the chunks in order (or reversed), then the J value tiles of Et columns, both
sequential; the carried states live in scratch, one [S,Et] per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_core.kernels import per_device, toolkit
from lra_core.kernels.mixed_chunk import tpu_grid

Array = jax.Array
f32 = jnp.float32
# Kernel operands in a fixed order. The state X: kv (a constant one) or carried with col / keep / read; its
# adjoint T: dkv (constant) or carried with acol / akeep / aread, the factors of the sum it is the adjoint of.
OPERANDS = ("qq", "qk", "lq", "lk", "v", "g", "kv", "dkv", "row", "bias", "qdoc", "kdoc", "oscale") + (
  "col",
  "keep",
  "read",
  "acol",
  "akeep",
  "aread",
)
ROWS = ("row", "kdoc")  # [B,1,T]
COLUMNS = ("qdoc", "oscale", "col", "keep", "read", "acol", "akeep", "aread")  # [B,T,1]


def _local(ins, load, cast, *, causal: bool, kernel: str, quad_scale: float):
  """The local part's scores and weights [C,C] (float32) and the mask of allowed pairs (None: all)."""
  qq, qk = cast(load("qq")), cast(load("qk"))
  c = qq.shape[0]
  scores = toolkit.dot(qq, qk, (1, 1)) * quad_scale
  if "bias" in ins:
    scores = scores + load("bias").astype(f32)
  allowed = None if "row" not in ins else jnp.broadcast_to(load("row") > 0, (c, c))
  if causal:
    tril = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1) <= jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    allowed = tril if allowed is None else allowed & tril
  if "kdoc" in ins:  # as the forward's walk: with document ids, the local part reads the query's document
    same = load("qdoc") == load("kdoc")
    allowed = same if allowed is None else allowed & same
  return scores, tpu_grid.weights(scores, allowed, kernel), allowed


def _own(ins, load, *, lin_scale: float):
  """The own-chunk term's weights [C,C] (float32, before oscale) and its mask: the query's document, real keys."""
  lq, lk = load("lq").astype(f32), load("lk").astype(f32)
  allowed = load("qdoc") == load("kdoc")
  if "row" in ins:
    allowed = allowed & (load("row") > 0)
  return jnp.where(allowed, toolkit.dot(lq, lk, (1, 1)) * lin_scale, 0.0), allowed


def _kernel(*refs, names, causal: bool, kernel: str, quad_scale: float, lin_scale: float, upcast: bool):
  """Grid (B, H, G, J). Refs by name (`walk` declares them); every part a walk has is present by its operands."""
  ins, out, scratch = toolkit.named_refs(refs, *names)
  rr, j = pl.program_id(2), pl.program_id(3)
  last_j = pl.num_programs(3) - 1
  load = lambda name: ins[name][...] if name in ins else None
  cast = (lambda x: x.astype(f32)) if upcast else (lambda x: x)
  v, g = cast(load("v")), cast(load("g"))
  gf = g.astype(f32)
  local, own = "qq" in ins, "oscale" in ins

  @pl.when(j == 0)
  def _():  # the chunk's sums over the value tiles start
    for name in ("dw", "dlq", "dlk"):
      if name in scratch:
        scratch[name][...] = jnp.zeros_like(scratch[name])

  @pl.when(rr == 0)
  def _():  # the first chunk of a walk reads empty states
    for name in ("x", "t"):
      if name in scratch:
        scratch[name][j] = jnp.zeros(scratch[name].shape[1:], f32)

  if "dw" in scratch:
    scratch["dw"][...] += toolkit.dot(g, v, (1, 1))  # g_i . v_j, this tile's columns
  dv = jnp.zeros(v.shape, f32)
  # the [C,C] scores and weights once per step: this tile's dv reads them, the last tile's dS too
  scores, w, allowed = (
    _local(ins, load, cast, causal=causal, kernel=kernel, quad_scale=quad_scale) if local else (None,) * 3
  )
  w_own, own_allowed = _own(ins, load, lin_scale=lin_scale) if own else (None, None)
  if local:
    dv += toolkit.dot(w.astype(v.dtype), g, (0, 0))
  if own:
    dv += toolkit.dot(w_own * load("oscale"), gf, (0, 0))
  if "kv" in ins or "x" in scratch:  # the state X this chunk reads: dlq
    x = load("kv") if "kv" in ins else scratch["x"][j]
    part = toolkit.dot(gf, x, (1, 1))
    scratch["dlq"][...] += part if "read" not in ins else part * load("read")
    if "x" in scratch:  # after its use, as the forward carries it
      lk = cast(load("lk"))
      keys = lk if "col" not in ins else jnp.where(load("col") > 0, lk, jnp.zeros_like(lk))
      x = x if "keep" not in ins else x * load("keep")[:1, :]
      scratch["x"][j] = x + toolkit.dot(keys, v, (0, 0)) * lin_scale
  if "dkv" in ins or "t" in scratch:  # the adjoint T of the sum this chunk's keys enter: dlk, dv
    t = load("dkv") if "dkv" in ins else scratch["t"][j]
    dlk = toolkit.dot(v.astype(f32), t, (1, 1)) * lin_scale
    dv_global = toolkit.dot(load("lk").astype(f32), t) * lin_scale
    if "acol" in ins:
      summed = load("acol") > 0  # the keys that enter the sum
      dlk, dv_global = jnp.where(summed, dlk, 0.0), jnp.where(summed, dv_global, 0.0)
    scratch["dlk"][...] += dlk
    dv += dv_global
    if "t" in scratch:
      lq = load("lq").astype(f32)
      t = t if "akeep" not in ins else t * load("akeep")[:1, :]
      scratch["t"][j] = t + toolkit.dot(lq if "aread" not in ins else lq * load("aread"), gf, (0, 0))
  out["dv"][...] = dv.astype(out["dv"].dtype)

  @pl.when(j == last_j)
  def _():  # every value column summed: the [C,C] adjoints and the key gradients
    dw = scratch["dw"][...] if "dw" in scratch else None
    if local:
      if kernel == "relu2":
        ds = dw * 2.0 * jnp.maximum(scores, 0.0)
      elif kernel == "softmax":  # w is 0 where not allowed
        ds = w * (dw - (w * dw).sum(-1, keepdims=True))
      else:
        ds = dw
      if allowed is not None:
        ds = jnp.where(allowed, ds, 0.0)
      out["dqq"][...] = (toolkit.dot(ds, load("qk").astype(f32)) * quad_scale).astype(out["dqq"].dtype)
      out["dqk"][...] = (toolkit.dot(ds, load("qq").astype(f32), (0, 0)) * quad_scale).astype(out["dqk"].dtype)
      if "dbias" in out:

        @pl.when(rr == 0)
        def _():
          out["dbias"][...] = jnp.zeros_like(out["dbias"])

        out["dbias"][...] += ds  # every chunk of the walk: one [C,C] per (batch, head)
    if own:
      ds = jnp.where(own_allowed, dw * load("oscale"), 0.0) * lin_scale
      scratch["dlq"][...] += toolkit.dot(ds, load("lk").astype(f32))
      scratch["dlk"][...] += toolkit.dot(ds, load("lq").astype(f32), (0, 0))
    for name in ("dlq", "dlk"):
      if name in out:
        out[name][...] = scratch[name][...].astype(out[name].dtype)


# -- sizes ----------------------------------------------------------------------------------------------


def vmem_bytes(*, chunk: int, s: int, e: int, value_block: int, itemsize: int) -> int:
  """Estimated VMEM of a step of the first walk, the larger (local part, own-chunk term, both states, every
  document factor), blocks padded to whole tiles as `tpu_grid.vmem_bytes` counts them: a [C,1] column takes
  C x 128 lanes. Compiled for TPU v3 (C 256, S 128, E 1536, bfloat16, non-causal with documents) Mosaic
  used 16.20 MiB at Et 768, where an estimate that left out the upcast tiles and two factors gave 13.3."""
  c, et, a = chunk, value_block, itemsize
  x = tpu_grid.tile_bytes
  # Double-buffered: four [C,S] operands and their gradients, v, g and dv tiles, masks and factors, bias.
  pipelined = 8 * x(c, s, a) + 3 * x(c, et, a) + 2 * x(1, c, 4) + 8 * x(c, 1, 4) + x(c, c, a)
  once = x(c, c, 4)  # dbias, resident over the chunks
  scratch = 2 * (e // et) * x(s, et, 4) + x(c, c, 4) + 2 * x(c, s, 4)  # both states, dW, dlq and dlk
  # float32: scores, weights, dS, the own term's and the masks' [C,C]; dv, its shares and the upcast tiles;
  # the states' updates; the upcast and the gradients' [C,S]
  temporaries = 8 * x(c, c, 4) + 5 * x(c, et, 4) + 2 * x(s, et, 4) + 6 * x(c, s, 4)
  return 2 * pipelined + once + scratch + temporaries + 2**20


def value_block(e: int, *, chunk: int, s: int, itemsize: int, budget: int | None, platform: str = "tpu") -> int:
  """The backward's value tile, a divisor of e, as the forward's (`tpu_grid.widest_fitting`) by `vmem_bytes`."""
  size = lambda w: vmem_bytes(chunk=chunk, s=s, e=e, value_block=w, itemsize=itemsize)
  return tpu_grid.widest_fitting(e, size, budget=budget, platform=platform)


def cost(
  *,
  batch: int,
  heads: int,
  seq_len: int,
  chunk: int,
  s: int,
  e: int,
  value_tile: int,
  itemsize: int,
  local: bool,
  own: bool,
  reads: int,
  adjoint: int,
) -> pl.CostEstimate:
  """What one walk computes and moves, for XLA's and lra_core.cost.hlo_cost's rooflines. Per chunk: the local
  scores once per value tile (the last tile's dS reuses them), dW and dv over E, dS's two [C,C] x [C,S] products; the
  own-chunk term as much again; per state [C,E] x [E,S] and [C,S] x [S,E] products. `reads` / `adjoint`: 0
  none, 1 carried (its update too), 2 a constant state read from HBM once per value tile."""
  b, h, t, c = batch, heads, seq_len, chunk
  tiles = e // value_tile
  square = local + own
  per_chunk = square * ((tiles + 2) * 2 * c * c * s + 4 * c * c * e)
  per_chunk += (reads > 0) * (1 + (reads == 1)) * 2 * c * s * e + (adjoint > 0) * (2 + (adjoint == 1)) * 2 * c * s * e
  # q and k operands (4 [T,S]), v and g read, dv written, the key gradients written; constant states
  moved = t * (8 * s + 3 * e) * itemsize + ((reads == 2) + (adjoint == 2)) * s * e * 4
  return pl.CostEstimate(flops=int(b * h * (t // c) * per_chunk), transcendentals=0, bytes_accessed=int(b * h * moved))


# -- the driver ---------------------------------------------------------------------------------------------


def walk(
  args: dict[str, Array],
  *,
  chunk: int,
  value_tile: int,
  reverse: bool,
  carry_x: bool,
  carry_t: bool,
  causal: bool,
  kernel: str,
  quad_scale: float,
  lin_scale: float,
  upcast: bool,
  interpret: bool,
) -> dict[str, Array]:
  """One walk over the chunks, one pallas_call, on head-major operands (`OPERANDS`; qq, qk, lq, lk [B,H,T,S],
  v and g [B,H,T,E], kv and dkv [B,H,S,E], ROWS [B,1,T], COLUMNS [B,T,1], bias [C,C]) -> its gradients: dv
  [B,H,T,E] always; dqq, dqk and dbias [B,H,C,C] (float32, to sum over B and H) with the local part; dlq with
  a state read, dlk with an adjoint or the own-chunk term."""
  b, h, t, e = args["v"].shape
  c, g, et = chunk, t // chunk, value_tile
  nj = e // et
  sl = args["lq"].shape[-1] if "lq" in args else 0
  at = (lambda rr: g - 1 - rr) if reverse else (lambda rr: rr)
  rows = lambda bb, hh, rr, jj: (bb, hh, at(rr), 0)
  tiled = lambda bb, hh, rr, jj: (bb, hh, at(rr), jj)
  inputs = toolkit.Inputs()
  for n in (n for n in OPERANDS if n in args):
    if n in ("v", "g"):
      spec = pl.BlockSpec((None, None, c, et), tiled)
    elif n in ("kv", "dkv"):
      spec = pl.BlockSpec((None, None, sl, et), lambda bb, hh, rr, jj: (bb, hh, 0, jj))
    elif n == "bias":
      spec = pl.BlockSpec((c, c), lambda bb, hh, rr, jj: (0, 0))
    elif n in ROWS:
      spec = pl.BlockSpec((None, 1, c), lambda bb, hh, rr, jj: (bb, 0, at(rr)))
    elif n in COLUMNS:
      spec = pl.BlockSpec((None, c, 1), lambda bb, hh, rr, jj: (bb, at(rr), 0))
    else:
      spec = pl.BlockSpec((None, None, c, args[n].shape[-1]), rows)
    inputs.add(n, args[n], spec)
  names = outputs_of(args, carry_x, carry_t)
  outputs = toolkit.Outputs()
  for n in names:
    if n == "dv":
      outputs.add(n, jax.ShapeDtypeStruct((b, h, t, e), args["v"].dtype), pl.BlockSpec((None, None, c, et), tiled))
    elif n == "dbias":  # one [C,C] per (batch, head), resident over the chunks
      whole = pl.BlockSpec((None, None, c, c), lambda bb, hh, rr, jj: (bb, hh, 0, 0))
      outputs.add(n, jax.ShapeDtypeStruct((b, h, c, c), f32), whole)
    else:
      x = args[n[1:]]  # dqq -> qq
      outputs.add(n, jax.ShapeDtypeStruct(x.shape, x.dtype), pl.BlockSpec((None, None, c, x.shape[-1]), rows))
  scratch = toolkit.Scratch()
  if carry_x:
    scratch.add("x", (nj, sl, et), f32)
  if carry_t:
    scratch.add("t", (nj, sl, et), f32)
  if "qq" in args or "oscale" in args:
    scratch.add("dw", (c, c), f32)
  for n in ("dlq", "dlk"):
    if n in names:
      scratch.add(n, (c, sl), f32)
  estimate = cost(
    batch=b,
    heads=h,
    seq_len=t,
    chunk=c,
    s=max(args[n].shape[-1] for n in ("qq", "lq") if n in args),
    e=e,
    value_tile=et,
    itemsize=jnp.dtype(args["v"].dtype).itemsize,
    local="qq" in args,
    own="oscale" in args,
    reads=carry_x + 2 * ("kv" in args),
    adjoint=carry_t + 2 * ("dkv" in args),
  )
  call = pl.pallas_call(
    functools.partial(
      _kernel,
      names=toolkit.ref_names(inputs, outputs, scratch),
      causal=causal,
      kernel=kernel,
      quad_scale=quad_scale,
      lin_scale=lin_scale,
      upcast=upcast,
    ),
    out_shape=outputs.shapes,
    grid=(b, h, g, nj),
    in_specs=inputs.specs,
    out_specs=outputs.specs,
    scratch_shapes=scratch.shapes,
    compiler_params=toolkit.compiler_params(2, sequential=True, num_sequential=2),
    interpret=interpret,
    cost_estimate=estimate,
    name="mixed_chunk_attention_reverse" if reverse else "mixed_chunk_attention_grad",
  )
  return outputs.named(call(*inputs.arrays))


def _walks(local, lin, layout, g, *, keep, documents, totals, causal: bool, chunk: int):
  """The walks of the gradient, each (operands, reverse, carry X, carry T): see the module docstring."""
  first = dict(local, g=g)
  if lin is None:
    return [(first, False, False, False)]
  lq, lk = lin
  first.update(lq=lq, lk=lk)
  if layout is None:
    cols = {} if keep is None else dict(col=keep[:, :, None])
    if not causal:  # the total and its adjoint, constant over the chunks
      first.update(kv=totals[0], dkv=totals[1], **({} if keep is None else dict(acol=keep[:, :, None])))
      return [(first, False, False, False)]
    first.update(cols)
    later = dict(v=local["v"], g=g, lq=lq, lk=lk, **{"a" + k: x for k, x in cols.items()})
    return [(first, False, True, False), (later, True, False, True)]
  flags = tpu_grid.token_flags(layout, chunk)
  fwd = dict(col=flags["fwd_w"], keep=flags["fwd_keep"], read=flags["fwd_read"] * flags["scale"])
  adjoint_of = lambda sums: {"a" + k: x for k, x in sums.items()}
  first.update(fwd)
  later = dict(v=local["v"], g=g, lq=lq, lk=lk, **adjoint_of(fwd))
  if causal:
    return [(first, False, True, False), (later, True, False, True)]
  bwd = dict(col=flags["bwd_w"], keep=flags["bwd_keep"], read=flags["bwd_read"] * flags["scale"])
  first.update(adjoint_of(bwd), row=keep[:, None, :], oscale=flags["scale"], **documents)
  later.update(bwd)
  return [(first, False, True, True), (later, True, True, True)]


def gradients(
  local: dict[str, Array],
  lin: tuple[Array, Array] | None,
  layout: dict[str, Array] | None,
  g: Array,
  *,
  keep: Array | None,
  documents: dict[str, Array],
  totals: tuple[Array, Array] | None,
  chunk: int,
  **statics,
) -> dict[str, Array]:
  """The grid driver's gradient, per device: the forward's operands (`tpu_grid.attention`'s local, lin,
  layout, keep, documents) and g, the output's cotangent head-major [B,H,T,E]; totals (the non-causal total
  and its adjoint, [B,H,S,E]) without documents and "mean" -> dqq, dqk, dlq, dlk, dv head-major, dbias [C,C]
  float32 (each where its input is), every walk's shares summed."""
  b, h = g.shape[:2]
  grads: dict[str, Array] = {}
  for args, reverse, carry_x, carry_t in _walks(
    local, lin, layout, g, keep=keep, documents=documents, totals=totals, causal=statics["causal"], chunk=chunk
  ):
    run = functools.partial(walk, chunk=chunk, reverse=reverse, carry_x=carry_x, carry_t=carry_t, **statics)
    dims = {n: "b.." if n in ROWS + COLUMNS else ".." if n == "bias" else "bh.." for n in args}
    names = outputs_of(args, carry_x, carry_t)
    got = per_device.run_per_device(
      functools.partial(toolkit.picked, run, names),
      (args,),
      (dims,),
      tuple("bh.." for _ in names),
      batch=b,
      heads=h,
    )
    for n, x in zip(names, got, strict=True):
      x = x.sum((0, 1)) if n == "dbias" else x
      grads[n] = x if n not in grads else grads[n] + x
  return grads


def outputs_of(args: dict, carry_x: bool, carry_t: bool) -> tuple[str, ...]:
  """What a walk writes: dv; dqq, dqk (and dbias with a bias) with the local part; dlq with a state read or
  the own-chunk term; dlk with an adjoint or the own-chunk term."""
  local, own = "qq" in args, "oscale" in args
  wanted = dict(
    dv=True,
    dqq=local,
    dqk=local,
    dlq=carry_x or "kv" in args or own,
    dlk=carry_t or "dkv" in args or own,
    dbias=local and "bias" in args,
  )
  return tuple(n for n, want in wanted.items() if want)
