"""scripts/reproduce.py: the table registry, the CLI's checks and how --out rebuilds a results file.

The tables themselves run for minutes; their output is docs/results.md. Here: every registered
table resolves to a function, bad arguments fail in one sentence before anything runs, and a
section replaces only its own part of the results file, leaving the hand-written discussion after it.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from lra_core.bench import param_counts
from lra_core.config import PROJECT_ROOT
from lra_core.errors import ConfigError
from lra_core.reproduce import cli as reproduce
from lra_core.reproduce import common
from lra_core.runtime import quiet_start


def test_every_table_resolves_to_a_function_and_is_listed():
  listing = reproduce.main(["--list"])
  for table in reproduce.TABLES:
    assert callable(reproduce.table_function(table)), table.name
    assert table.name in listing
  required = {
    "params",
    "vq_throughput",
    "vq_codebook",
    "vq_cache",
    "flash_latency",
    "flash_quality",
    "latte_runtime",
    "latte_lra",
    "fit_scaling",
    "fit_interleave",
    "block_throughput",
    "context_extension",
  }
  assert required <= set(reproduce.BY_NAME)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--table", "nope"], "is not a table"),
    (["--table", "vq_codebook"], "pass --data_dir"),
    (["--table", "vq_codebook", "--data_dir", "/nonexistent/data"], "does not exist"),
  ],
)
def test_bad_arguments_fail_before_running(argv, message):
  with pytest.raises(ConfigError, match=message):
    reproduce.main(argv)


def test_section_replaces_only_its_own_part(tmp_path):
  table = reproduce.BY_NAME["params"]
  plot = tmp_path / "img" / "p.png"
  result = common.Result(
    setting="Setting.", markdown="| a |\n|---|\n| 1 |", plots=[plot], comparison="ours / paper: 0.98x"
  )
  first = reproduce.section(
    table,
    result,
    command="python scripts/reproduce.py --table params",
    seconds=90,
    machine_text="cpu",
    commit_text="abc",
    relative_to=tmp_path,
  )
  assert "![p](img/p.png)" in first and "(1.5 min)" in first and "commit: `abc`" in first
  assert first.index("![p]") < first.index("ours / paper: 0.98x") < first.index("<!-- /table: params -->")
  with pytest.raises(ValueError, match="more than one line"):  # why ours differs is hand-written, not generated
    common.Result(setting="s", markdown="m", comparison="ours / paper: 0.98x\nbecause ...")
  other = reproduce.section(
    reproduce.BY_NAME["vq_cache"],
    result,
    command="c",
    seconds=1,
    machine_text="cpu",
    commit_text="abc",
    relative_to=tmp_path,
  )
  text = reproduce.replace_section("# Results\n", "params", first)
  text = reproduce.replace_section(text, "vq_cache", other)
  assert text.index("table: params") < text.index("table: vq_cache")
  again = reproduce.section(
    table,
    common.Result(setting="New.", markdown="| b |\n|---|\n| 2 |"),
    command="c",
    seconds=1,
    machine_text="cpu",
    commit_text="def",
    relative_to=tmp_path,
  )
  text = reproduce.replace_section(text, "params", again)
  assert text.startswith("# Results\n") and "New." in text and "Setting." in text  # vq_cache kept
  assert text.count("<!-- table: params -->") == 1 and "| 1 |" in text.split("table: vq_cache")[1]
  assert text.index("table: params") < text.index("table: vq_cache")  # replaced in place


def test_out_keeps_the_hand_written_discussion(tmp_path, monkeypatch):
  results = tmp_path / "results.md"
  settings = iter(["First run.", "Second run."])
  monkeypatch.setattr(
    reproduce,
    "table_function",
    lambda table: lambda ctx: common.Result(setting=next(settings), markdown="| a |\n|---|\n| 1 |"),
  )
  argv = ["--table", "params", "--out", str(results), "--workdir", str(tmp_path)]
  reproduce.main(argv)  # a new table: its section, then an empty discussion to write
  text = results.read_text()
  assert text.index("<!-- /table: params -->") < text.index("<!-- discussion: params -->\n### Discussion\n")
  discussion = "Ours is 2% off because ...\n\n- and a list."
  results.write_text(text.replace("### Discussion\n", f"### Discussion\n\n{discussion}\n") + "\nAfter.\n")
  printed = reproduce.main(argv)
  text = results.read_text()
  assert "First run." not in text and text.count("Second run.") == 1 and text.count(discussion) == 1
  assert text.index("Second run.") < text.index("<!-- /table: params -->") < text.index(discussion)
  assert text.index(discussion) < text.index("<!-- /discussion: params -->") < text.index("After.")
  assert "command: `python scripts/reproduce.py --table params --workdir " in printed and discussion not in printed


def test_every_results_section_is_followed_by_its_discussion():
  text = (PROJECT_ROOT / "docs" / "results.md").read_text()
  for table in reproduce.TABLES:
    end, begin = reproduce.end_marker(table.name), f"<!-- discussion: {table.name} -->"
    assert text.count(end) == 1 and text.count(begin) == 1, table.name
    between = text[text.index(end) + len(end) : text.index(begin)]
    assert not between.strip(), table.name  # the discussion follows its section
    assert text.index(f"<!-- /discussion: {table.name} -->") > text.index(begin), table.name


def test_every_params_row_has_a_tolerance_and_every_family_is_listed():
  assert all(0 < row.tolerance <= 0.05 for row in param_counts.PAPER)
  papers = {row.config.split(":")[0].split("/")[-1].removesuffix(".py") for row in param_counts.PAPER}
  assert {"transformer_vq", "latte", "flash", "fit_ar", "block_transformer", "transformer"} <= papers


def test_data_path_names_the_missing_folder(tmp_path):
  with pytest.raises(common.DataError, match="pass --data_dir"):
    common.data_path(common.Context(), "enwik8")
  with pytest.raises(common.DataError, match="enwik8"):
    common.data_path(common.Context(data_dir=tmp_path), "enwik8")
  (tmp_path / "enwik8").mkdir()
  assert common.data_path(common.Context(data_dir=pathlib.Path(tmp_path)), "enwik8") == tmp_path / "enwik8"


def test_the_printed_command_leaves_out_where_it_was_pasted():
  assert reproduce.without_out(["--table", "params", "--out", "docs/results.md", "--full"]) == [
    "--table",
    "params",
    "--full",
  ]
  assert reproduce.without_out(["--out=x.md", "--table=params"]) == ["--table=params"]


def test_tpu_fit_covers_every_paper_config_on_a_known_slice_with_distinct_records():
  from lra_core.compilation import topologies
  from lra_core.reproduce import tpu

  specs = [row.spec for row in tpu.paper_rows()]
  assert specs == [row.config for row in param_counts.PAPER]
  slugs = {row.slug(rung) for row in tpu.FULL_ROWS for rung in tpu.LADDER}
  assert len(slugs) == len(tpu.FULL_ROWS) * len(tpu.LADDER)  # a long name never makes two settings share a record
  for row in tpu.FULL_ROWS:
    assert row.topology in topologies.known_topologies(), row
    assert row.rungs()[:2] == tpu.LADDER[:2]  # every row may try remat; micro-batches only where they split
  assert tpu.table6("vq", "shga", 8192).rungs() == tpu.LADDER[:2]  # batch 8 on 8 cores: no micro-batches
  table6 = [row for row in tpu.FULL_ROWS if row.paper.startswith("Transformer-VQ Table 6")]
  assert len(table6) == 3 * 4 * 2 and sum(row.paper_measured == "out of memory" for row in table6) == 8


def test_the_fit_tables_fail_a_row_whose_paper_run_would_exceed_peak():
  from lra_core.reproduce import tpu

  timed = tpu.Row("timed", "configs/c4/flash.py", "v4:2x4x4", paper_step_ms=50.0)
  rated = tpu.Row("rated", tpu.VQ, "v3:2x2", paper_tokens_per_s=80_000.0)
  unmeasured = tpu.Row("unmeasured", tpu.VQ, "v3:2x2")
  # Our step: 100 ms at 40% MFU; the paper's 50 ms would need 80% of peak for the same FLOPs.
  report = {"est_step_seconds": 0.1, "est_mfu": 0.4, "est_tokens_per_s": 40_000.0}
  assert tpu.paper_mfu(timed, report) == pytest.approx(0.8)
  assert tpu.paper_mfu(rated, report) == pytest.approx(0.8)  # twice our tokens/s
  assert tpu.paper_mfu(unmeasured, report) is None
  assert tpu.sanity_cell(timed, report) == "80%"
  fast = tpu.Row("fast", "configs/c4/flash.py", "v4:2x4x4", paper_step_ms=25.0)
  assert tpu.sanity_cell(fast, report) == "**fails: 160%**"
  refused = {"est_step_seconds": None, "est_mfu": None, "est_tokens_per_s": None}
  assert tpu.paper_mfu(timed, refused) is None and tpu.sanity_cell(timed, refused) == ""
  line = tpu.failed_rows([timed, fast, unmeasured, timed], [report, report, report, None])
  assert line.startswith("paper runs over 100% MFU under our FLOP count: 1 of 2 measured rows (fast)")


def test_the_fit_tables_name_the_commits_their_records_were_compiled_at():
  from lra_core.reproduce import tpu

  metas = [{"commit": "abc"}, {"commit": "abc"}, {}, {"commit": "def+changes"}]
  assert tpu.compiled_at(metas) == "`abc` (2 rows); `unrecorded` (1 row); `def+changes` (1 row)"


def test_the_published_tpu_fit_table_has_every_row_from_the_current_count():
  """docs/results.md's tpu_fit section: one row per default row, each with where its step goes, the
  sanity column, no paper run over 100% MFU, and no estimate left from before the convolution fix."""
  from lra_core.reproduce import tpu

  text = (PROJECT_ROOT / "docs" / "results.md").read_text()
  section = text[text.index("<!-- table: tpu_fit -->") : text.index("<!-- /discussion: tpu_fit -->")]
  assert "paper's MFU under our count" in section and "where the step goes" in section
  assert "**fails" not in section and "predates" not in section
  table = section[: section.index("<!-- /table: tpu_fit -->")]
  rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
  assert [line.split(" | ")[0][2:] for line in rows] == [row.paper for row in tpu.DEFAULT_ROWS]
  assert "paper runs over 100% MFU under our FLOP count: 0 of" in section


@pytest.mark.parametrize("limit", [1000, 70_000, 2**20 + 5, 2**26 + 1])
@pytest.mark.parametrize("start", [1024, 65536, 2**22])
@pytest.mark.parametrize("fixed, curve, unit", [(2.0, 1, 1), (0.5, 2, 1), (2.0, 1, 3)])
def test_the_long_context_search_pins_the_longest_length_between_a_fit_and_twice_it(limit, start, fixed, curve, unit):
  """`long_context.longest` against a fake compiler whose memory grows linearly (a linear-time family)
  or quadratically (full attention) and fits while the length is at most `limit` units: the answer is
  the largest unit x power of two under it, and both it and twice it were compiled (unit 3: FIT-AR's
  rows of 192-token groups)."""
  from lra_core.reproduce import long_context

  usable = 95.0
  per = (usable - fixed) / (unit * limit) ** curve

  def compile_at(t):
    assert t % unit == 0 and (t // unit) & (t // unit - 1) == 0, t  # unit x a power of two
    peak = fixed + per * t**curve
    return {"t": t, "report": {"fits": peak <= usable, "peak_gib": peak, "arguments_gib": fixed, "usable_gib": usable}}

  t, report, metas = long_context.longest(compile_at, unit * start, unit)
  tried = {m["t"]: m["report"]["fits"] for m in metas}
  expected = 2 ** (limit.bit_length() - 1) if limit >= long_context.SHORTEST else None
  expected = unit * min(expected, long_context.LONGEST) if expected else None
  assert t == expected and (report is None) == (t is None)
  if t is not None:
    assert tried[t] and (t == unit * long_context.LONGEST or tried[2 * t] is False)
  else:
    assert tried[unit * long_context.SHORTEST] is False
  assert len(metas) <= 2 + abs(((expected or 1024 * unit) // unit).bit_length() - start.bit_length())


def test_the_readme_counts_the_tables_there_are():
  readme = (PROJECT_ROOT / "README.md").read_text()
  assert f"# the {len(reproduce.TABLES)} tables" in readme


def test_plots_go_beside_the_markdown_or_under_the_workdir_never_into_the_project_by_default():
  assert reproduce.default_img_dir("docs/results.md", "runs/reproduce") == pathlib.Path("docs/img")
  assert reproduce.default_img_dir("", "runs/reproduce") == pathlib.Path("runs/reproduce/img")


# Runs scripts/reproduce.py in a process where importing matplotlib fails as when the plot extra is not installed.
WITHOUT_MATPLOTLIB = (
  "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'scripts/reproduce.py'; "
  "runpy.run_path('scripts/reproduce.py', run_name='__main__')"
)


def reproduce_without_matplotlib(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", WITHOUT_MATPLOTLIB, *argv], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
  )


def test_listing_the_tables_needs_no_matplotlib_and_a_table_that_plots_says_so_in_one_sentence():
  listed = reproduce_without_matplotlib("--list")
  assert listed.returncode == 0 and listed.stderr == "", listed.stderr[-3000:]
  assert all(t.name in listed.stdout for t in reproduce.TABLES)
  plotting = reproduce_without_matplotlib("--table", "vq_throughput")
  assert plotting.returncode == 2
  assert plotting.stderr.splitlines() == [
    "error: matplotlib is not installed; install the plot extra: pip install -e \".[plot]\"."
  ]
  assert [t.name for t in reproduce.TABLES if t.plots] == [
    "vq_throughput",
    "flash_latency",
    "flash_quality",
    "latte_runtime",
    "fit_scaling",
    "fit_interleave",
    "block_throughput",
  ]


def test_a_table_run_on_a_cpu_host_prints_no_accelerator_plugin_noise(tmp_path):
  """The table starts the backends inside the start-up filter (lra_core/runtime/quiet_start.py)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run(
    [sys.executable, "scripts/reproduce.py", "--table", "params", f"--workdir={tmp_path}"],
    cwd=PROJECT_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  if not quiet_start.has_accelerator():
    assert proc.stderr == ""
