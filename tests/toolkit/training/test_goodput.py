"""Goodput bookkeeping against a hand-made clock: phases, other, wall, the productive fraction."""
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


def test_a_phase_that_raises_still_counts_and_unknown_phases_are_refused():
  clock = Clock()
  goodput = goodput_lib.Goodput(clock)
  with pytest.raises(ValueError), goodput.phase("eval"):
    clock.now += 2.5
    raise ValueError
  assert goodput.record()["eval_seconds"] == 2.5
  with pytest.raises(KeyError, match="unknown phase 'sampling'"):
    goodput.add("sampling", 1.0)
