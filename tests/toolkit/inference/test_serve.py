"""The HTTP server under load: 200 requests from 16 concurrent clients (scripts/load_test.py),
none lost or mixed up, while bad requests get a 4xx and the server keeps serving."""
import json
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from models import Llama, LlamaConfig
from toolkit.data import text as text_data
from toolkit.inference import server as server_lib
from toolkit.inference import engine as engine_lib
from toolkit.inference.sampling import SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[3]
CFG = LlamaConfig.preset("tiny")
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server():
  params = nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(params=0)), nnx.Param))
  mesh = sharding.make_mesh(sharding.parse_axis_sizes("data:1", "mesh.ici"), [],
                            jax.devices()[:1])
  engine = engine_lib.Engine(CFG, params, mesh, sharding.Rules.preset("dp"), cache_length=64)
  batcher = engine_lib.Batcher(engine, batch_size=4, max_queue=256)
  batcher.warmup()
  running = server_lib.Server(batcher, port=0, request_timeout_s=TIMEOUT_S,
                         info={"batch_size": 4}).start()
  yield running
  running.stop()


def post(url, body: bytes):
  request = urllib.request.Request(url + "/generate", data=body,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b'["a list"]', "must be a JSON object"),
    (b'{"max_tokens": 4}', 'exactly one of "prompt"'),
    (b'{"prompt": 7}', '"prompt" must be a string'),
    (b'{"prompt": "x", "temperature": -1}', "temperature=-1 must be >= 0"),
    (b'{"prompt": "x", "top_p": 0}', r"top_p=0 must be in (0, 1]"),
    (b'{"prompt": "x", "top_k": 2.5}', "top_k=2.5"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens=0"),
    (b'{"prompt": "x", "max_tokens": 64}', "exceeds the cache length 64"),
    (b'{"prompt": "x", "tmperature": 1}', "unknown field 'tmperature'"),
    (b'{"tokens": [1, 999]}', "token ids must be in [0, 256)"),
]


def test_load_with_bad_requests_in_between(server, tmp_path):
  responses = tmp_path / "responses.jsonl"
  load = subprocess.Popen(
      [sys.executable, str(REPO / "scripts" / "load_test.py"), f"--url={server.url}",
       "--clients=16", "--requests=200", "--max_tokens=6", "--temperature=0",
       f"--responses={responses}", f"--json={tmp_path / 'summary.json'}"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    # Bad requests while the load runs: each a 4xx with its reason; none disturbs the rest.
    for body, message in BAD_REQUESTS:
      status, payload = post(server.url, body)
      assert status == 400, (body, payload)
      assert message in payload["error"], (body, payload)
    stdout, stderr = load.communicate(timeout=TIMEOUT_S)
  finally:
    if load.poll() is None:
      load.kill()
  assert load.returncode == 0, stdout + stderr[-3000:]
  assert "200/200 ok from 16 clients" in stdout and "mixed up: 0" in stdout
  records = [json.loads(line) for line in responses.read_text().splitlines()]
  assert sorted(r["index"] for r in records) == list(range(200))
  # Each answer equals its prompt generated alone (greedy), so none was lost or swapped.
  engine = server.batcher.engine
  for record in records:
    prompt = text_data.encode(record["request"]["prompt"])
    alone = engine_lib.generate(engine, [prompt], [SamplingParams(max_tokens=6)], 1)[0]
    assert record["response"]["tokens"] == alone.tokens, record["index"]
    assert record["response"]["completion"] == text_data.decode(alone.tokens)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["ok"] == 200 and summary["latency_s"]["0.99"] > 0

  # Still serving after all that, with a sampled request that is reproducible by seed.
  body = json.dumps({"prompt": "The ", "max_tokens": 5, "temperature": 1.0, "seed": 3}).encode()
  first, second = post(server.url, body), post(server.url, body)
  assert first[0] == 200 and first[1]["tokens"] == second[1]["tokens"]
  assert first[1]["finish_reason"] == "length" and first[1]["completion_tokens"] == 5


def test_health_and_metrics(server):
  with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT_S) as response:
    health = json.loads(response.read())
  assert response.status == 200 and health["status"] == "ok" and health["batch_size"] == 4
  post(server.url, b'{"prompt": "abc", "max_tokens": 2}')
  post(server.url, b"{oops")
  with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
    text = response.read().decode()
  values = {line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines() if line and not line.startswith("#")}
  assert values["meshkit_requests_finished_total"] >= 1
  assert values['meshkit_requests_rejected_total{status="400"}'] >= 1
  assert values["meshkit_tokens_generated_total"] >= 2
  assert values["meshkit_active_requests"] == 0
  assert 0 < values["meshkit_slot_utilization"] <= 1
  assert np.isfinite(values['meshkit_latency_seconds{quantile="0.99"}'])


def test_port_in_use_is_a_clear_error(server):
  other = server_lib.Server(server.batcher, port=server.port)
  with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{server.port}"):
    other.start()


def test_command_line_mistakes_are_one_error_line(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
      [sys.executable, "-m", "toolkit.serve", "--config=experiments/lm.py:tiny",
       f"--checkpoint={tmp_path / 'missing'}", "--port=0"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"error: --checkpoint='{tmp_path / 'missing'}' does not exist")


class _FailingEngine:
  """The real engine, except that every prefill raises (say the device went away)."""

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def prefill(self, *args, **kwargs):
    raise RuntimeError("device lost")


def test_failing_steps_are_logged_exported_and_make_health_fail(server, capfd):
  batcher = engine_lib.Batcher(server.batcher.engine, batch_size=4, max_queue=16)
  batcher.engine = _FailingEngine(server.batcher.engine)
  failing = server_lib.Server(batcher, port=0, request_timeout_s=TIMEOUT_S).start()
  try:
    statuses = []
    for _ in range(server_lib.UNHEALTHY_AFTER_STEP_ERRORS):
      status, body = post(failing.url, b'{"prompt": "abc", "max_tokens": 2}')
      statuses.append(status)
      assert "device lost" in json.dumps(body)
    assert all(status >= 500 for status in statuses), statuses
    # A request is answered just before its step counts as failed: wait for the count.
    deadline = time.monotonic() + TIMEOUT_S
    while batcher.consecutive_step_errors < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    with pytest.raises(urllib.error.HTTPError) as error:
      urllib.request.urlopen(failing.url + "/health", timeout=TIMEOUT_S)
    health = json.loads(error.value.read())
    assert error.value.code == 503 and health["status"].startswith("failing: the last 3 ")
    assert "device lost" in health["status"] and health["step_errors"] == 3
    with urllib.request.urlopen(failing.url + "/metrics", timeout=TIMEOUT_S) as response:
      assert "meshkit_step_errors_total 3" in response.read().decode().splitlines()
  finally:
    failing.stop()
  logged = [line for line in capfd.readouterr().err.splitlines()
            if line.startswith("error: decode step failed")]
  assert len(logged) == 3 and "3 in a row, 3 in all" in logged[-1] and "device lost" in logged[-1]
