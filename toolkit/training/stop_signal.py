"""Stopping a run by signal: the first SIGTERM/SIGINT asks the loop to stop after the step it
is in (and save), a second one exits at once."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

import jax
from jax.experimental import multihost_utils

# The exit status of a run stopped by a second SIGINT/SIGTERM, as a shell reports Ctrl-C.
INTERRUPTED_EXIT = 128 + signal.SIGINT


class StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits cleanly.

  With several processes all must stop after the same step, or the ones still training wait
  in a collective for the ones saving. JAX's runtime catches SIGTERM on any process and agrees
  with the others on a step (`reached_preemption_sync_point`, TPU maintenance events use it
  too), so SIGTERM is left to it and SIGINT is passed on to it as SIGTERM.

  A second signal (Ctrl-C twice) exits at once with one line and INTERRUPTED_EXIT, saving
  nothing more: the checkpoints already committed stay as they are (a save in flight never
  commits). `exit` is os._exit but for tests.
  """

  def __init__(self, exit: Callable[[int], None] = os._exit):  # pylint: disable=redefined-builtin,protected-access
    self.requested = False
    self.multiprocess = jax.process_count() > 1
    self._previous = {}
    self._signals = 0
    self._exit = exit

  def __enter__(self):
    signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self._signals += 1
    if self._signals > 1:
      print(f"received {signal.Signals(signum).name} again: exiting now without saving; "
            f"committed checkpoints are intact", flush=True)
      sys.stderr.flush()
      self._exit(INTERRUPTED_EXIT)
      return
    if self.multiprocess:
      os.kill(os.getpid(), signal.SIGTERM)
      return
    self.requested = True
    if jax.process_index() == 0:
      print(f"received {signal.Signals(signum).name}: finishing this step, then saving",
            flush=True)

  def should_stop(self, done: int) -> bool:
    """Whether to stop after step `done`; call it once per step, on every process."""
    if self.multiprocess:
      return multihost_utils.reached_preemption_sync_point(done)
    return self.requested

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
