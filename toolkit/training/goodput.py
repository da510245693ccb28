"""Goodput: where a run's wall time went, and the productive fraction of it.

The loop times its phases into one `Goodput`: start-up (validation, the workdir, restoring
or creating the state), compile, steps (the train steps themselves), data wait (the loop
blocked on the next batch), eval, checkpointing (saves, and waiting for the last one to
finish) and other (what is left: plots, the sample at the end, logging). Productive time is
the steps' time; the fraction is steps / wall time. One line at the end of every run and a
`"kind": "goodput"` record in metrics.jsonl (toolkit.training.metrics) carry it.
"""
from __future__ import annotations

import contextlib
import time

# (record field, how the line names it), in the order of a run.
PHASES = (("startup", "start-up"), ("compile", "compile"), ("steps", "steps"),
          ("data_wait", "data wait"), ("eval", "eval"), ("checkpoint", "checkpointing"))


class Goodput:
  """Seconds per phase since construction (the start of the run)."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self.start = clock()
    self.seconds = {name: 0.0 for name, _ in PHASES}

  @contextlib.contextmanager
  def phase(self, name: str):
    """Times the block into phase `name`."""
    began = self._clock()
    try:
      yield
    finally:
      self.add(name, self._clock() - began)

  def add(self, name: str, seconds: float) -> None:
    if name not in self.seconds:
      raise KeyError(f"unknown phase {name!r}; one of {', '.join(self.seconds)}")
    self.seconds[name] += seconds

  def record(self) -> dict[str, float]:
    """The metrics.jsonl fields: `<phase>_seconds`, other_seconds, wall_seconds and
    productive_fraction (steps / wall)."""
    wall = self._clock() - self.start
    record = {f"{name}_seconds": seconds for name, seconds in self.seconds.items()}
    record["other_seconds"] = max(0.0, wall - sum(self.seconds.values()))
    record["wall_seconds"] = wall
    record["productive_fraction"] = self.seconds["steps"] / wall if wall > 0 else 0.0
    return record


def format_line(record: dict[str, float]) -> str:
  """`goodput 61.2% of 95.3 s wall: start-up 4.1 s, compile 12.0 s, steps 58.3 s, ...`."""
  parts = [f"{label} {record[f'{name}_seconds']:.1f} s" for name, label in PHASES]
  parts.append(f"other {record['other_seconds']:.1f} s")
  return (f"goodput {record['productive_fraction']:.1%} of {record['wall_seconds']:.1f} s wall: "
          + ", ".join(parts))
