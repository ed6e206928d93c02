"""Parameter counts of the paper configs, computed from shapes (jax.eval_shape), beside the papers'.

The command is scripts/param_counts.py (examples there), or `python -m lra_core.bench.param_counts`.

No parameters are allocated, so the 1.3B models count in seconds on a laptop.
"""

from __future__ import annotations

import argparse

import lra_core
from lra_core.models import latte, transformer_vq

BLOCK = "configs/c4/block_transformer.py"  # its paper counts non-embedding parameters
# (config spec, the paper's count, where the paper states it)
PAPER = [
    ("configs/enwik8/transformer_vq.py", 190e6, "Transformer-VQ Table 10, Enwik8"),
    ("configs/pg19/transformer_vq.py", 1.3e9, "Transformer-VQ Table 10, PG-19"),
    ("configs/imagenet64/transformer_vq.py", 190e6, "Transformer-VQ Table 10, ImageNet64 (small)"),
    ("configs/imagenet64/transformer_vq.py:large", 1.2e9, "Transformer-VQ Table 10, ImageNet64 (large)"),
] + [(f"configs/c4/latte.py:{variant}", count, f"Latte Table 1, {variant}")
     for variant, count in latte.PAPER_COUNTS.items()] + [
    ("configs/c4/flash.py", 112e6, "FLASH Table 8, FLASH (C4 MLM)"),
    ("configs/c4/flash_quad.py", 112e6, "FLASH Table 8, FLASH-Quad (C4 MLM)"),
    ("configs/c4/flash.py:performer", 110e6, "FLASH Table 8, Performer (C4 MLM)"),
    ("configs/c4/transformer.py:mlm", 110e6, "FLASH Table 8, Transformer (C4 MLM)"),
    ("configs/c4/transformer.py:mlm,plus", 110e6, "FLASH Table 8, Transformer+ (C4 MLM)"),
    ("configs/c4/transformer.py:mlm,plusplus", 110e6, "FLASH Table 8, Transformer++ (C4 MLM)"),
    ("configs/pg19/flash.py", 496e6, "FLASH Table 10, FLASH (PG-19)"),
    ("configs/pg19/flash.py:flash_quad", 496e6, "FLASH Table 10, FLASH-Quad (PG-19)"),
    ("configs/pg19/transformer.py:flash", 486e6, "FLASH Table 10, Transformer+ (PG-19)"),
    ("configs/pg19/transformer.py:flash,plusplus", 486e6, "FLASH Table 10, Transformer++ (PG-19)"),
    ("configs/imagenet64/fit_ar.py", 153e6, "FIT Table 4, FIT-AR (ImageNet64)"),
] + [  # Tables 2-4 print 5M / 19M / 85M; 2 nL (12 D^2 + 13 D) gives 4.7M / 18.9M / 85.1M
    (f"{BLOCK}:{size}", count, f"Block Transformer Table 3, block {size}, non-embedding")
     for size, count in (("5m", 4.7e6), ("19m", 18.9e6), ("85m", 85.1e6), ("302m", 302e6), ("805m", 805e6),
                         ("1.2b", 1.2e9))] + [
    (f"{BLOCK}:{size},vanilla", count, f"Block Transformer Table 2, vanilla {size}, non-embedding")
    for size, count in (("5m", 4.7e6), ("19m", 18.9e6), ("85m", 85.1e6), ("302m", 302e6))] + [
    (f"{BLOCK}:{size},megabyte", count, f"Block Transformer Table 4, MEGABYTE {size}, non-embedding")
    for size, count in (("5m", 4.7e6), ("19m", 18.9e6), ("85m", 85.1e6))]


def counts(config, spec: str = "") -> dict[str, int]:
  if config.model.name == "transformer_vq":
    return transformer_vq.parameter_counts(config)
  if spec.startswith(BLOCK):
    n = lra_core.registry.non_embedding_parameter_count(config)
    return {"params": n, "codebook": 0, "total": n}
  n = lra_core.registry.parameter_count(config)
  return {"params": n, "codebook": 0, "total": n}


def rows() -> list[dict]:
  out = []
  for spec, paper, source in PAPER:
    c = counts(lra_core.load_config(spec), spec)
    out.append(dict(spec=spec, source=source, paper=paper, **c, gap=(c["total"] - paper) / paper))
  return out


def table(records: list[dict]) -> str:
  lines = ["| config | paper | ours: trainable | codebooks (EMA) | total | gap |", "|---|---|---|---|---|---|"]
  for r in records:
    paper = f"{r['paper'] / 1e9:.3g}B" if r["paper"] >= 1e9 else f"{r['paper'] / 1e6:.3g}M"
    lines.append(f"| `{r['spec']}` | {paper} ({r['source']}) | {r['params']:,} | "
                 f"{r['codebook']:,} | {r['total']:,} | {100 * r['gap']:+.1f}% |")
  return "\n".join(lines)


def main(argv=None) -> None:
  argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
  print(table(rows()))


if __name__ == "__main__":
  main()
