"""The scoring server of a recommendation checkpoint (toolkit/serving/score_api.py): concurrent
clients get the scores the offline model gives, requests waiting together are scored in one
call, malformed requests get a 4xx naming the field while the server keeps serving, and the
command line serves a click checkpoint."""
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import dlrm
from models.dlrm import DLRM, DLRMConfig
from tests.tiny_runs import TOLERANCE
from tests.toolkit.serving import test_openai_api
from toolkit import training
from toolkit.inference import scoring
from toolkit.inference.restore import restore_params
from toolkit.inference.score_requests import Features
from toolkit.serving import score_api

REPO = pathlib.Path(__file__).resolve().parents[3]
TIMEOUT_S = 120
FEATURES = Features.of("criteo")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
  """experiments/dlrm.py:tiny, 4 steps on 8 devices, its tables row-wise: the workdir."""
  workdir = str(tmp_path_factory.mktemp("dlrm"))
  config = dlrm.get_config("tiny")
  config.train.update(steps=4, checkpoint_every=4, eval_every=4)
  training.run(config, workdir)
  return workdir


@pytest.fixture(scope="module")
def server(trained):
  running = score_api.start(dlrm.get_config("tiny"), trained, "127.0.0.1", 0, max_batch=256,
                            max_wait_s=0.01, max_candidates=200, max_queue=64,
                            request_timeout_s=TIMEOUT_S, log=lambda line: None)
  yield running
  running.stop()


def post(url: str, body) -> tuple[int, dict]:
  return test_openai_api.post(url, "/v1/score", body)


def _request(rng, candidates: int) -> dict:
  """A user's dense features and ids in the context; the item's ids per candidate. Ids come
  as the file's hex strings and as integers."""
  context = {f"I{i}": int(rng.integers(0, 50)) for i in range(1, 14)}
  context.update({f"C{i}": f"{int(rng.integers(0, 2**32)):08x}" for i in range(1, 14)})
  items = [{f"C{i}": int(rng.integers(-2**31, 2**31)) for i in range(14, 27)}
           for _ in range(candidates)]
  return {"context": context, "candidates": items}


def _offline_scores(workdir: str, *bodies: dict) -> list[np.ndarray]:
  """Each request's scores from the checkpoint's model on one device, unsharded, on the
  request's features as the Criteo reader would give them (one call for all of them)."""
  rows = [{**body["context"], **c} for body in bodies for c in body["candidates"]]
  dense = np.log1p([[max(r[f"I{i}"], 0) for i in range(1, 14)] for r in rows]).astype(np.float32)
  ids = np.array([[int(v, 16) if isinstance(v, str) else v % 2**32
                   for v in (r[f"C{i}"] for i in range(1, 27))] for r in rows],
                 np.uint32).view(np.int32)[:, :, None]
  model = _restored(workdir)
  scores = np.asarray(jax.nn.sigmoid(model(dense, ids, np.ones(ids.shape[:2], np.int32))))
  return np.split(scores, np.cumsum([len(b["candidates"]) for b in bodies])[:-1])


_MODELS = {}


def _restored(workdir: str) -> DLRM:
  """The checkpoint's model on one device."""
  if workdir not in _MODELS:
    config = dlrm.get_config("tiny")
    config.mesh.ici = "data:1"
    params, *_ = restore_params(config, workdir, devices=jax.devices()[:1])
    cfg = DLRMConfig(**{k: v for k, v in config.model.items() if k != "kind"})
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DLRM(cfg, rngs=nnx.Rngs(params=0))))
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(params) if isinstance(params, nnx.State)
                        else params)
    _MODELS[workdir] = nnx.merge(graphdef, nnx.State(pure))
  return _MODELS[workdir]


def test_concurrent_clients_get_the_offline_models_scores(server, trained):
  rng = np.random.default_rng(0)
  bodies = [_request(rng, int(rng.integers(1, 101))) for _ in range(48)]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(lambda b: post(server.url, b), bodies))
  for body, (status, answer), want in zip(bodies, answers, _offline_scores(trained, *bodies)):
    assert status == 200, answer
    assert answer["candidates"] == len(body["candidates"])
    np.testing.assert_allclose(answer["scores"], want, **TOLERANCE)
  counters = server.batcher.counters
  assert counters["candidates"] >= sum(len(b["candidates"]) for b in bodies)


def test_requests_waiting_together_are_scored_in_one_call(server):
  """Five jobs queued before the loop runs: one call scores them all; with a smaller call
  size, the job that does not fit waits for the next call whole."""
  scorer = server.batcher.scorer
  rng = np.random.default_rng(1)
  for max_batch, calls in ((256, 1), (128, 2)):
    batcher = scoring.ScoreBatcher(scorer, max_wait_s=0.5, max_batch=max_batch)
    done = []
    for size in (40, 40, 40, 40, 40):
      job = scoring.Job(np.zeros((size, 13), np.float32),
                        rng.integers(0, 2**31, (size, 26, 1)).astype(np.int32),
                        np.ones((size, 26), np.int32), done.append)
      batcher.submit(job)
    stop = threading.Event()
    loop = threading.Thread(target=batcher.run, args=(stop,))
    loop.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < 5 and time.monotonic() < deadline:
      time.sleep(0.01)
    stop.set()
    loop.join(TIMEOUT_S)
    assert len(done) == 5 and all(j.scores.shape == (40,) for j in done)
    assert batcher.counters["calls"] == calls, (max_batch, batcher.counters)


BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON"),
    (b'["a list"]', 400, "must be a JSON object"),
    ({"candidates": []}, 400, "candidates must be a non-empty list"),
    ({"context": {"C1": 1}, "candidates": [{"C2": 2}], "extra": 1}, 400, "unknown field(s) 'extra'"),
    ({"context": {"user": 3}, "candidates": [{}]}, 400, "context.user is not a feature"),
    ("missing", 400, "feature 'C26' is missing"),
    ("twice", 400, "candidates[0].C1 is also in context"),
    ("non-hex", 400, "not a 32-bit hex id"),
    ("too-big", 400, "ids are 32-bit integers"),
    ("bag", 400, "has 2 ids; at most 1"),
    ("dense-nan", 400, "must be a finite number"),
    ("many", 400, "201 candidates; at most 200 a request"),
    (b"x" * (9 << 20), 413, "larger than"),
]


def _bad_body(kind, rng):
  if not isinstance(kind, str):
    return kind
  body = _request(rng, 2)
  context, first = body["context"], body["candidates"][0]
  if kind == "missing":
    del first["C26"]
  elif kind == "twice":
    first["C1"] = 5
  elif kind == "non-hex":
    context["C1"] = "zz"
  elif kind == "too-big":
    first["C14"] = 2**40
  elif kind == "bag":
    first["C14"] = [1, 2]
  elif kind == "dense-nan":
    context["I1"] = "NaN"
  elif kind == "many":
    body = _request(rng, 201)
  return body


@pytest.mark.parametrize("kind,status,message", BAD_REQUESTS,
                         ids=[str(k)[:20] for k, *_ in BAD_REQUESTS])
def test_a_malformed_request_gets_a_4xx_naming_the_field_and_serving_goes_on(
    server, trained, kind, status, message):
  rng = np.random.default_rng(2)
  got, answer = post(server.url, _bad_body(kind, rng))
  assert got == status and message in answer["error"], answer
  body = _request(rng, 3)
  got, answer = post(server.url, body)
  assert got == 200
  np.testing.assert_allclose(answer["scores"], _offline_scores(trained, body)[0], **TOLERANCE)


def test_health_and_metrics(server):
  with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT_S) as response:
    health = json.loads(response.read())
  assert health["status"] == "ok" and health["max_batch"] == 256
  assert health["features"][:2] == ["I1", "I2"] and len(health["features"]) == 39
  post(server.url, _request(np.random.default_rng(3), 5))
  with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
    text = response.read().decode()
  for name in ("meshkit_scored_candidates_total", "meshkit_score_calls_total",
               'meshkit_requests_rejected_total{status="400"}',
               "meshkit_score_latency_seconds_bucket", "meshkit_score_queue_seconds_count"):
    assert name in text, name
  assert float(re.search(r"^meshkit_scored_candidates_total (\S+)$", text, re.M)[1]) >= 5


def test_the_command_line_serves_a_click_checkpoint(trained):
  process = subprocess.Popen(
      [sys.executable, "-m", "toolkit.serve", "--config=experiments/dlrm.py:tiny",
       f"--checkpoint={trained}", "--port=0", "--max_batch=64"], cwd=REPO, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    lines, url = [], None
    deadline = time.monotonic() + TIMEOUT_S
    while url is None and time.monotonic() < deadline:
      line = process.stdout.readline()
      if not line:
        break
      lines.append(line)
      found = re.search(r"serving on (http://\S+) \(POST /v1/score", line)
      url = found and found[1]
    assert url, "".join(lines)
    body = _request(np.random.default_rng(4), 7)
    status, answer = post(url, body)
    assert status == 200 and len(answer["scores"]) == 7
    np.testing.assert_allclose(answer["scores"], _offline_scores(trained, body)[0], **TOLERANCE)
  finally:
    process.terminate()
    process.wait(TIMEOUT_S)
