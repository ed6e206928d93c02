"""scripts/peer_bench.py (our step beside a plain JAX peer) and scripts/bench_loop.py (the trainer's
loop beside its bare step); scripts/authors_vq_bench.py's check of its input."""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lra_core
from lra_core.bench import loop, plain_jax_lm1b, side_by_side
from lra_core.errors import ConfigError
from tiers import quick

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMALL = [
  "model.d_model=32",
  "model.num_layers=2",
  "model.num_heads=2",
  "model.d_ff=64",
  "train.seq_len=16",
  "model.dropout=0.0",
]


@pytest.mark.parametrize("variant", quick(["", ":plus", ":plusplus"], keep=[], ids=["transformer", "plus", "plusplus"]))
def test_lm1b_peer_computes_our_transformer_on_our_weights(variant):
  """Same function, so the side-by-side times compare equal work: the peer on our weights gives our
  loss and our gradients (its extra biases, zero, aside)."""
  config = lra_core.load_config("configs/enwik8/transformer.py" + variant, SMALL)
  model = lra_core.build_model(config, seed=0)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(0)
  batch = {name: jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32) for name in ("inputs", "targets")}
  graphdef, _ = nnx.split(model, nnx.Param)

  def ours(params):
    m = nnx.merge(graphdef, params)
    return optax.softmax_cross_entropy_with_integer_labels(m(batch["inputs"]), batch["targets"]).mean()

  reference = plain_jax_lm1b.make_peer(config)
  theirs = lambda p: reference.loss(p, {}, batch, None)[0]
  mapped = plain_jax_lm1b.params_from_ours(params, config)
  np.testing.assert_allclose(float(jax.jit(theirs)(mapped)), float(jax.jit(ours)(params)), rtol=1e-6)
  g_ours = jax.jit(jax.grad(ours))(params)
  g_peer = jax.jit(jax.grad(theirs))(mapped)
  for name in ("query", "out"):
    np.testing.assert_allclose(g_peer["blocks"][1][name], g_ours["blocks"][1]["attn"][name]["kernel"], atol=1e-6)
  np.testing.assert_allclose(g_peer["blocks"][0]["wi"]["kernel"], g_ours["blocks"][0]["mlp"]["up"]["kernel"], atol=1e-6)
  np.testing.assert_allclose(g_peer["embed"], g_ours["embed"]["embedding"], atol=1e-6)
  # Its own initialisation has our tree's shapes (plus the biases).
  fresh, _ = reference.init(jax.random.key(0))
  assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, mapped)


def test_lm1b_peer_refuses_what_it_does_not_mirror():
  for override in (
    "model.window=4",
    "model.num_kv_heads=1",
    "model.dropout=0.1",
    "model.norm=rms",
    "model.scan_layers=True",
    "model.remat=full",
  ):
    with pytest.raises(ConfigError, match="lm1b-style peer"):
      plain_jax_lm1b.make_peer(lra_core.load_config("configs/enwik8/transformer.py", [*SMALL, override]))
  with pytest.raises(ConfigError, match="no peer"):
    side_by_side.make_peer(lra_core.load_config("configs/enwik8/linear_transformer.py:tiny"))


def test_interleaved_timing_alternates_who_goes_first():
  calls = []
  times = side_by_side.interleaved_seconds([lambda: calls.append("a"), lambda: calls.append("b")], steps=3, warmup=1)
  assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
  assert [len(t) for t in times] == [3, 3] and all(s >= 0 for t in times for s in t)


def test_shapes_parse_and_refuse():
  assert side_by_side.shapes("1024x8, 256x32") == [(1024, 8), (256, 32)]
  for bad in ("1024", "", "0x8", "ax2"):
    with pytest.raises(ConfigError):
      side_by_side.shapes(bad)


@pytest.mark.slow
def test_peer_bench_times_both_steps_and_writes_the_table(tmp_path):
  out, raw = tmp_path / "bench.md", tmp_path / "rows.json"
  rows = side_by_side.main(
    [
      "--config=configs/enwik8/transformer.py",
      *(f"--override={o}" for o in SMALL[:4]),
      "--override=model.dropout=0.0",
      "--variant=base:",
      "--variant=pp:config=configs/enwik8/transformer.py:plusplus",
      "--shapes=16x2",
      "--steps=2",
      "--warmup=1",
      "--matmul_size=128",
      f"--out={out}",
      f"--json={raw}",
    ]
  )
  assert [r["variant"] for r in rows] == ["base", "pp"]
  for r in rows:
    assert r["ours_ms"] > 0 and r["peer_ms"] > 0 and r["ratio"] == pytest.approx(r["ours_ms"] / r["peer_ms"])
    assert len(r["ours_ms_all"]) == len(r["peer_ms_all"]) == 2
    # The same model: XLA counts nearly the same work, and the first losses agree in size.
    assert r["peer_flops"] == pytest.approx(r["ours_flops"], rel=0.1)
    assert np.isfinite([r["ours_loss"], r["peer_loss"]]).all()
    assert 0 < r["ours_peak_fraction"]
  text = out.read_text()
  assert "| base | 16 x 2 |" in text and "| pp | 16 x 2 |" in text and "scripts/peer_bench.py" in text
  assert json.loads(raw.read_text())["rows"][1]["variant"] == "pp"


@pytest.mark.slow
def test_bench_loop_compares_the_trainer_with_its_bare_step(tmp_path):
  row = loop.main(
    [
      "--config=configs/lra/listops/transformer.py:tiny",
      "--override=train.steps=6",
      "--override=train.log_every=2",
      f"--workdir={tmp_path / 'run'}",
      "--bare_steps=3",
      "--warmup=1",
      f"--json={tmp_path / 'loop.json'}",
    ]
  )
  assert len(row["loop_intervals"]) == 3
  assert row["loop_tokens_per_s"] > 0 and row["bare_tokens_per_s"] > 0
  assert row["ratio"] == pytest.approx(row["loop_tokens_per_s"] / row["bare_tokens_per_s"])
  with pytest.raises(ConfigError, match="already holds a run"):
    loop.measure(lra_core.load_config("configs/lra/listops/transformer.py:tiny"), tmp_path / "run")


def test_the_authors_vq_bench_names_a_missing_source_folder(tmp_path, capsys, monkeypatch):
  """scripts/authors_vq_bench.py times the authors' own code, which only the user can provide."""
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the folder on it
  spec = importlib.util.spec_from_file_location("authors_vq_bench", ROOT / "scripts" / "authors_vq_bench.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  with pytest.raises(SystemExit) as e:
    script.main([f"--authors_src={tmp_path}"])
  assert e.value.code == 2 and f"--authors_src {tmp_path} holds no transformer_vq package" in capsys.readouterr().err
