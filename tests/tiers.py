"""The quick tier (`pytest -m "not slow"`) keeps a few cases of a long parametrization; the full
suite runs them all."""

import pytest


def quick(cases, *, keep, ids=None):
  """pytest.params of `cases` (tuples for several argnames), the ones at indices `keep` in the
  quick tier and the rest marked slow; `ids` names them (a list, or a function of a case)."""
  keep = set(keep)
  out = []
  for i, case in enumerate(cases):
    name = ids[i] if isinstance(ids, (list, tuple)) else ids(case) if callable(ids) else None
    values = case if isinstance(case, tuple) else (case,)
    out.append(pytest.param(*values, id=name, marks=() if i in keep else pytest.mark.slow))
  return out
