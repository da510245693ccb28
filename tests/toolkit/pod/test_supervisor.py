"""toolkit.supervise (toolkit/pod/supervisor.py): a job killed mid-run and then hung is
restarted twice and finishes with the losses of an uninterrupted run, each step once in
metrics.jsonl (the fault drill's jobs, scripts/dev/drill_faults.py); a mistake is not retried."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
import types

import pytest

from tests import codegen, preloaded
from tests.toolkit.pod import supervised
from toolkit.pod import supervisor as supervisor_lib

STEPS = 100  # the tiny model: 20-150 ms a step here
TRAIN = ["--config=experiments/lm.py:tiny", f"--config.train.steps={STEPS}",
         "--config.train.checkpoint_every=10", "--config.train.log_every=1",
         "--config.train.eval_every=1000", "--config.train.sample_tokens=0"]
DRILL_TIMEOUT_S = 600  # two jobs of ~35-45 s quiet, each with a deadline of 280 s (--timeout_s)


def test_a_mistake_is_not_retried(tmp_path):
  err = io.StringIO()
  supervisor = supervisor_lib.Supervisor(1, 8, [*TRAIN, f"--workdir={tmp_path / 'w'}",
                                                "--config.train.steps=0"],
                                         out=io.StringIO(), err=err, restart_delay_s=0)
  assert supervisor.run() == 1
  assert [a.cause for a in supervisor.attempts] == ["mistake"]
  assert "[supervise] restart" not in err.getvalue()
  assert "[supervise] job failed before training a step (not retried) after 1 attempt(s)" in \
      err.getvalue()


def test_each_attempt_is_told_what_the_attempts_before_it_cost():
  # Two failed attempts, by hand (monotonic seconds): a crash at step 27 after a start at 0, a
  # restart 2 s later that restored step 20, first stepped at 6.0 and hung (4.5 s waited out)
  # after logging step 44 at 0.25 s a step.
  supervisor = supervisor_lib.Supervisor(1, 8, TRAIN, environ={"KEEP": "1"})
  supervisor._started_unix = 5000.0
  supervisor.attempts = [
      supervisor_lib.Attempt(1, 0.0, ended=2.0, first_progress=1.0, last_step=27,
                             cause="crash"),
      supervisor_lib.Attempt(2, 4.0, ended=20.0, first_progress=6.0, restored=20, last_step=44,
                             step_seconds=0.25, cause="hang", detection_s=4.5)]
  third = supervisor_lib.Attempt(3, 23.0)
  env = supervisor._job_environ(third)
  job = json.loads(env[supervisor_lib.JOB_ENV])
  assert env["KEEP"] == "1"
  assert job.pop("attempt_started_unix") >= 5000.0
  assert job == {"attempt": 3, "job_started_unix": 5000.0, "hang_detection_s": 4.5,
                 "restart_s": (6.0 - 2.0) + (23.0 - 20.0), "steps_trained_again": 7,
                 "steps_trained_again_s": 7 * 0.25, "last_step": 44}
  # The training side reads the same variable (toolkit/pod does not import toolkit/training).
  from toolkit.training import goodput  # pylint: disable=g-import-not-at-top
  assert goodput.JOB_ENV == supervisor_lib.JOB_ENV


@pytest.mark.slow  # the fault drill's two jobs at 60 steps: ~75 s quiet, ~120 s under load
def test_a_crash_and_a_hang_are_restarted_and_the_losses_equal_an_uninterrupted_run(tmp_path):
  """scripts/dev/drill_faults.py --steps=60 (its documented command): a 2 x 4 job supervised
  without faults, and the same job with process 1 SIGKILLed past step 18 (its local folder
  deleted) and SIGSTOPped past step 42. The drill itself exits 1 unless the failures came as a
  crash and a hang, the crash's restart restored the local step saved before it from the
  peer's copy, and the losses equal the clean job's; this test reads what it kept."""
  done = preloaded.run(script="scripts/dev/drill_faults.py",
                       args=["--steps=60", "--timeout_s=280", f"--keep={tmp_path}"],
                       env=_shell_env(), timeout=DRILL_TIMEOUT_S)
  output = (tmp_path / "faulted.log").read_text()
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + output[-3000:]
  assert "faulted job's losses equal the clean job's, bitwise: True" in done.stdout
  assert re.search(r"^\[supervise\] restart 1 of 3 after a crash \(p1 killed by SIGKILL\) at "
                   r"step \d+", output, re.M), output[-5000:]
  assert re.search(r"^\[supervise\] restart 2 of 3 after a hang \(p0: no progress for "
                   r"[\d.]+ s after step \d+\)", output, re.M), output[-5000:]
  recovered = re.findall(r"^\[supervise\] recovered in ([\d.]+) s: restored step (\d+), (\d+) "
                         r"step\(s\) lost", output, re.M)
  assert len(recovered) == 2 and all(int(lost) <= 10 for _, _, lost in recovered), recovered
  assert re.search(r"^\[supervise\] job finished after 3 attempt\(s\) \(failures: crash, "
                   r"hang\)", output, re.M), output[-3000:]
  # The same steps on the same batches from the same checkpoints: the uninterrupted losses,
  # each step recorded once.
  workdir = tmp_path / "faulted"
  assert supervised.losses(workdir) == supervised.losses(tmp_path / "clean")
  [clean] = [json.loads(l) for l in
             (tmp_path / "clean" / "supervisor.jsonl").read_text().splitlines()]
  assert clean["causes"] == [] and clean["final"] == "finished", clean
  [record] = [json.loads(l) for l in (workdir / "supervisor.jsonl").read_text().splitlines()]
  assert record["causes"] == ["crash", "hang"] and record["final"] == "finished"
  assert 6 <= record["hang_detection_s"] < 8  # the drill's train.hang_timeout_s=6, polled
  # The last attempt's goodput line and record carry the job's lifetime: the same hang time
  # and steps trained again as the supervisor's record, a restart time at least its own.
  goodput = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "goodput"][-1]
  assert goodput["job_attempt"] == 3
  assert goodput["job_hang_detection_seconds"] == pytest.approx(record["hang_detection_s"],
                                                                abs=1e-3)
  assert goodput["job_steps_trained_again"] == record["steps_trained_again"]
  assert 0 < goodput["job_restart_seconds"] and goodput["job_wall_seconds"] <= record["wall_s"]
  assert re.search(r"^\[p0\] goodput .*; the job \(attempt 3\): [\d.]+ s since it started, "
                   r"[\d.]+ s waiting out hangs", output, re.M), output[-3000:]


def _shell_env() -> dict[str, str]:
  """The environment a user's shell gives the drill (the supervisor simulates each process's
  devices itself), with the suite's code generation (tests/codegen.py)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return env | {"XLA_FLAGS": " ".join(codegen.flags())}


def test_the_drill_refuses_a_folder_that_is_not_empty(tmp_path):
  (tmp_path / "kept").mkdir()
  (tmp_path / "kept" / "notes.txt").write_text("mine")
  done = preloaded.run(script="scripts/dev/drill_faults.py", args=[f"--keep={tmp_path / 'kept'}"],
                       env=_shell_env(), timeout=60)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1] == \
      f"error: --keep={tmp_path / 'kept'} is not empty; name a new folder", done.stderr
  assert os.listdir(tmp_path / "kept") == ["notes.txt"]


def test_the_drill_refuses_a_peer_timeout_within_the_hang_timeout(tmp_path):
  done = preloaded.run(script="scripts/dev/drill_faults.py",
                       args=["--peer_timeout_s=6", f"--keep={tmp_path / 'kept'}"],
                       env=_shell_env(), timeout=60)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1] == (
      "error: --peer_timeout_s=6 must exceed --hang_timeout_s=6 (a stopped peer must end as a "
      "hang)"), done.stderr
  assert not (tmp_path / "kept").exists()


def test_a_killed_host_is_named_before_the_peers_it_took_down():
  """Seen ending at the same poll (within 50 ms), the process a signal killed is the cause,
  not a peer that exited 1 because it died (insertion order alone named the peer)."""
  procs = [types.SimpleNamespace(returncode=code) for code in (1, 0, 1, -signal.SIGKILL)]
  job = types.SimpleNamespace(procs=procs, exit_times={0: 5.0, 2: 5.0, 3: 5.0, 1: 6.0})
  supervisor = supervisor_lib.Supervisor(4, 2, ["--config=experiments/lm.py:tiny"])
  attempt = supervisor_lib.Attempt(1, 0.0, returncode=1, first_progress=1.0)
  assert supervisor._classify(attempt, job) == ("crash", "p3 killed by SIGKILL")
  # One that failed earlier is still the first.
  job.exit_times[0] = 4.9
  assert supervisor._classify(attempt, job) == ("crash", "p0 exit status 1")


def test_a_hang_exit_after_a_killed_peer_is_a_crash_and_before_it_a_hang():
  """A peer's watchdog that fires while it waits on a killed process (its exit 75 after the
  kill) does not make the kill a hang; a watchdog's exit before its stopped peer is killed
  (by the launcher, after it) is one; so is one after a peer's collective timeout (exit 1)."""
  supervisor = supervisor_lib.Supervisor(2, 4, ["--config=experiments/lm.py:tiny"])
  attempt = supervisor_lib.Attempt(1, 0.0, returncode=-signal.SIGKILL, first_progress=1.0)
  killed = types.SimpleNamespace(procs=[types.SimpleNamespace(returncode=code)
                                        for code in (75, -signal.SIGKILL)],
                                 exit_times={1: 5.0, 0: 8.0})
  assert supervisor._classify(attempt, killed) == ("crash", "p1 killed by SIGKILL")
  killed.exit_times = {0: 5.0, 1: 8.0}
  attempt.returncode = 75
  assert supervisor._classify(attempt, killed)[0] == "hang"
  timed_out = types.SimpleNamespace(procs=[types.SimpleNamespace(returncode=code)
                                           for code in (1, 75)], exit_times={0: 5.0, 1: 6.0})
  attempt.returncode = 1
  assert supervisor._classify(attempt, timed_out)[0] == "hang"


@pytest.mark.slow  # a supervised 2 x 4 job to its fifth step, then two signals: ~40 s
def test_ctrl_c_twice_hurries_the_supervised_job_and_exits_130(tmp_path):
  """Issue 62: the second ^C under toolkit.supervise repeated its line and the job exited 0.
  Now the job's processes get SIGINT each time, so the second one hurries the stop as Ctrl-C
  twice does toolkit.train: each saves the step it is in and exits 130, passed on."""
  workdir, log = tmp_path / "w", tmp_path / "log"
  args = ["--processes=2", "--devices_per_process=4", "--", *TRAIN,
          "--config.train.steps=100000", "--config.train.checkpoint_every=100000",
          f"--workdir={workdir}"]
  with open(log, "w") as out:
    process = preloaded.start("toolkit.supervise", args, env=_shell_env(), stdout=out,
                              stderr=subprocess.STDOUT, text=True)
    try:
      deadline = time.monotonic() + DRILL_TIMEOUT_S
      while not re.search(r"^\[p0\] step 5/", log.read_text(), re.M):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress line before the deadline"
        time.sleep(0.1)  # polling interval, not a wait for readiness
      process.send_signal(signal.SIGINT)
      while "stopping the job (it saves)" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
      process.send_signal(signal.SIGINT)
      signalled = time.monotonic()
      returncode = process.wait(timeout=120)
      seconds = time.monotonic() - signalled
    finally:
      if process.poll() is None:
        process.kill()
        process.wait()
  output = log.read_text()
  assert returncode == 130, output[-3000:]
  assert "[supervise] SIGINT: stopping the job (it saves), no restart; again to hurry it" \
      in output
  assert "[supervise] SIGINT again: hurrying the job's stop" in output, output[-3000:]
  assert "Traceback" not in output
  assert seconds < 60, f"{seconds:.0f} s"
  # The attempt's log holds every line its processes printed.
  assert re.search(r"^\[p0\] step 5/", (workdir / "attempts" / "1.log").read_text(), re.M)
