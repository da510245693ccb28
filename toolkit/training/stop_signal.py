"""Stopping a run by signal: the first SIGTERM/SIGINT asks the loop to stop after the step it
is in (and save), a second one hurries that (no eval before the save, nothing after it), a
third exits at once."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax
from jax.experimental import multihost_utils

# The exit status of a run stopped by a second SIGINT/SIGTERM, as a shell reports Ctrl-C.
INTERRUPTED_EXIT = 128 + signal.SIGINT
# How long after a second signal the process waits for the step's checkpoint before it exits.
GRACE_S = 5.0


class StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits cleanly.

  With several processes all must stop after the same step, or the ones still training wait
  in a collective for the ones saving. JAX's runtime catches SIGTERM on any process and agrees
  with the others on a step (`reached_preemption_sync_point`, TPU maintenance events use it
  too), so SIGTERM is left to it and SIGINT is passed on to it as SIGTERM.

  A second signal (Ctrl-C twice) hurries the stop: the loop skips what it would still do
  before saving (an eval, periodic work; one process only, where they are no collective) and
  the run ends once the step is saved, without plots or a sample (`urgent`), exit status
  INTERRUPTED_EXIT. If no checkpoint is committed within GRACE_S the process exits anyway,
  as it does at once on a third signal, saving nothing more: the checkpoints already
  committed stay as they are (a save in flight never commits). `exit` is os._exit but for
  tests.

  Python runs a handler once for however many of a signal land while the main thread is in
  C (a step, a save), so Ctrl-C twice during a step would count once: each delivery is
  counted from the bytes the interpreter's C-level handler writes to the wakeup fd
  (`_Deliveries`).
  """

  def __init__(self, exit: Callable[[int], None] = os._exit,  # pylint: disable=redefined-builtin,protected-access
               grace_s: float = GRACE_S):
    self.requested = False
    self.urgent = False
    self.multiprocess = jax.process_count() > 1
    self._previous = {}
    self._signals = 0
    self._exit = exit
    self._grace_s = grace_s
    self._deliveries = None

  def __enter__(self):
    # The counter first: a signal our handler sees after it was installed has its byte.
    self._deliveries = _Deliveries.install()
    signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    # One call may stand for several deliveries; a later call may find its own delivery
    # already counted by an earlier one (then it has nothing left to do).
    count = 1 if self._deliveries is None else self._deliveries.take(signum)
    for _ in range(count):
      self._handle_one(signum)

  def _handle_one(self, signum) -> None:
    self._signals += 1
    name = signal.Signals(signum).name
    if self._signals == 2:
      self.urgent = True
      _say(f"received {name} again: saving this step and exiting; in {self._grace_s:g} s (or "
           f"at the next signal) without saving")
      threading.Thread(target=self._exit_after_grace, name="stop-signal grace",
                       daemon=True).start()
      return
    if self._signals > 2:
      self._exit_now(f"received {name} a third time")
      return
    if self.multiprocess:
      os.kill(os.getpid(), signal.SIGTERM)
      return
    self.requested = True
    if jax.process_index() == 0:
      print(f"received {name}: finishing this step, then saving", flush=True)

  def _exit_after_grace(self) -> None:
    time.sleep(self._grace_s)
    self._exit_now(f"no checkpoint committed {self._grace_s:g} s after the second signal")

  def _exit_now(self, why: str) -> None:
    _say(f"{why}: exiting now without saving; committed checkpoints are intact")
    self._exit(INTERRUPTED_EXIT)

  def should_stop(self, done: int) -> bool:
    """Whether to stop after step `done`; call it once per step, on every process."""
    if self.multiprocess:
      return multihost_utils.reached_preemption_sync_point(done)
    return self.requested

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    if self._deliveries is not None:
      self._deliveries.uninstall()


class _Deliveries:
  """Counts the deliveries of each signal: for every delivery to a signal with a Python
  handler, the interpreter's C-level handler writes the signal's number as one byte to the
  wakeup fd (`signal.set_wakeup_fd`), before the Python handler runs."""

  def __init__(self, read: int, write: int, previous: int):
    self._read, self._write, self._previous = read, write, previous
    self._counts: dict[int, int] = {}

  @classmethod
  def install(cls) -> _Deliveries | None:
    """The counter, or None where the wakeup fd is someone else's (an event loop's) or cannot
    be set (not the main thread): then each handler call counts as one delivery."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
      previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:
      previous = None
    if previous != -1:
      if previous is not None:
        signal.set_wakeup_fd(previous)
      os.close(read)
      os.close(write)
      return None
    return cls(read, write, previous)

  def take(self, signum: int) -> int:
    """The deliveries of `signum` not yet taken (the others are kept for their handlers)."""
    while True:
      try:
        data = os.read(self._read, 512)
      except BlockingIOError:
        break
      if not data:
        break
      for number in data:
        self._counts[number] = self._counts.get(number, 0) + 1
    return self._counts.pop(signum, 0)

  def uninstall(self) -> None:
    signal.set_wakeup_fd(self._previous)
    os.close(self._read)
    os.close(self._write)


def _say(line: str) -> None:
  """One line on stdout, from every process (each tells its own)."""
  print(line, flush=True)
  sys.stderr.flush()
