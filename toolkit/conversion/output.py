"""The output folder of an import or export: refused when it holds anything, written through
a temporary folder, so a failure leaves nothing behind.

A local folder is written as a sibling and renamed into place. A Cloud Storage folder
(gs://bucket/path) has no rename: it is written into a local temporary folder (under $TMPDIR)
and then each file is uploaded as one object; should an upload fail, the objects already
uploaded are deleted again.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from toolkit import workdir
from toolkit.errors import ConfigError

_UPLOAD_CHUNK_BYTES = 16 * 2**20


def check_empty(path: str, flag: str) -> None:
  """Refuses an output folder that exists and is not empty (or is a file); for a gs:// URL,
  also one that Cloud Storage refuses (bucket, credentials, network)."""
  if not path:
    raise ConfigError(f"{flag} is empty; give a folder that does not exist yet")
  if workdir.is_url(path):
    _check_empty_url(path, flag)
    return
  if os.path.isfile(path):
    raise ConfigError(f"{flag}={path!r} is a file; give a folder that does not exist yet")
  if os.path.isdir(path) and os.listdir(path):
    raise ConfigError(f"{flag}={path!r} exists and is not empty; give a new folder (nothing "
                      f"was written)")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise ConfigError(f"{flag}={path!r}: its parent folder {parent} does not exist; create it "
                      f"first")


def _check_empty_url(url: str, flag: str) -> None:
  if (why := workdir.problem(url, flag, reach=True)) is not None:
    raise ConfigError(why)
  if workdir.isfile(url):
    raise ConfigError(f"{flag}={url!r} is an object; give a folder that does not exist yet")
  if workdir.isdir(url) and any(True for _ in workdir.path(url).iterdir()):
    raise ConfigError(f"{flag}={url!r} exists and is not empty; give a new folder (nothing "
                      f"was written)")


@contextlib.contextmanager
def staged(path: str):
  """Yields a local temporary folder; on success its files become `path` (a local folder or a
  gs:// URL), on any error nothing is left of them."""
  if workdir.is_url(path):
    staging = tempfile.mkdtemp(prefix="meshkit-staged-")
    try:
      yield staging
      upload(staging, path)
    finally:
      shutil.rmtree(staging, ignore_errors=True)
    return
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


def upload(folder: str, url: str) -> list[str]:
  """Uploads every file under the local `folder` to `url` (one object each, streamed: a 2 GB
  safetensors shard is not held in memory); returns the object names. Should one fail, those
  already uploaded are deleted before the error propagates."""
  targets: list[str] = []
  try:
    for root, _, files in os.walk(folder):
      for name in sorted(files):
        relative = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
        target = workdir.join(url, relative)
        # Listed before the upload: a file object closed by an error still commits its part.
        targets.append(target)
        with open(os.path.join(root, name), "rb") as source, \
            workdir.path(target).open("wb") as sink:
          shutil.copyfileobj(source, sink, _UPLOAD_CHUNK_BYTES)
  except BaseException:
    for target in targets:
      with contextlib.suppress(OSError):
        workdir.path(target).unlink()
    raise
  return targets
