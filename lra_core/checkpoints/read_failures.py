"""Quiet the fallout of a checkpoint read that failed.

When one array of an orbax restore cannot be read, orbax raises at once and closes its event loop
while TensorStore still reads the other arrays in its own threads. As those reads end they print,
for seconds afterwards, a traceback each on stderr: callbacks into the closed loop ("Event loop is
closed"), tasks whose error nobody retrieved, coroutines that failed as they were collected, each
with the array's whole TensorStore spec. One damaged checkpoint of a small model gave 65 KB of
them, burying the one line that says what happened (and which the caller reports anyway).

`install()`, called before every read, drops unraisable "Event loop is closed" errors (a callback
into a loop that has ended has no one to tell); `failed(directory)`, called after a read failed,
drops from then on unraisable errors and asyncio log records that name that checkpoint folder.
Everything else passes through unchanged.
"""

from __future__ import annotations

import logging
import sys
import threading

_failed: set[str] = set()
_lock = threading.Lock()


def install() -> None:
  """Puts the filters in place (once: again only if someone replaced sys.unraisablehook since)."""
  with _lock:
    if not getattr(sys.unraisablehook, "drops_read_fallout", False):
      sys.unraisablehook = _dropping(sys.unraisablehook)
      logging.getLogger("asyncio").addFilter(_keep_record)


def failed(directory) -> None:
  """Drops the leftover reads' messages about the checkpoint folder `directory` from now on."""
  install()
  text = str(directory)
  with _lock:
    _failed.add(text)
    path = text.split("://", 1)[1].partition("/")[2] if "://" in text else ""
    if path:  # an object store's TensorStore spec names the bucket and the path apart
      _failed.add(path)


def _names_a_failed_read(text: str) -> bool:
  return any(d in text for d in _failed)


def _is_fallout(exc: BaseException | None) -> bool:
  if exc is None:
    return False
  text = str(exc)
  return (isinstance(exc, RuntimeError) and text == "Event loop is closed") or _names_a_failed_read(text)


def _dropping(hook):
  def unraisable(info):
    if not _is_fallout(info.exc_value):
      hook(info)

  unraisable.drops_read_fallout = True
  return unraisable


def _keep_record(record: logging.LogRecord) -> bool:
  exc = record.exc_info[1] if record.exc_info else None
  return not (_is_fallout(exc) or _names_a_failed_read(record.getMessage()))
