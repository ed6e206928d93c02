"""Parameter counts of the paper configs, computed from shapes (jax.eval_shape), beside the papers'.

  python scripts/param_counts.py            # markdown table on stdout

The same command as `python -m lra_core.bench.param_counts`.

No parameters are allocated, so the 1.3B models count in seconds on a laptop.
"""

from __future__ import annotations

import lra_core
from lra_core import cli, registry
from lra_core.protocol import PaperRow

# Every family's paper rows (its FAMILY record), family by family.
PAPER: tuple[PaperRow, ...] = tuple(row for family in registry.families() for row in family.paper_rows)


def counts(config, row: PaperRow) -> dict[str, int]:
  """Trainable parameters, counted state (codebooks) and total; non-embedding where the paper counts so."""
  if row.counts == "non_embedding":
    n = registry.non_embedding_parameter_count(config)
    return {"params": n, "codebook": 0, "total": n}
  return registry.parameter_counts(config)


def rows() -> list[dict]:
  out = []
  for row in PAPER:
    c = counts(lra_core.load_config(row.config), row)
    out.append(
      dict(
        spec=row.config,
        source=row.source,
        paper=row.count,
        tolerance=row.tolerance,
        gap_reason=row.gap_reason,
        **c,
        gap=(c["total"] - row.count) / row.count,
      )
    )
  return out


def table(records: list[dict]) -> str:
  lines = ["| config | paper | ours: trainable | codebooks (EMA) | total | gap |", "|---|---|---|---|---|---|"]
  for r in records:
    paper = f"{r['paper'] / 1e9:.3g}B" if r["paper"] >= 1e9 else f"{r['paper'] / 1e6:.3g}M"
    lines.append(
      f"| `{r['spec']}` | {paper} ({r['source']}) | {r['params']:,} | "
      f"{r['codebook']:,} | {r['total']:,} | {100 * r['gap']:+.1f}% |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  cli.doc_parser("python scripts/param_counts.py", __doc__).parse_args(argv)
  print(table(rows()))


if __name__ == "__main__":
  main()
