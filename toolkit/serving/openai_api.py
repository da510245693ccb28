"""OpenAI-compatible routes over the continuous batcher (aiohttp), beside the server's own
/generate (toolkit/serving/server.py mounts them):

  GET  /v1/models             the served model
  POST /v1/completions        text completions, `stream: true` as server-sent events
  POST /v1/chat/completions   chat completions through the model's chat template

The fields, what is refused and the defaults are in toolkit/serving/openai_protocol.py.
A streamed answer is `data: {chunk}` events in OpenAI's chunk format, one per choice each
time new tokens arrive (the text may be empty while an unfinished character or a possible
stop string is held back), the usage chunk with stream_options.include_usage, then
`data: [DONE]`. aiohttp-sse writes the events: it keeps an idle stream alive with comment
pings and aborts a client that stops reading for its send timeout.

Cancellation: a client that disconnects (streaming or not) has its engine requests cancelled
(`Batcher.cancel`: the slots are free at the next step) and is counted in /metrics
(`meshkit_client_disconnects_total`); a stop string cancels its choice the same way.

Errors are OpenAI's error object, {"error": {"message", "type", "param", "code"}}: 400 for
a request to fix (invalid_request_error, `param` names the field), 404 for another model or
path, 405 for another method, 413 for a body over 1 MiB, 429 when --max_queue requests
already wait, 500 when generation failed, 503 when the decode loop stopped, 504 past
--request_timeout. An error after a stream started is sent as an event before [DONE].
"""
from __future__ import annotations

import asyncio
import json
import queue
import time

from aiohttp import web
from aiohttp_sse import EventSourceResponse

from toolkit.inference import engine as engine_lib
from toolkit.serving import openai_protocol as protocol
from toolkit.serving.http_request import BodyError, PastDeadline, Submissions, read_json
from toolkit.serving.openai_protocol import OpenAIError
from toolkit.inference.sampling import RequestError
from toolkit.serving.text_stream import TextStream

PING_S = 15.0  # comment lines that keep an idle stream (a long prefill) open through proxies


class _Failed(Exception):
  """A choice's generation failed in the engine (Result.error)."""


class _Choices:
  """The text, finish reason and token count of every choice of one answer as events come."""

  def __init__(self, job: protocol.Job, submissions: Submissions, decode, histograms):
    self.job, self.submissions, self.histograms = job, submissions, histograms
    self.streams = [TextStream(decode, job.stop) for _ in job.params]
    self.reasons: list[str | None] = [None] * len(job.params)

  def apply(self, choice: int, event) -> tuple[str, str | None] | None:
    """(new text, finish reason or None) of `choice` after `event` (a token id or the
    Result), or None when the choice had already ended."""
    if self.reasons[choice] is not None:
      return None
    stream = self.streams[choice]
    if isinstance(event, engine_lib.Result):
      if event.error is not None:
        raise _Failed(event.error)
      piece = stream.add(event.tokens[len(stream.tokens):]) + stream.finish()
      reason = "length" if event.finish_reason == "length" and not stream.stopped else "stop"
    else:
      piece = stream.add([event])
      if not stream.stopped:
        return piece, None
      self.submissions.cancel(choice)  # a stop string: free the slot now
      reason = "stop"
    self.reasons[choice] = reason
    request = self.submissions.requests[choice]
    self.histograms.observe(request.submitted,
                            self.submissions.token_times[choice][:len(stream.tokens)],
                            time.perf_counter())
    return piece, reason

  def usage(self) -> dict:
    return protocol.usage(sum(len(p) for p in self.job.prompts),
                          sum(len(s.tokens) for s in self.streams))


class OpenAIRoutes:
  """The /v1 handlers of one server. `service` is the server's Service (its batcher,
  counters, histograms, timeout and whether the decode loop runs)."""

  def __init__(self, service, context: protocol.ModelContext):
    self.service, self.context = service, context

  def add_to(self, app: web.Application) -> None:
    app.middlewares.append(self._openai_errors)
    app.add_routes([web.get("/v1/models", self.models),
                    web.post("/v1/completions", self.completions),
                    web.post("/v1/chat/completions", self.chat_completions)])

  @web.middleware
  async def _openai_errors(self, request: web.Request, handler):
    """aiohttp's own errors on /v1 paths (no such route, wrong method) in OpenAI's shape."""
    if not request.path.startswith("/v1/"):
      return await handler(request)
    try:
      return await handler(request)
    except web.HTTPException as e:
      if e.status < 400:
        raise
      detail = (f"no route {request.method} {request.path[:200]}; this server answers GET "
                f"/v1/models, POST /v1/completions and POST /v1/chat/completions")
      return self._reject(OpenAIError(e.status, detail, None, e.reason.lower().replace(
          " ", "_")))

  def _reject(self, error: OpenAIError) -> web.Response:
    self.service.counters[f"rejected_{error.status}"] += 1
    return web.json_response(error.body(), status=error.status)

  async def models(self, request: web.Request) -> web.Response:
    del request
    return web.json_response(protocol.models_list(self.context))

  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, protocol.parse_completion)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, protocol.parse_chat)

  # --- one request ---------------------------------------------------------------------------
  def _job(self, body, parse) -> protocol.Job:
    job = parse(body, self.context)
    if not self.service.loop_alive():
      raise OpenAIError(503, "the decode loop stopped; restart the server", None,
                        "decode_loop_stopped")
    try:
      for choice, params in enumerate(job.params):
        self.service.batcher.engine.check_request(job.prompt_of(choice), params)
    except RequestError as e:  # what the engine alone knows (its cache, say)
      raise OpenAIError(400, str(e)) from None
    return job

  async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
    try:
      try:
        body = await read_json(request)
      except BodyError as e:
        raise OpenAIError(e.status, e.message) from None
      job = self._job(body, parse)
    except OpenAIError as e:
      return self._reject(e)
    live = job.stream or bool(job.stop)
    submissions = Submissions(self.service.batcher,
                              [job.prompt_of(c) for c in range(len(job.params))], job.params,
                              live)
    try:
      submissions.submit()
    except queue.Full:
      return self._reject(OpenAIError(
          429, f"the queue is full ({self.service.batcher.queue.maxsize} requests waiting); "
               f"retry later", None, "queue_full"))
    except RequestError as e:  # the batcher's own check, should it refuse what passed ours
      return self._reject(OpenAIError(400, str(e)))
    deadline = time.monotonic() + self.service.request_timeout_s
    choices = _Choices(job, submissions, self.context.codec.decode, self.service.histograms)
    try:
      if job.stream:
        return await self._stream(request, job, submissions, choices, deadline)
      return await self._answer(job, submissions, choices, deadline)
    except asyncio.CancelledError:  # the client went away (aiohttp's handler cancellation)
      self.service.counters["client_disconnects"] += 1
      raise
    finally:
      submissions.cancel_all()  # nothing for choices that ended

  def _failure(self, error: Exception) -> OpenAIError:
    if isinstance(error, PastDeadline):
      self.service.counters["timeouts"] += 1
      return OpenAIError(504, f"no answer within {self.service.request_timeout_s:.0f} s; the "
                              f"server is overloaded or stuck", None, "timeout")
    return OpenAIError(500, f"generation failed: {error}", None, "generation_failed")

  async def _answer(self, job, submissions: Submissions, choices: _Choices,
                    deadline: float) -> web.Response:
    try:
      async for batch in submissions.events(deadline):
        for choice, event in batch:
          choices.apply(choice, event)
    except (PastDeadline, _Failed) as e:
      error = self._failure(e)
      return web.json_response(error.body(), status=error.status)
    texts = [stream.text for stream in choices.streams]
    return web.json_response(protocol.Reply(job).response(texts, choices.reasons,
                                                          choices.usage()))

  async def _stream(self, request: web.Request, job, submissions: Submissions,
                    choices: _Choices, deadline: float) -> web.StreamResponse:
    reply = protocol.Reply(job)
    response = EventSourceResponse(sep="\n", allow_all_methods=True, ping_interval=PING_S)
    started = [False] * len(job.params)  # a chat choice's first chunk carries the role
    try:
      await response.prepare(request)
      async with response:
        try:
          async for batch in submissions.events(deadline):
            pieces: dict[int, tuple[str, str | None]] = {}
            for choice, event in batch:
              if (update := choices.apply(choice, event)) is not None:
                pieces[choice] = (pieces.get(choice, ("", None))[0] + update[0], update[1])
            for choice, (text, reason) in pieces.items():
              await response.send(json.dumps(reply.chunk(
                  choice, text, reason, role=job.chat and not started[choice])))
              started[choice] = True
          if job.include_usage:
            await response.send(json.dumps(reply.usage_chunk(choices.usage())))
        except (PastDeadline, _Failed) as e:
          await response.send(json.dumps(self._failure(e).body()))
        await response.send("[DONE]")
    except (ConnectionResetError, TimeoutError):  # the client went away, or stopped reading
      # for aiohttp-sse's send timeout (which then aborts the connection)
      self.service.counters["client_disconnects"] += 1
    return response
