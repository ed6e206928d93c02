"""Random access to a tensorflow-datasets dataset a user has prepared in array_record format.

No TensorFlow is needed: `tfds.data_source` reads array_record shards directly. Datasets are
never downloaded at run time; a missing preparation is an error that says how to prepare it.
"""

from __future__ import annotations

import os

from lra_core.errors import DataError, optional_import


def open_split(name: str, split: str, data_dir: str):
  """A random-access source over tfds `name` (e.g. "pg19", "c4/en") split `split`, which may
  carry a slice ("train[:90%]"). Records are dicts of numpy values; text comes as bytes."""
  tfds = optional_import("tensorflow_datasets", "tfds")  # imported here: the raw-file loaders never need it

  data_dir = os.path.expanduser(data_dir) if data_dir else None
  prepare = (
    f"prepare it with `tfds build {name.split('/')[0]} --file_format=array_record"
    f"{' --data_dir=' + data_dir if data_dir else ''}`, or read the release files instead"
  )
  where = data_dir or "~/tensorflow_datasets"
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # tfds raises many kinds for an unknown name or unreadable folder
    raise DataError(
      f"tfds dataset {name!r} cannot be opened under {where} ({str(e).strip().splitlines()[0]}); {prepare}."
    ) from e
  if not builder.is_prepared():
    raise DataError(f"tfds dataset {name!r} is not prepared under {where}; {prepare}.")
  try:
    return builder.as_data_source(split=split)
  except NotImplementedError as e:
    raise DataError(f"tfds dataset {name!r} under {where} is not in array_record format; {prepare}.") from e
  except ValueError as e:
    raise DataError(f"tfds dataset {name!r} has no split {split!r} ({e}).") from e


def text(value) -> str:
  """A tfds Text feature value (bytes) as str."""
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)
