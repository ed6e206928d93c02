"""ListOps: generator against an independent parser/evaluator, loader on handwritten files."""

import itertools
import logging
import pathlib
import random
import re

import ml_collections
import numpy as np
import pytest

from lra_core.data.datasets.lra import listops
from lra_core.errors import ConfigError, DataError

SMALL = dict(num_train=40, num_val=10, num_test=10, max_depth=5, max_args=5, min_length=16, max_length=128)


def _parse_pairs(tokens, i=0):
  """Official string form -> nested pairs: a digit, an operator, ']' or (left, right)."""
  tok = tokens[i]
  if tok != "(":
    assert tok in ("]",) + listops.OPERATORS or tok.isdigit(), tok
    return (int(tok) if tok.isdigit() else tok), i + 1
  left, i = _parse_pairs(tokens, i + 1)
  right, i = _parse_pairs(tokens, i)
  assert tokens[i] == ")"
  return (left, right), i + 1


def _evaluate(node) -> tuple[int, int]:
  """Value and model-token length of a pair tree, checking it has the ((op, c0), c1)...] shape."""
  if isinstance(node, int):
    return node, 1
  head, close = node
  assert close == "]"
  args = []
  while isinstance(head, tuple):  # peel ((op, c0), c1)... from the right
    head, child = head
    args.append(child)
  assert head in listops.OPERATORS and len(args) >= 2
  results = [_evaluate(c) for c in reversed(args)]
  values = np.array([v for v, _ in results])
  value = {"[MIN": values.min(), "[MAX": values.max(), "[SM": values.sum() % 10, "[MED": int(np.median(values))}[head]
  return int(value), 2 + sum(n for _, n in results)


def _stack_machine(source: str) -> int:
  """Evaluates the bracket-free token string left to right."""
  stack = []
  for tok in source.split():
    if tok in "()":
      continue
    if tok == "]":
      args = []
      while not isinstance(stack[-1], str):
        args.append(stack.pop())
      op = stack.pop()
      s = sorted(args)
      med = s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) // 2
      stack.append({"[MIN": min(args), "[MAX": max(args), "[SM": sum(args) % 10, "[MED": med}[op])
    else:
      stack.append(tok if tok.startswith("[") else int(tok))
  assert len(stack) == 1
  return stack[0]


def _rows(path):
  lines = pathlib.Path(path).read_bytes().decode().split("\r\n")
  assert lines[-1] == ""
  return [line.split("\t") for line in lines[1:-1]]


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
  out = tmp_path_factory.mktemp("listops_small")
  listops.generate_files(out, seed=3, **SMALL)
  return out


def test_same_seed_same_bytes_and_other_seed_differs(small_set, tmp_path):
  listops.generate_files(tmp_path / "again", seed=3, **SMALL)
  listops.generate_files(tmp_path / "other", seed=4, **SMALL)
  for name in listops.SPLIT_FILES.values():
    assert (tmp_path / "again" / name).read_bytes() == (small_set / name).read_bytes()
  other = (tmp_path / "other" / "basic_train.tsv").read_bytes()
  assert other != (small_set / "basic_train.tsv").read_bytes()


def test_file_format_counts_and_disjoint_splits(small_set):
  seen = set()
  for split, count in (("train", 40), ("validation", 10), ("test", 10)):
    data = (small_set / listops.SPLIT_FILES[split]).read_bytes()
    assert data.startswith(b"Source\tTarget\r\n") and data.endswith(b"\r\n")
    assert data.count(b"\n") == data.count(b"\r\n") == count + 1
    rows = _rows(small_set / listops.SPLIT_FILES[split])
    assert len(rows) == count and all(len(r) == 2 for r in rows)
    sources = {r[0] for r in rows}
    assert len(sources) == count and not sources & seen
    seen |= sources


@pytest.mark.parametrize(
  "settings",
  [
    SMALL,
    dict(num_train=200, num_val=1, num_test=1, max_depth=3, max_args=4, min_length=4, max_length=12),
    dict(num_train=20, num_val=5, num_test=5, max_depth=10, max_args=10, min_length=500, max_length=2000),
  ],
)
def test_labels_match_independent_evaluators_and_lengths_are_strict(tmp_path, settings):
  listops.generate_files(tmp_path, seed=0, **settings)
  for name in listops.SPLIT_FILES.values():
    for source, target in _rows(tmp_path / name):
      tokens = source.split()
      tree, end = _parse_pairs(tokens)
      assert end == len(tokens)
      value, length = _evaluate(tree)
      assert int(target) == value == _stack_machine(source)
      assert length == len(listops.encode(source))
      assert settings["min_length"] < length < settings["max_length"]


def test_official_string_form():
  # Depth 2 forces the children to be digits, so one draw sequence is easy to check by hand.
  for seed in range(50):
    tokens, length, value = listops.random_tree(random.Random(seed), 2, 3)
    if len(tokens) > 1:
      break
  source = " ".join(tokens)
  n = length - 2
  assert source.startswith("( " * (n + 1)) and source.endswith(" ] )")
  assert value == _stack_machine(source)
  assert listops.decode(listops.encode("( ( ( [MAX 2 ) 9 ) ] )")) == "[MAX 2 9 X"


def test_vocabulary_is_fixed_and_sorted():
  assert listops.VOCAB == (
    "<pad>",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "X",
    "[MAX",
    "[MED",
    "[MIN",
    "[SM",
  )
  assert list(listops.VOCAB[1:]) == sorted(listops.VOCAB[1:])
  assert listops.VOCAB_SIZE == listops.Source.info.vocab_size == 16
  assert listops.Source.info.num_classes == 10


FIXTURE = (
  "Source\tTarget\r\n"
  "( ( ( [MAX 2 ) 9 ) ] )\t9\r\n"
  "( ( ( ( [SM 7 ) ( ( ( [MIN 4 ) 6 ) ] ) ) 8 ) ] )\t9\r\n"
  "( ( ( ( ( [MED 1 ) 2 ) 8 ) 9 ) ] )\t5\r\n"
)


def _config(folder="", seq_len=8, **data):
  return ml_collections.ConfigDict(dict(data=listops.data_config(dir=str(folder), **data), train=dict(seq_len=seq_len)))


def test_loader_on_handwritten_file(tmp_path, caplog):
  (tmp_path / "basic_train.tsv").write_bytes(FIXTURE.encode())
  ids = {tok: i for i, tok in enumerate(listops.VOCAB)}
  with caplog.at_level(logging.WARNING):
    source = listops.Source(tmp_path / "basic_train.tsv", seq_len=6)
  assert len(source) == 3
  expected = [
    (["[MAX", "2", "9", "X"], 9),
    (["[SM", "7", "[MIN", "4", "6", "X"], 9),  # 8 X cut off at seq_len 6
    (["[MED", "1", "2", "8", "9", "X"], 5),
  ]
  for i, (tokens, label) in enumerate(expected):
    ex = source[i]
    want = np.zeros(6, np.int32)
    want[: len(tokens)] = [ids[t] for t in tokens]
    np.testing.assert_array_equal(ex["inputs"], want)
    np.testing.assert_array_equal(ex["mask"], want != 0)
    assert ex["inputs"].dtype == np.int32 and ex["mask"].dtype == bool
    assert ex["targets"].shape == () and ex["targets"].dtype == np.int32 and ex["targets"] == label
    assert ex["weights"].dtype == np.float32 and ex["weights"] == 1.0
  np.testing.assert_array_equal(source[-1]["inputs"], source[2]["inputs"])
  assert [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()] == [
    f"{tmp_path / 'basic_train.tsv'}: 1 of 3 ListOps examples are longer than seq_len 6 and are truncated."
  ]
  assert listops.encode("( ( ( [SM 7 ) 8 ) ] )") == [ids["[SM"], ids["7"], ids["8"], ids["X"]]


@pytest.mark.parametrize(
  "content, message",
  [
    ("", "is empty"),
    ("Text\tLabel\r\n( ( ( [MAX 2 ) 9 ) ] )\t9\r\n", "line 1: header"),
    ("Source\tTarget\r\n", "no examples"),
    ("Source\tTarget\r\n( ( ( [MAX 2 ) 9 ) ] )\t9\r\n( ( ( [AVG 2 ) 9 ) ] )\t5\r\n", "line 3: token '[AVG'"),
    ("Source\tTarget\r\n( ( ( [MAX 2 ) 9 ) ] )\t12\r\n", "line 2: label '12'"),
    ("Source\tTarget\r\n( ( ( [MAX 2 ) 9 ) ] )\r\n", "line 2: found 1"),
    (bytes(range(256)) * 4, "is not UTF-8 text"),  # random bytes under the TSV's name
  ],
)
def test_bad_files_raise_data_error_naming_the_file(tmp_path, content, message):
  path = tmp_path / "basic_val.tsv"
  path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content, newline="")
  with pytest.raises(DataError, match=re.escape(message)) as e:
    listops.load_tsv(path)
  assert str(path) in str(e.value)


def test_make_source_reads_dir_and_pads(tmp_path):
  for name in listops.SPLIT_FILES.values():
    (tmp_path / name).write_bytes(FIXTURE.encode())
  source = listops.make_source(_config(tmp_path, seq_len=10), "validation")
  assert source[0]["inputs"].shape == (10,)
  assert source[0]["mask"].sum() == 4 and not source[0]["mask"][4:].any()
  assert source[1]["mask"].sum() == 8


def test_validate_config_errors(tmp_path):
  with pytest.raises(DataError, match="data.generate=True"):
    listops.validate_config(_config())
  (tmp_path / "basic_train.tsv").write_bytes(FIXTURE.encode())
  with pytest.raises(DataError, match="basic_val.tsv"):
    listops.validate_config(_config(tmp_path))
  for bad, name in (
    (dict(min_length=600, max_length=600), "min_length"),
    (dict(max_args=1), "max_args"),
    (dict(max_depth=0), "max_depth"),
    (dict(num_val=0), "num_val"),
    (dict(max_depth=2, min_length=20), "longest"),
  ):
    with pytest.raises(ConfigError, match=name):
      listops.validate_config(_config(generate=True, **bad))
  with pytest.raises(ConfigError, match="is not a field of the listops dataset"):
    listops.data_config(max_len=5)


def test_generate_into_cache_once_and_per_setting(tmp_path, monkeypatch):
  calls = []
  real = listops.generate_files
  monkeypatch.setattr(listops, "generate_files", lambda *a, **k: calls.append(k) or real(*a, **k))
  cache = tmp_path / "cache"
  config = _config(generate=True, cache_dir=str(cache), **SMALL)
  first = listops.make_source(config, "train")
  assert len(first) == 40 and len(calls) == 1
  second = listops.make_source(config, "test")
  assert len(second) == 10 and len(calls) == 1
  other = _config(generate=True, cache_dir=str(cache), **dict(SMALL, seed=1))
  listops.make_source(other, "train")
  assert len(calls) == 2
  folders = sorted(p.name for p in cache.iterdir())
  assert len(folders) == 2 and all(f.startswith("listops-") for f in folders)  # no temp leftovers
  assert listops.cache_folder(config.data) != listops.cache_folder(other.data)
  monkeypatch.setenv("LRA_CORE_CACHE", str(tmp_path / "env"))
  assert listops.cache_folder(_config(generate=True).data).parent == tmp_path / "env"


def test_losing_a_generation_race_keeps_the_winner(tmp_path, monkeypatch):
  config = _config(generate=True, cache_dir=str(tmp_path), **SMALL)
  final = listops.cache_folder(config.data)
  real = listops.generate_files

  def generate_while_another_process_finishes(out, **settings):
    real(final, **settings)  # the other process renames its copy into place first
    (final / "winner").touch()
    real(out, **settings)

  monkeypatch.setattr(listops, "generate_files", generate_while_another_process_finishes)
  assert listops.ensure_generated(config.data) == final
  assert (final / "winner").exists() and [p.name for p in tmp_path.iterdir()] == [final.name]


def test_cli_generate_and_stats(tmp_path, capsys):
  listops.main(
    [
      "generate",
      "--out",
      str(tmp_path),
      "--num_train",
      "5",
      "--num_val",
      "2",
      "--num_test",
      "2",
      "--max_depth",
      "4",
      "--max_args",
      "4",
      "--min_length",
      "8",
      "--max_length",
      "40",
      "--seed",
      "7",
    ]
  )
  said = capsys.readouterr().out.splitlines()[0]  # before anything is written: how much will be
  assert said == f"writing 9 expressions of 8-40 tokens to {tmp_path}: about 0 MB"
  assert listops.expected_bytes(100_000, 500, 2000) == pytest.approx(635e6, rel=0.1)  # the defaults: 635 MB written
  listops.main(["stats", str(tmp_path / "basic_train.tsv")])
  out = capsys.readouterr().out
  assert "basic_train.tsv: 5 examples; length min" in out and "labels 0:" in out


TINY_CLI = ["--num_train", "20", "--num_val", "2", "--num_test", "2", "--max_depth", "4", "--max_args", "4"]
TINY_CLI += ["--min_length", "8", "--max_length", "40"]


def test_cli_generate_shows_progress_and_writes_whole_files(tmp_path, capsys):
  listops.main(["generate", "--out", str(tmp_path), *TINY_CLI])
  err = capsys.readouterr().err
  assert f"writing {tmp_path / 'basic_train.tsv'}: 2 of 20 (10%)" in err
  assert f"writing {tmp_path / 'basic_train.tsv'}: 20 of 20 (100%)" in err
  assert f"writing {tmp_path / 'basic_test.tsv'}: 2 of 2 (100%)" in err
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(listops.SPLIT_FILES.values())  # no temporary left
  assert len(listops.load_tsv(tmp_path / "basic_train.tsv")) == 20


def test_cli_generate_ctrl_c_leaves_no_file_and_exits_130(tmp_path, monkeypatch, capsys):
  real = listops.sample_expressions

  def interrupted(*args, **kwargs):
    yield from itertools.islice(real(*args, **kwargs), 5)  # some rows of basic_train.tsv written, then Ctrl-C
    raise KeyboardInterrupt

  monkeypatch.setattr(listops, "sample_expressions", interrupted)
  (tmp_path / "basic_val.tsv").write_text("an earlier file")
  with pytest.raises(SystemExit) as exit_:
    listops.main(["generate", "--out", str(tmp_path), *TINY_CLI])
  assert exit_.value.code == 130
  assert capsys.readouterr().err.splitlines()[-1] == "aborted (Ctrl-C)."
  assert [p.name for p in tmp_path.iterdir()] == ["basic_val.tsv"]  # no basic_train.tsv, whole or partial
  assert (tmp_path / "basic_val.tsv").read_text() == "an earlier file"


def test_cli_generate_help_shows_defaults(capsys):
  with pytest.raises(SystemExit) as exit_:
    listops.main(["generate", "--help"])
  assert exit_.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  for name in listops.GENERATOR_FIELDS:
    assert f"--{name}" in out
  assert "(default: 96000)" in out and "(default: 2000)" in out and "(default: 500)" in out
