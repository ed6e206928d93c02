"""Times attention cores alone (the Latte paper's Figures 8-10 setting): forward, or forward + backward.

  python scripts/bench.py --cores=causal_latte,causal_latte:chunk=1,causal_attention \
      --seq_lens=512,1024,2048,4096,16384 --batch_size=2 --heads=4 --width=128 --latents=128

Cores: causal_latte / bidirectional_latte (kernels.latte; `:chunk=C` sets the time chunk of the
causal scan, 1 = the paper's token-by-token recurrence), causal_attention / attention (softmax
attention with a causal / no mask, kernels.dot_product_attention, quadratic),
window_attention (`:window=W`, kernels.local_attention), vq_attention (kernels.vq_attention,
`:block=L` default 512, `:codes=S` default 512, serial reduction) and mixed_chunk (FLASH's causal
mixed chunk attention, relu^2 inside chunks, `:chunk=C` default 256). `:impl=pallas` times the
Pallas kernel of the Latte, VQ and mixed chunk cores (kernel vs XLA reference:

  python scripts/bench.py --cores=vq_attention,vq_attention:impl=pallas --seq_lens=2048,8192,32768,131072 \
      --heads=1 --width=128 --batch_size=1

). `--width` and `--latents` are totals split across `--heads`, as the paper's benchmark code
splits them. Inputs are random normal float32 [B,T,H,*]; each row reports the median time of the
jitted call, XLA's planned memory (arguments + outputs + temporaries; a Pallas kernel's on-chip
scratch is not in it) and the bandwidth of reading the inputs and writing the output once
(GB/s; divide by the device's peak for the fraction).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from lra_core import kernels
from lra_core.bench.common import is_oom, median_seconds, xla_memory_bytes
from lra_core.errors import ConfigError, brief
from lra_core.kernels.softmax.reference import attention_mask
from lra_core.markdown import markdown_table

CORES = (
  "causal_latte",
  "bidirectional_latte",
  "causal_attention",
  "attention",
  "window_attention",
  "vq_attention",
  "mixed_chunk",
)
IMPLS = ("xla", "pallas")


def parse_core(text: str) -> tuple[str, dict[str, int | str]]:
  """'name:key=value,...' -> (name, options): integers, and impl in {xla, pallas}."""
  name, _, rest = text.partition(":")
  if name not in CORES:
    raise ConfigError(f"core {name!r} is not one of {list(CORES)}.")
  options = {}
  for item in filter(None, rest.split(",")):
    key, sep, value = item.partition("=")
    if key.strip() == "impl" and value.strip() in IMPLS:
      options["impl"] = value.strip()
      continue
    if not sep or not value.strip().isdigit():
      raise ConfigError(f"core option {item!r} is not of the form key=integer.")
    options[key.strip()] = int(value)
  return name, options


def core_fn(name: str, options: dict) -> Callable:
  """f(q, k, v) for the core; q, k hold latent logits for Latte and head vectors otherwise."""
  impl = options.get("impl", "xla")
  if name == "causal_latte":
    return lambda q, k, v: kernels.causal_latte(q, k, v, chunk=options.get("chunk"), impl=impl)
  if name == "bidirectional_latte":
    return lambda q, k, v: kernels.bidirectional_latte(q, k, v, impl=impl)
  if name == "vq_attention":

    def vq_attention(q, k, v):
      codebook = jax.random.normal(jax.random.key(3), (k.shape[2], options.get("codes", 512), k.shape[3]), k.dtype)
      return kernels.vq_attention(q, k, v, codebook, block_len=min(options.get("block", 512), q.shape[1]), impl=impl)

    return vq_attention
  if name == "mixed_chunk":
    return lambda q, k, v: kernels.mixed_chunk_attention(
      q,
      k,
      q,
      k,
      v,
      chunk=options.get("chunk", 256),
      causal=True,
      quad_scale=q.shape[-1] ** -0.5,
      lin_scale=1.0 / q.shape[1],
      impl=impl,
    )
  if name == "window_attention":
    return lambda q, k, v: kernels.local_attention(q, k, v, window=options.get("window", 128), causal=True)
  causal = name == "causal_attention"

  def attention(q, k, v):
    t = q.shape[1]
    mask = attention_mask(jnp.arange(t), jnp.arange(t), causal=True) if causal else None
    return kernels.dot_product_attention(q, k, v, mask=mask)

  return attention


def time_core(
  label: str,
  *,
  seq_len: int,
  batch_size: int,
  heads: int,
  width: int,
  latents: int,
  steps: int,
  warmup: int,
  backward: bool = False,
) -> dict:
  name, options = parse_core(label)
  b, t, h = batch_size, seq_len, heads
  if width % h or latents % h:
    raise ConfigError(f"--width {width} and --latents {latents} must be multiples of --heads {h}.")
  qk_dim = latents // h if name.endswith("latte") else width // h
  keys = jax.random.split(jax.random.key(0), 3)
  q, k = (jax.random.normal(key, (b, t, h, qk_dim)) for key in keys[:2])
  v = jax.random.normal(keys[2], (b, t, h, width // h))
  fn = core_fn(name, options)
  if backward:
    fn = jax.grad(lambda q, k, v, f=fn: f(q, k, v).sum(), argnums=(0, 1, 2))
  row = {"variant": label, "seq_len": t, "batch_size": b, "backward": backward}
  compiled = None
  try:
    compiled = jax.jit(fn).lower(q, k, v).compile()
    median, times = median_seconds(lambda: compiled(q, k, v), steps=steps, warmup=warmup)
  except Exception as e:
    if not is_oom(e):
      raise
    gc.collect()
    row.update(status="OOM", error=brief(e))
    return row
  moved = sum(x.size * x.dtype.itemsize for x in (q, k, v)) + v.size * v.dtype.itemsize
  row.update(
    status="ok",
    ms=1e3 * median,
    ms_all=[1e3 * s for s in times],
    memory_bytes=xla_memory_bytes(compiled),
    tokens_per_s=b * t / median,
    gb_per_s=moved / median / 1e9,
  )
  return row


def format_table(rows: Sequence[dict]) -> str:
  """Markdown rows; the last column is the first core's time at the same length over this row's."""
  header = [
    "core",
    "T",
    "batch",
    "ms (median)",
    "tokens/s",
    "XLA memory MiB",
    "GB/s (in + out once)",
    "speed-up vs first core",
  ]
  lines, first = [], {}
  for r in rows:
    if r["status"] == "ok":
      first.setdefault(r["seq_len"], r["ms"])
  for r in rows:
    cells = [f"`{r['variant']}`", str(r["seq_len"]), str(r["batch_size"])]
    if r["status"] != "ok":
      cells += [r["status"]] + ["-"] * 4
    else:
      mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:,.0f}"
      cells += [
        f"{r['ms']:,.2f}",
        f"{r['tokens_per_s']:,.0f}",
        mem,
        f"{r['gb_per_s']:,.2f}",
        f"{first[r['seq_len']] / r['ms']:,.1f}x",
      ]
    lines.append(cells)
  return markdown_table(header, lines)


def run(cores: Sequence[str], *, seq_lens: Sequence[int], log=None, **shape) -> list[dict]:
  rows = []
  for t in seq_lens:  # by length, so each length's rows share a baseline in the ratio column
    for label in cores:
      row = time_core(label, seq_len=t, **shape)
      rows.append(row)
      if log:
        log(f"{label} T={t}: " + (f"{row['ms']:.2f} ms" if row["status"] == "ok" else row["status"]))
      gc.collect()
  return rows
