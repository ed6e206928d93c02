"""The `params` table: parameter counts of every paper config against the five papers' tables.

Counts come from shapes (jax.eval_shape through lra_core/bench/param_counts.py), so the default and
--full runs are the same and the 1.3B models count on a laptop. The rows, tolerances and the reasons
for known gaps are the families' paper rows (their FAMILY records): the papers round their counts.
"""

from __future__ import annotations

from lra_core.bench import param_counts
from lra_core.markdown import markdown_table
from lra_core.reproduce.common import Context, Result


def _paper(count: float) -> str:
  return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


def params(ctx: Context) -> Result:
  del ctx  # shapes only: the same at every size
  records = param_counts.rows()
  rows, within = [], 0
  for r in records:
    tol = r["tolerance"]
    ok = abs(r["gap"]) <= tol
    within += ok
    rows.append(
      [
        f"`{r['spec']}`",
        r["source"],
        _paper(r["paper"]),
        f"{r['params']:,}",
        f"{r['codebook']:,}" if r["codebook"] else "-",
        f"{r['total']:,}",
        f"{100 * r['gap']:+.1f}%",
        f"{100 * tol:.0f}%",
        "yes" if ok else "**no**",
      ]
    )
  table = markdown_table(
    ["config", "paper (where)", "paper", "ours: trainable", "EMA codebooks", "total", "gap", "tolerance", "within"],
    rows,
  )
  setting = (
    "Parameter counts of the paper configs in `configs/`, computed from shapes with "
    "`jax.eval_shape` (nothing is allocated), against the count each paper prints. The "
    "tolerance is the one each model's issue set: Transformer-VQ, Latte and FIT 5%, FLASH 3%, "
    "Block Transformer 2%."
  )
  return Result(
    setting=setting, markdown=table, comparison=f"{within} of {len(records)} rows are within their paper's tolerance."
  )
