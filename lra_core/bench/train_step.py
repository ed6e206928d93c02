r"""Times the trainer's jitted train step: tokens/s, compile time, memory and FLOP/s per length.

  python scripts/bench.py --config=configs/enwik8/transformer.py \
      --variant base: --variant glu:model.mlp=glu,model.d_ff=1536 \
      --seq_lens=2048,8192,16384 --batch_size=1 --steps=5 --warmup=2 --out=docs/bench.md
  python scripts/bench.py --cores=causal_latte,causal_attention --seq_lens=512,2048   # attention cores alone
  lra-bench --config=configs/enwik8/transformer.py:tiny --seq_lens=256   # lra-bench: installed with the package

The same command as `lra-bench` and `python -m lra_core.bench.train_step`.

Each (variant, length) loads the config with the --override settings, then the variant's, then
train.seq_len=T, train.batch_size=B, train.update_len=0 (one update window = the whole
sequence), a one-device mesh and model.max_len=T where the model sets a nonzero max_len. The
optimizer, state and step are built exactly as lra_core/train.py builds them; batches are random
tokens with the fields the task's datasets give, so no dataset is opened. Reported: compile time
(trace + lower + XLA compile of the step), the median of --steps timed steps after --warmup
discarded ones, tokens/s = B*T / median, peak memory (device peak on accelerators, host max RSS
on CPU; both are process-wide high-water marks, so a row that sets no new mark shows "<="), and
the step's matrix-product FLOPs (bench.common.cost_flops: loops counted by their trip counts) as
GFLOP/s and as a fraction of a float32 matmul's FLOP/s measured on the same machine. A length
that runs out of memory gives an "OOM" row instead of stopping.
"""

from __future__ import annotations

import ast
import gc
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lra_core import cli, layout, sharding, task_kinds
from lra_core.bench import cores
from lra_core.bench.common import (
  MiB,
  Variant,
  cost_flops,
  ints,
  is_oom,
  median_seconds,
  output_flags,
  parse_variant,
  publish,
  variant_config,
  xla_memory_bytes,
)
from lra_core.config import load_config
from lra_core.data import DataInfo
from lra_core.errors import ConfigError, brief
from lra_core.markdown import markdown_table
from lra_core.run import data_setup
from lra_core.run.batches import to_device
from lra_core.run.state import run_setup
from lra_core.run.steps import make_train_step
from lra_core.tasks import make_task

COLUMNS = (
  "variant",
  "T",
  "batch",
  "tokens/s",
  "step ms (median)",
  "compile s",
  "peak memory MiB",
  "GFLOP/s",
  "% of matmul peak",
)


def bench_config(spec: str, overrides: Sequence[str] = (), *, seq_len: int, batch_size: int = 1):
  """The config for one row: `overrides` (user's, then the variant's) and the bench settings.

  train.grad_accum_steps defaults to 1 (a batch of one sequence cannot be split) but an override
  may set it; the length, batch, window and mesh settings always win.
  """
  overrides = ["train.grad_accum_steps=1", *overrides]
  fixed = [
    f"train.seq_len={seq_len}",
    f"train.batch_size={batch_size}",
    "train.update_len=0",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
  ]
  # Loaded once at the config's own length to see whether the model pins a position table size.
  base = load_config(spec, overrides)
  if base.model.get("max_len", 0):
    fixed.append(f"model.max_len={seq_len}")
  return load_config(spec, [*overrides, *fixed])


data_info = data_setup.config_data_info


def random_batch(config, info: DataInfo, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A host batch of random tokens with the fields the pipeline gives the task's train step."""
  b, t = config.train.batch_size, config.train.seq_len
  kind = task_kinds.kind(config.task)

  def tokens(shape):
    return rng.integers(0, info.vocab_size, shape, dtype=np.int32)

  if kind.causal:
    # One window per sequence: the pipeline marks every batch as a sequence start.
    return {
      "inputs": tokens((b, t)),
      "targets": tokens((b, t)),
      "weights": np.ones((b, t), np.float32),
      "reset": np.asarray(True),
    }
  if kind.per_token:  # masked LM: the task masks inputs on device and predicts them
    return {"inputs": tokens((b, t)), "weights": np.ones((b, t), np.float32)}
  if kind.classifies:
    shape = (b, kind.towers, t) if kind.towers > 1 else (b, t)
    return {
      "inputs": tokens(shape),
      "mask": np.ones(shape, bool),
      "targets": rng.integers(0, max(info.num_classes, 1), (b,), dtype=np.int32),
      "weights": np.ones((b,), np.float32),
    }
  raise ConfigError(
    f"task {config.task!r} has no benchmark batch; expected a per-token task {list(task_kinds.names(per_token=True))} "
    f"or a classifying one {list(task_kinds.names(classifies=True))}."
  )


def one_device_mesh():
  return layout.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])


def peak_memory(device: jax.Device) -> tuple[int, str]:
  """(bytes, kind): the device's allocator high-water mark, else the process's max RSS."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device peak"
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(rss if sys.platform == "darwin" else rss * 1024), "host RSS"  # macOS: bytes, Linux: KiB


def matmul_peak_flops(
  n: int = 0, *, dtype=jnp.float32, steps: int = 5, warmup: int = 2, device: jax.Device | None = None
) -> float:
  """FLOP/s of an n x n matmul on `device`: the yardstick for the step's achieved FLOP/s.

  n = 0 picks 2048 on CPU and 8192 on accelerators (large enough to be compute bound).
  """
  device = device or jax.devices()[0]
  n = n or (2048 if device.platform == "cpu" else 8192)
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(ka, (n, n), dtype), device)
  b = jax.device_put(jax.random.normal(kb, (n, n), dtype), device)
  dot = jax.jit(jnp.dot).lower(a, b).compile()
  median, _ = median_seconds(lambda: dot(a, b), steps=steps, warmup=warmup)
  return 2.0 * n**3 / median


def init_state(spec) -> dict:
  """`spec.init()`, the trainer's initial state, compiled without backend optimisation.

  It runs once, so its compile time is all it costs (seconds per row on CPU at full optimisation);
  the values are the trainer's. Falls back to the plain call where the option is not accepted.
  """
  try:
    init = spec.init.lower().compile({"xla_backend_optimization_level": 0})
  except (ValueError, TypeError, jax.errors.JaxRuntimeError) as e:
    if is_oom(e):
      raise
    return spec.init()
  return init()


class TrainStepRun:
  """The trainer's train step for `config` on one device, compiled, with two random batches; `ready()`
  (or the first call) makes the initial state, and each call runs one step (alternating the
  batches) and returns its metrics.

  Attributes: compiled, state, metrics (of the last call), num_params, start / lowered_at /
  compiled_at (perf_counter times around lowering and compiling), host_batches (numpy).
  """

  def __init__(self, config, *, compiler_options: dict | None = None, seed: int = 0):
    self.compiled = self.state = self.metrics = None
    self.calls = 0
    mesh = one_device_mesh()
    rules = config.sharding.rules
    info = data_info(config)
    data_setup.check_compatible(config, info, mesh)
    task = make_task(config, info)
    self.tx, schedule, spec = run_setup(config, mesh)
    self.num_params = spec.num_params
    with sharding.activate(mesh, rules):
      step = jax.jit(
        make_train_step(config, spec, task, self.tx, schedule), donate_argnums=0, out_shardings=(spec.shardings, None)
      )
      rng = np.random.default_rng(seed)
      self.host_batches = [random_batch(config, info, rng) for _ in range(2)]
      self.batches = [to_device(b, mesh, rules) for b in self.host_batches]
      self.start = time.perf_counter()
      lowered = step.lower(spec.abstract, self.batches[0])
      self.lowered_at = time.perf_counter()
      self.compiled = lowered.compile(compiler_options)
      self.compiled_at = time.perf_counter()
    self.spec = spec

  def ready(self) -> TrainStepRun:
    """Makes the initial state (once)."""
    if self.state is None:
      self.state = init_state(self.spec)
    return self

  def __call__(self) -> dict:
    self.ready()
    self.state, self.metrics = self.compiled(self.state, self.batches[self.calls % len(self.batches)])
    self.calls += 1
    return self.metrics

  def free(self) -> None:
    self.state = self.batches = self.metrics = None


def time_train_step(
  config,
  *,
  steps: int = 5,
  warmup: int = 2,
  peak_flops: float | None = None,
  seed: int = 0,
  compiler_options: dict | None = None,
) -> dict:
  """Compiles and times the trainer's train step for `config` on one device.

  compiler_options: XLA options for the step's compile (e.g. {"xla_backend_optimization_level": 0}
  makes CPU compiles 2-3x faster for tests, and the step slower).

  Returns a row: status 'ok' with tokens_per_s, step_ms, compile_s (trace_lower_s + xla_compile_s),
  memory_bytes / memory_kind / memory_exact (False: the process's high-water mark was set before
  this row, so the row used at most that much), xla_memory_bytes, flops_per_step, flops_per_s,
  peak_fraction (with `peak_flops`), loss; or status 'OOM' with stage ('compile' | 'run') and the
  error's first line. tokens_per_s counts B*T tokens per step, as the trainer does (retrieval's
  two towers read 2*B*T).
  """
  if steps < 1 or warmup < 0:
    raise ConfigError(f"steps {steps} / warmup {warmup}: expected steps >= 1 and warmup >= 0.")
  t = config.train
  row = {"seq_len": t.seq_len, "batch_size": t.batch_size, "steps": steps, "warmup": warmup}
  if compiler_options:
    row["compiler_options"] = dict(compiler_options)
  device = jax.devices()[0]
  memory_before, _ = peak_memory(device)
  run = None
  try:
    run = TrainStepRun(config, compiler_options=compiler_options, seed=seed)
    row["num_params"] = run.num_params
    run.ready()
    median, times = median_seconds(run, steps=steps, warmup=warmup)
    loss = float(jax.device_get(run.metrics["objective"]))
  except Exception as e:  # only running out of memory becomes a row; anything else is a bug
    if not is_oom(e):
      raise
    compiled = None if run is None else run.compiled
    run = None
    gc.collect()
    row.update(status="OOM", stage="compile" if compiled is None else "run", error=brief(e))
    if compiled is not None:  # what XLA planned to allocate, for comparison with the device
      row["xla_memory_bytes"] = xla_memory_bytes(compiled)
    return row
  run.free()  # the device buffers go before the next row
  memory_after, memory_kind = peak_memory(device)
  flops = cost_flops(run.compiled)
  tokens = t.batch_size * t.seq_len
  row.update(
    status="ok",
    tokens_per_s=tokens / median,
    step_ms=1e3 * median,
    step_ms_all=[1e3 * s for s in times],
    trace_lower_s=run.lowered_at - run.start,
    xla_compile_s=run.compiled_at - run.lowered_at,
    compile_s=run.compiled_at - run.start,
    memory_bytes=memory_after,
    memory_kind=memory_kind,
    memory_exact=memory_after > memory_before,
    xla_memory_bytes=xla_memory_bytes(run.compiled),
    flops_per_step=flops,
    flops_per_s=None if flops is None else flops / median,
    loss=loss,
  )
  if peak_flops:
    row["peak_flops"] = peak_flops
    row["peak_fraction"] = None if flops is None else flops / median / peak_flops
  return row


def run(
  spec: str,
  *,
  overrides: Sequence[str] = (),
  variants: Sequence[Variant] = (Variant("default"),),
  seq_lens: Sequence[int] = (2048,),
  batch_size: int = 1,
  tokens_per_batch: int = 0,
  steps: int = 5,
  warmup: int = 2,
  matmul_size: int = 0,
  compiler_options: dict | None = None,
  log: Callable[[str], None] | None = None,
) -> tuple[list[dict], float]:
  """Times every variant at every length; -> (rows, matmul FLOP/s), fractions filled in.

  tokens_per_batch > 0 sets the batch of length T to max(1, tokens_per_batch // T) (the papers'
  fixed tokens per step); otherwise every length uses batch_size. The matmul yardstick runs after
  the rows, so its buffers do not set their memory marks.
  """
  rows = []
  for variant in variants:
    variant_spec, variant_overrides = variant_config(spec, variant)
    for seq_len in seq_lens:
      batch = max(1, tokens_per_batch // seq_len) if tokens_per_batch else batch_size
      config = bench_config(variant_spec, [*overrides, *variant_overrides], seq_len=seq_len, batch_size=batch)
      row = {"variant": variant.name, "overrides": list(variant.overrides)}
      row.update(time_train_step(config, steps=steps, warmup=warmup, compiler_options=compiler_options))
      rows.append(row)
      if log:
        log(format_row_log(row))
      gc.collect()
  peak = matmul_peak_flops(matmul_size, steps=steps, warmup=warmup)
  set_peak_fractions(rows, peak)
  return rows, peak


def set_peak_fractions(rows: Sequence[dict], peak: float) -> None:
  """Adds each timed row's FLOP/s as a fraction of `peak`, the matmul yardstick's FLOP/s."""
  for row in rows:
    if row.get("flops_per_s") is not None:
      row["peak_flops"] = peak
      row["peak_fraction"] = row["flops_per_s"] / peak


def format_row_log(row: dict) -> str:
  if row["status"] != "ok":
    return f"{row['variant']} T={row['seq_len']}: {row['status']} ({row.get('error', '')})"
  return (
    f"{row['variant']} T={row['seq_len']}: {row['tokens_per_s']:,.0f} tokens/s, "
    f"{row['step_ms']:.1f} ms/step, compile {row['compile_s']:.1f} s, loss {row['loss']:.3f}"
  )


def _num(value: float | None, fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def format_table(rows: Sequence[dict]) -> str:
  """A markdown table of `rows` (from `run` / `time_train_step` plus a 'variant' key)."""
  kinds = sorted({r["memory_kind"] for r in rows if r.get("memory_kind")})
  header = list(COLUMNS)
  if kinds:
    header[COLUMNS.index("peak memory MiB")] = f"peak memory MiB ({', '.join(kinds)})"
  lines = []
  for r in rows:
    cells = [str(r.get("variant", "")), str(r["seq_len"]), str(r["batch_size"])]
    if r["status"] != "ok":
      cells += [r["status"]] + ["-"] * (len(header) - 4)
    else:
      memory = _num(r["memory_bytes"] / MiB, ",.0f")
      if not r.get("memory_exact", True):
        memory = "<= " + memory
      fraction = r.get("peak_fraction")
      cells += [
        f"{r['tokens_per_s']:,.0f}",
        f"{r['step_ms']:.2f}",
        f"{r['compile_s']:.2f}",
        memory,
        _num(None if r.get("flops_per_s") is None else r["flops_per_s"] / 1e9, ",.1f"),
        _num(None if fraction is None else 100 * fraction, ".1f"),
      ]
    lines.append(cells)
  return markdown_table(header, lines)


def _options(items: Sequence[str]) -> dict:
  """KEY=VALUE strings -> a compiler_options dict; values are Python literals or strings."""
  options = {}
  for item in items:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
      raise ConfigError(f"compiler option {item!r} is not of the form key=value.")
    try:
      value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      value = text.strip()
    options[key.strip()] = value
  return options


def main(argv: Sequence[str] | None = None) -> list[dict]:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.doc_parser("python scripts/bench.py", __doc__)
  parser.add_argument("--config", default="", help="config file[:arg], as for lra_core.train")
  parser.add_argument(
    "--cores",
    default="",
    help="comma-separated attention cores to time alone instead of "
    "a train step (see lra_core/bench/cores.py), e.g. causal_latte,causal_attention",
  )
  parser.add_argument("--heads", type=int, default=4, help="--cores: heads")
  parser.add_argument("--width", type=int, default=128, help="--cores: value width of all heads together")
  parser.add_argument("--latents", type=int, default=128, help="--cores: Latte's latent states, all heads")
  parser.add_argument("--backward", action="store_true", help="--cores: time forward + backward")
  parser.add_argument(
    "--override",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override for every variant (repeatable); --config.KEY=VALUE, as lra_core.train takes it, too",
  )
  parser.add_argument(
    "--variant",
    action="append",
    default=[],
    metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
    help="a named set of overrides (repeatable; default: one variant 'default'); "
    "the override config=<spec> gives the variant its own config file",
  )
  parser.add_argument("--seq_lens", default="2048", help="comma-separated sequence lengths")
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument(
    "--tokens_per_batch", type=int, default=0, help="if > 0: batch max(1, N // T) at length T instead of --batch_size"
  )
  parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  parser.add_argument(
    "--matmul_size", type=int, default=0, help="matmul yardstick size; 0: 2048 on CPU, 8192 on accelerators"
  )
  parser.add_argument(
    "--compiler_option",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="XLA compile option for the train step (repeatable), e.g. xla_backend_optimization_level=0",
  )
  output_flags(parser)
  args = cli.parse_overriding(parser, argv)
  cli.setup_logging()
  if args.batch_size < 1:
    raise ConfigError(f"--batch_size {args.batch_size} is not positive.")
  if bool(args.config) == bool(args.cores):
    raise ConfigError("give either --config (time a train step) or --cores (time attention cores).")
  log = lambda s: print(s, file=sys.stderr, flush=True)
  if args.cores:
    rows = cores.run(
      re.split(r",(?![^,:]*=)", args.cores),
      seq_lens=ints(args.seq_lens),
      batch_size=args.batch_size,
      heads=args.heads,
      width=args.width,
      latents=args.latents,
      steps=args.steps,
      warmup=args.warmup,
      backward=args.backward,
      log=log,
    )
    peak, table = None, cores.format_table(rows)
  else:
    variants = [parse_variant(v) for v in args.variant] or [Variant("default")]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
      raise ConfigError(f"variant names {names} repeat; expected distinct names.")
    rows, peak = run(
      args.config,
      overrides=args.override,
      variants=variants,
      seq_lens=ints(args.seq_lens),
      batch_size=args.batch_size,
      tokens_per_batch=args.tokens_per_batch,
      steps=args.steps,
      warmup=args.warmup,
      matmul_size=args.matmul_size,
      compiler_options=_options(args.compiler_option),
      log=log,
    )
    table = format_table(rows)
  publish(
    "scripts/bench.py",
    argv,
    table,
    rows,
    args,
    peak=peak,
    matmul_size=args.matmul_size,
    title=args.config or args.cores,
  )
  return rows


if __name__ == "__main__":
  cli.run(main)
