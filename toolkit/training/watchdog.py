"""The hang watchdog: a process whose training makes no progress for `train.hang_timeout_s`
dumps every thread's Python stack, leaves a marker for a supervisor and exits HANG_EXIT.

On a pod the costly failure is a hang, not a crash: a process stuck in a collective, or in a
storage write with no deadline (gcsfs uploading metrics.jsonl to an object store that stopped
answering), sits at 0 % CPU with no output while every chip of the job idles. Each process
watches itself (no network, no peer): a daemon thread checks how long ago the loop last made
progress, which is

- a step completing on the devices: the loop hands each step's outputs to `step()` and the
  thread polls them (`jax.Array.is_ready`), so a loop that dispatches ahead and then waits in
  a device_get for many steps still shows progress while they complete;
- the loop finishing a phase that runs no train step: an eval, a periodic task, a checkpoint
  save, the end of the run (`beat()`), so each long legitimate phase gets a whole timeout.

It is armed by the first step that completes (the first step's execution may set up
collectives for minutes on a large pod; compiling happens before it), and `stop()` ends the
thread at the end of the run or on an exception. When it fires it prints one `error:` line
(the last completed step, the timeout) and every thread's stack (faulthandler) on stderr,
writes the same stacks to workdir/hang/process_<i>.txt and the marker
workdir/hang/process_<i>.json (MARKER_FIELDS), then `os._exit(HANG_EXIT)`: the main thread is
the stuck one, so no normal exit can happen. For a gs:// workdir the stacks are written first
to a local folder (`local_hang_folder`) and copied beside the marker. The workdir's storage may
be what hangs, so those writes get FILES_TIMEOUT_S, then the process exits regardless.
"""
from __future__ import annotations

import collections
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax

from toolkit import workdir as workdir_lib

# The exit status of a process the watchdog ended: sysexits.h's EX_TEMPFAIL ("a temporary
# failure; the user is invited to retry"), which a supervisor reads as "restart from the last
# checkpoint". Distinct from 1 (a mistake or failure), 2 (the command line), 130 (interrupted).
HANG_EXIT = 75
DEFAULT_TIMEOUT_S = 600.0  # AXLearn's fault-tolerance agent waits as long for step progress
# How long the stack file and the marker may take to write (the storage may be the hang).
FILES_TIMEOUT_S = 30.0
FOLDER = "hang"  # inside the workdir
# The marker's fields, for the supervisor that reads it.
MARKER_FIELDS = ("cause", "step", "process_index", "process_count", "time", "timeout_s",
                 "idle_s", "last_progress", "stacks", "exit_code", "pid", "host")
THREAD_NAME = "hang-watchdog"


def local_hang_folder(workdir: str) -> str:
  """Where this process writes its stack file: workdir/hang for a local workdir; for a gs://
  workdir $XDG_CACHE_HOME/meshkit/hang/<the URL as a file name> (~/.cache without it), since
  faulthandler writes to a local file descriptor."""
  if workdir_lib.is_url(workdir):
    return workdir_lib.cache_folder(workdir_lib.absolute(workdir), FOLDER)
  return os.path.join(workdir_lib.absolute(workdir), FOLDER)


def timeout_of(config) -> float:
  """train.hang_timeout_s (absent from configs saved before it existed: DEFAULT_TIMEOUT_S)."""
  return float(config.train.get("hang_timeout_s", DEFAULT_TIMEOUT_S))


def describe(config) -> str:
  """The start-up line."""
  timeout_s = timeout_of(config)
  if not timeout_s:
    return "hang watchdog: off (train.hang_timeout_s=0)"
  return (f"hang watchdog: {timeout_s:g} s without progress after the first step dumps the "
          f"stacks and exits {HANG_EXIT} (train.hang_timeout_s; 0 is off)")


class Watchdog:
  """Watches one process's training progress; `timeout_s` 0 is off (every method a no-op).

  The loop calls `step(n, outputs)` after dispatching step n, `beat(what)` after a phase
  that runs no step, and `stop()` when the run ends or fails. `exit_process` (os._exit
  but for tests) and `stream` (stderr) are how it exits and where it reports; `poll_s` is
  how often it looks."""

  def __init__(self, timeout_s: float = 0.0, workdir: str = "", process_index: int = 0,
               process_count: int = 1,
               exit_process: Callable[[int], Any] = os._exit,  # pylint: disable=protected-access
               stream: TextIO | None = None, poll_s: float | None = None):
    self.timeout_s = float(timeout_s)
    self.workdir = workdir
    self.process_index, self.process_count = process_index, process_count
    self._exit, self._stream = exit_process, stream
    self._poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, self.timeout_s / 10))
    self._in_flight: collections.deque = collections.deque()  # (step, outputs), oldest first
    self.completed_step: int | None = None  # the last step whose outputs were ready
    self._last_progress = time.monotonic()
    self._last_what = "start"
    self._armed = False
    self._stopping = threading.Event()
    self._lock = threading.Lock()  # the decision to fire vs stop()
    self._thread: threading.Thread | None = None
    self.fired = False

  @classmethod
  def for_run(cls, config, workdir: str) -> Watchdog:
    """This process's watchdog for a run of `config` (train.hang_timeout_s)."""
    return cls(timeout_of(config), workdir, jax.process_index(), jax.process_count())

  # --- the loop's side ------------------------------------------------------------------------

  def step(self, step: int, outputs: Any) -> None:
    """Step `step` was dispatched; it has completed once every array in `outputs` is ready.
    The first call starts the thread."""
    if not self.timeout_s or self._stopping.is_set():
      return
    self._in_flight.append((step, outputs))
    if self._thread is None:
      self._thread = threading.Thread(target=self._watch, name=THREAD_NAME, daemon=True)
      self._thread.start()

  def beat(self, what: str) -> None:
    """Progress without a step: the loop finished `what` (an eval, a save, ...)."""
    self._last_progress, self._last_what = time.monotonic(), what

  def stop(self) -> None:
    """Ends the thread: after this the watchdog never fires. If it has already begun to fire
    this waits for it (the process is exiting)."""
    with self._lock:
      self._stopping.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(FILES_TIMEOUT_S + 10)

  @property
  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  # --- the thread -----------------------------------------------------------------------------

  def _watch(self) -> None:
    while not self._stopping.wait(self._poll_s):
      self._collect_completed()
      if not self._armed or time.monotonic() - self._last_progress < self.timeout_s:
        continue
      with self._lock:
        if self._stopping.is_set():
          return
        self.fired = True
      self._fire(time.monotonic() - self._last_progress)
      return

  def _collect_completed(self) -> None:
    while self._in_flight and _ready(self._in_flight[0][1]):
      step, _ = self._in_flight.popleft()
      self.completed_step = step
      self.beat(f"step {step} completed")
      self._armed = True

  def _fire(self, idle_s: float) -> None:
    stream = self._stream if self._stream is not None else sys.stderr
    local = local_hang_folder(self.workdir)
    name = f"process_{self.process_index}"
    stacks = os.path.join(local, f"{name}.txt")
    where = f"process {self.process_index} of {self.process_count}"
    line = (f"error: hang: no progress for {idle_s:.1f} s (train.hang_timeout_s="
            f"{self.timeout_s:g}) on {where}; the last completed step is "
            f"{self.completed_step} (last progress: {self._last_what}); every thread's stack "
            f"follows and is in {stacks}; exiting with status {HANG_EXIT}")
    marker = {"cause": "hang", "step": self.completed_step,
              "process_index": self.process_index, "process_count": self.process_count,
              "time": time.time(), "timeout_s": self.timeout_s, "idle_s": round(idle_s, 3),
              "last_progress": self._last_what, "stacks": stacks, "exit_code": HANG_EXIT,
              "pid": os.getpid(), "host": socket.gethostname()}
    # Each report in a thread of its own, all within FILES_TIMEOUT_S: the stuck thread may
    # hold what one of them needs (stderr's lock, a pipe nobody reads, the workdir's mount).
    reports = [threading.Thread(target=_report, args=(stream, line), daemon=True,
                                name=f"{THREAD_NAME}-stderr"),
               threading.Thread(target=self._write_files, args=(stacks, name, marker),
                                daemon=True, name=f"{THREAD_NAME}-files")]
    deadline = time.monotonic() + FILES_TIMEOUT_S
    for report in reports:
      report.start()
    for report in reports:
      report.join(max(0.0, deadline - time.monotonic()))
    self._exit(HANG_EXIT)

  def _write_files(self, stacks: str, name: str, marker: dict) -> None:
    """The stack file, then the marker (and on gs:// the stacks beside it); errors are
    printed, not raised: the exit comes either way."""
    try:
      os.makedirs(os.path.dirname(stacks), exist_ok=True)
      with open(stacks, "w") as f:
        _dump_stacks(f)
      folder = workdir_lib.join(self.workdir, FOLDER)
      workdir_lib.makedirs(folder)
      if workdir_lib.is_url(self.workdir):
        with open(stacks) as f:
          workdir_lib.write_text(workdir_lib.join(folder, f"{name}.txt"), f.read())
      workdir_lib.write_text(workdir_lib.join(folder, f"{name}.json"),
                             json.dumps(marker, indent=1) + "\n")
    except Exception as e:  # pylint: disable=broad-except  # reported; the exit follows
      print(f"warning: hang: the stack file or marker could not be written ({e})",
            file=sys.stderr, flush=True)


def _report(stream: TextIO, line: str) -> None:
  try:
    print(line, file=stream, flush=True)
    _dump_stacks(stream)
  except (OSError, ValueError):  # a closed stream: the stack file and the marker still say it
    pass


def _ready(outputs: Any) -> bool:
  for leaf in jax.tree.leaves(outputs):
    try:
      if hasattr(leaf, "is_ready") and not leaf.is_ready():
        return False
    except Exception:  # pylint: disable=broad-except  # deleted or failed: not waiting on it
      pass
  return True


def _dump_stacks(stream: TextIO) -> None:
  """Every thread's stack (faulthandler: no locks taken, works whatever the stuck thread
  holds), after a line that names the threads faulthandler lists by their ids."""
  try:
    names = ", ".join(f"{t.ident:#018x} {t.name}" for t in threading.enumerate()
                      if t.ident is not None)  # None: a thread still starting
    stream.write(f"threads: {names}\n")
    stream.flush()
  except Exception:  # pylint: disable=broad-except  # the stacks matter more than their names
    pass
  try:
    stream.fileno()
  except (AttributeError, OSError, ValueError):  # a stream object without a descriptor
    stream = sys.__stderr__
  faulthandler.dump_traceback(stream, all_threads=True)
