"""The HTTP server under load: 200 requests from 16 concurrent clients (scripts/bench/load_test.py),
none lost or mixed up, while bad requests get a 4xx and the server keeps serving; a fuzz run
of malformed requests to /generate and the OpenAI routes (test_openai_api.py has the rest of
the OpenAI routes' tests)."""
import collections
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
from tests import preloaded
from flax import nnx

import sharding
from models import Llama, LlamaConfig
from toolkit.data import text as text_data
from toolkit.serving import server as server_lib
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
    # Each of these once answered 500 with a traceback.
    (b'{"tokens": [2147483648]}', "token ids must be in [0, 256); got 2147483648"),
    (b'{"prompt": "ab\\ud800"}', '"prompt" is not valid UTF-8 text (lone surrogate U+D800 at '
                                   'character 2)'),
    (b"[" * 100 + b"]" * 100, "the body is refused: JSON nested deeper than 32 levels"),
    (b'{"prompt": "x", "top_k": 4294967296}', "top_k=4294967296 must be an integer in [0, 256]"),
]


@pytest.mark.slow  # 21 s; the default suite stays near its budget (docs/testing.md)
def test_load_with_bad_requests_in_between(server, tmp_path):
  responses = tmp_path / "responses.jsonl"
  load = subprocess.Popen(
      [sys.executable, str(REPO / "scripts" / "bench" / "load_test.py"), f"--url={server.url}",
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


@pytest.mark.smoke
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
  assert values["meshkit_e2e_request_latency_seconds_count"] >= 1
  assert np.isfinite(values["meshkit_time_to_first_token_seconds_sum"])


def test_port_in_use_is_a_clear_error(server):
  other = server_lib.Server(server.batcher, port=server.port)
  with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{server.port}"):
    other.start()


def test_command_line_mistakes_are_one_error_line(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  done = preloaded.run("toolkit.serve", ["--config=experiments/lm.py:tiny",
                                         f"--checkpoint={tmp_path / 'missing'}", "--port=0"],
                       env=env, timeout=TIMEOUT_S)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"error: --checkpoint='{tmp_path / 'missing'}' does not exist")


class _FailingEngine:
  """The real engine, except that every step raises (say the device went away)."""

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def step(self, *args, **kwargs):
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


# --- fuzzing: a few hundred malformed requests, each a 4xx, never a 5xx or a traceback --------

FUZZ_REQUESTS = 500  # 3 in 5 to /generate, the rest to the OpenAI routes
FUZZ_SECONDS = 300  # the whole fuzz run, valid requests included
VALID_EVERY = 10    # a valid request after every 10 malformed ones

_BAD_VALUES = {  # field -> values that are each wrong for it
    "prompt": [7, None, [], {}, True, "", "\ud800", "ab\udfffcd", "\ud83d", "x\udc80"],
    "tokens": [[], [256], [-1], [2**31], [2**63], [10**30], [1.5], [True], ["a"], [[1]], "abc",
               {"0": 1}, None, [1, 2**40]],
    "max_tokens": [0, -1, 1.5, "4", None, True, 10**30, 2**63, 64, [4]],
    "temperature": [-1, "hot", None, [1], True, 10**400 and "1e999", -0.5],
    "top_k": [-1, 2.5, "3", 2**31, 2**63, 10**30, None, True],
    "top_p": [0, -0.1, 1.5, "1", None, [0.5], True],
    "seed": [-1, 2**32, 2**64, 1.5, "0", None, True],
    "stop_tokens": [[-1], [256], [2**40], "10", [1.5], list(range(9)), [None], {"a": 1}],
}
# Literals that are not valid in every position: inserted as raw JSON text.
_RAW_VALUES = {"temperature": ["NaN", "Infinity", "-Infinity", "1e999"],
               "top_p": ["NaN", "1e999"], "max_tokens": ["1e999", "-1e999"]}
# The OpenAI routes' fields -> values that are each wrong for them (toolkit/inference/
# openai_protocol.py); "stream_options" values go with "stream": true.
_OPENAI_BAD = {
    "model": [7, None, "gpt-4", "", ["meshkit"]],
    "max_tokens": [0, -1, 1.5, "4", True, 10**30, 2**63, 64, [4]],
    "temperature": [-1, 2.5, "hot", True, [1], -0.0001],
    "top_p": [0, -0.1, 1.5, "1", True],
    "top_k": [-1, 257, 1.5, "3"],
    "n": [0, -1, 65, 1.5, "2", True, 10**9],
    "seed": [-1, 2**32, 1.5, "0", True],
    "stop": ["", [""], ["a"] * 5, 7, [7], {"a": 1}, ["x" * 300], "\ud800"],
    "stop_token_ids": [[256], [-1], "1", [1.5], list(range(9)), [True]],
    "stream": ["yes", 1, [True]],
    "stream_options": [{"include_usage": "yes"}, {"bogus": 1}, "x", [1]],
    "ignore_eos": ["yes", 1],
    "logprobs": [1, 5], "logit_bias": [{"1": 5}], "frequency_penalty": [0.5],
    "presence_penalty": [-1], "unknown_field": [1],
}
_COMPLETION_BAD = {
    **_OPENAI_BAD,
    "prompt": [7, None, [], [[]], [1, "a"], [256], [-1], [[1], "a"], "", "\ud800", [2**40],
               {"a": 1}, True, [1.5], "x" * 70],
    "echo": [True], "best_of": [2], "suffix": ["x"],
}
_CHAT_BAD = {
    **_OPENAI_BAD,
    "messages": [[], "hi", [{"role": "robot", "content": "x"}], [{"content": "x"}],
                 [{"role": "user"}], [{"role": "user", "content": 7}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "tool", "content": "x", "tool_call_id": "1"}],
                 [{"role": "user", "content": "x", "tool_calls": []}], ["not an object"],
                 [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "x",
                                                            "name": 3}],
                 [{"role": "user", "content": "x" * 70}]],
    "max_completion_tokens": [0, 10**30, "5"],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "response_format": [{"type": "json_object"}], "tool_choice": ["auto"], "echo": [True],
}
_OPENAI_ROUTES = {"/v1/completions": ({"prompt": "The ", "max_tokens": 4}, _COMPLETION_BAD),
                  "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 4}, _CHAT_BAD)}


def _generic_malformed(rng, valid: dict) -> tuple[bytes, dict] | None:
  """Bodies that are wrong on any route (None: pick a route-specific one)."""
  kind = rng.randrange(9)
  if kind == 0:  # random bytes
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), {}
  if kind == 1:  # a valid request cut short
    text = json.dumps({**valid, "temperature": 0.5})
    return text[:rng.randrange(1, len(text))].encode(), {}
  if kind == 2:  # JSON that is not an object
    return rng.choice([b"[]", b"1", b'"x"', b"null", b"true", b"[{}]", b"3.5e3"]), {}
  if kind == 3:  # nested too deep, in the body or in a field
    depth = rng.choice([33, 100, 5000, 200_000])
    nested = "[" * depth + "]" * depth
    return rng.choice([nested, '{"prompt": "x", "id": ' + nested + "}"]).encode(), {}
  if kind == 4:  # bytes that are not UTF-8 inside a string, or a body over the size limit
    if rng.random() < 0.8:
      return b'{"prompt": "ab' + bytes([rng.randrange(0x80, 0x100)]) + b'"}', {}
    return b'{"prompt": "' + b"x" * (server_lib.MAX_BODY_BYTES + 10) + b'"}', {}
  if kind == 5:  # a body that claims a compression it does not have
    return json.dumps(valid).encode(), {"Content-Encoding": rng.choice(["gzip", "deflate",
                                                                        "br"])}
  if kind == 6:  # an integer beyond the 4300 digits Python's int() takes (once a 500)
    return json.dumps(valid)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}", {}
  return None


def _malformed(rng) -> tuple[bytes, dict]:
  """One /generate body (and extra headers) that must be refused with a 4xx."""
  valid = {"prompt": "The ", "max_tokens": 4}
  generic = _generic_malformed(rng, valid)
  if generic is not None:
    return generic
  kind = rng.randrange(3)
  if kind == 0:  # one field with a wrong value
    field = rng.choice(sorted(_BAD_VALUES))
    body = {k: v for k, v in valid.items() if field != "tokens" or k != "prompt"}
    body[field] = rng.choice(_BAD_VALUES[field])
    return json.dumps(body).encode(), {}
  if kind == 1:  # a literal Python's json reads as a non-finite float, or a huge number
    field = rng.choice(sorted(_RAW_VALUES))
    return f'{{"prompt": "x", "{field}": {rng.choice(_RAW_VALUES[field])}}}'.encode(), {}
  # fields: unknown, both prompt and tokens, neither
  return json.dumps(rng.choice([{**valid, f"f{rng.randrange(1000)}": 1},
                                {**valid, "tokens": [1]}, {"max_tokens": 3},
                                {"prompt": "x" * 300, "max_tokens": 4}])).encode(), {}


def _malformed_openai(rng) -> tuple[str, bytes, dict]:
  """One OpenAI-route request (path, body, extra headers) that must be refused with a 4xx."""
  path = rng.choice(sorted(_OPENAI_ROUTES))
  valid, bad = _OPENAI_ROUTES[path]
  generic = _generic_malformed(rng, valid)
  if generic is not None:
    return (path, *generic)
  kind = rng.randrange(4)
  if kind == 0:  # a literal Python's json reads as a non-finite float, or a huge number
    field = rng.choice(sorted(_RAW_VALUES))
    body = json.dumps(valid)[:-1] + f', "{field}": {rng.choice(_RAW_VALUES[field])}}}'
    return path, body.encode(), {}
  if kind == 1:  # the request's text field missing, stream_options without stream
    return path, json.dumps(rng.choice([{"max_tokens": 3}, {**valid, "stream_options": {
        "include_usage": True}}])).encode(), {}
  field = rng.choice(sorted(bad))
  body = {**valid, field: rng.choice(bad[field])}
  if field == "stream_options":
    body["stream"] = True
  return path, json.dumps(body).encode(), {}


def post_raw(url: str, body: bytes, headers: dict, path: str = "/generate") -> tuple[int, bytes]:
  request = urllib.request.Request(url + path, data=body,
                                   headers={"Content-Type": "application/json", **headers})
  try:
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
      return response.status, response.read()
  except urllib.error.HTTPError as e:
    return e.code, e.read()


def _valid_request(url: str, rng, index: int) -> tuple[list[int], str]:
  """A valid greedy request to /generate, /v1/completions or /v1/chat/completions in turn:
  (the prompt's ids, the completion text)."""
  prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 12)))
  route = index % 3
  body = ({"prompt": prompt, "max_tokens": 5} if route < 2 else
          {"messages": [{"role": "user", "content": prompt}], "max_tokens": 5})
  path = ("/generate", "/v1/completions", "/v1/chat/completions")[route]
  status, payload = post_raw(url, json.dumps(body).encode(), {}, path)
  assert status == 200, (path, payload)
  answer = json.loads(payload)
  text = (answer["completion"] if route == 0 else answer["choices"][0]["text"] if route == 1
          else answer["choices"][0]["message"]["content"])
  rendered = prompt if route < 2 else f"user: {prompt}\nassistant:"  # the default template
  return list(text_data.encode(rendered)), text


def _check_refusal(status: int, payload: bytes, openai_shape: bool, what) -> None:
  assert 400 <= status < 500, (status, what, payload[:300])
  if payload.startswith(b"{"):  # else aiohttp's own 400 for a message it cannot parse
    error = json.loads(payload)["error"]
    if openai_shape:
      assert set(error) == {"message", "type", "param", "code"}, payload
      assert error["message"] and error["type"] == "invalid_request_error", payload
    else:
      assert error, payload


def test_fuzz_malformed_requests_get_4xx_and_valid_ones_still_right(server, capfd):
  import logging  # pylint: disable=g-import-not-at-top
  import random  # pylint: disable=g-import-not-at-top
  records: list[logging.LogRecord] = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  logging.getLogger("aiohttp").addHandler(handler)
  rng = random.Random(16)
  started = time.monotonic()
  answers, refused = [], collections.Counter()
  try:
    for i in range(FUZZ_REQUESTS):
      assert time.monotonic() - started < FUZZ_SECONDS, f"only {i} requests in time"
      if rng.random() < 0.6:
        path, (body, headers) = "/generate", _malformed(rng)
      else:
        path, body, headers = _malformed_openai(rng)
      status, payload = post_raw(server.url, body, headers, path)
      refused[path, status] += 1
      _check_refusal(status, payload, path != "/generate", (path, body[:200], headers))
      if i % VALID_EVERY == VALID_EVERY - 1:
        answers.append(_valid_request(server.url, rng, i // VALID_EVERY))
  finally:
    logging.getLogger("aiohttp").removeHandler(handler)
  # Each valid answer equals its prompt generated alone (one slot: one prompt at a time).
  alone = engine_lib.generate(server.batcher.engine, [np.asarray(p, np.int32) for p, _ in answers],
                              [SamplingParams(max_tokens=5)] * len(answers), 1)
  for (prompt, text), result in zip(answers, alone):
    assert text == text_data.decode(result.tokens), prompt
  assert len(answers) == FUZZ_REQUESTS // VALID_EVERY
  assert not records, [r.getMessage() for r in records]
  captured = capfd.readouterr()
  assert "Traceback" not in captured.out + captured.err
  print(f"{sum(refused.values())} malformed requests: " + ", ".join(
      f"{path} {status}: {count}" for (path, status), count in sorted(refused.items())))
