"""Where a run writes: a local folder or a Cloud Storage URL (gs://bucket/path). No JAX import:
the launchers in scripts/ use this too.

Every file a run writes goes through `etils.epath` (what Orbax uses), so the same calls work
on a local disk and on gs://: checkpoints through Orbax and TensorStore, config.json,
metrics.jsonl, TensorBoard events and plots through the helpers here. Object stores have no
append and no atomic rename: a file here is written whole in one request (`write_text`,
`write_bytes`), which on gs:// is atomic (a reader sees the old object or the new one), and a
checkpoint step counts only once Orbax's commit marker is in it.

`problem(url)` checks a gs:// workdir before anything is written: the bucket exists, the
credentials are accepted, and the endpoint answers, within `REACH_SECONDS`, so a typo in a
bucket name is one line, not a 60-second client stall.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

SCHEMES = ("gs",)
# What a multi-host run's workdir must be.
SHARED = ("a gs://bucket/path URL, or one folder every host sees at the same path (Filestore, "
          "NFS, Lustre)")
# How long the check of a gs:// workdir may take (the clients retry a refused connection for
# ~30 s before they give up).
REACH_SECONDS = 15.0
CREDENTIALS_FIX = ("give this machine Cloud Storage credentials: `gcloud auth application-default "
                   "login` on a workstation, a service account on a VM "
                   "(GOOGLE_APPLICATION_CREDENTIALS=key.json)")


# How long one storage call (a read, a listing, a whole-file write of metrics, config, plots,
# TensorBoard events) may take before it counts as hung: an object store that stops answering
# leaves the client waiting forever (gcsfs has no deadline of its own). Runs set it from
# train.storage_timeout_s (`set_deadline`).
DEFAULT_DEADLINE_S = 120.0
_deadline_s = DEFAULT_DEADLINE_S
T = TypeVar("T")


def set_deadline(seconds: float) -> None:
  global _deadline_s  # pylint: disable=global-statement
  _deadline_s = float(seconds)


def deadline() -> float:
  """The seconds one storage call may take (`set_deadline`)."""
  return _deadline_s


def bounded(function: Callable[[], T], what: str, seconds: float | None = None) -> T:
  """function() in a daemon thread for at most `seconds` (the deadline when None): its result,
  or what it raised; past it TimeoutError (errno ETIMEDOUT, "no answer within N s") naming
  `what`, the call left running (a daemon thread cannot hold the process at exit)."""
  seconds = _deadline_s if seconds is None else seconds
  outcome: list = []

  def target():
    try:
      outcome.append((True, function()))
    except BaseException as e:  # pylint: disable=broad-except  # handed back to the caller
      outcome.append((False, e))

  thread = threading.Thread(target=target, name=f"storage: {what}", daemon=True)
  thread.start()
  thread.join(seconds)
  if not outcome:
    raise TimeoutError(errno.ETIMEDOUT, f"no answer within {seconds:g} s", what)
  ok, value = outcome[0]
  if not ok:
    raise value
  return value


def is_url(path: str) -> bool:
  return "://" in str(path)


def absolute(path: str) -> str:
  """A URL as given (no trailing slash); a local path made absolute."""
  path = str(path)
  return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
  return "/".join([str(base).rstrip("/"), *parts]) if is_url(base) else os.path.join(base, *parts)


def path(name: str):
  """`name` as an `etils.epath.Path` (local or gs://)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(name)


def exists(name: str) -> bool:
  return _remote(lambda: path(name).exists(), name)


def isdir(name: str) -> bool:
  return _remote(lambda: path(name).is_dir(), name)


def isfile(name: str) -> bool:
  return _remote(lambda: path(name).is_file(), name)


def _remote(function: Callable[[], T], name: str) -> T:
  """A call on an object store runs within the deadline (`bounded`); on a local disk as is."""
  return bounded(function, name) if is_url(name) else function()


def makedirs(name: str) -> None:
  """Creates a local folder and its parents; nothing on an object store (folders there are
  prefixes of the objects written into them)."""
  if not is_url(name):
    os.makedirs(name, exist_ok=True)


def read_text(name: str) -> str:
  return _remote(lambda: path(name).read_text(), name)


def read_bytes(name: str) -> bytes:
  return _remote(lambda: path(name).read_bytes(), name)


def write_text(name: str, text: str) -> None:
  """Writes the whole file at once: on gs:// one upload (atomic); on a local disk a temporary
  file renamed over `name`, so a reader never sees half of it."""
  write_bytes(name, text.encode())


def write_bytes(name: str, data: bytes) -> None:
  """Within the deadline (`bounded`) on an object store and on a local disk alike (a network
  file system can hang too)."""
  bounded(lambda: _write_bytes(name, data), name)


def _write_bytes(name: str, data: bytes) -> None:
  if is_url(name):
    path(name).write_bytes(data)
    return
  temporary = f"{name}.tmp"
  with open(temporary, "wb") as f:
    f.write(data)
  os.replace(temporary, name)


def cache_folder(url: str, kind: str) -> str:
  """The local folder that mirrors the gs:// folder `url` (Hugging Face weights, token shards:
  files read by memory map, which needs a local file):
  $XDG_CACHE_HOME/meshkit/<kind>/<url as a file name>-<hash> (~/.cache without
  XDG_CACHE_HOME). Delete it to get the space back; it is filled again on the next read."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  readable = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[-1]).strip("._")[:80]
  digest = hashlib.sha256(url.encode()).hexdigest()[:12]
  return os.path.join(root, "meshkit", kind, f"{readable}-{digest}")


def cached_copy(url: str, local: str, size: int) -> str:
  """`local`, a copy of the object `url` of `size` bytes. An existing copy of that size is
  reused (the size is all that is compared: an object rewritten with the same size needs its
  cache folder deleted); otherwise the object is streamed into a temporary file that is then
  renamed to `local`, so processes copying at once, or a copy cut short, never leave half a
  file under that name."""
  if os.path.isfile(local) and os.path.getsize(local) == size:
    return local
  print(f"copying {url} ({size / 2**20:,.1f} MiB) into {os.path.dirname(local)}",
        file=sys.stderr, flush=True)
  os.makedirs(os.path.dirname(local), exist_ok=True)
  partial = f"{local}.partial-{os.getpid()}-{threading.get_ident()}"
  try:
    with path(url).open("rb") as source, open(partial, "wb") as target:
      shutil.copyfileobj(source, target, 16 * 2**20)
    os.replace(partial, local)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return local


def bucket(url: str) -> str:
  return url.split("://", 1)[1].split("/", 1)[0]


def _syntax(workdir: str, flag: str) -> str | None:
  if not workdir:
    return f"{flag} is empty; give a directory for checkpoints and metrics"
  if not is_url(workdir):
    return None
  scheme = workdir.split("://", 1)[0]
  if scheme not in SCHEMES:
    return (f"{flag}={workdir}: {scheme}:// is not supported; use a gs://bucket/path URL or a "
            f"local or shared folder")
  if not bucket(workdir):
    return f"{flag}={workdir}: no bucket name; write it as gs://BUCKET/path"
  return None


def problem(workdir: str, flag: str = "--workdir", reach: bool = False) -> str | None:
  """Why `workdir` cannot be used, naming the fix; None when it can. With `reach`, a gs:// URL
  is also checked against Cloud Storage (bucket, credentials, network), within REACH_SECONDS."""
  if (why := _syntax(workdir, flag)) is not None:
    return why
  if reach and is_url(workdir):
    return reach_problem(workdir, flag)
  return None


def reach_problem(url: str, flag: str = "--workdir", seconds: float = REACH_SECONDS) -> str | None:
  """Lists one object under `url` and says what went wrong, if anything, within `seconds`."""
  outcome: list = []

  def probe():
    import logging  # pylint: disable=g-import-not-at-top
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs each refusal's traceback
    try:
      import gcsfs  # pylint: disable=g-import-not-at-top
      prefix = url.split("://", 1)[1].split("/", 1)[1:] or [""]
      from fsspec import asyn  # pylint: disable=g-import-not-at-top
      fs = gcsfs.GCSFileSystem()
      # One request, without gcsfs's retries (six, ~30 s of back-off for a refused
      # connection or an expired token): the answer, whatever it is, comes at once.
      once = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)
      if once is None:
        fs.call("GET", "b/{}/o", bucket(url), maxResults=1, prefix=prefix[0], json_out=True)
      else:
        asyn.sync(fs.loop, once, fs, "GET", "b/{}/o", bucket(url), maxResults=1,
                  prefix=prefix[0])
      outcome.append(None)
    except BaseException as e:  # pylint: disable=broad-except  # classified below
      outcome.append(e)

  thread = threading.Thread(target=probe, name=f"reach {url}", daemon=True)
  thread.start()
  thread.join(seconds)
  name = bucket(url)
  if thread.is_alive():
    return (f"{flag}={url}: Cloud Storage did not answer within {seconds:.0f} s; check this "
            f"machine's network (and STORAGE_EMULATOR_HOST, if set)")
  error = outcome[0]
  if error is None:
    return None
  text = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
  code = getattr(error, "code", None)
  if isinstance(error, FileNotFoundError) or code == 404:
    return (f"{flag}={url}: bucket {name!r} does not exist; create it "
            f"(gcloud storage buckets create gs://{name}) or fix the name")
  if code == 401 or "credentials" in text.lower() or type(error).__name__.endswith(
      "CredentialsError"):
    return f"{flag}={url}: Cloud Storage refused the credentials ({text}); {CREDENTIALS_FIX}"
  if isinstance(error, PermissionError) or code == 403 or "forbidden" in text.lower():
    return (f"{flag}={url}: permission denied on bucket {name!r} ({text}); grant this account "
            f"roles/storage.objectAdmin on it")
  if isinstance(error, (OSError, ConnectionError)) or "connect" in text.lower():
    return (f"{flag}={url}: Cloud Storage cannot be reached ({text}); check this machine's "
            f"network (and STORAGE_EMULATOR_HOST, if set)")
  return f"{flag}={url}: Cloud Storage failed ({type(error).__name__}: {text})"


def argument(text: str) -> str:
  """An argparse `type=` for --workdir in the launchers (the syntax only: the launcher's
  machine may have no access to the bucket; the hosts check it when they start)."""
  import argparse  # pylint: disable=g-import-not-at-top
  if (why := _syntax(text, "--workdir")) is not None:
    raise argparse.ArgumentTypeError(why.split(": ", 1)[-1] if text else why)
  return text
