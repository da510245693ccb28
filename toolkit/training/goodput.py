"""Goodput: where a run's wall time went, and the productive fraction of it.

The loop times its phases into one `Goodput`: start-up (validation, the workdir, restoring
or creating the state), compile, steps (the train steps themselves), data wait (the loop
blocked on the next batch), eval, checkpointing (saves, and waiting for the last one to
finish) and other (what is left: plots, the sample at the end, logging). A run whose batches
are its own work adds rollouts (GRPO sampling and scoring its batches from the model being
trained), which would otherwise be data wait. Productive time is the steps' and the
rollouts'; the fraction is that over the wall time. One line at the end of every run and a
`"kind": "goodput"` record in metrics.jsonl (toolkit.training.metrics) carry it.

Under `toolkit.supervise` a run is one attempt of a job that may have failed and restarted
before. The supervisor hands each attempt what the attempts before it cost (JOB_ENV), and the
line and record add the job's lifetime (`job_fields`): its wall time so far, the time spent
waiting out hangs, restarting and restoring (this attempt's start-up and compile included),
and the steps trained again (this attempt's: those between the step it restored and the last
step the attempt before it logged).
"""
from __future__ import annotations

import contextlib
import json
import os
import time

# (record field, how the line names it), in the order of a run.
PHASES = (("startup", "start-up"), ("compile", "compile"), ("steps", "steps"),
          ("data_wait", "data wait"), ("eval", "eval"), ("checkpoint", "checkpointing"))
# Set by toolkit.pod.supervisor for each attempt it starts: a JSON object with attempt (1, 2,
# ...), job_started_unix and attempt_started_unix (time.time() when the job and this attempt
# started: before this process was launched), hang_detection_s, restart_s (the restarts before
# this attempt, each from the failure to the next attempt's first step, and the delay before
# this one), steps_trained_again and steps_trained_again_s (the earlier restarts'), and
# last_step (the last step the attempt before logged; 0 for the first).
# Phases a run has only when it uses them (in the record and the line only then), and the
# phases that count as productive.
OPTIONAL_PHASES = (("rollouts", "rollouts"),)
PRODUCTIVE = ("steps", "rollouts")
JOB_ENV = "MESHKIT_JOB"
_JOB_KEYS = ("attempt", "job_started_unix", "attempt_started_unix", "hang_detection_s",
             "restart_s", "steps_trained_again", "steps_trained_again_s", "last_step")


class Goodput:
  """Seconds per phase since construction (the start of the run)."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self.start = clock()
    self.started_unix = time.time()  # for job_fields: comparable with another process's
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
    if name not in self.seconds and name not in dict(OPTIONAL_PHASES):
      names = [n for n, _ in PHASES + OPTIONAL_PHASES]
      raise KeyError(f"unknown phase {name!r}; one of {', '.join(names)}")
    self.seconds[name] = self.seconds.get(name, 0.0) + seconds

  def record(self) -> dict[str, float]:
    """The metrics.jsonl fields: `<phase>_seconds`, other_seconds, wall_seconds and
    productive_fraction ((steps + rollouts) / wall)."""
    wall = self._clock() - self.start
    record = {f"{name}_seconds": seconds for name, seconds in self.seconds.items()}
    record["other_seconds"] = max(0.0, wall - sum(self.seconds.values()))
    record["wall_seconds"] = wall
    productive = sum(self.seconds.get(name, 0.0) for name in PRODUCTIVE)
    record["productive_fraction"] = productive / wall if wall > 0 else 0.0
    return record


def job_fields(record: dict[str, float], start_step: int, final_step: int,
               run_started_unix: float, now_unix: float, environ=None) -> dict[str, float]:
  """The job's lifetime fields for this run's goodput `record` (steps `start_step` to
  `final_step`; the Goodput began at `run_started_unix`, it is `now_unix`), from the
  supervisor's JOB_ENV; {} when no supervisor started this run (or its value is not what the
  supervisor writes)."""
  text = (os.environ if environ is None else environ).get(JOB_ENV, "")
  try:
    job = {key: float(json.loads(text)[key]) for key in _JOB_KEYS}
  except (ValueError, KeyError, TypeError):
    return {}
  restarted = job["attempt"] > 1
  again = max(0, int(job["last_step"]) - start_step) if restarted else 0
  per_step = record["steps_seconds"] / (final_step - start_step) if final_step > start_step else 0
  # A restart lasts until its first step: the process's launch and imports (before this
  # Goodput began), then its start-up and compile.
  restart = job["restart_s"] + (
      max(0.0, run_started_unix - job["attempt_started_unix"]) + record["startup_seconds"]
      + record["compile_seconds"] if restarted else 0.0)
  return {"job_attempt": int(job["attempt"]),
          "job_wall_seconds": max(0.0, now_unix - job["job_started_unix"]),
          "job_hang_detection_seconds": job["hang_detection_s"],
          "job_restart_seconds": restart,
          "job_steps_trained_again": int(job["steps_trained_again"]) + again,
          "job_steps_trained_again_seconds": job["steps_trained_again_s"] + again * per_step}


def format_line(record: dict[str, float]) -> str:
  """`goodput 61.2% of 95.3 s wall: start-up 4.1 s, compile 12.0 s, steps 58.3 s, ...`, and
  the job's lifetime after it when `record` has `job_fields`."""
  shown = [phase for name, label in PHASES  # the optional ones after the steps, when used
           for phase in ((name, label), *(OPTIONAL_PHASES if name == "steps" else ()))]
  parts = [f"{label} {record[f'{name}_seconds']:.1f} s"
           for name, label in shown if f"{name}_seconds" in record]
  parts.append(f"other {record['other_seconds']:.1f} s")
  line = (f"goodput {record['productive_fraction']:.1%} of {record['wall_seconds']:.1f} s "
          "wall: " + ", ".join(parts))
  if "job_attempt" in record:
    line += (f"; the job (attempt {record['job_attempt']}): {record['job_wall_seconds']:.1f} s "
             f"since it started, {record['job_hang_detection_seconds']:.1f} s waiting out "
             f"hangs, {record['job_restart_seconds']:.1f} s restarting and restoring, "
             f"{record['job_steps_trained_again']} step(s) trained again "
             f"(~{record['job_steps_trained_again_seconds']:.1f} s)")
  return line
