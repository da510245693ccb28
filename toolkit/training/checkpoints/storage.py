"""The storage a run writes to: checked before training, and every write failure (no space,
read-only, permissions, I/O errors) turned into one `StorageError` naming the folder and the
cause, with the partial files of a failed checkpoint removed and nothing left blocking exit.

Paths go through `etils.epath` where that is cheap, so the same calls work on an object store
once workdirs may live there (a rename there is a copy and a delete, see `set_aside`).
"""
from __future__ import annotations

import errno
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable

from etils import epath

from toolkit.errors import ConfigError

# What the operator does about each OS error; anything else: check the disk.
_FIX = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "raise the disk quota",
        errno.EROFS: "mount it writable or choose another --workdir",
        errno.EACCES: "make it writable for this user or choose another --workdir",
        errno.EPERM: "make it writable for this user or choose another --workdir",
        # workdir.bounded's deadline (train.storage_timeout_s) passed
        errno.ETIMEDOUT: "check the network and the storage service (STORAGE_EMULATOR_HOST, "
                         "if set) or raise train.storage_timeout_s"}
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]|\[Errno (\d+)\]")
# Folders Orbax writes into before it renames them to the step's name (local disks).
_TEMPORARY = ".orbax-checkpoint-tmp"
# What Orbax writes last into a step folder on an object store, where it cannot rename.
_COMMITTED = "commit_success.txt"


class StorageError(ConfigError):
  """The disk or folder a run writes to failed: full, read-only, no permission, I/O error. The
  operator fixes the storage and reruns the same command, which resumes."""


def os_error_code(error: BaseException) -> int | None:
  """The errno behind `error`: an OSError in its chain, or the code TensorStore writes into
  its messages ("[os_error_code='28']")."""
  seen = error
  while seen is not None:
    if isinstance(seen, OSError) and seen.errno:
      return seen.errno
    match = _OS_ERROR_CODE.search(str(seen))
    if match:
      return int(match.group(1) or match.group(2))
    seen = seen.__cause__ or seen.__context__
  return None


def cause(error: BaseException) -> str:
  """One short phrase for why `error` happened: the OS's words when there is an errno, else
  the first line of the innermost exception it chains to (Orbax wraps TensorStore's errors in
  messages that print the whole TensorStore spec)."""
  if isinstance(error, TimeoutError) and error.strerror:
    return error.strerror  # workdir.bounded's "no answer within N s"
  code = os_error_code(error)
  if code is not None:
    return os.strerror(code)
  while error.__cause__ is not None:
    error = error.__cause__
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def fix(error: BaseException) -> str:
  return _FIX.get(os_error_code(error), "check the disk (dmesg, df)")


def check_writable(directory: str) -> None:
  """Creates `directory` if needed and checks that this process may write there, without
  writing anything (a refused run leaves an existing workdir exactly as it was). A full disk
  shows only when a write fails; `free_space_warning` warns ahead."""
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise StorageError(f"{directory} cannot be created ({cause(e)}); {fix(e)}") from None
  if os.access(directory, os.W_OK | os.X_OK):
    return
  read_only = os.statvfs(directory).f_flag & os.ST_RDONLY
  code = errno.EROFS if read_only else errno.EACCES
  raise StorageError(f"{directory} is not writable ({os.strerror(code)}); {_FIX[code]}")


def free_space_warning(directory: str, needed_bytes: int) -> str | None:
  """A warning when the disk under `directory` has less than twice `needed_bytes` free (a new
  checkpoint is written beside the old ones before they are deleted)."""
  try:
    free = shutil.disk_usage(directory).free
  except OSError:
    return None  # an object store, or a path that does not exist yet: nothing to say
  if free >= 2 * needed_bytes:
    return None
  return (f"{directory} has {free / 2**20:,.1f} MiB free, less than twice a checkpoint "
          f"({needed_bytes / 2**20:,.1f} MiB); saves may fail with no space left")


def remove_partial(directory: str) -> list[str]:
  """Removes the folders of unfinished saves in `directory`; returns their names.

  On local disks Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when
  complete, so those folders are exactly the partial checkpoints. On an object store (gs://)
  Orbax writes in place and marks a complete step with commit_success.txt last: a partial step
  is a step folder without it (Orbax ignores it; a save of the same step later would write
  over its leftovers). Folders that cannot be removed (a read-only disk) are left: Orbax never
  reads them, and the next run's manager removes them at start."""
  removed = []
  in_place = "://" in str(directory)
  try:
    entries = list(epath.Path(directory).iterdir())
  except OSError:
    return removed
  for entry in entries:
    if _TEMPORARY in entry.name or (in_place and entry.name.isdigit()
                                    and not (entry / _COMMITTED).exists()):
      try:
        entry.rmtree()
        removed.append(entry.name)
      except OSError:
        pass
  return removed


def set_aside(directory: str, step: int) -> str:
  """Moves step folder `directory/<step>` to `<parent>/damaged_checkpoints/<step>` (never
  deleting it: an operator may still want to look) and returns where it went. A rename on a
  local disk; on an object store epath copies and deletes, which takes as long as the copy."""
  source = epath.Path(directory) / str(step)
  target_dir = epath.Path(directory).parent / "damaged_checkpoints"
  try:
    target_dir.mkdir(parents=True, exist_ok=True)
    target, n = target_dir / str(step), 1
    while target.exists():
      n += 1
      target = target_dir / f"{step}.{n}"
    source.rename(target)
  except OSError as e:
    raise StorageError(f"checkpoint step {step} in {directory} is damaged and cannot be moved "
                       f"to {target_dir} ({cause(e)}); {fix(e)}, or move it away by hand"
                       ) from None
  return str(target)


class Writer:
  """One daemon thread that runs submitted writes in order, so the caller does not wait for
  them. The first failure is kept in `failure` (later writes still run: each reports its own);
  being a daemon, the thread never holds the process at exit."""

  def __init__(self, name: str):
    self.name, self.failure = name, None
    self._jobs: queue.Queue = queue.Queue()
    self._pending = 0
    self._done = threading.Condition()
    self._thread: threading.Thread | None = None

  def submit(self, job: Callable[[], object]) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
      self._thread.start()
    with self._done:
      self._pending += 1
    self._jobs.put(job)

  def _run(self) -> None:
    while True:
      job = self._jobs.get()
      try:
        job()
      except BaseException as e:  # pylint: disable=broad-except  # kept for the caller
        self.failure = self.failure or e
      finally:
        with self._done:
          self._pending -= 1
          self._done.notify_all()

  def wait(self, timeout_s: float | None = None) -> bool:
    """Waits until every submitted write has run; False if `timeout_s` passed first."""
    with self._done:
      return self._done.wait_for(lambda: self._pending == 0, timeout_s)


class KeptFailure:
  """The first failure of the writes one owner queued on a Writer, raised by the owner's next
  save or wait (the thread cannot raise it to anyone)."""

  def __init__(self):
    self.failure: BaseException | None = None

  def run(self, write: Callable[[], object]) -> None:
    try:
      write()
    except BaseException as e:  # pylint: disable=broad-except  # raised by raise_if_any
      self.failure = self.failure or e

  def raise_if_any(self) -> None:
    if self.failure is not None:
      raise self.failure


def call_bounded(function: Callable[[], object], seconds: float, what: str) -> BaseException | None:
  """Runs `function` in a daemon thread for at most `seconds`; returns what it raised, a
  TimeoutError if it did not finish (it is left running, but cannot hold the process), or
  None."""
  outcome: list = []

  def target():
    try:
      function()
      outcome.append(None)
    except BaseException as e:  # pylint: disable=broad-except  # handed back to the caller
      outcome.append(e)

  thread = threading.Thread(target=target, name=f"bounded: {what}", daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    return TimeoutError(f"{what} did not finish within {seconds:.0f} s")
  return outcome[0]
