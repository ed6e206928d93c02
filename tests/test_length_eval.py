"""Evaluation as the length grows (`python -m lra_core.evaluate --lengths`), passkey retrieval
(lra_core/tasks/passkey.py, `--passkey`) and the context_extension table at a reduced size.

One tiny Transformer++ run (RoPE and fixed sinusoids: any length) trained at 32 bytes is read at 16, 32
and 64: a row per length over the same tokens; a learned position table is refused past its length in
one sentence; a passkey prompt holds its key at the asked depth and the scorer counts a model that copies
the key as right and one that does not as wrong.
"""

import dataclasses
import json
import re

import numpy as np
import pytest

import lra_core
from lra_core import evaluate
from lra_core.data.datasets import bytes as bytes_data
from lra_core.errors import ConfigError, DataError
from lra_core.reproduce import context_extension
from lra_core.reproduce.common import Context
from lra_core.tasks import passkey
from lra_core.train import train_and_evaluate

TINY = "configs/enwik8/transformer.py:tiny,plusplus"
KEY_TEXT = re.compile(r"pass key is (\d+)\. Remember")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  rng = np.random.default_rng(0)
  words = np.array(["alpha", "beta", "gamma", "delta", "the", "a", "of", "and"])
  folder = tmp_path_factory.mktemp("length_eval")
  text = folder / "corpus.txt"
  text.write_text(" ".join(rng.choice(words, size=6000)))
  config = lra_core.load_config(TINY, [f"data.path={text}", "train.steps=2", "train.seq_len=32"])
  train_and_evaluate(config, folder / "run")
  return config, folder / "run"


def test_every_length_reads_the_same_tokens_and_each_setting_keeps_its_entry(run, capsys):
  config, workdir = run
  evaluate.main(["--workdir", str(workdir), "--lengths=16,32,64", "--tokens=640"])
  printed = capsys.readouterr().out
  saved = json.loads((workdir / "eval_lengths_test_2.json").read_text())
  rows = saved[evaluate.AS_TRAINED]["lengths"]
  assert [r["length"] for r in rows] == [16, 32, 64]
  assert [r["tokens"] for r in rows] == [640, 640, 640] and [r["rows"] for r in rows] == [40, 20, 10]
  assert all(np.isfinite(r["loss"]) and r["bits_per_byte"] == pytest.approx(r["loss"] / np.log(2)) for r in rows)
  assert "Every length reads the same 640 tokens of the test split (10 rows of 64" in printed
  for length in ("| 16 |", "| 32 |", "| 64 |"):
    assert length in printed
  # Another setting is another entry: the first stays.
  scaled = ["--config.model.rope_scaling.type=linear", "--config.model.rope_scaling.factor=2"]
  evaluate.main(["--workdir", str(workdir), "--lengths=64", "--tokens=640", *scaled])
  saved = json.loads((workdir / "eval_lengths_test_2.json").read_text())
  key = "model.rope_scaling.type=linear model.rope_scaling.factor=2"  # the overrides, as the config reads them
  assert set(saved) == {evaluate.AS_TRAINED, key} and saved[key]["lengths"][0]["tokens"] == 640


def test_a_file_of_the_users_is_never_overwritten(tmp_path):
  (tmp_path / "eval_lengths_test_1.json").write_text("[1, 2]\n")
  path = evaluate.write_keyed(tmp_path, "eval_lengths_test_1", "as trained", {"loss": 1.0})
  assert path == str(tmp_path / "eval_lengths_test_1_1.json")
  assert (tmp_path / "eval_lengths_test_1.json").read_text() == "[1, 2]\n"


def test_a_learned_position_table_is_refused_past_its_length_in_one_sentence():
  config = lra_core.load_config("configs/enwik8/transformer.py:tiny")  # learned positions, 64 of them
  evaluate.check_positions(config, [32, 64])
  with pytest.raises(ConfigError, match=r"holds 64 positions .* cannot read 128 tokens; give --lengths up to 64\.$"):
    evaluate.check_positions(config, [64, 128])
  with pytest.raises(ConfigError, match="does not divide the longest"):
    evaluate.parse_lengths(config, [48, 64])


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_passkey_prompt_holds_the_key_at_the_depth_asked(depth):
  prompt = passkey.build_prompt(bytes_data.encode, 400, depth, "12345")
  key = " " + passkey.KEY_SENTENCE.format(key="12345")
  text = bytes_data.decode(prompt.ids)
  assert len(prompt.ids) == 400 and text.endswith(passkey.QUESTION) and text.count("12345") == 1
  assert bytes_data.decode(prompt.ids[prompt.key_at : prompt.key_at + len(key)]) == key
  sentence = max(len(s) + 1 for s in passkey.FILLER)  # the key sits at the boundary nearest to the depth
  assert abs(prompt.key_at - depth * prompt.filler) <= sentence / 2
  assert prompt.key_at == {0.0: 0, 1.0: prompt.filler}.get(depth, prompt.key_at)


def answer_with(text_of):
  """A fake decoder that answers each prompt with `text_of(key in the prompt)`, recording its shapes."""
  shapes = []

  def generate(prompts, new):
    shapes.append(prompts.shape)
    out = []
    for row in prompts:
      key = KEY_TEXT.search(bytes_data.decode(row)).group(1)
      out.append(bytes_data.encode(text_of(key).ljust(new))[:new])
    return np.asarray(out, np.int32)

  return generate, shapes


def test_the_scorer_counts_a_copied_key_right_and_another_number_wrong():
  assert passkey.score(" 12345. Remember", "12345") == (True, 5)
  assert passkey.score(" 12346.", "12345") == (False, 4)
  assert passkey.score(" 123456", "12345")[0] is False
  assert passkey.score(" none", "12345") == (False, 0)
  copy, shapes = answer_with(lambda key: f" {key}.")
  rows = passkey.passkey_rows(
    copy, bytes_data.encode, bytes_data.decode, 256, [0.0, 0.5, 1.0], 3, digits=5, batch_size=4
  )
  assert [r["accuracy"] for r in rows] == [1.0, 1.0, 1.0] and [r["digit_accuracy"] for r in rows] == [1.0] * 3
  assert [r["depth"] for r in rows] == [0.0, 0.5, 1.0] and rows[0]["key_depth"] == 0.0
  assert shapes == [(4, 256 - passkey.answer_tokens(5))] * 3  # 9 prompts in 3 calls of one shape
  wrong, _ = answer_with(lambda key: " " + key[::-1] + "0")
  rows = passkey.passkey_rows(wrong, bytes_data.encode, bytes_data.decode, 256, [0.5], 3, digits=5)
  assert rows[0]["accuracy"] == 0.0


def test_passkey_on_a_trained_run_and_a_length_too_short_for_it(run):
  config, workdir = run
  with pytest.raises(ConfigError, match=r"passkey length 32 cannot hold .*; ask for \d+ or more\.$"):
    evaluate.evaluate_passkey(config, workdir, [32], [0.5])
  result = evaluate.evaluate_passkey(config, workdir, [96], [0.5], trials=2, digits=3)
  (row,) = result["rows"]
  assert row["length"] == 96 and row["trials"] == 2 and 0.0 <= row["accuracy"] <= 1.0
  assert "| 96 | 0.5 |" in evaluate.passkey_table(result)


def test_the_full_table_says_what_to_pass(tmp_path):
  with pytest.raises(DataError, match=r"pass --data_dir=<folder holding gemma-2-2b/ .* and c4/>\.$"):
    context_extension.context_extension(Context(full=True, workdir=tmp_path))
  with pytest.raises(DataError, match="gemma-2-2b does not exist"):
    context_extension.context_extension(Context(full=True, data_dir=tmp_path, workdir=tmp_path))


@pytest.mark.slow
def test_the_context_extension_table_at_a_reduced_size(tmp_path):
  size = dataclasses.replace(
    context_extension.default_size(length=96, steps=4, extension_steps=2),
    multiples=(1, 2),
    scalings=(),  # a scaling row reads as the first row does, with overrides (the CLI test sets one)
    tokens=2 * 192,
    trials=1,
    depths=(0.5,),
    listops=("data.num_train=2000",),
  )
  result = context_extension.context_extension(Context(workdir=tmp_path, img_dir=tmp_path / "img"), size)
  for row in ("| as trained |", "| extension_yarn_x4 |", "| Gemma-Macchiato |"):
    assert row in result.markdown
  assert "1L = 96 | 2L = 192" in result.markdown and "384 validation bytes" in result.markdown
  assert result.comparison.startswith("perplexity at 2L / L: as trained ") and "extension_yarn_x4" in result.comparison
