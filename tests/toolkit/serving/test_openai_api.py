"""The OpenAI-compatible routes, through the official `openai` client (sync, async, streaming)
against a server on 127.0.0.1: the text equals the server's own /generate for the same seed,
streamed pieces join to the whole answer, usage counts the tokens, n and stop strings work,
bad requests get OpenAI's error object, a client that disconnects frees its slot within two
steps, /metrics has the latency histograms, and scripts/bench/bench_serve.py reports every column.
"""
import asyncio
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx
from prometheus_client.parser import text_string_to_metric_families

import sharding
from models import Llama, LlamaConfig
from tests import extras
from toolkit.data import text as text_data
from toolkit.inference import engine as engine_lib
from toolkit.serving import openai_protocol
from toolkit.serving import server as server_lib
from toolkit.inference.codec import BYTE_LEVEL, Codec
from toolkit.inference.sampling import SamplingParams
from toolkit.serving.text_stream import TextStream

openai = extras.require("openai")  # the test extra: the official client
REPO = pathlib.Path(__file__).resolve().parents[3]
CFG = LlamaConfig.preset("tiny")
TIMEOUT_S = 120
MODEL = "tiny"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine():
  params = nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(params=0)), nnx.Param))
  mesh = sharding.make_mesh(sharding.parse_axis_sizes("data:1", "mesh.ici"), [],
                            jax.devices()[:1])
  return engine_lib.Engine(CFG, params, mesh, sharding.Rules.preset("dp"), cache_length=64)


@pytest.fixture(scope="module")
def server(engine):
  batcher = engine_lib.Batcher(engine, batch_size=4, max_queue=64)
  batcher.warmup()
  running = server_lib.Server(batcher, port=0, request_timeout_s=TIMEOUT_S,
                              model_name=MODEL).start()
  yield running
  running.stop()


def client(url: str) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S)


def post(url: str, path: str, body) -> tuple[int, dict]:
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  request = urllib.request.Request(url + path, data=data,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def wait_for(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
    time.sleep(0.005)


# --- the text of a stream ----------------------------------------------------------------------

def test_text_stream_holds_back_partial_characters_and_stop_strings():
  decode = text_data.decode
  stream = TextStream(decode)
  assert stream.add([0xC3]) == ""             # the first byte of "é" is held back
  assert stream.add([0xA9, ord("a")]) == "éa"
  # Random bytes, valid UTF-8 or not, one token at a time: the pieces join to the decode.
  rng = np.random.default_rng(0)
  for _ in range(50):
    tokens = rng.integers(0, 256, rng.integers(1, 30)).tolist()
    stream = TextStream(decode)
    joined = "".join(stream.add([t]) for t in tokens) + stream.finish()
    assert joined == decode(tokens)
  # A stop string completed by a later token: the text ends before it, nothing after.
  stream = TextStream(decode, stop=("lo w", "xyz"))
  tokens = list(b"hello world")
  pieces = [stream.add([t]) for t in tokens]
  assert "".join(pieces) + stream.finish() == "hel" and stream.stopped
  assert len(stream.tokens) == len(b"hello w")  # counted up to the token that completed it
  assert "".join(pieces[:4]) == "h"  # "el" held back while "lo w" could still start there


def test_chat_template_comes_from_the_flag_then_the_tokenizer_folder_then_the_default(tmp_path):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  encode, where, end = openai_protocol.chat_encoder(BYTE_LEVEL)
  assert where == "the default chat template" and end == ()  # never trained on its turns
  assert bytes(encode(messages).tolist()) == b"system: Be brief.\nuser: Hi\nassistant:"
  extras.require("tokenizers")  # the test extra: a Hugging Face tokenizer.json
  folder = tmp_path / "model"
  folder.mkdir()
  shutil.copy(REPO / "tests" / "fixtures" / "tokenizer.json", folder)
  codec = Codec.load(str(folder))
  assert openai_protocol.chat_encoder(codec)[1] == "the default chat template"  # none there
  (folder / "chat_template.jinja").write_text(
      "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}[assistant]{% endif %}")
  encode, where, end = openai_protocol.chat_encoder(codec)
  assert where == str(folder / "chat_template.jinja")
  assert end == tuple(codec.tokenizer.encode("\n")[:1])  # what the template writes after a turn
  # Tokenized without special tokens, as apply_chat_template(tokenize=True) does.
  rendered = "[system] Be brief.\n[user] Hi\n[assistant]"
  assert encode(messages).tolist() == codec.tokenizer.encode(rendered).tolist()
  encode, _, _ = openai_protocol.chat_encoder(codec, "{{ messages[-1].content }}!")
  assert codec.decode(encode(messages)) == codec.decode(codec.tokenizer.encode("Hi!"))


# --- completions and chat through the openai client -------------------------------------------

@pytest.mark.smoke
def test_completions_equal_generate_and_stream_joins_to_the_answer(server):
  openai_client = client(server.url)
  assert [m.id for m in openai_client.models.list().data] == [MODEL]
  for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}):
    full = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            **sampling)
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **sampling))
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("length") == 1
    # The server's own route, same prompt and seed: the same tokens.
    status, generated = post(server.url, "/generate", {"prompt": PROMPT, "max_tokens": 12,
                                                       **sampling})
    assert status == 200 and choice.text == generated["completion"], sampling
    assert full.usage.prompt_tokens == len(PROMPT.encode()) == generated["prompt_tokens"]
    assert full.usage.completion_tokens == 12 == full.usage.total_tokens - len(PROMPT.encode())
  # Two prompts at once with n=2 each (greedy), and token ids as the prompt.
  batch = openai_client.completions.create(model=MODEL, prompt=[PROMPT, "A"], max_tokens=4,
                                           temperature=0, n=2)
  by_ids = openai_client.completions.create(model=MODEL, prompt=list(PROMPT.encode()),
                                            max_tokens=4, temperature=0)
  expected = [post(server.url, "/generate", {"prompt": p, "max_tokens": 4})[1]["completion"]
              for p in (PROMPT, "A")]
  assert [c.index for c in batch.choices] == [0, 1, 2, 3]
  assert [c.text for c in batch.choices] == [expected[0]] * 2 + [expected[1]] * 2
  assert by_ids.choices[0].text == expected[0]
  assert batch.usage.prompt_tokens == len(PROMPT) + 1 and batch.usage.completion_tokens == 16


def test_chat_async_streaming_n_choices_and_usage(server):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  rendered = "system: Be brief.\nuser: Hi\nassistant:"  # the default template (no tokenizer)

  async def run():
    async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=TIMEOUT_S)
    sampling = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.8,
                    seed=11)
    full, alone = await asyncio.gather(
        async_client.chat.completions.create(n=3, **sampling),
        async_client.chat.completions.create(**{**sampling, "seed": 12}))
    stream = await async_client.chat.completions.create(
        n=3, stream=True, stream_options={"include_usage": True}, **sampling)
    texts, roles, reasons, usage = [""] * 3, [None] * 3, [None] * 3, None
    async for chunk in stream:
      usage = chunk.usage or usage
      for choice in chunk.choices:
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] = roles[choice.index] or choice.delta.role
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    await async_client.close()
    return full, alone, texts, roles, reasons, usage

  full, alone, texts, roles, reasons, usage = asyncio.run(run())
  assert full.object == "chat.completion" and [c.index for c in full.choices] == [0, 1, 2]
  assert texts == [c.message.content for c in full.choices]
  assert roles == ["assistant"] * 3 and reasons == ["length"] * 3
  # Choice i of n draws with seed + i: choice 1 is the request with seed 12 alone.
  assert alone.choices[0].message.content == full.choices[1].message.content
  assert full.usage.prompt_tokens == len(rendered.encode()) == usage.prompt_tokens
  assert full.usage.completion_tokens == 30 == usage.completion_tokens


def test_stop_strings_end_the_text_and_free_the_slot(server):
  openai_client = client(server.url)
  batcher = server.batcher
  for prompt in ("The ", "Once upon", "abc", "x y z", "Hello, "):
    reference = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                 temperature=0).choices[0].text
    # An early stop string (the engine must not reach max_tokens before the cancel lands).
    stops = [reference[i:i + 2] for i in range(2, min(10, len(reference) - 2))
             if "\ufffd" not in reference[i:i + 2]]
    if stops:
      break
  assert stops, "no clean two-character stop string in the greedy references"
  stop = stops[0]
  expected = reference[:reference.index(stop)]
  cancelled = batcher.counters["requests_cancelled"]
  full = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                          temperature=0, stop=[stop, "never"])
  streamed = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                              temperature=0, stop=stop, stream=True)
  pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed]
  assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
  assert "".join(text for text, _ in pieces) == expected and pieces[-1][1] == "stop"
  assert 0 < full.usage.completion_tokens < 24
  # Both requests were cancelled in the engine when the stop string appeared.
  wait_for(lambda: batcher.counters["requests_cancelled"] == cancelled + 2 and
           batcher.active == 0, "cancellation of the stopped requests")


# --- errors ---------------------------------------------------------------------------------

BAD_REQUESTS = [  # (path, body, status, param, words of the message)
    ("/v1/completions", b"{oops", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "integer in [1, 64]"),
    ("/v1/completions", {"prompt": "x", "n": 65}, 400, "n", "integer in [1, 64]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens",
     "maximum context length is 64"),
    ("/v1/completions", {"prompt": "x" * 70}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "up to 4"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed when 'stream' is true"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, 400,
     "stream_options.bogus", "Unrecognized"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "not supported"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    ("/v1/completions", {"prompt": [1, 999]}, 400, "prompt", "outside [0, 256)"),
    ("/v1/completions", {"prompt": [[1], "a"]}, 400, "prompt", "without mixing"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [300]}, 400, "stop_token_ids",
     "not a token id"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "list of 1 to"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400,
     "messages[0].content", "must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content",
     "text only"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", "must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "integer >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True},
     400, "echo", "Unrecognized"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
  for path, body, status, param, words in BAD_REQUESTS:
    got, payload = post(server.url, path, body)
    assert got == status, (body, payload)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, payload
    assert error["param"] == param and words in error["message"], (body, error)
    assert error["type"] == "invalid_request_error"
  for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404)):
    request = urllib.request.Request(server.url + path, method=method, data=b"{}" if
                                     method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as raised:
      urllib.request.urlopen(request, timeout=TIMEOUT_S)
    assert raised.value.code == status
    assert json.loads(raised.value.read())["error"]["type"] == "invalid_request_error"
  # The client's own exception types read them.
  openai_client = client(server.url)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    openai_client.completions.create(model="other", prompt="x")
  with pytest.raises(openai.BadRequestError, match="'n' must be"):
    openai_client.chat.completions.create(model=MODEL, n=0,
                                          messages=[{"role": "user", "content": "x"}])
  done = openai_client.completions.create(model=MODEL, prompt="x", max_tokens=3)
  assert done.usage.completion_tokens == 3


# --- cancellation ---------------------------------------------------------------------------

class GatedBatcher(engine_lib.Batcher):
  """A batcher that steps only when the test allows it (`allow(n)`), so that a test can
  count the steps between a disconnect and the freed slot."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.permits = threading.Semaphore(0)
    self.steps_done = 0

  def allow(self, steps: int) -> None:
    self.permits.release(steps)

  def step(self, wait_s: float = 0.0) -> bool:
    if not self.permits.acquire(timeout=max(wait_s, 0.01)):
      return bool(self.active)
    try:
      return super().step(0.0)
    finally:
      self.steps_done += 1


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
  """Sends a request on a socket of our own (closing it is the disconnect)."""
  host, port = url.removeprefix("http://").split(":")
  sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
  data = json.dumps(body).encode()
  sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
  return sock


def test_client_that_disconnects_frees_its_slot_within_two_steps(server):
  batcher = GatedBatcher(server.batcher.engine, batch_size=4, max_queue=1)
  gated = server_lib.Server(batcher, port=0, request_timeout_s=TIMEOUT_S,
                            model_name=MODEL).start()
  counters = gated.service.counters
  try:
    for streaming, disconnects in ((True, 1), (False, 2)):
      body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "stream": streaming}
      before = batcher.steps_done
      if streaming:  # the openai client, closed after the first chunk
        stream = client(gated.url).completions.create(**body)
        batcher.allow(3)
        assert next(iter(stream)).choices[0].index == 0
      else:
        submitted = batcher.counters["requests_submitted"]
        sock = _raw_post(gated.url, "/v1/completions", body)
        wait_for(lambda: batcher.counters["requests_submitted"] > submitted, "the request")
        batcher.allow(3)  # once it waits: steps before would find nothing to do
      wait_for(lambda: batcher.steps_done == before + 3, "three steps")
      assert batcher.active == 1
      if streaming:
        stream.close()
      else:
        sock.close()
      wait_for(lambda: counters["client_disconnects"] == disconnects, "the disconnect")
      assert batcher.active == 1  # still running: no step since
      steps = batcher.steps_done
      for _ in range(2):
        batcher.allow(1)
        wait_for(lambda: batcher.steps_done > steps, "a step")
        steps = batcher.steps_done
        if batcher.active == 0:
          break
      assert batcher.active == 0, "the slot was not freed within two steps"
      assert batcher.counters["requests_cancelled"] == disconnects
    # A full queue is a 429 in OpenAI's shape: one request waits (no steps), the next is refused.
    waiting = _raw_post(gated.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    wait_for(lambda: batcher.queue.qsize() == 1, "the queued request")
    status, payload = post(gated.url, "/v1/completions", {"prompt": "y", "max_tokens": 2})
    assert status == 429 and payload["error"]["type"] == "rate_limit_error"
    with urllib.request.urlopen(gated.url + "/metrics", timeout=TIMEOUT_S) as response:
      metrics = response.read().decode().splitlines()
    assert "meshkit_client_disconnects_total 2" in metrics
    assert "meshkit_requests_cancelled_total 2" in metrics
    waiting.close()
  finally:
    batcher.allow(1000)
    gated.stop()


# --- metrics and the benchmark ----------------------------------------------------------------

def _histograms(url: str) -> dict[str, dict[str, float]]:
  with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT_S) as response:
    text = response.read().decode()
  found = {}
  for family in text_string_to_metric_families(text):
    if family.type == "histogram":
      found[family.name] = {
          (s.name.removeprefix(family.name), s.labels.get("le", "")): s.value
          for s in family.samples}
  return found


def test_metrics_export_latency_histograms(server):
  before = _histograms(server.url)
  openai_client = client(server.url)
  openai_client.completions.create(model=MODEL, prompt="ab", max_tokens=5)
  list(openai_client.completions.create(model=MODEL, prompt="cd", max_tokens=5, stream=True))
  post(server.url, "/generate", {"prompt": "ef", "max_tokens": 5})
  after = _histograms(server.url)
  names = {"meshkit_time_to_first_token_seconds": 3, "meshkit_inter_token_latency_seconds": 12,
           "meshkit_time_per_output_token_seconds": 3, "meshkit_e2e_request_latency_seconds": 3}
  for name, observations in names.items():
    count = after[name][("_count", "")]
    assert count - before[name][("_count", "")] == observations, name
    buckets = sorted((float(le), v) for (kind, le), v in after[name].items()
                     if kind == "_bucket")
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), name  # cumulative
    assert buckets[-1] == (float("inf"), count) and after[name][("_sum", "")] > 0


def test_bench_serve_quick_reports_every_column(server, tmp_path):
  plot = tmp_path / "latency.png"
  for workload in ("random", "shared_prefix", "long_prompt"):
    report = tmp_path / f"{workload}.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "bench_serve.py"), f"--url={server.url}",
         "--quick", f"--workload={workload}", f"--json={report}",
         *([f"--plot={plot}"] if workload == "random" else [])],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| rate"))
    for column in ("rate (req/s)", "completed", "failed", "req/s", "output tok/s",
                   "total tok/s", "TTFT ms", "TPOT ms", "ITL ms", "E2E ms"):
      assert column in header, (column, header)
    results = json.loads(report.read_text())
    runs = results["runs"]
    assert len(runs) == (1 if workload == "long_prompt" else 2)
    for run in runs:
      assert run["completed"] == run["requests"] and run["failed"] == 0
      assert run["output_throughput"] > 0 and run["request_throughput"] > 0
      for name in ("ttft", "tpot", "itl", "e2e"):
        stats = run[f"{name}_ms"]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (workload, name, stats)
    if workload == "long_prompt":
      assert runs[0]["long_prompt_len"] == 32 and runs[0]["itl_before_ms"]["p99"] > 0
      assert "long prompt of 32 tokens" in done.stdout
  assert plot.stat().st_size > 0


def test_a_fine_tunes_template_is_served_and_ends_its_answers():
  """Issue 62: toolkit.serve ignored an SFT config's chat template (a fine-tune scoring 100 %
  answered 'ssisfantfs'), and answers ran past the end of the turn to max_tokens. The config's
  template is the default, and a chat answer stops at its end-of-turn token; a completion and
  a request with ignore_eos do not."""
  from experiments import lm, sft  # pylint: disable=g-import-not-at-top
  config = sft.get_config("cpu")
  template = openai_protocol.trained_chat_template(config)
  assert template and template == config.data.chat_template
  assert openai_protocol.trained_chat_template(lm.get_config("cpu")) == ""
  encode, _, end = openai_protocol.chat_encoder(BYTE_LEVEL, template)
  assert end == (ord("\n"),)  # the byte template closes an answer with a line break
  ctx = openai_protocol.ModelContext(
      name=MODEL, vocab_size=256, max_model_len=64, defaults=SamplingParams(max_tokens=8),
      codec=BYTE_LEVEL, encode_chat=encode, draw_seed=lambda: 0, end_of_turn=end)
  messages = [{"role": "user", "content": "Repeat: cat"}]
  chat = openai_protocol.parse_chat({"model": MODEL, "messages": messages}, ctx)
  assert ord("\n") in chat.params[0].stop_tokens
  raw = openai_protocol.parse_chat({"model": MODEL, "messages": messages, "ignore_eos": True},
                                   ctx)
  assert ord("\n") not in raw.params[0].stop_tokens
  completion = openai_protocol.parse_completion({"model": MODEL, "prompt": "cat"}, ctx)
  assert ord("\n") not in completion.params[0].stop_tokens
