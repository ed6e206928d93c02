"""Layer-stack variants compiled for one TPU chip on this host, compared by their estimated step.

    python scripts/tpu_variants.py [--topology=v4:2x2x1] [--batch=8] [--seq_len=512]

Each variant is the gradient of a 24-layer scanned stack in bfloat16 (float32 weights), compiled by
libtpu for one chip of the slice and costed by lra_core/cost/hlo_cost.py, so that a choice of how a
layer is written (one fused projection or two, how SiLU keeps its residuals) is judged by what the
TPU compiler makes of it:
  gau/*  FLASH's GAU at d 768, e 1536, s 128 (mixed chunk attention, chunk 256): the paper's one
         projection d -> 2e + s, or u, v and z from two matrices;
  glu/*  a SwiGLU MLP at d 768, d_ff 3072: gate and value from two matrices or one fused d -> 2 d_ff;
  silu   for both: jax.nn.silu, jax.checkpoint(jax.nn.silu), or models.layers.core.silu (keeps
         only its input for the backward pass).
"""

from __future__ import annotations

# Before JAX: a command imports it with the accelerator plugins' noise dropped (lra_core/runtime/quiet_start.py).
import lra_core  # noqa: F401

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

from lra_core import cli
from lra_core.compilation import topologies
from lra_core.cost import chips, hlo_cost
from lra_core.kernels import mixed_chunk
from lra_core.models.layers.core import silu
from lra_core.runtime import quiet_start

LAYERS, D, E, S, CHUNK, D_FF = 24, 768, 1536, 128, 256, 3072
BF16 = jnp.bfloat16
SILU = {"jax": jax.nn.silu, "checkpoint": jax.checkpoint(jax.nn.silu), "lean": silu}


def _dense(x, w, b=None):
  y = x @ w.astype(BF16)
  return y if b is None else y + b.astype(BF16)


def gau_layer(p, x, fused: bool, act):
  if fused:
    u, v, z = jnp.split(act(_dense(x, p["w"], p["b"])), [E, 2 * E], axis=-1)
  else:
    uv = act(_dense(x, p["w_uv"], p["b_uv"]))
    u, v = uv[..., :E], uv[..., E:]
    z = act(_dense(x, p["w_z"], p["b_z"]))
  heads = z[..., None, :] * p["gamma"].astype(BF16) + p["beta"].astype(BF16)  # [B,T,4,S]
  qq, qk, lq, lk = (heads[..., i : i + 1, :] for i in range(4))
  y = mixed_chunk.mixed_chunk_attention(
    qq, qk, lq, lk, v[..., None, :], chunk=CHUNK, causal=False, quad_scale=1 / CHUNK, lin_scale=1 / CHUNK
  )
  return x + _dense(u * y[..., 0, :], p["w_o"])


def glu_layer(p, x, fused: bool, act):
  if fused:
    gate, value = jnp.split(_dense(x, p["w_gv"]), 2, axis=-1)
  else:
    gate, value = _dense(x, p["w_g"]), _dense(x, p["w_v"])
  return x + _dense(act(gate) * value, p["w_o"])


def shapes(block: str, fused: bool) -> dict[str, tuple[int, ...]]:
  if block == "gau":
    proj = (
      dict(w=(D, 2 * E + S), b=(2 * E + S,)) if fused else dict(w_uv=(D, 2 * E), b_uv=(2 * E,), w_z=(D, S), b_z=(S,))
    )
    return {**proj, "gamma": (4, S), "beta": (4, S), "w_o": (E, D)}
  return ({"w_gv": (D, 2 * D_FF)} if fused else {"w_g": (D, D_FF), "w_v": (D, D_FF)}) | {"w_o": (D_FF, D)}


def estimate(block: str, fused: bool, act_name: str, device, batch: int, seq_len: int) -> hlo_cost.Roofline:
  layer = {"gau": gau_layer, "glu": glu_layer}[block]
  act = SILU[act_name]

  def loss(params, x):
    y, _ = jax.lax.scan(lambda h, p: (layer(p, h, fused, act), None), x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {k: jax.ShapeDtypeStruct((LAYERS, *s), jnp.float32, sharding=whole) for k, s in shapes(block, fused).items()}
  x = jax.ShapeDtypeStruct((batch, seq_len, D), BF16, sharding=whole)
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  return hlo_cost.roofline(compiled.as_text(), chips.chip_of(device))


def main(argv=None) -> None:
  parser = cli.doc_parser("python scripts/tpu_variants.py", __doc__)
  parser.add_argument("--topology", default="v4:2x2x1", help="the TPU slice whose first chip compiles the stack")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=512)
  args = parser.parse_args(argv)
  quiet_start.start_backends()  # describing the slice starts the backends: here, with the plugins' noise dropped
  device = topologies.tpu_devices(args.topology)[0]
  variants = [
    ("gau", True, "jax"),
    ("gau", True, "checkpoint"),
    ("gau", True, "lean"),
    ("gau", False, "lean"),
    ("glu", False, "jax"),
    ("glu", False, "lean"),
    ("glu", True, "lean"),
  ]
  print(f"{LAYERS}-layer stacks, gradient, batch {args.batch} x {args.seq_len} tokens, one {device.device_kind}:")
  print(f"{'block':6} {'projection':12} {'silu':11} {'est. ms':>8} {'HBM GB':>7} {'FLOPs at peak, ms':>18}")
  for block, fused, act in variants:
    r = estimate(block, fused, act, device, args.batch, args.seq_len)
    print(
      f"{block:6} {'one fused' if fused else 'two':12} {act:11} {r.seconds * 1e3:8.1f} {r.hbm_bytes / 1e9:7.1f} "
      f"{r.flop_s * 1e3:18.1f}"
    )


if __name__ == "__main__":
  cli.run(main)
