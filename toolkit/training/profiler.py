"""A profiler window: `train.profile_steps="10:15"` traces steps 10 to 14 with jax.profiler.

The trace goes to workdir/profile/plugins/profile/<time>/: `*.xplane.pb` for TensorBoard's
profile plugin / XProf (`tensorboard --logdir=WORKDIR/profile`) and `perfetto_trace.json.gz`
for https://ui.perfetto.dev. Steps are counted as in the progress line (step 1 is the first);
the window opens before step START runs and closes once step STOP - 1 has finished, so the
trace holds whole steps. A resumed run past START opens it at its first step.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import jax

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError


def parse_profile_steps(text: str, total_steps: int) -> tuple[int, int] | None:
  """(first step, step after the last) of `train.profile_steps` ("START:STOP"), or None."""
  if not text:
    return None
  start, sep, stop = str(text).partition(":")
  try:
    if not sep:
      raise ValueError
    first, end = int(start), int(stop)
  except ValueError:
    raise ConfigError(f"train.profile_steps={text!r} is not START:STOP; write e.g. "
                      f"--config.train.profile_steps=10:15 (steps 10 to 14), or '' for none"
                      ) from None
  if not 1 <= first < end <= total_steps + 1:
    raise ConfigError(f"train.profile_steps={text!r}: need 1 <= START < STOP <= train.steps + 1 "
                      f"= {total_steps + 1}; e.g. --config.train.profile_steps="
                      f"{min(2, total_steps)}:{min(2, total_steps) + 1}")
  return first, end


class StepProfiler:
  """Opens and closes the trace around the steps of the window; does nothing without one."""

  def __init__(self, window: tuple[int, int] | None, workdir: str,
               log: Callable[[str], None] = print):
    self.window, self.log = window, log
    self.directory = workdir_lib.join(workdir_lib.absolute(workdir), "profile")
    # gs://: JAX's profiler writes local files; they are uploaded when the trace closes.
    self._staging = None
    self.active = False

  def _trace_folder(self) -> str:
    if not workdir_lib.is_url(self.directory):
      return self.directory
    self._staging = tempfile.TemporaryDirectory(prefix="meshkit-profile-")
    return self._staging.name

  def before_step(self, step: int) -> None:
    """Call before dispatching step `step` (1-based)."""
    if self.window and not self.active and self.window[0] <= step < self.window[1]:
      jax.profiler.start_trace(self._trace_folder(), create_perfetto_trace=True)
      self.active = True

  def after_step(self, step: int, outputs) -> None:
    """Call after dispatching step `step`, with its outputs (waited for before closing)."""
    if self.active and step + 1 >= self.window[1]:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self._staging is not None:
        for folder, _, files in os.walk(self._staging.name):
          for name in files:
            local = os.path.join(folder, name)
            with open(local, "rb") as f:
              workdir_lib.write_bytes(workdir_lib.join(
                  self.directory, os.path.relpath(local, self._staging.name)), f.read())
        self._staging.cleanup()
        self._staging = None
      self.log(f"profile of steps {self.window[0]}-{self.window[1] - 1}: {self.directory} "
               f"(tensorboard --logdir={self.directory}, or its perfetto_trace.json.gz in "
               f"ui.perfetto.dev)")
