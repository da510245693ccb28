"""Several processes, one job: N local processes x M simulated CPU devices joined on 127.0.0.1
into one global mesh (toolkit.pod; scripts/launch/local_pod.py is its command line), checked against
one process on 8 devices.

Runs shared by the tests (module fixtures):
  reference  1 process x 8 devices, in this process: `train.run` of the tiny config, N steps;
  two        scripts/launch/local_pod.py, 2 processes x 4 devices, stopped at step K of the same
             N-step schedule, on a mesh where each process holds two separate blocks of rows;
  four       `two`'s checkpoint continued by 4 processes x 2 devices past N, then process 0
             is killed.
Every wait is bounded; every process is started here and killed here, by PID.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments import lm
from tests.tiny_runs import TOLERANCE, assert_trees_close
from toolkit.training.checkpoints import checkpoint
from toolkit import training
from toolkit.pod import local as pod

pytestmark = pytest.mark.multiprocess

REPO = pathlib.Path(__file__).resolve().parents[3]
K, N = 5, 10  # the 2-process run stops at step K of an N-step schedule; resumed runs go to N
# Batch rows over data x fsdp with data innermost: with 2 processes x 4 devices each process
# holds rows 0-3 and 8-11 (or 4-7 and 12-15), two separate blocks.
SPLIT_ROWS_MESH = "fsdp:2,tensor:2,data:2"
COMMON = ["--config=experiments/lm.py:tiny", f"--config.optimizer.schedule_steps={N}",
          f"--config.train.checkpoint_every={K}"]
RUN_TIMEOUT_S = 300        # one tiny multi-process run takes ~25-45 s on 2 shared cores
DEATH_NOTICE_S = 30        # every survivor of a killed peer must have exited within this
INIT_TIMEOUT_S = 5         # --initialization_timeout for the peer that never starts
INIT_MARGIN_S = 25         # + Python/JAX start-up before the timeout starts counting


@pytest.fixture(scope="module")
def environ() -> dict[str, str]:
  """The children's environment: the suite's, whose compilation cache (tests/conftest.py) the
  runs share (the kill tests compile what earlier runs compiled; process 0 then skips its
  compile)."""
  return dict(os.environ)


def tiny_config():
  """The config of the command lines below (COMMON, train.steps=N), default mesh."""
  config = lm.get_config("tiny")
  config.optimizer.schedule_steps = N
  config.train.steps = N
  return config


def train_losses(workdir: pathlib.Path) -> dict[int, float]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if r["kind"] == "train"]
  assert len(steps) == len(set(steps)), "metrics written twice: more than one process wrote"
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def restore_params(workdir: pathlib.Path, step: int | None = None):
  """Parameters of `workdir`'s checkpoint `step` (default: latest), restored in this process
  onto 8 devices, as host arrays; and the step."""
  setup = training.build(tiny_config())
  manager = checkpoint.Checkpoints(str(workdir / "checkpoints"), read_only=True)
  step = manager.latest_step() if step is None else step
  assert step is not None, f"no complete checkpoint in {workdir}"
  state, data_position = manager.restore(step, setup.layout.abstract)
  manager.close()
  assert data_position["step"] == step
  return jax.device_get(state["params"]), step


def assert_losses_close(actual: dict[int, float], expected: dict[int, float]) -> None:
  assert sorted(actual) == sorted(expected)
  np.testing.assert_allclose([actual[s] for s in sorted(actual)],
                             [expected[s] for s in sorted(expected)], **TOLERANCE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """1 process x 8 devices: the same config trained N steps by `train.run` in this process."""
  workdir = tmp_path_factory.mktemp("reference")
  result = training.run(tiny_config(), str(workdir))
  return result.train_losses, {step: restore_params(workdir, step)[0] for step in (K, N)}


@pytest.fixture(scope="module")
def two(tmp_path_factory, environ):
  """scripts/launch/local_pod.py: 2 processes x 4 devices, K steps of the N-step schedule."""
  workdir = tmp_path_factory.mktemp("two") / "w"
  result = subprocess.run(
      [sys.executable, "scripts/launch/local_pod.py", "--processes=2", "--devices_per_process=4", "--",
       *COMMON, f"--workdir={workdir}", f"--config.train.steps={K}",
       f"--config.mesh.ici={SPLIT_ROWS_MESH}", "--config.train.sample_tokens=8"],
      cwd=REPO, env=environ, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
  return workdir, result


def test_two_processes_train_like_one(reference, two):
  (losses, params), (workdir, result) = reference, two
  assert result.returncode == 0, result.stdout + result.stderr
  # Each process reports where it stands; every other output line comes from process 0.
  stdout = result.stdout.splitlines()
  assert "[p1] process 1 of 2 (flags): 4 local / 8 global cpu devices" in stdout
  assert [line for line in stdout if line.startswith("[p1]")] == [
      "[p1] process 1 of 2 (flags): 4 local / 8 global cpu devices"]
  assert "[p0] process 0 of 2 (flags): 4 local / 8 global cpu devices" in stdout
  assert any(re.match(rf"\[p0\] step {K}/{K} \| loss", line) for line in stdout), result.stdout
  # The end-of-run sample needs all parameters on process 0: gathered from both processes.
  assert re.search(r"^\[p0\] sample:\n\[p0\] The ", result.stdout, re.M), result.stdout
  assert re.search(r"^\[pod\] p0 exit status 0 after", result.stderr, re.M)
  assert "[Gloo]" not in result.stdout + result.stderr  # the launcher drops Gloo's chatter

  assert_losses_close(train_losses(workdir), {s: losses[s] for s in range(1, K + 1)})
  restored, step = restore_params(workdir)
  assert step == K
  assert_trees_close(restored, params[K], **TOLERANCE)
  assert (workdir / "loss.png").read_bytes().startswith(b"\x89PNG")
  assert json.loads((workdir / "config.json").read_text())["mesh"]["ici"] == SPLIT_ROWS_MESH
  assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_one_process_continues_a_two_process_checkpoint(reference, two, environ, tmp_path):
  """The plain command, no distributed runtime: 1 process x 4 devices, another mesh."""
  (losses, params), (source, _) = reference, two
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  result = subprocess.run(
      [sys.executable, "-m", "toolkit.train", *COMMON, f"--workdir={workdir}",
       f"--config.train.steps={N}", "--config.mesh.ici=fsdp:2,tensor:2"],
      cwd=REPO, env=pod.process_env(4, environ), capture_output=True, text=True,
      timeout=RUN_TIMEOUT_S)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"restored step {K} from" in result.stdout
  assert_continues_like_reference(workdir, losses, params)


def assert_continues_like_reference(workdir: pathlib.Path, losses, params) -> None:
  continued = {s: loss for s, loss in train_losses(workdir).items() if K < s <= N}
  assert_losses_close(continued, {s: losses[s] for s in range(K + 1, N + 1)})
  restored, _ = restore_params(workdir, N)
  assert_trees_close(restored, params[N], **TOLERANCE)


def _wait_for_training_past_a_checkpoint(job: pod.Pod, workdir: pathlib.Path,
                                         at_least: int) -> int:
  """Polls until checkpoint `at_least` or a later one is complete and process 0 has logged a
  later step; returns that checkpoint's step."""
  deadline = time.monotonic() + RUN_TIMEOUT_S
  while True:
    saved = [int(p.name) for p in (workdir / "checkpoints").glob("*")
             if p.name.isdigit() and int(p.name) >= at_least]
    logged = [int(s) for s in re.findall(r"^step (\d+)/", job.output(0), re.M)]
    if saved and logged and max(logged) > min(saved):
      return min(saved)
    assert all(proc.poll() is None for proc in job.procs), job.output(0)
    assert time.monotonic() < deadline, f"no progress past a checkpoint:\n{job.output(0)}"
    time.sleep(0.1)  # polling interval, not a wait for readiness


def run_and_kill(processes: int, devices: int, victim: int, args: list[str],
                 workdir: pathlib.Path, environ, after_checkpoint: int = 1):
  """Trains in a local pod, SIGKILLs process `victim` once training is past a complete
  checkpoint, waits for the others; returns (pod, seconds from the kill to each survivor's
  exit, that checkpoint's step)."""
  out = io.StringIO()
  with pod.Pod(processes, devices, [*args, "--config.train.steps=100000"], environ=environ,
               out=out, err=out, grace_s=RUN_TIMEOUT_S) as job:
    job.start()
    saved = _wait_for_training_past_a_checkpoint(job, workdir, after_checkpoint)
    os.kill(job.procs[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    job.wait(timeout_s=RUN_TIMEOUT_S)
  noticed = {proc.process_id: job.exit_times[proc.process_id] - killed_at
             for proc in job.procs if proc.process_id != victim}
  print(f"\n{processes} processes, p{victim} killed: survivors exited after "
        f"{ {i: round(t, 1) for i, t in noticed.items()} } s")
  return job, noticed, saved


@pytest.fixture(scope="module")
def four(two, environ, tmp_path_factory):
  """`two`'s checkpoint continued by 4 processes x 2 devices on another mesh, past step N;
  then process 0 (the coordinator) is killed."""
  workdir = tmp_path_factory.mktemp("four") / "w"
  shutil.copytree(two[0], workdir)
  args = [*COMMON, f"--workdir={workdir}", "--config.mesh.ici=data:2,fsdp:2,tensor:2"]
  job, noticed, saved = run_and_kill(4, 2, 0, args, workdir, environ, after_checkpoint=N)
  return workdir, job, noticed, saved


def test_four_processes_continue_a_two_process_checkpoint(reference, four):
  (losses, params), (workdir, job, _, _) = reference, four
  assert f"restored step {K} from" in job.output(0)
  assert_continues_like_reference(workdir, losses, params)


def assert_survivors_stopped(job: pod.Pod, noticed: dict[int, float]) -> None:
  """Every survivor exited non-zero within DEATH_NOTICE_S, with one `error:` line when the
  runtime raised, or ended by JAX's runtime itself (SIGABRT) with its own message."""
  for process_id, seconds in noticed.items():
    proc, output = job.procs[process_id], job.output(process_id)
    assert proc.returncode != 0, output
    assert seconds < DEATH_NOTICE_S, output
    # The line can land inside JAX's own abort report, which another thread prints as the
    # process ends (seen in CI, exit status 1: after a space, and once glued to the report's
    # "Extension modules: ..., numpy.linalg._umath_linalg"): it is read wherever it starts,
    # but for the report's own "Fatal Python error:".
    errors = re.findall(r"(?<!Fatal Python )error: .*$", output, re.M)
    if errors:
      assert len(errors) == 1 and "the distributed runtime failed" in errors[0], output
    else:
      assert proc.returncode == -signal.SIGABRT, output
      assert "the JAX distributed service detected fatal errors" in output, output


def test_a_killed_coordinator_stops_every_other_process(four):
  workdir, job, noticed, saved = four
  assert_survivors_stopped(job, noticed)
  _, step = restore_params(workdir)
  assert step >= saved


@pytest.mark.slow  # 14 s; the default suite stays near its budget (docs/testing.md)
def test_a_killed_worker_stops_every_other_process(environ, tmp_path):
  """Process 1 of 2 dies: process 0 notices in a collective (an `error:` line) or by missing
  heartbeats; the last complete checkpoint still restores."""
  workdir = tmp_path / "w"
  args = [*COMMON, f"--workdir={workdir}", f"--config.mesh.ici={SPLIT_ROWS_MESH}"]
  job, noticed, saved = run_and_kill(2, 4, 1, args, workdir, environ)
  assert_survivors_stopped(job, noticed)
  _, step = restore_params(workdir)
  assert step >= saved


def test_a_process_that_never_starts_is_reported(environ, tmp_path):
  """Only one of two processes starts (process 0, or only process 1): within the configured
  --initialization_timeout it fails with one line saying so."""
  def start_only(process_id: int):
    out = io.StringIO()
    with pod.Pod(2, 4, [*COMMON, f"--workdir={tmp_path / str(process_id)}",
                        f"--initialization_timeout={INIT_TIMEOUT_S}"],
                 environ=environ, out=out, err=out) as job:
      job.start(only=[process_id])
      returncode = job.wait(timeout_s=RUN_TIMEOUT_S)
      return returncode, job.exit_times[process_id] - job.started_at, job.output(process_id)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(start_only, (0, 1)))
  print(f"\nnever-started peer reported after "
        f"{[round(seconds, 1) for _, seconds, _ in results]} s (timeout {INIT_TIMEOUT_S} s)")
  for process_id, (returncode, seconds, output) in enumerate(results):
    assert returncode == 1, output
    assert INIT_TIMEOUT_S <= seconds < INIT_TIMEOUT_S + INIT_MARGIN_S, output
    assert output.splitlines() == [
        f"error: process {process_id} of 2: the distributed runtime did not start within "
        f"--initialization_timeout={INIT_TIMEOUT_S} s: not every process connected to the "
        f"coordinator at 127.0.0.1:{output.split('127.0.0.1:')[1].split(';')[0]}; start the "
        f"same command on every worker, each with its own --process_id"], output


@pytest.mark.slow
def test_ctrl_c_stops_every_process_after_the_same_step(environ, tmp_path):
  """SIGINT to scripts/launch/local_pod.py: every process stops after one agreed step, saves it and
  exits 0; the checkpoint restores."""
  workdir, log, errors = tmp_path / "w", tmp_path / "stdout", tmp_path / "stderr"
  with open(log, "w") as stdout, open(errors, "w") as stderr:
    launcher = subprocess.Popen(
        [sys.executable, "scripts/launch/local_pod.py", "--processes=2", "--devices_per_process=4",
         "--", *COMMON, f"--workdir={workdir}", "--config.train.steps=100000",
         "--config.train.checkpoint_every=1000"],
        cwd=REPO, env=environ, stdout=stdout, stderr=stderr, text=True)
    try:
      deadline = time.monotonic() + RUN_TIMEOUT_S
      while not re.search(r"^\[p0\] step 5/", log.read_text(), re.M):
        assert launcher.poll() is None, log.read_text() + errors.read_text()
        assert time.monotonic() < deadline, "no progress line before the deadline"
        time.sleep(0.1)  # polling interval, not a wait for readiness
      launcher.send_signal(signal.SIGINT)
      launcher.wait(timeout=RUN_TIMEOUT_S)
    finally:
      if launcher.poll() is None:  # a failed wait: end the launcher and its children by PID
        launcher.kill()
        launcher.wait()
        for pid in re.findall(r"p\d+=(\d+)", errors.read_text()):
          with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
  output, stderr = log.read_text(), errors.read_text()
  assert launcher.returncode == 0, output + stderr
  stopped = re.search(r"^\[p0\] stopped at step (\d+) on request; checkpoint saved$", output,
                      re.M)
  assert stopped, output
  assert "[pod] SIGINT: asking every process to stop" in stderr
  assert re.search(r"^\[pod\] p1 exit status 0 after", stderr, re.M), stderr
  _, step = restore_params(workdir)
  assert step == int(stopped.group(1))
