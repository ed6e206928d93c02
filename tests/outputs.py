"""Reading a run's outputs back as a user's tools see them: metrics.jsonl and TensorBoard.

`logged_once(workdir)` checks that every (step, metric) appears once in metrics.jsonl and that
TensorBoard (its own event reader, which applies purge_step the way the UI does) shows each step of
each metric once with the same value, and returns {metric: [(step, value), ...]} without the timing
metrics (which differ between two runs of the same config).
"""

import collections
import math
import pathlib
import tempfile

from lra_core.run.metrics import read_metrics
from lra_core.runtime import fs

TIMING = ("step_time_s", "tokens_per_s", "mfu", "goodput")  # measured time: differs run to run


def tensorboard_scalars(workdir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} as TensorBoard shows them (read from a local copy of the events)."""
  from tensorboard.backend.event_processing import event_accumulator

  source = fs.path(workdir) / "tensorboard"
  with tempfile.TemporaryDirectory() as local:
    for f in source.glob("events.out.tfevents.*"):
      pathlib.Path(local, f.name).write_bytes(f.read_bytes())
    acc = event_accumulator.EventAccumulator(local, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logged_once(workdir) -> dict[str, list[tuple[int, float]]]:
  seen = collections.Counter()
  values = collections.defaultdict(list)
  for record in read_metrics(workdir):
    for k, v in record.items():
      if k != "step":
        seen[(record["step"], k)] += 1
        values[k].append((record["step"], v))
  repeated = [key for key, n in seen.items() if n > 1]
  assert not repeated, f"metrics.jsonl logs {repeated[:5]} more than once"
  shown = tensorboard_scalars(workdir)
  for tag, events in shown.items():
    steps = [s for s, _ in events]
    assert len(steps) == len(set(steps)), f"TensorBoard shows {tag} at steps {steps}"
    logged = dict(values[tag])
    assert steps == sorted(logged), (tag, steps, sorted(logged))
    for step, value in events:
      assert math.isclose(value, logged[step], rel_tol=1e-6, abs_tol=1e-6), (tag, step, value, logged[step])
  assert set(shown) == {k for k, v in values.items() if all(isinstance(x, (int, float)) for _, x in v)}
  return {k: v for k, v in values.items() if k not in TIMING}
