"""Straggler report: with several processes, one slow host holds every other in each
collective, and the job's step time is its step time; nothing else in the log says which host
it is. Each process adds up its own host time per step (the wall time of the loop before it
hands the step to the devices: waiting for its batch, placing it, its Python), every
`train.straggler_every` steps the processes gather those means (a collective, at the same step
on every process), and a process whose mean is above THRESHOLD x the median is named in one
log line and a `straggler` record of metrics.jsonl. Host time excludes the device work and the
collectives, which a slow peer stretches on every process alike.

Small differences are noise, not stragglers: a process is named only when its excess over the
median is also at least MIN_EXCESS of the window's step time (a 0.2 ms lead on a 2 s step is
not worth a line).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

THRESHOLD = 1.15  # Levanter's and MaxText's habit: a host 15 % slower than the median
MIN_EXCESS = 0.02  # of the step time: below it, the lead is noise


@dataclasses.dataclass(frozen=True)
class Straggler:
  process: int
  host_seconds: float  # its mean host time per step over the window
  median_seconds: float  # the median over the processes

  @property
  def ratio(self) -> float:
    return self.host_seconds / self.median_seconds if self.median_seconds else float("inf")


def find(host_seconds: Sequence[float], step_seconds: float,
         threshold: float = THRESHOLD) -> list[Straggler]:
  """The processes whose mean host time per step is above `threshold` x the median, by at
  least MIN_EXCESS of `step_seconds` (the window's wall time per step)."""
  median = statistics.median(host_seconds)
  return [Straggler(i, seconds, median) for i, seconds in enumerate(host_seconds)
          if seconds > threshold * median and seconds - median >= MIN_EXCESS * step_seconds]


class HostTimes:
  """This process's host time per step since the last report; `every` 0 (or one process)
  turns the report off (then nothing is gathered)."""

  def __init__(self, every: int, first_step: int = 0):
    self.every = every if jax.process_count() > 1 else 0
    self._seconds, self._steps, self._first = 0.0, 0, first_step + 1
    self._started = time.perf_counter()

  def add(self, seconds: float) -> None:
    self._seconds += seconds
    self._steps += 1

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def report(self, step: int) -> tuple[list[Straggler], str]:
    """Gathers every process's mean (call it at the same step on every process): the
    stragglers, and the window's steps as "A-B"."""
    steps = max(self._steps, 1)
    mean, wall = self._seconds / steps, (time.perf_counter() - self._started) / steps
    gathered = multihost_utils.process_allgather(np.float64(mean))
    window = f"{self._first}-{step}"
    self._seconds, self._steps, self._first = 0.0, 0, step + 1
    self._started = time.perf_counter()
    return find([float(s) for s in np.ravel(gathered)], wall), window


def line(straggler: Straggler, window: str) -> str:
  return (f"straggler: process {straggler.process} spent {straggler.host_seconds * 1e3:.1f} ms "
          f"per step before handing each step to its devices (its batch, its Python) over "
          f"steps {window}, {straggler.ratio:.2f}x the median {straggler.median_seconds * 1e3:.1f}"
          f" ms; every other process waits for it in each collective")


def record(straggler: Straggler) -> dict[str, float]:
  """Its metrics.jsonl record's values."""
  return {"process": float(straggler.process), "host_seconds": straggler.host_seconds,
          "median_seconds": straggler.median_seconds, "ratio": straggler.ratio}
