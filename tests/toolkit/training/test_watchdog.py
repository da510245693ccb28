"""The hang watchdog (toolkit/training/watchdog.py): a process without progress for
train.hang_timeout_s after its first completed step dumps every thread's stack, writes a marker
and exits HANG_EXIT; progress (steps completing, phases beating) keeps it quiet; it is quiet
before the first step completes and after `stop()`.

The unit tests run the watchdog in this process with timeouts under a second and an exit
function that records the status instead of ending pytest. The end-to-end test makes a real
`toolkit.train` hang in a storage write: it swaps a FIFO (no reader) in for metrics.jsonl
mid-run, so the next record's `open` blocks in the kernel as on a storage mount that stopped
answering."""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest

from experiments import lm
from tests import preloaded
from tests.toolkit.test_cli import RUN_TIMEOUT_S, TINY, _env
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib
from toolkit.training import watchdog as watchdog_lib

WAIT_S = 10  # bound on waiting for an exit that is due (a loaded machine)


class Outputs:
  """A step's outputs: complete once `done` is set (as jax.Array.is_ready reports)."""

  def __init__(self, ready: bool = True):
    self.done = threading.Event()
    if ready:
      self.done.set()

  def is_ready(self) -> bool:
    return self.done.is_set()


class Exits:
  """Stands in for os._exit: records the status, ends nothing."""

  def __init__(self):
    self.codes: list[int] = []
    self.called = threading.Event()

  def __call__(self, code: int) -> None:
    self.codes.append(code)
    self.called.set()


@pytest.fixture
def make(tmp_path):
  """make(timeout_s) -> (watchdog into tmp_path/run as process 3 of 4, its Exits); every
  watchdog made is stopped at the end."""
  made = []
  stderr = open(tmp_path / "stderr", "w")  # pylint: disable=consider-using-with

  def make_(timeout_s: float):
    exits = Exits()
    dog = watchdog_lib.Watchdog(timeout_s, str(tmp_path / "run"), process_index=3,
                                process_count=4, exit_process=exits, stream=stderr)
    made.append(dog)
    return dog, exits

  yield make_
  for dog in made:
    dog.stop()
  stderr.close()


def stuck_in_a_collective(release: threading.Event) -> None:
  release.wait(WAIT_S * 3)


def test_it_fires_after_the_timeout_with_the_stacks_and_the_marker(make, tmp_path):
  dog, exits = make(0.5)
  release = threading.Event()
  stuck = threading.Thread(target=stuck_in_a_collective, args=(release,), name="stuck")
  stuck.start()
  try:
    dog.step(1, Outputs())
    dog.step(2, Outputs())
    began = time.monotonic()
    assert exits.called.wait(WAIT_S)
    assert 0.5 <= time.monotonic() - began < 0.5 + WAIT_S
  finally:
    release.set()
    stuck.join()
  assert exits.codes == [watchdog_lib.HANG_EXIT] == [75]
  marker = json.loads((tmp_path / "run" / "hang" / "process_3.json").read_text())
  assert set(marker) == set(watchdog_lib.MARKER_FIELDS)
  assert (marker["cause"], marker["step"], marker["process_index"], marker["process_count"],
          marker["exit_code"], marker["timeout_s"]) == ("hang", 2, 3, 4, 75, 0.5)
  assert marker["last_progress"] == "step 2 completed" and marker["idle_s"] >= 0.5
  assert marker["stacks"] == str(tmp_path / "run" / "hang" / "process_3.txt")
  stacks = (tmp_path / "run" / "hang" / "process_3.txt").read_text()
  assert "in stuck_in_a_collective" in stacks
  assert f"{stuck.ident:#018x} stuck" in stacks  # faulthandler's thread ids, named
  stderr = (tmp_path / "stderr").read_text()
  first_line = stderr.splitlines()[0]
  assert re.fullmatch(
      r"error: hang: no progress for \d+\.\d s \(train.hang_timeout_s=0.5\) on process 3 of 4; "
      r"the last completed step is 2 \(last progress: step 2 completed\); every thread's "
      rf"stack follows and is in {re.escape(marker['stacks'])}; exiting with status 75",
      first_line), first_line
  assert "in stuck_in_a_collective" in stderr


def test_progress_keeps_it_quiet(make):
  dog, exits = make(0.8)
  dog.step(1, Outputs())
  # Steps dispatched ahead and completing one by one (the loop waits in a device_get), then
  # phases without steps: every 0.15 s something, for twice the timeout. The sleeps pace the
  # progress; they are what is tested.
  ahead = [Outputs(ready=False) for _ in range(6)]
  for step, outputs in enumerate(ahead, start=2):
    dog.step(step, outputs)
  for outputs in ahead:
    time.sleep(0.15)
    outputs.done.set()
  for what in ("eval at step 7", "periodic work at step 7", "checkpoint save at step 7",
               "the last checkpoint written", "the sample"):
    time.sleep(0.15)
    dog.beat(what)
  assert not exits.called.is_set()
  assert dog.completed_step == 7
  assert exits.called.wait(WAIT_S)  # and without progress it fires
  assert exits.codes == [75]


def test_it_is_quiet_until_the_first_step_completes(make, tmp_path):
  dog, exits = make(0.2)
  dog.beat("eval at step 0")
  first = Outputs(ready=False)  # the first step executing: minutes on a large pod
  dog.step(1, first)
  assert dog.running
  assert not exits.called.wait(1.0)  # 5 timeouts
  first.done.set()
  assert exits.called.wait(WAIT_S)
  marker = json.loads((tmp_path / "run" / "hang" / "process_3.json").read_text())
  assert marker["step"] == 1


def test_stop_ends_the_thread_and_it_never_fires(make):
  dog, exits = make(0.3)
  dog.step(1, Outputs())
  assert dog.running
  dog.stop()
  assert not dog.running
  assert watchdog_lib.THREAD_NAME not in [t.name for t in threading.enumerate()]
  dog.step(2, Outputs())  # a step after stop() starts nothing
  assert not dog.running
  assert not exits.called.wait(1.0)


def test_the_config_field_zero_is_off_and_it_is_range_checked(make, tmp_path):
  config = lm.get_config("tiny")
  assert config.train.hang_timeout_s == watchdog_lib.DEFAULT_TIMEOUT_S == 600
  assert watchdog_lib.describe(config) == (
      "hang watchdog: 600 s without progress after the first step dumps the stacks and exits "
      "75 (train.hang_timeout_s; 0 is off)")
  config.train.hang_timeout_s = -1.0
  with pytest.raises(ConfigError, match=r"train.hang_timeout_s=-1.0 must be a finite number "
                                        r">= 0 \(seconds without progress"):
    config_lib.check_ranges(config)
  config.train.hang_timeout_s = 0.0
  config_lib.check_ranges(config)
  assert watchdog_lib.describe(config) == "hang watchdog: off (train.hang_timeout_s=0)"
  dog = watchdog_lib.Watchdog.for_run(config, str(tmp_path))
  dog.step(1, Outputs())
  assert not dog.running and dog._thread is None  # pylint: disable=protected-access


def test_the_stacks_of_a_gs_workdir_are_written_locally(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  folder = watchdog_lib.local_hang_folder("gs://bucket/runs/lm/")
  assert folder.startswith(str(tmp_path / "cache" / "meshkit" / "hang") + os.sep)
  assert "bucket_runs_lm" in folder and "gs:" not in folder
  assert watchdog_lib.local_hang_folder("runs/lm") == os.path.abspath("runs/lm/hang")


@pytest.mark.slow  # a run, then the 5 s timeout: ~13 s; the default suite is at its budget
def test_a_training_run_that_hangs_in_a_storage_write_exits_75(tmp_path):
  """`toolkit.train` with log_every=1 and a 5 s timeout; after step 3's line metrics.jsonl
  becomes a FIFO, so the next record's write blocks: the process exits 75 within the timeout
  + 10 s, naming the stuck frame, with the marker and the stack file in the workdir."""
  timeout_s = 5
  workdir = tmp_path / "run"
  stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
  with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
    process = preloaded.start(
        "toolkit.train", [TINY, f"--workdir={workdir}", "--config.train.steps=100000",
                          "--config.train.log_every=1", "--config.train.eval_every=100000",
                          "--config.train.checkpoint_every=100000",
                          f"--config.train.hang_timeout_s={timeout_s}"],
        env=_env(), stdout=stdout, stderr=stderr)
    try:
      deadline = time.monotonic() + RUN_TIMEOUT_S
      while not re.search(r"^step 3/", stdout_path.read_text(), re.M):
        assert process.poll() is None, stdout_path.read_text() + stderr_path.read_text()
        assert time.monotonic() < deadline, "no progress line before the deadline"
        time.sleep(0.1)  # polling interval, not a wait for readiness
      os.mkfifo(tmp_path / "fifo")
      os.replace(tmp_path / "fifo", workdir / "metrics.jsonl")  # atomic: no write slips past
      hung = time.monotonic()
      try:
        returncode = process.wait(timeout=timeout_s + 10)
      except subprocess.TimeoutExpired:
        returncode = None
      detected_s = time.monotonic() - hung
    finally:
      if process.poll() is None:
        process.kill()  # by PID
        process.wait()
  output = stdout_path.read_text() + stderr_path.read_text()
  assert returncode == watchdog_lib.HANG_EXIT, output
  assert detected_s < timeout_s + 10, detected_s
  assert f"hang watchdog: {timeout_s} s without progress" in output
  errors = [line for line in stderr_path.read_text().splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "error: hang: no progress for " in errors[0], output
  assert "training/metrics.py\", line" in output and " in write\n" in output, output
  marker = json.loads((workdir / "hang" / "process_0.json").read_text())
  assert marker["cause"] == "hang" and marker["step"] >= 3 and marker["exit_code"] == 75
  assert " in write\n" in (workdir / "hang" / "process_0.txt").read_text()
