"""Dataset statistics and loader throughput for any config, on the data it points at.

  python -m lra_core.data.stats --config=configs/lra/text/transformer.py \
      --config.data.dir=/data/imdb [--splits=train,test] [--max_examples=0] [--throughput=2000]

Per split: examples, real tokens (non-padding input positions), label balance for classification,
the time to open the split (first open builds the loader's cache, later ones map it), random-access
reads per second, and examples per second through the batched, prefetching pipeline the trainer
uses (`--batch_size`, default the config's; at least 16 batches, timed from the iterator's start). Reading is
single-process; the pipeline reads with
`data.num_threads` threads.
"""

from __future__ import annotations

import collections
import json
import time

import numpy as np

from lra_core import cli
from lra_core import data as data_lib
from lra_core.data import pipeline

EXAMPLE = (
  "python -m lra_core.data.stats --config=configs/lra/listops/transformer.py \\\n"
  "      --config.data.dir=$DATA/lra/listops --splits=train,test --max_examples=1000"
)


def real_tokens(example: dict[str, np.ndarray]) -> int:
  """Non-padding input positions of one example."""
  if "mask" in example:
    return int(np.asarray(example["mask"]).sum())
  if "segment_ids" in example:
    return int((np.asarray(example["segment_ids"]) > 0).sum())
  weights = np.asarray(example["weights"])
  return int((weights > 0).sum()) if weights.ndim else int(np.asarray(example["inputs"]).size)


def split_stats(
  config, split: str, *, max_examples: int = 0, throughput: int = 2000, batch_size: int = 0, seed: int = 0
) -> dict:
  start = time.perf_counter()
  source = data_lib.make_source(config, split)
  open_s = time.perf_counter() - start
  n = len(source)
  scan = n if not max_examples else min(n, max_examples)
  tokens, labels = 0, collections.Counter()
  for i in range(scan):
    example = source[i]
    tokens += real_tokens(example)
    if source.info.num_classes:
      labels[int(example["targets"])] += 1
  rng = np.random.default_rng(seed)
  picks = rng.integers(0, n, size=throughput)
  start = time.perf_counter()
  for i in picks:
    source[int(i)]
  random_access = throughput / (time.perf_counter() - start)
  batch_size = batch_size or config.train.batch_size
  reader = pipeline.BatchReader(config, source, train=True, batch_size=batch_size, process_index=0, process_count=1)
  num_batches = max(16, throughput // batch_size)
  start = time.perf_counter()  # from the iterator's creation: threads and prefetch included
  iterator = pipeline.iterate(
    reader, 0, num_batches, num_threads=config.data.num_threads, prefetch=config.data.prefetch
  )
  for _ in range(num_batches):
    next(iterator)
  batched = num_batches * batch_size / (time.perf_counter() - start)
  example = source[0]
  out = {
    "split": split,
    "examples": n,
    "scanned": scan,
    "real_tokens": tokens,
    "tokens_per_example": tokens / max(scan, 1),
    "fields": {k: f"{v.dtype}{list(v.shape)}" for k, v in example.items()},
    "vocab_size": source.info.vocab_size,
    "open_s": round(open_s, 3),
    "random_access_per_s": round(random_access, 1),
    "pipeline_examples_per_s": round(batched, 1),
  }
  if labels:
    out["labels"] = {str(k): labels[k] for k in sorted(labels)}
    out["majority"] = max(labels.values()) / scan
  if "words" in example:
    out["words"] = float(sum(source[i]["words"].sum() for i in range(scan)))
  return out


def main(argv=None) -> None:
  def flags(parser):
    parser.add_argument("--splits", default="train,validation,test")
    parser.add_argument("--max_examples", type=int, default=0, help="examples scanned per split (0 = all)")
    parser.add_argument("--throughput", type=int, default=2000, help="examples read for the timings")
    parser.add_argument("--batch_size", type=int, default=0, help="pipeline batch (0 = train.batch_size)")

  def run():
    args = cli.parse(argv, default_workdir="", extra=flags, prog="python -m lra_core.data.stats", example=EXAMPLE)
    config, ns = args.config, args.extra
    data_lib.validate_config(config)
    for split in ns.splits.split(","):
      stats = split_stats(
        config, split, max_examples=ns.max_examples, throughput=ns.throughput, batch_size=ns.batch_size
      )
      print(json.dumps(dict(data=config.data.name, **stats)), flush=True)

  cli.run(run)


if __name__ == "__main__":
  main()
