"""The Linear Transformer's attention against its quadratic form (the README's example family)."""

import ast
import json
import pathlib
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import oracles
import tiers
from lra_core import train
from lra_core.models import linear_transformer
from lra_core.models.linear_transformer import elu_linear_attention
from lra_core.protocol import RunInfo


def quadratic(q, k, v, causal, mask):
  """softmax attention's shape with exp(q.k) replaced by phi(q).phi(k): an explicit T x T matrix."""
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
  scores = np.einsum("bihd,bjhd->bhij", phi(q), phi(k))
  t = q.shape[1]
  allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
  allowed = allowed[None, None] & mask[:, None, None, :]
  scores = scores * allowed
  return np.einsum("bhij,bjhe->bihe", scores, v) / (scores.sum(-1).transpose(0, 2, 1)[..., None] + 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_equals_its_quadratic_form(causal):
  q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), (2, 11, 3, 4))) for i in range(3))
  mask = np.ones((2, 11), bool)
  mask[1, 8:] = False
  out = oracles.compiled(elu_linear_attention, q, k, v, causal=causal, mask=mask)
  np.testing.assert_allclose(out, quadratic(q, k, v, causal, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", tiers.quick([True, False], keep=[1], ids=["causal", "bidirectional"]))
def test_linear_attention_with_documents_equals_masked_quadratic_form(causal):
  q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), (2, 11, 3, 4))) for i in range(3))
  seg = np.array([[1] * 4 + [2] * 5 + [0] * 2, [1] * 11])
  out = np.asarray(
    oracles.compiled(elu_linear_attention, q, k, v, causal=causal, mask=jnp.asarray(seg > 0), segments=jnp.asarray(seg))
  )
  for row, lo, hi in ((0, 0, 4), (0, 4, 9), (1, 0, 11)):  # each document alone
    alone = quadratic(
      q[row : row + 1, lo:hi], k[row : row + 1, lo:hi], v[row : row + 1, lo:hi], causal, np.ones((1, hi - lo), bool)
    )
    np.testing.assert_allclose(out[row : row + 1, lo:hi], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task", tiers.quick(["lm", "mlm"], keep=[1], ids=["lm", "mlm"]))
def test_packed_documents_are_independent(task):
  c = linear_transformer.transformer.model_config(
    "transformer", vocab_size=23, d_model=16, num_layers=2, num_heads=2, d_ff=32
  )
  c.name = "linear_transformer"
  model = linear_transformer.Model(c, RunInfo(task, seq_len=20), rngs=nnx.Rngs(params=0))
  model.eval()
  oracles.assert_documents_independent(
    lambda rows, segs: oracles.forward(model, rows, segment_ids=segs),
    np.arange(3, 12) % 23,
    (np.arange(7) * 5 + 1) % 23,
    20,
  )


def test_the_readmes_adding_a_model_section_matches_the_files():
  """The README's worked example names what the module defines and copies its config file verbatim
  (without the docstring): an edit to either file that the README does not follow fails here."""
  root = pathlib.Path(__file__).resolve().parent.parent
  readme = (root / "README.md").read_text()
  section = readme[readme.index("## Adding a model family") :]
  section = section[: section.index("\n## ")]
  for name in ("elu_linear_attention", "LinearAttention", "Model", "FAMILY"):
    assert re.search(rf"`[^`]*\b{name}\b[^`]*`", section) and hasattr(linear_transformer, name), name
  config_file = root / "configs/enwik8/linear_transformer.py"
  module = ast.parse(config_file.read_text())
  body = config_file.read_text().splitlines()[module.body[0].end_lineno :]
  assert re.findall(r"```python\n(.*?)```", section, re.S) == ["\n".join(body).strip("\n") + "\n"]


def test_the_readme_s_first_run_of_the_example_family_trains_as_written(tmp_path, monkeypatch):
  """The worked example's train command, as the README gives it (its workdir moved under tmp_path)."""
  root = pathlib.Path(__file__).resolve().parent.parent
  readme = (root / "README.md").read_text()
  start = readme.index("python -m lra_core.train --config=configs/enwik8/linear_transformer.py:tiny")
  line = readme[start : readme.index("\n", readme.index("--workdir", start))]
  argv = shlex.split(line.split("#")[0].replace("\\\n", " "))[3:]
  assert argv[-1] == "--workdir=runs/linear_tiny"
  monkeypatch.chdir(root)
  train.main([*argv[:-1], f"--workdir={tmp_path / 'linear_tiny'}"])
  assert json.loads((tmp_path / "linear_tiny" / "summary.json").read_text())["step"] > 0
