"""An HTTP JSON endpoint over the continuous batcher (aiohttp); `python -m toolkit.serve` runs it.

  python -m toolkit.serve --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --port=8000
  curl -s localhost:8000/generate -d '{"prompt": "The ", "max_tokens": 40, "temperature": 0.8}'

Endpoints:
  POST /generate  {"prompt": text | "tokens": [ids], max_tokens, temperature, top_k, top_p,
                   seed, stop_tokens} -> {"completion", "tokens", "finish_reason",
                   "prompt_tokens", "completion_tokens", "latency_s", "time_to_first_token_s"}
  GET /v1/models, POST /v1/completions, POST /v1/chat/completions: OpenAI's API, streaming
                  included (toolkit/serving/openai_api.py)
  GET  /health    200 {"status": "ok", ...} while the decode loop runs and not every one of
                  its last UNHEALTHY_AFTER_STEP_ERRORS steps raised, else 503
  GET  /metrics   Prometheus text: requests, cancellations, tokens, steps, queue depth, slot
                  use, and histograms of time to first token, inter-token latency, time per
                  output token and end-to-end latency (toolkit/serving/latency.py)

Threads: aiohttp's event loop parses requests and waits on the batcher's events; one batcher
thread owns the devices and steps the decode batch, admitting queued requests at every step.
A client that disconnects before its answer has its request cancelled (aiohttp cancels the
handler; the batcher frees the slot at its next step). Bad requests get a 4xx with an `error`
message and never reach the batcher: a body over 1 MiB (413), JSON that does not parse or
nests deeper than 32 levels, prompt text that is not valid UTF-8 (a lone surrogate escape),
token ids outside the vocabulary, sampling fields out of range (400).
tests/toolkit/serving/test_serve.py fuzzes it with a few hundred such requests.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import random
import threading
import time

import numpy as np
from aiohttp import http_exceptions, web

from toolkit.inference import engine as engine_lib
from toolkit.serving import openai_protocol
from toolkit.inference.codec import BYTE_LEVEL, Codec
from toolkit.serving.http_request import (MAX_BODY_BYTES, BodyError, PastDeadline,
                                            Submissions, read_json)
from toolkit.serving.latency import Histograms
from toolkit.serving.openai_api import OpenAIRoutes
from toolkit.inference.requests import parse_prompt, result_record
from toolkit.inference.sampling import RequestError, SamplingParams

__all__ = ["Listener", "MAX_BODY_BYTES", "Server", "Service", "UNHEALTHY_AFTER_STEP_ERRORS"]
# /health answers 503 once this many decode steps in a row raised (one can be a bad request).
UNHEALTHY_AFTER_STEP_ERRORS = 3
REJECTED_STATUSES = (400, 404, 405, 413, 429, 503)


def _client_mistakes_without_tracebacks(record: logging.LogRecord) -> bool:
  """A filter for aiohttp's server logger. aiohttp answers an HTTP message it cannot parse
  (bad framing, an unknown Content-Encoding, a body that does not decode) with a 400 and logs
  it as an error with a traceback; that is the client's mistake, so it becomes a debug line.
  Errors of the server itself keep theirs."""
  error = record.exc_info[1] if record.exc_info else None
  if isinstance(error, (http_exceptions.HttpProcessingError, web.RequestPayloadError)):
    record.levelno, record.levelname, record.exc_info = logging.DEBUG, "DEBUG", None
    record.msg, record.args = f"{record.msg}: %s", (*record.args, " ".join(str(error).split()))
  return True


def _error(status: int, message: str) -> web.Response:
  return web.json_response({"error": message}, status=status)


class Service:
  """The request handlers; `batcher` is stepped by another thread. `model_name` is the name
  the OpenAI routes serve; `chat_template` a Jinja template (text or .jinja file) replacing
  the tokenizer folder's (toolkit/serving/openai_protocol.py: chat_encoder)."""

  def __init__(self, batcher: engine_lib.Batcher, defaults: SamplingParams,
               request_timeout_s: float, info: dict, codec: Codec = BYTE_LEVEL,
               model_name: str = "meshkit", chat_template: str = ""):
    self.batcher, self.defaults, self.request_timeout_s = batcher, defaults, request_timeout_s
    self.codec = codec  # text in and out; its EOS ids end every request
    self.info = info
    self.counters = collections.Counter()
    self.histograms = Histograms()
    self.loop_alive = lambda: True
    self.started = time.time()
    encode_chat, self.chat_template, end_of_turn = openai_protocol.chat_encoder(codec,
                                                                                chat_template)
    seeds = random.Random()  # seeded from the OS: requests without a seed differ
    self.openai = OpenAIRoutes(self, openai_protocol.ModelContext(
        name=model_name, vocab_size=batcher.engine.model_cfg.vocab_size,
        max_model_len=batcher.engine.cache_length, defaults=defaults, codec=codec,
        encode_chat=encode_chat, draw_seed=lambda: seeds.getrandbits(32),
        end_of_turn=end_of_turn))

  def app(self) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.add_routes([web.post("/generate", self.generate), web.get("/health", self.health),
                    web.get("/metrics", self.metrics)])
    self.openai.add_to(app)
    return app

  def _reject(self, status: int, message: str) -> web.Response:
    self.counters[f"rejected_{status}"] += 1
    return _error(status, message)

  def _parse_generate(self, body) -> tuple[np.ndarray, SamplingParams]:
    vocab_size = self.batcher.engine.model_cfg.vocab_size
    prompt = parse_prompt(body, vocab_size, self.codec)
    fields = {k: v for k, v in body.items() if k not in ("prompt", "tokens", "id")}
    params = self.codec.stop_at_eos(SamplingParams.from_dict(fields, vocab_size,
                                                             self.defaults))
    self.batcher.engine.check_request(prompt, params)
    return prompt, params

  async def generate(self, request: web.Request) -> web.Response:
    try:
      body = await read_json(request)
      prompt, params = self._parse_generate(body)
    except BodyError as e:
      return self._reject(e.status, e.message)
    except RequestError as e:
      return self._reject(400, str(e))
    submissions = Submissions(self.batcher, [prompt], [params], live=False)
    try:
      submissions.submit()
    except queue.Full:
      return self._reject(503, f"the queue is full ({self.batcher.queue.maxsize} requests "
                               f"waiting); retry later")
    except RequestError as e:
      return self._reject(400, str(e))
    try:
      async for _ in submissions.events(time.monotonic() + self.request_timeout_s):
        pass
    except PastDeadline:
      self.counters["timeouts"] += 1
      return _error(504, f"no result within {self.request_timeout_s:.0f} s; the server is "
                         f"overloaded or stuck")
    except asyncio.CancelledError:  # the client went away (aiohttp's handler cancellation)
      self.counters["client_disconnects"] += 1
      raise
    finally:
      submissions.cancel_all()  # nothing once it ended
    result = submissions.results[0]
    if result.error is not None:
      return _error(500, f"generation failed: {result.error}")
    self.histograms.observe(submissions.requests[0].submitted, submissions.token_times[0],
                            time.perf_counter())
    record = result_record(result, body, self.codec)
    record.update(latency_s=round(result.latency_s, 6),
                  time_to_first_token_s=round(result.time_to_first_token_s, 6))
    return web.json_response(record)

  async def health(self, request: web.Request) -> web.Response:
    """200 while the decode loop runs and its last steps did not all fail, else 503."""
    del request
    failing = self.batcher.consecutive_step_errors
    if not self.loop_alive():
      status = "decode loop stopped"
    elif failing >= UNHEALTHY_AFTER_STEP_ERRORS:
      status = f"failing: the last {failing} decode steps raised: {self.batcher.last_step_error}"
    else:
      status = "ok"
    body = {"status": status, **self.info, "active": self.batcher.active,
            "queued": self.batcher.queue.qsize(), "step_errors": self.batcher.counters[
                "step_errors"]}
    return web.json_response(body, status=200 if status == "ok" else 503)

  async def metrics(self, request: web.Request) -> web.Response:
    del request
    c, b = self.batcher.counters, self.batcher
    steps = c["decode_steps"]
    lines = []

    def add(name: str, kind: str, help_text: str, value, labels: str = "") -> None:
      if not any(line.startswith(f"# TYPE meshkit_{name} ") for line in lines):
        lines.extend([f"# HELP meshkit_{name} {help_text}", f"# TYPE meshkit_{name} {kind}"])
      lines.append(f"meshkit_{name}{labels} {value}")

    add("requests_submitted_total", "counter", "Requests accepted into the queue.",
        c["requests_submitted"])
    add("requests_finished_total", "counter", "Requests answered.", c["requests_finished"])
    add("requests_failed_total", "counter", "Requests that failed in generation.",
        c["requests_failed"])
    add("requests_cancelled_total", "counter", "Requests cancelled before their end: the client "
        "disconnected, or a stop string ended them.", c["requests_cancelled"])
    add("client_disconnects_total", "counter", "HTTP requests whose client went away before "
        "the answer (their requests are cancelled).", self.counters["client_disconnects"])
    add("request_timeouts_total", "counter", "HTTP requests answered 504 past "
        "--request_timeout.", self.counters["timeouts"])
    for status in REJECTED_STATUSES:
      add("requests_rejected_total", "counter", "Requests refused before queueing.",
          self.counters[f"rejected_{status}"], f'{{status="{status}"}}')
    add("step_errors_total", "counter", "Decode-loop steps that raised (their requests got the "
        "error).", c["step_errors"])
    add("tokens_generated_total", "counter", "Tokens sampled.", c["tokens_generated"])
    add("decode_steps_total", "counter", "Decode steps over the whole batch.", steps)
    add("prefill_calls_total", "counter", "Prefill calls (each admits 1+ requests).",
        c["prefill_calls"])
    add("active_requests", "gauge", "Slots decoding now.", b.active)
    add("queued_requests", "gauge", "Requests waiting for a slot.", b.queue.qsize())
    add("slot_utilization", "gauge", "Busy slots per decode step over the batch size.",
        f"{c['busy_slot_steps'] / (steps * b.batch_size):.4f}" if steps else 0)
    add("compiled_shapes", "gauge", "Distinct prefill/decode shapes traced.",
        len(b.engine.traces))
    add("uptime_seconds", "gauge", "Seconds since start.", f"{time.time() - self.started:.1f}")
    lines.append(self.histograms.exposition().rstrip("\n"))
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


class Listener:
  """A worker thread (`worker(stop_event)`, which owns the devices) plus aiohttp serving
  `service.app()` on its own event-loop thread; `start` returns once the socket listens, `stop`
  ends both. Port 0 picks a free port (see `url`). The service's `loop_alive` reports the
  worker."""

  def __init__(self, service, worker, host: str, port: int):
    self.service, self.host, self.port = service, host, port
    self._stop = threading.Event()
    self._decode_thread = threading.Thread(target=worker, args=(self._stop,),
                                           name="decode-loop", daemon=True)
    self.service.loop_alive = self._decode_thread.is_alive
    self._loop = asyncio.new_event_loop()
    self._http_thread = threading.Thread(target=self._loop.run_forever, name="http",
                                         daemon=True)
    self._runner: web.AppRunner | None = None
    self.url = ""

  def start(self, timeout_s: float = 60.0):
    server_logger = logging.getLogger("aiohttp.server")
    if _client_mistakes_without_tracebacks not in server_logger.filters:
      server_logger.addFilter(_client_mistakes_without_tracebacks)
    self._http_thread.start()

    async def listen():
      # handler_cancellation: a handler whose client disconnects is cancelled, and cancels
      # its engine requests (aiohttp leaves handlers running by default since 3.9).
      self._runner = web.AppRunner(self.service.app(), access_log=None,
                                   handler_cancellation=True)
      await self._runner.setup()
      site = web.TCPSite(self._runner, self.host, self.port)
      await site.start()
      return self._runner.addresses[0]

    try:
      address = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(timeout_s)
    except OSError as e:
      self.stop()
      raise RequestError(f"cannot listen on {self.host}:{self.port} ({e.strerror}); pick "
                         f"another --port or --host") from None
    # Only a server that listens runs the worker: one thread per batcher, ever.
    self._decode_thread.start()
    host, port = address[0], address[1]
    self.port = port
    self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    return self

  def stop(self, timeout_s: float = 30.0) -> None:
    if self._runner is not None and self._loop.is_running():
      asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout_s)
    if self._loop.is_running():
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._http_thread.join(timeout_s)
    self._stop.set()
    if self._decode_thread.is_alive():
      self._decode_thread.join(timeout_s)


class Server(Listener):
  """The language-model server: the batcher's decode loop plus the Service's routes."""

  def __init__(self, batcher: engine_lib.Batcher, defaults: SamplingParams = SamplingParams(),
               host: str = "127.0.0.1", port: int = 8000, request_timeout_s: float = 600.0,
               info: dict | None = None, codec: Codec = BYTE_LEVEL, model_name: str = "meshkit",
               chat_template: str = ""):
    self.batcher = batcher
    super().__init__(Service(batcher, defaults, request_timeout_s, info or {}, codec,
                             model_name, chat_template), batcher.run, host, port)
