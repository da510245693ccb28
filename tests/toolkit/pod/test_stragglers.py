"""The straggler report (toolkit/training/stragglers.py): which processes it names, and a
4-process job on 127.0.0.1 whose process 3 waits 40 ms longer for each batch (slow input, the
usual straggler) is named, and only it."""
from __future__ import annotations

import io
import json
import pathlib
import re
import sys

import pytest

from toolkit.pod import local as pod
from toolkit.training import stragglers

REPO = pathlib.Path(__file__).resolve().parents[3]
RUN_TIMEOUT_S = 300


def test_a_process_above_the_threshold_and_the_noise_floor_is_named():
  assert [s.process for s in stragglers.find([0.010, 0.011, 0.010, 0.030], 0.1)] == [3]
  [slow] = stragglers.find([0.010, 0.030], 0.1)  # two: the median is their mean
  assert (slow.process, round(slow.ratio, 3)) == (1, 1.5)
  assert stragglers.find([0.010, 0.011, 0.0105], 0.1) == []  # within 1.15x
  # 3x the median, but 2 ms on a 1 s step (< MIN_EXCESS of it): noise, not a straggler
  assert stragglers.find([0.001, 0.001, 0.003], 1.0) == []
  assert stragglers.find([0.0, 0.0, 0.0], 0.1) == []


def test_one_process_gathers_nothing():
  assert not stragglers.HostTimes(every=1).due(1)  # this process is the only one


# Process 3's command: the trainer with a slower batch wait (Interval.wait_for), nothing else.
_SLOW_INPUT = """
import runpy, sys, time
from toolkit.training import loop
wait_for = loop.Interval.wait_for
def slow_wait_for(self, batch_iter):
  time.sleep(0.04)
  return wait_for(self, batch_iter)
loop.Interval.wait_for = slow_wait_for
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__")
"""


@pytest.mark.slow  # 4 processes start and join: ~60 s on 2 cores
@pytest.mark.multiprocess
def test_a_process_with_slow_input_is_named_and_no_other(tmp_path):
  workdir = tmp_path / "w"
  out, err = io.StringIO(), io.StringIO()
  job = pod.Pod(4, 2, ["--config=experiments/lm.py:tiny", f"--workdir={workdir}",
                       "--config.train.steps=40", "--config.train.straggler_every=10",
                       "--config.train.eval_every=1000", "--config.train.sample_tokens=0"],
                out=out, err=err, grace_s=10)
  job.commands[3] = [sys.executable, "-c", _SLOW_INPUT, *job.commands[3][3:]]
  try:
    job.start()
    returncode = job.wait(timeout_s=RUN_TIMEOUT_S)
  finally:
    job.close()
  output = out.getvalue() + err.getvalue()
  assert returncode == 0, output[-5000:]
  named = re.findall(r"^\[p0\] straggler: process (\d+) spent ([\d.]+) ms per step .* over "
                     r"steps (\d+)-(\d+), ([\d.]+)x the median", output, re.M)
  assert {int(process) for process, *_ in named} == {3}, output[-5000:]
  assert len(named) >= 3, output[-5000:]  # of the 4 windows (1-10, ..., 31-40)
  for _, host_ms, *_ in named:
    assert float(host_ms) >= 40
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert {r["process"] for r in records if r["kind"] == "straggler"} == {3.0}
