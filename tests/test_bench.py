"""scripts/bench.py times the trainer's train step and writes markdown / JSON tables."""

import json
import os
import subprocess
import sys

import jax
import pytest

from lra_core.bench import train_step as bench
from lra_core.config import PROJECT_ROOT
from lra_core.errors import ConfigError
from lra_core.runtime import quiet_start

ENWIK8 = "configs/enwik8/transformer.py:tiny"
VARIANTS = ("base:", "narrow:model.d_model=32,model.d_ff=64")
SEQ_LENS = (16, 32)
# For every row: a smaller step and an unoptimised XLA backend compile 2x faster on CPU (cold
# compiles are most of this file's time); the harness is what is tested here.
SMALL = ("model.num_layers=1", "model.dropout=0.0")
FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def bench_run():
  variants = [bench.parse_variant(v) for v in VARIANTS]
  return bench.run(
    ENWIK8,
    overrides=SMALL,
    variants=variants,
    seq_lens=SEQ_LENS,
    steps=2,
    warmup=1,
    matmul_size=256,
    compiler_options=FAST,
  )


def test_parse_variant_keeps_commas_inside_values():
  assert bench.parse_variant("base:") == bench.Variant("base", ())
  assert bench.parse_variant("v:a.b=(1, 2),c.d=3") == bench.Variant("v", ("a.b=(1, 2)", "c.d=3"))
  with pytest.raises(ConfigError):
    bench.parse_variant(":a=1")
  with pytest.raises(ConfigError):
    bench.parse_variant("v:nonsense")


def test_bench_config_sets_length_batch_and_one_window():
  overrides = ["model.max_len=64", "train.update_len=16"]
  config = bench.bench_config(ENWIK8, overrides, seq_len=128, batch_size=2)
  t = config.train
  assert (t.seq_len, t.batch_size, t.update_len, t.grad_accum_steps) == (128, 2, 0, 1)
  assert config.model.max_len == 128  # a pinned position table grows with the length
  assert bench.bench_config(ENWIK8, seq_len=128).model.max_len == 0  # 0 (= seq_len) stays 0


def test_variant_may_name_its_own_config_and_batches_follow_tokens_per_batch():
  own = bench.parse_variant("quad:config=configs/c4/flash_quad.py:tiny,lm,model.num_layers=1")
  assert bench.variant_config(ENWIK8, own) == ("configs/c4/flash_quad.py:tiny,lm", ["model.num_layers=1"])
  assert bench.variant_config(ENWIK8, bench.Variant("base")) == (ENWIK8, [])
  rows, _ = bench.run(
    ENWIK8,
    overrides=SMALL,
    variants=[own],
    seq_lens=(16, 32),
    tokens_per_batch=64,
    steps=1,
    warmup=0,
    matmul_size=64,
    compiler_options=FAST,
  )
  assert [(r["seq_len"], r["batch_size"], r["status"]) for r in rows] == [(16, 4, "ok"), (32, 2, "ok")]


@pytest.mark.slow
def test_rows_time_every_variant_and_length(bench_run):
  rows, peak = bench_run
  assert peak > 0
  expected = [(v.split(":")[0], t) for v in VARIANTS for t in SEQ_LENS]
  assert [(r["variant"], r["seq_len"]) for r in rows] == expected
  for r in rows:
    assert r["status"] == "ok" and r["batch_size"] == 1
    assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["compile_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["seq_len"] / (r["step_ms"] / 1e3))
    assert len(r["step_ms_all"]) == 2
    assert r["memory_bytes"] > 0 and r["memory_kind"] == "host RSS"
    assert r["flops_per_step"] > 0 and 0 < r["peak_fraction"] == pytest.approx(r["flops_per_s"] / peak)
    assert 4.0 < r["loss"] < 8.0  # random bytes: about log(256) = 5.5
  base, narrow = rows[0], rows[2]
  assert narrow["num_params"] < base["num_params"] and narrow["flops_per_step"] < base["flops_per_step"]
  assert rows[1]["flops_per_step"] > base["flops_per_step"]  # longer sequence, more work


@pytest.mark.slow
def test_table_has_one_line_per_row_and_marks_oom(bench_run):
  rows, _ = bench_run
  oom = dict(rows[0], status="OOM", error="RESOURCE_EXHAUSTED: out of memory")
  lines = bench.format_table(rows + [oom]).splitlines()
  assert lines[0].startswith("| variant | T | batch | tokens/s | step ms (median) | compile s | peak memory MiB")
  assert len(lines) == 2 + len(rows) + 1
  assert [line.split("|")[1:3] for line in lines[2:6]] == [
    [f" {v.split(':')[0]} ", f" {t} "] for v in VARIANTS for t in SEQ_LENS
  ]
  assert lines[-1].split("|")[4].strip() == "OOM"


def test_out_of_memory_becomes_a_row(monkeypatch):
  oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 bytes.")
  assert bench.is_oom(oom) and bench.is_oom(MemoryError())
  assert not bench.is_oom(ValueError("RESOURCE_EXHAUSTED"))  # only XLA's runtime error counts

  def fail(spec):
    raise oom

  monkeypatch.setattr(bench, "init_state", fail)
  config = bench.bench_config(ENWIK8, SMALL, seq_len=16)
  row = bench.time_train_step(config, steps=1, warmup=0, compiler_options=FAST)  # compile cached above
  assert row["status"] == "OOM" and row["stage"] == "run"
  assert row["error"].startswith("RESOURCE_EXHAUSTED")
  assert row["xla_memory_bytes"] > 0
  monkeypatch.setattr(bench, "init_state", lambda spec: 1 / 0)
  with pytest.raises(ZeroDivisionError):  # anything else is a bug and propagates
    bench.time_train_step(config, steps=1, warmup=0, compiler_options=FAST)


def test_cli_prints_and_appends_markdown_and_writes_json(tmp_path, capsys):
  out, raw = tmp_path / "docs" / "bench.md", tmp_path / "rows.json"
  argv = [
    f"--config={ENWIK8}",
    *(f"--override={o}" for o in SMALL),
    "--variant",
    "base:",
    "--seq_lens=16",
    "--steps=2",
    "--warmup=1",
    "--matmul_size=256",
    "--compiler_option=xla_backend_optimization_level=0",
    f"--out={out}",
    f"--json={raw}",
  ]
  rows = bench.main(argv)
  assert [r["status"] for r in rows] == ["ok"] and rows[0]["compiler_options"] == FAST
  printed = capsys.readouterr().out
  assert printed.startswith("machine: cpu") and "command: python scripts/bench.py --config=" in printed
  assert "| base | 16 | 1 |" in printed
  bench.main(argv + ["--title=second", "--config.train.log_every=7"])  # the trainer's syntax; same step: cached
  with pytest.raises(ConfigError, match="unknown config key 'train.stepz'"):  # read as an override, not refused
    bench.main([*argv, "--config.train.stepz", "3"])
  text = out.read_text()
  assert text.startswith(f"### {ENWIK8}\n") and "\n### second\n" in text
  assert text.count("| base | 16 | 1 |") == 2
  data = json.loads(raw.read_text())
  assert data["rows"][0]["seq_len"] == 16 and data["matmul_flops_per_s"] > 0


def test_cores_mode_times_attention_cores_alone(tmp_path, capsys):
  out = tmp_path / "cores.md"
  rows = bench.main(
    [
      "--cores=causal_attention,causal_latte:chunk=4,bidirectional_latte,window_attention:window=4,"
      "vq_attention:block=4,codes=8,impl=pallas,mixed_chunk:chunk=4,impl=pallas",
      "--seq_lens=16",
      "--heads=2",
      "--width=8",
      "--latents=6",
      "--steps=1",
      "--warmup=0",
      f"--out={out}",
    ]
  )
  assert [r["variant"] for r in rows] == [
    "causal_attention",
    "causal_latte:chunk=4",
    "bidirectional_latte",
    "window_attention:window=4",
    "vq_attention:block=4,codes=8,impl=pallas",
    "mixed_chunk:chunk=4,impl=pallas",
  ]
  assert all(r["status"] == "ok" and r["ms"] > 0 and r["seq_len"] == 16 and r["gb_per_s"] > 0 for r in rows)
  assert "| `causal_latte:chunk=4` | 16 | 1 |" in out.read_text()
  with pytest.raises(ConfigError, match="either --config"):
    bench.main(["--cores=causal_latte", f"--config={ENWIK8}"])
  with pytest.raises(ConfigError, match="core 'flash' is not one of"):
    bench.main(["--cores=flash"])


def test_decode_bench_times_each_variant_and_context(tmp_path, capsys):
  from lra_core.bench import decode as bench_decode

  out = tmp_path / "decode.md"
  rows = bench_decode.main(
    [
      "--config=configs/imagenet64/fit_ar.py:tiny",
      "--variant",
      "fit:",
      "--variant",
      "tpp:config=configs/imagenet64/transformer.py:tiny,plusplus",
      "--context_lens=96,192",
      "--tokens=48",
      "--repeats=1",
      "--warmup=0",
      f"--out={out}",
    ]
  )
  assert [(r["variant"], r["context"]) for r in rows] == [("fit", 96), ("fit", 192), ("tpp", 96), ("tpp", 192)]
  assert all(r["ms_per_token"] > 0 for r in rows)
  fit_state, tpp_state = [r["state_mib"] for r in rows[:2]], [r["state_mib"] for r in rows[2:]]
  assert tpp_state[1] == pytest.approx(2 * tpp_state[0], rel=1e-3)  # a KV cache of L slots
  assert fit_state[1] < 2 * fit_state[0]  # one group's cache plus latents: grows more slowly
  assert out.read_text().count("| fit |") == 2 and "ms / token" in capsys.readouterr().out
  with pytest.raises(ConfigError, match="--tokens 500 exceeds the context length 96"):
    bench_decode.main(["--config=configs/imagenet64/fit_ar.py:tiny", "--context_lens=96", "--tokens=500"])


def test_bench_generate_times_block_and_vanilla_generation(tmp_path, capsys):
  from lra_core.bench import generate as bench_generate

  out = tmp_path / "generate.md"
  rows = bench_generate.main(
    [
      "--config=configs/c4/block_transformer.py:tiny",
      "--variant",
      "block:",
      "--variant",
      "vanilla:config=configs/c4/block_transformer.py:tiny,vanilla",
      "--batch_sizes=2",
      "--settings=32:8",
      "--repeats=1",
      "--warmup=0",
      f"--out={out}",
    ]
  )
  assert [(r["variant"], r["prompt"], r["new"]) for r in rows] == [("block", 32, 8), ("vanilla", 32, 8)]
  assert all(r["tokens_per_s"] > 0 for r in rows)
  block, vanilla = rows
  assert block["state_mib"] < vanilla["state_mib"] / 2  # a KV cache over blocks, not tokens
  # Speed-ups against the last variant, the baseline: its own row 1.0x, the other's the ratio (1.0x too
  # where the two run within 5% of each other, as they may at this size).
  table = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
  assert "| 1.0x |" in table["vanilla"], table
  assert f"| {block['tokens_per_s'] / vanilla['tokens_per_s']:.1f}x |" in table["block"], table
  assert "generated tokens/s" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="not PROMPT:NEW"):
    bench_generate.parse_settings("2048-128")


def test_a_bench_on_a_cpu_host_prints_its_rows_without_accelerator_plugin_noise(tmp_path):
  """Parsing a benchmark's flags starts the backends inside the start-up filter (lra_core/runtime/quiet_start.py)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  command = [sys.executable, "scripts/bench.py", f"--config={ENWIK8}", "--seq_lens=16", "--batch_size=2"]
  command += ["--steps=1", "--warmup=0", *(f"--override={o}" for o in SMALL), f"--out={tmp_path / 'b.md'}"]
  proc = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  if not quiet_start.has_accelerator():
    assert [line.split(":")[0] for line in proc.stderr.splitlines()] == ["default T=16"], proc.stderr[-3000:]
