"""The output folder of an import or export: refused when it holds anything, written through
a temporary sibling that is renamed into place, so a failure leaves nothing behind."""
from __future__ import annotations

import contextlib
import os
import shutil

from toolkit.errors import ConfigError


def check_empty(path: str, flag: str) -> None:
  """Refuses an output folder that exists and is not empty (or is a file)."""
  if not path:
    raise ConfigError(f"{flag} is empty; give a folder that does not exist yet")
  if os.path.isfile(path):
    raise ConfigError(f"{flag}={path!r} is a file; give a folder that does not exist yet")
  if os.path.isdir(path) and os.listdir(path):
    raise ConfigError(f"{flag}={path!r} exists and is not empty; give a new folder (nothing "
                      f"was written)")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise ConfigError(f"{flag}={path!r}: its parent folder {parent} does not exist; create it "
                      f"first")


@contextlib.contextmanager
def staged(path: str):
  """Yields a temporary folder beside `path`; on success it becomes `path`, on any error it
  is removed."""
  staging = f"{os.path.abspath(path).rstrip(os.sep)}.partial-{os.getpid()}"
  os.makedirs(staging)
  try:
    yield staging
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  if os.path.isdir(path):
    os.rmdir(path)  # empty, as check_empty made sure
  os.rename(staging, path)
