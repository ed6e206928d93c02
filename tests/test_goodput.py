"""Goodput (lra_core/run/goodput.py, also the command python -m lra_core.run.goodput): where a run's wall
time went, over every start of the trainer in its workdir, and the steps a restart trained again."""

import time

import pytest

import fixtures.listops
import lra_core
from lra_core import train
from lra_core.errors import ConfigError
from lra_core.run import goodput
from lra_core.run.metrics import read_metrics
from lra_core.train import train_and_evaluate

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")
RUN = [
  "train.test_at_end=False",
  "train.eval_batches=1",
  "train.steps=8",
  "train.checkpoint_every=4",
  "train.log_every=1",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return fixtures.listops.build(tmp_path_factory.mktemp("listops"))


def test_goodput_adds_up_to_the_wall_time_and_counts_the_steps_trained_again(data, tmp_path, monkeypatch, capsys):
  """A first start lost after step 6 (its checkpoint at 4), a second that resumes at 4 and finishes:
  the two ledgers' wall time is the measured one within 2%, their buckets add up to it, and the 2 steps
  trained again are the lost ones."""
  config = lra_core.load_config(fixtures.listops.SPEC, [*data, *RUN])
  workdir = tmp_path / "run"
  finish_log = train._finish_log

  def lost_at_step_6(task, sums, guard, meter, step):
    if step == 6:
      raise RuntimeError("the host was lost")
    return finish_log(task, sums, guard, meter, step)

  wall = 0.0  # of the two starts, each timed around its call: the time between starts is no start's
  with monkeypatch.context() as m:
    m.setattr(train, "_finish_log", lost_at_step_6)
    with pytest.raises(RuntimeError, match="the host was lost"):
      start = time.monotonic()
      try:
        train_and_evaluate(config, workdir)
      finally:
        wall += time.monotonic() - start
  start = time.monotonic()
  summary = train_and_evaluate(config, workdir)
  wall += time.monotonic() - start
  records = goodput.read(workdir)
  assert [(r["start_step"], r["last_step"]) for r in records] == [(0, 6), (4, 8)]
  total = goodput.summarize(records)
  assert total["lost_steps"] == 2 and total["invocations"] == 2
  assert total["wall_s"] == pytest.approx(wall, rel=0.02)
  parts = sum(total[f"{k}_s"] for k in (*goodput.BUCKETS, "other"))
  assert parts == pytest.approx(total["wall_s"], rel=1e-9)
  assert total["compile_s"] > 0 and total["restore_s"] > 0 and total["checkpoint_s"] > 0 and total["steps_s"] > 0
  assert 0 < total["lost_s"] < total["steps_s"] and 0 < total["goodput"] < 1
  assert summary["goodput"] == pytest.approx(total["goodput"], rel=0.05)
  assert [r["goodput"] for r in read_metrics(workdir) if "goodput" in r] == [summary["goodput"]]  # the last record
  goodput.main([f"--workdir={workdir}"])
  printed = capsys.readouterr().out
  assert "| 1 | 0-6 |" in printed and "| 2 | 4-8 |" in printed and "2 step(s) trained again after a restart" in printed


def test_a_workdir_without_ledgers_is_one_sentence(tmp_path):
  with pytest.raises(ConfigError, match=r"holds no goodput.json; give the workdir of a run"):
    goodput.main([f"--workdir={tmp_path}"])


def test_a_finished_length_evaluated_again_loses_no_steps():
  """An invocation that only evaluates (no steps) between two that train takes no steps from them."""
  seconds = dict.fromkeys((*goodput.BUCKETS, "other"), 1.0)
  records = [
    dict(started=1, wall_s=8.0, start_step=0, last_step=10, trains=True, seconds=seconds),
    dict(started=2, wall_s=8.0, start_step=6, last_step=6, trains=False, seconds=seconds),
    dict(started=3, wall_s=8.0, start_step=10, last_step=20, trains=True, seconds=seconds),
  ]
  assert goodput.summarize(records)["lost_steps"] == 0
