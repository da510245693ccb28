"""Goodput bookkeeping against a hand-made clock: phases, other, wall, the productive fraction."""
import json

import pytest

from toolkit.training import goodput as goodput_lib


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_phases_other_and_fraction_from_a_known_timeline():
  clock = Clock()
  goodput = goodput_lib.Goodput(clock)
  with goodput.phase("startup"):
    clock.now += 4.0
  with goodput.phase("compile"):
    clock.now += 10.0
  goodput.add("steps", 24.0)      # measured elsewhere (the loop's intervals)
  goodput.add("data_wait", 1.0)
  clock.now += 25.0
  with goodput.phase("eval"):
    clock.now += 3.0
  with goodput.phase("checkpoint"):
    clock.now += 2.0
  clock.now += 6.0                # plots, the sample: nobody's phase
  record = goodput.record()
  assert record["wall_seconds"] == 50.0
  assert record["other_seconds"] == 6.0
  assert record["productive_fraction"] == pytest.approx(24.0 / 50.0)
  assert goodput_lib.format_line(record) == (
      "goodput 48.0% of 50.0 s wall: start-up 4.0 s, compile 10.0 s, steps 24.0 s, "
      "data wait 1.0 s, eval 3.0 s, checkpointing 2.0 s, other 6.0 s")


def test_rollouts_count_as_productive_and_show_only_when_a_run_has_them():
  clock = Clock()
  goodput = goodput_lib.Goodput(clock)
  goodput.add("steps", 10.0)
  goodput.add("rollouts", 15.0)   # GRPO sampling its batches: work, not data wait
  goodput.add("data_wait", 0.5)
  clock.now += 50.0
  record = goodput.record()
  assert record["rollouts_seconds"] == 15.0
  assert record["other_seconds"] == 24.5
  assert record["productive_fraction"] == pytest.approx(25.0 / 50.0)
  assert goodput_lib.format_line(record) == (
      "goodput 50.0% of 50.0 s wall: start-up 0.0 s, compile 0.0 s, steps 10.0 s, "
      "rollouts 15.0 s, data wait 0.5 s, eval 0.0 s, checkpointing 0.0 s, other 24.5 s")
  assert "rollouts_seconds" not in _record()


def test_a_phase_that_raises_still_counts_and_unknown_phases_are_refused():
  clock = Clock()
  goodput = goodput_lib.Goodput(clock)
  with pytest.raises(ValueError), goodput.phase("eval"):
    clock.now += 2.5
    raise ValueError
  assert goodput.record()["eval_seconds"] == 2.5
  with pytest.raises(KeyError, match="unknown phase 'sampling'"):
    goodput.add("sampling", 1.0)


def _record() -> dict[str, float]:
  """The timeline above: start-up 4 s, compile 10 s, steps 24 s of 50 s wall."""
  clock = Clock()
  goodput = goodput_lib.Goodput(clock)
  goodput.add("startup", 4.0)
  goodput.add("compile", 10.0)
  goodput.add("steps", 24.0)
  clock.now += 50.0
  return goodput.record()


# Attempt 3 of a supervised job that started at t=1000 (unix); this attempt's process was
# launched at t=1060 and its Goodput began at t=1063 (3 s of imports).
JOB = {"attempt": 3, "job_started_unix": 1000.0, "attempt_started_unix": 1060.0,
       "hang_detection_s": 4.0, "restart_s": 9.0, "steps_trained_again": 5,
       "steps_trained_again_s": 0.8, "last_step": 40}


def test_a_supervised_runs_goodput_adds_the_jobs_lifetime_by_hand_numbers():
  record = _record()
  env = {goodput_lib.JOB_ENV: json.dumps(JOB)}
  # It restored step 30 (the attempt before logged step 40) and trained to step 100.
  job = goodput_lib.job_fields(record, 30, 100, 1063.0, 1113.0, env)
  assert job == pytest.approx({
      "job_attempt": 3, "job_wall_seconds": 113.0, "job_hang_detection_seconds": 4.0,
      "job_restart_seconds": 9.0 + 3.0 + 4.0 + 10.0,   # earlier + launch + start-up + compile
      "job_steps_trained_again": 5 + 10,
      "job_steps_trained_again_seconds": 0.8 + 10 * 24.0 / 70})
  assert goodput_lib.format_line({**record, **job}).endswith(
      "; the job (attempt 3): 113.0 s since it started, 4.0 s waiting out hangs, 26.0 s "
      "restarting and restoring, 15 step(s) trained again (~4.2 s)")


def test_the_first_attempt_has_no_restart_and_no_supervisor_means_no_job_fields():
  record = _record()
  first = {**JOB, "attempt": 1, "hang_detection_s": 0.0, "restart_s": 0.0,
           "steps_trained_again": 0, "steps_trained_again_s": 0.0, "last_step": 0}
  job = goodput_lib.job_fields(record, 0, 100, 1063.0, 1113.0,
                               {goodput_lib.JOB_ENV: json.dumps(first)})
  assert job["job_restart_seconds"] == 0.0 and job["job_steps_trained_again"] == 0
  for env in ({}, {goodput_lib.JOB_ENV: "not json"}, {goodput_lib.JOB_ENV: '{"attempt": 2}'},
              {goodput_lib.JOB_ENV: "[1, 2]"}):
    assert goodput_lib.job_fields(record, 0, 100, 1063.0, 1113.0, env) == {}, env
  assert "job" not in goodput_lib.format_line(record)
