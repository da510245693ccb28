"""An HTTP JSON endpoint over the continuous batcher (aiohttp); `python -m toolkit.serve` runs it.

  python -m toolkit.serve --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --port=8000
  curl -s localhost:8000/generate -d '{"prompt": "The ", "max_tokens": 40, "temperature": 0.8}'

Endpoints:
  POST /generate  {"prompt": text | "tokens": [ids], max_tokens, temperature, top_k, top_p,
                   seed, stop_tokens} -> {"completion", "tokens", "finish_reason",
                   "prompt_tokens", "completion_tokens", "latency_s", "time_to_first_token_s"}
  GET  /health    200 {"status": "ok", ...} while the decode loop runs and not every one of
                  its last UNHEALTHY_AFTER_STEP_ERRORS steps raised, else 503
  GET  /metrics   Prometheus text: requests, tokens, steps, queue depth, slot use, latency

Threads: aiohttp's event loop parses requests and waits on futures; one batcher thread owns
the devices and steps the decode batch, admitting queued requests at every step. Bad requests
get a 4xx with an `error` message and never reach the batcher: a body over 1 MiB (413), JSON
that does not parse or nests deeper than 32 levels, prompt text that is not valid UTF-8
(a lone surrogate escape), token ids outside the vocabulary, sampling fields out of range
(400). tests/toolkit/inference/test_serve.py fuzzes it with a few hundred such requests.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

import numpy as np
from aiohttp import http_exceptions, web

from toolkit.inference import engine as engine_lib
from toolkit.inference.codec import BYTE_LEVEL, Codec
from toolkit.inference.requests import parse_json, parse_prompt, result_record
from toolkit.inference.sampling import RequestError, SamplingParams

MAX_BODY_BYTES = 1 << 20
LATENCY_WINDOW = 2048  # recent requests the latency quantiles in /metrics cover
# /health answers 503 once this many decode steps in a row raised (one can be a bad request).
UNHEALTHY_AFTER_STEP_ERRORS = 3


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
  """The request handlers; `batcher` is stepped by another thread."""

  def __init__(self, batcher: engine_lib.Batcher, defaults: SamplingParams,
               request_timeout_s: float, info: dict, codec: Codec = BYTE_LEVEL):
    self.batcher, self.defaults, self.request_timeout_s = batcher, defaults, request_timeout_s
    self.codec = codec  # text in and out; its EOS ids end every request
    self.info = info
    self.counters = collections.Counter()
    self.latencies: collections.deque = collections.deque(maxlen=LATENCY_WINDOW)
    self.first_token: collections.deque = collections.deque(maxlen=LATENCY_WINDOW)
    self.loop_alive = lambda: True
    self.started = time.time()

  def app(self) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.add_routes([web.post("/generate", self.generate), web.get("/health", self.health),
                    web.get("/metrics", self.metrics)])
    return app

  def _reject(self, status: int, message: str) -> web.Response:
    self.counters[f"rejected_{status}"] += 1
    return _error(status, message)

  async def generate(self, request: web.Request) -> web.Response:
    try:
      raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
      return self._reject(413, f"the body is larger than {MAX_BODY_BYTES} bytes; send one "
                               f"request per call")
    except web.RequestPayloadError as e:  # e.g. a body that does not decode as its encoding
      reason = " ".join(str(e).split()).removeprefix("400, message: ")
      return self._reject(400, f"the body could not be read ({reason})")
    try:
      body = parse_json(raw)
    except RequestError as e:
      return self._reject(400, f"the body {e}")
    try:
      prompt = parse_prompt(body, self.batcher.engine.model_cfg.vocab_size, self.codec)
      fields = {k: v for k, v in body.items() if k not in ("prompt", "tokens", "id")}
      params = self.codec.stop_at_eos(SamplingParams.from_dict(
          fields, self.batcher.engine.model_cfg.vocab_size, self.defaults))
      self.batcher.engine.check_request(prompt, params)
    except RequestError as e:
      return self._reject(400, str(e))
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def on_done(result: engine_lib.Result) -> None:  # on the batcher thread
      loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

    try:
      self.batcher.submit(engine_lib.Request(np.asarray(prompt, np.int32), params, on_done))
    except queue.Full:
      return self._reject(503, f"the queue is full ({self.batcher.queue.maxsize} requests "
                               f"waiting); retry later")
    try:
      result = await asyncio.wait_for(asyncio.shield(done), self.request_timeout_s)
    except asyncio.TimeoutError:
      self.counters["timeouts"] += 1
      return _error(504, f"no result within {self.request_timeout_s:.0f} s; the server is "
                         f"overloaded or stuck")
    if result.error is not None:
      return _error(500, f"generation failed: {result.error}")
    self.latencies.append(result.latency_s)
    self.first_token.append(result.time_to_first_token_s)
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
    for status in (400, 413, 503):
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
    for name, window in (("latency_seconds", self.latencies),
                         ("time_to_first_token_seconds", self.first_token)):
      for q in (0.5, 0.9, 0.99):
        value = float(np.quantile(list(window), q)) if window else float("nan")
        add(name, "summary", f"Over the last {LATENCY_WINDOW} requests.", f"{value:.6f}",
            f'{{quantile="{q}"}}')
    add("uptime_seconds", "gauge", "Seconds since start.", f"{time.time() - self.started:.1f}")
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


class Server:
  """The batcher thread plus aiohttp on its own event-loop thread; `start` returns once the
  socket listens, `stop` ends both. Port 0 picks a free port (see `url`)."""

  def __init__(self, batcher: engine_lib.Batcher, defaults: SamplingParams = SamplingParams(),
               host: str = "127.0.0.1", port: int = 8000, request_timeout_s: float = 600.0,
               info: dict | None = None, codec: Codec = BYTE_LEVEL):
    self.batcher, self.host, self.port = batcher, host, port
    self.service = Service(batcher, defaults, request_timeout_s, info or {}, codec)
    self._stop = threading.Event()
    self._decode_thread = threading.Thread(target=batcher.run, args=(self._stop,),
                                           name="decode-loop", daemon=True)
    self.service.loop_alive = self._decode_thread.is_alive
    self._loop = asyncio.new_event_loop()
    self._http_thread = threading.Thread(target=self._loop.run_forever, name="http",
                                         daemon=True)
    self._runner: web.AppRunner | None = None
    self.url = ""

  def start(self, timeout_s: float = 60.0) -> Server:
    server_logger = logging.getLogger("aiohttp.server")
    if _client_mistakes_without_tracebacks not in server_logger.filters:
      server_logger.addFilter(_client_mistakes_without_tracebacks)
    self._http_thread.start()

    async def listen():
      self._runner = web.AppRunner(self.service.app(), access_log=None)
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
    # Only a server that listens steps the batcher: one thread per batcher, ever.
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
