"""Markdown tables, as the benchmarks, sweeps and result tables print them."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A markdown table; cells are str()-ed, None becomes '-'."""
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  for row in rows:
    if len(row) != len(header):
      raise ValueError(f"row {row!r} has {len(row)} cells for {len(header)} columns.")
    lines.append("| " + " | ".join("-" if c is None else str(c) for c in row) + " |")
  return "\n".join(lines)
