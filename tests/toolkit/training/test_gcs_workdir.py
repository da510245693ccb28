"""gs:// workdirs against a local Cloud Storage emulator (scripts/dev/gcs_emulator.py): a killed run
resumes bitwise, every output lands in the bucket, half-written steps are skipped, inference
and sweeps read and write there, and every unusable URL is one line within 30 s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from scripts.dev import gcs_emulator
from tests.tiny_runs import TOLERANCE, assert_trees_close, tiny_config
from toolkit import training
from toolkit import workdir as workdir_lib
from toolkit.training import metrics as metrics_lib
from toolkit.training.checkpoints import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = 200        # long enough (~5 s here) to be killed after its first checkpoint
RUN_TIMEOUT_S = 240
REFUSAL_S = 30     # a bad URL: exit 1 within this, start-up included
COMMON = ["--config=experiments/lm.py:tiny", f"--config.train.steps={STEPS}",
          "--config.train.checkpoint_every=20", "--config.train.log_every=10",
          "--config.train.eval_every=1000", "--config.train.keep_checkpoints=2"]


def _env(gcs_server, **extra) -> dict[str, str]:
  return {**os.environ, **gcs_server.env, **extra}  # 8 CPU devices (tests/conftest.py)


def _train(env, workdir: str, *args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "toolkit.train", *COMMON, f"--workdir={workdir}",
                         *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=RUN_TIMEOUT_S)


def _losses(metrics_path: str) -> dict[int, float]:
  """Train loss per step; a step logged twice (before a kill and after the resume) keeps its
  last value, which must equal the uninterrupted run's."""
  return {r["step"]: r["loss"] for r in metrics_lib.read_metrics(metrics_path)
          if r["kind"] == "train"}


def _params(workdir: str, step: int):
  setup = training.build(tiny_config(steps=STEPS))
  manager = checkpoint.Checkpoints(workdir_lib.join(workdir, "checkpoints"), read_only=True)
  state, _ = manager.restore(step, setup.layout.abstract)
  manager.close()
  return jax.device_get(state["params"])


def _committed(gcs_server, bucket: str, run: str) -> list[int]:
  names = gcs_server.objects(bucket, f"{run}/checkpoints/")
  return sorted(int(n.split("/")[2]) for n in names if n.count("/") == 3
                and n.endswith("/commit_success.txt"))


@pytest.mark.slow  # 22 s; the default suite stays near its budget (docs/testing.md)
def test_a_killed_run_resumes_in_the_bucket_bitwise(gcs_server, gcs_bucket, tmp_path):
  env = _env(gcs_server)
  local = str(tmp_path / "local")
  straight = _train(env, local)
  assert straight.returncode == 0, straight.stderr[-3000:]

  url = f"gs://{gcs_bucket}/run"
  command = [sys.executable, "-m", "toolkit.train", *COMMON, f"--workdir={url}"]
  with open(tmp_path / "killed.log", "w") as log:
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + RUN_TIMEOUT_S
      while not _committed(gcs_server, gcs_bucket, "run") and time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.05)
      assert process.poll() is None, "the run ended before it could be killed"
      os.kill(process.pid, signal.SIGKILL)
      process.wait(timeout=30)
    finally:
      if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
  killed_at = _committed(gcs_server, gcs_bucket, "run")
  assert killed_at and killed_at[-1] < STEPS, killed_at

  resumed = _train(env, url)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"restored step {killed_at[-1]} from {url}/checkpoints" in resumed.stdout
  assert _losses(f"{url}/metrics.jsonl") == _losses(f"{local}/metrics.jsonl")  # bitwise
  for a, b in zip(jax.tree.leaves(_params(url, STEPS)), jax.tree.leaves(_params(local, STEPS))):
    np.testing.assert_array_equal(a, b)

  # Every output is in the bucket and reads back.
  names = gcs_server.objects(gcs_bucket, "run/")
  assert json.loads(workdir_lib.read_text(f"{url}/config.json"))["train"]["steps"] == STEPS
  assert workdir_lib.path(f"{url}/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  events = [n for n in names if n.startswith("run/tensorboard/events.out.tfevents.")]
  assert len(events) == 2, names  # one event file per run (the killed one, the resumed one)
  _, _, event_pb2 = metrics_lib.tensorboardx_modules()
  tags = set()
  for name in events:
    data = workdir_lib.path(f"gs://{gcs_bucket}/{name}").read_bytes()
    while data:  # TFRecord: length (8), its CRC (4), the event, its CRC (4)
      length = int.from_bytes(data[:8], "little")
      event = event_pb2.Event.FromString(data[12:12 + length])
      tags |= {v.tag for v in event.summary.value}
      data = data[16 + length:]
  assert {"train/loss", "train/learning_rate"} <= tags
  assert not os.path.exists(os.path.join(REPO, "gs:")), "a local folder named gs: was created"


@pytest.mark.slow  # 17 s; make test stays within its 10-minute budget (docs/testing.md)
def test_a_half_written_step_is_skipped_and_removed(gcs_server, gcs_bucket):
  env = _env(gcs_server)
  url = f"gs://{gcs_bucket}/run"
  first = _train(env, url, "--config.train.steps=40")
  assert first.returncode == 0, first.stderr[-3000:]
  # Step 60 as a killed save leaves it on an object store: shards, no commit marker.
  for name in gcs_server.objects(gcs_bucket, "run/checkpoints/40/"):
    if not name.endswith("commit_success.txt"):
      source = workdir_lib.path(f"gs://{gcs_bucket}/{name}")
      workdir_lib.write_bytes(f"gs://{gcs_bucket}/{name.replace('/40/', '/60/')}",
                              source.read_bytes())
  assert checkpoint.Checkpoints(f"{url}/checkpoints", read_only=True).latest_step() == 40
  second = _train(env, url, "--config.train.steps=80")
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"restored step 40 from {url}/checkpoints" in second.stdout
  assert _committed(gcs_server, gcs_bucket, "run") == [60, 80]


@pytest.mark.slow
def test_generate_serve_and_a_sweep_use_the_bucket(gcs_server, gcs_bucket, tmp_path):
  env = _env(gcs_server)
  url = f"gs://{gcs_bucket}/run"
  trained = _train(env, url, "--config.train.steps=20")
  assert trained.returncode == 0, trained.stderr[-3000:]
  generated = subprocess.run(
      [sys.executable, "-m", "toolkit.generate", "--config=experiments/lm.py:tiny",
       f"--checkpoint={url}", "--prompt=The ", "--max_tokens=4"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
  assert generated.returncode == 0, generated.stderr[-3000:]
  assert "step 20" in generated.stderr + generated.stdout
  _serve_one_request(env, url, tmp_path)

  sweep = f"gs://{gcs_bucket}/sweep"
  command = [sys.executable, "-m", "toolkit.sweep", "--config=experiments/lm.py:tiny",
             f"--workdir={sweep}"]
  first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
  assert first.returncode == 0, first.stderr[-3000:]
  names = set(gcs_server.objects(gcs_bucket, "sweep/"))
  assert {"sweep/results.csv", "sweep/results.md", "sweep/sweep.json",
          "sweep/trials/000/trial.json", "sweep/trials/000/metrics.jsonl"} <= names
  table = workdir_lib.read_text(f"{sweep}/results.csv")
  again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "4/4 trials" in again.stdout, again.stdout[-2000:]
  assert workdir_lib.read_text(f"{sweep}/results.csv").splitlines()[1:] == \
      table.splitlines()[1:]  # resumed: the same results, nothing trained again


def _serve_one_request(env, checkpoint_url: str, tmp_path) -> None:
  """toolkit.serve from `checkpoint_url` on a free 127.0.0.1 port: one request answered."""
  log_path = tmp_path / "serve.log"
  with open(log_path, "w") as log:
    process = subprocess.Popen(
        [sys.executable, "-m", "toolkit.serve", "--config=experiments/lm.py:tiny",
         f"--checkpoint={checkpoint_url}", "--port=0", "--batch_size=4", "--cache_length=32"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline, url = time.monotonic() + RUN_TIMEOUT_S, None
      while url is None and time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
          if line.startswith("serving on "):
            url = line.split()[2]
        time.sleep(0.1)
      assert url, log_path.read_text()[-3000:]
      request = urllib.request.Request(f"{url}/generate", headers={"Content-Type":
                                                                   "application/json"},
                                       data=json.dumps({"prompt": "The ", "max_tokens": 4}
                                                       ).encode())
      with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        assert len(json.loads(response.read())["tokens"]) == 4
      assert "restored step 20" in log_path.read_text()
    finally:
      process.kill()
      process.wait(timeout=30)


@pytest.mark.parametrize("case, expected", [
    ("missing bucket", "bucket 'no-such-bucket' does not exist; create it"),
    ("unreachable", "Cloud Storage cannot be reached"),
    pytest.param("silent", "Cloud Storage did not answer within 15 s",  # waits out 15 s
                 marks=pytest.mark.slow),
    ("permission", "permission denied on bucket"),
    ("credentials", "Cloud Storage refused the credentials"),
])
def test_an_unusable_bucket_is_one_line_within_30_s(gcs_server, gcs_bucket, tmp_path, case,
                                                    expected):
  bucket = "no-such-bucket" if case == "missing bucket" else gcs_bucket
  status = {"permission": 403, "credentials": 401}.get(case)
  with gcs_emulator.refusing_endpoint(status or 403) as refusing, \
      gcs_emulator.silent_endpoint() as silent:
    endpoint = {"unreachable": f"http://127.0.0.1:{gcs_emulator.free_port()}", "silent": silent,
                "permission": refusing, "credentials": refusing}.get(case, gcs_server.url)
    env = _env(gcs_server, **gcs_emulator.client_env(endpoint))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "toolkit.train", f"--config={REPO}/experiments/lm.py:tiny",
         f"--workdir=gs://{bucket}/run"], cwd=tmp_path, env={**env, "PYTHONPATH": REPO},
        capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
  assert result.returncode == 1, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert seconds < REFUSAL_S, f"{seconds:.1f} s"
  assert os.listdir(tmp_path) == [], "something was created locally"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_process_pod_writes_one_bucket_workdir_that_restores_on_one(gcs_server, gcs_bucket,
                                                                         tmp_path):
  env = _env(gcs_server)
  del env["XLA_FLAGS"]  # local_pod.py gives each process its own devices
  url = f"gs://{gcs_bucket}/pod"
  steps = ["--config.train.steps=20", "--config.optimizer.schedule_steps=20"]
  pod = subprocess.run(
      [sys.executable, "scripts/launch/local_pod.py", "--processes=2", "--devices_per_process=4", "--",
       *COMMON, *steps, f"--workdir={url}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
  assert pod.returncode == 0, pod.stdout[-3000:] + pod.stderr[-3000:]
  local = str(tmp_path / "local")
  one = _train(_env(gcs_server), local, *steps)
  assert one.returncode == 0, one.stderr[-3000:]

  losses, expected = _losses(f"{url}/metrics.jsonl"), _losses(f"{local}/metrics.jsonl")
  assert sorted(losses) == sorted(expected)
  train_steps = [r["step"] for r in metrics_lib.read_metrics(f"{url}/metrics.jsonl")
                 if r["kind"] == "train"]
  assert len(train_steps) == len(set(train_steps)), "more than one process wrote metrics"
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [expected[s] for s in sorted(expected)], **TOLERANCE)
  assert_trees_close(_params(url, 20), _params(local, 20), **TOLERANCE)  # restored on 1 x 8


@pytest.mark.slow  # a run, then the deadline and the bounded waits after it: ~30 s
def test_a_store_that_stops_answering_mid_run_is_one_error_within_the_deadline(tmp_path):
  """Issue 32: with the emulator stopped (SIGSTOP: connections accepted, nothing answered) the
  run sat at 0 % CPU for minutes inside a metrics upload. Now the write's deadline
  (train.storage_timeout_s) ends it: one error line naming the file, a non-zero exit."""
  server = gcs_emulator.Emulator(str(tmp_path / "gcs"))  # its own: this test stops it
  try:
    bucket = server.new_bucket()
    url = f"gs://{bucket}/run"
    command = [sys.executable, "-m", "toolkit.train", *COMMON, "--config.train.steps=1000000",
               "--config.train.checkpoint_every=1000000", "--config.train.storage_timeout_s=3",
               f"--workdir={url}"]
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
      process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **server.env},
                                 stdout=log, stderr=subprocess.STDOUT)
      try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "step 10/" not in log_path.read_text():
          assert process.poll() is None, log_path.read_text()[-3000:]
          assert time.monotonic() < deadline, "no progress line before the deadline"
          time.sleep(0.1)
        os.kill(server.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        returncode = process.wait(timeout=120)
        seconds = time.monotonic() - stopped
      finally:
        if process.poll() is None:
          process.kill()
          process.wait(timeout=30)
  finally:
    os.kill(server.process.pid, signal.SIGCONT)
    server.stop()
  output = log_path.read_text()
  assert returncode == 1, output[-3000:]
  assert "Traceback" not in output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, output[-3000:]
  assert errors[0].startswith(f"error: metrics could not be written to {url}/"), errors[0]
  assert "(no answer within 3 s); check the network and the storage service" in errors[0]
  # The write's deadline, then at most the bounded wait for the checkpoint manager after a
  # storage failure (loop.WAIT_AFTER_STORAGE_FAILURE_S).
  assert seconds < 3 + 10 + 20, f"{seconds:.1f} s"
