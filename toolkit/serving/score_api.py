"""The scoring server of a recommendation checkpoint: `python -m toolkit.serve` with a click
model's config (models/dlrm.py) serves these routes instead of the language model's.

  POST /v1/score  {"context": {feature: value}, "candidates": [{feature: value}, ...]}
                  -> {"scores": [click probability per candidate], "candidates": N,
                      "latency_s"} (toolkit/inference/score_requests.py has the fields)
  GET  /health    200 while the scoring loop runs and its last calls did not all fail, else 503
  GET  /metrics   Prometheus text: requests, candidates, calls, padding, rejections, queue
                  depth, and histograms of end-to-end latency, queueing and candidates per call

Requests of many clients are scored together (toolkit/inference/scoring.py: ScoreBatcher).
A malformed request gets a 4xx naming the field and never reaches the devices; a full queue
gets 503; a request not answered within --request_timeout gets 504.
"""
from __future__ import annotations

import asyncio
import collections
import queue
import time

import prometheus_client
from aiohttp import web

from toolkit.inference import scoring
from toolkit.inference.sampling import RequestError
from toolkit.inference.score_requests import Features, parse_score_request
from toolkit.serving.http_request import BodyError, read_json
from toolkit.serving.latency import BUCKETS
from toolkit.serving.server import UNHEALTHY_AFTER_STEP_ERRORS, Listener

REJECTED_STATUSES = (400, 413, 503)


class ScoreService:
  """The handlers; `batcher` runs on another thread."""

  def __init__(self, batcher: scoring.ScoreBatcher, features: Features,
               table_rows: tuple[int, ...], hash_ids: bool, max_candidates: int,
               request_timeout_s: float, info: dict):
    self.batcher, self.features, self.info = batcher, features, info
    self.table_rows, self.hash_ids = table_rows, hash_ids
    self.max_candidates = min(max_candidates, batcher.max_batch)
    self.request_timeout_s = request_timeout_s
    self.counters = collections.Counter()
    self.loop_alive = lambda: True
    self.started = time.time()
    self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
    self.e2e = prometheus_client.Histogram(
        "meshkit_score_latency_seconds", "Submission to scores, per request.", buckets=BUCKETS,
        registry=self.registry)
    self.queueing = prometheus_client.Histogram(
        "meshkit_score_queue_seconds", "Submission to the start of the request's call.",
        buckets=BUCKETS, registry=self.registry)
    self.call_sizes = prometheus_client.Histogram(
        "meshkit_score_call_candidates", "Candidates per request scored.",
        buckets=(1, 10, 100, 1000, 10000), registry=self.registry)

  def app(self) -> web.Application:
    app = web.Application(client_max_size=8 << 20)
    app.add_routes([web.post("/v1/score", self.score), web.get("/health", self.health),
                    web.get("/metrics", self.metrics)])
    return app

  def _reject(self, status: int, message: str) -> web.Response:
    self.counters[f"rejected_{status}"] += 1
    return web.json_response({"error": message}, status=status)

  async def score(self, request: web.Request) -> web.Response:
    try:
      body = await read_json(request)
      inputs = parse_score_request(body, self.features, self.table_rows, self.hash_ids,
                                   self.max_candidates)
    except BodyError as e:
      return self._reject(e.status, e.message)
    except RequestError as e:
      return self._reject(400, str(e))
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    job = scoring.Job(inputs.dense, inputs.ids, inputs.lengths,
                      lambda j: loop.call_soon_threadsafe(_settle, done, j))
    try:
      self.batcher.submit(job)
    except queue.Full:
      return self._reject(503, f"the queue is full ({self.batcher.queue.maxsize} requests "
                               f"waiting); retry later")
    try:
      await asyncio.wait_for(asyncio.shield(done), self.request_timeout_s)
    except asyncio.TimeoutError:
      self.counters["timeouts"] += 1
      return web.json_response({"error": f"no scores within {self.request_timeout_s:.0f} s; "
                                         f"the server is overloaded or stuck"}, status=504)
    if job.error is not None:
      self.counters["failed"] += 1
      return web.json_response({"error": f"scoring failed: {job.error}"}, status=500)
    ended = time.perf_counter()
    self.counters["answered"] += 1
    self.e2e.observe(ended - job.submitted)
    self.queueing.observe(max(0.0, job.started - job.submitted))
    self.call_sizes.observe(len(job))
    record = {"scores": [round(float(s), 7) for s in job.scores], "candidates": len(job),
              "latency_s": round(ended - job.submitted, 6)}
    if "id" in body:
      record["id"] = body["id"]
    return web.json_response(record)

  async def health(self, request: web.Request) -> web.Response:
    del request
    failing = self.batcher.consecutive_errors
    status = ("scoring loop stopped" if not self.loop_alive() else
              f"failing: the last {failing} scoring calls raised"
              if failing >= UNHEALTHY_AFTER_STEP_ERRORS else "ok")
    return web.json_response({"status": status, **self.info,
                              "queued": self.batcher.queue.qsize()},
                             status=200 if status == "ok" else 503)

  async def metrics(self, request: web.Request) -> web.Response:
    del request
    c = self.batcher.counters
    lines = []

    def add(name: str, kind: str, help_text: str, value, labels: str = "") -> None:
      if not any(line.startswith(f"# TYPE meshkit_{name} ") for line in lines):
        lines.extend([f"# HELP meshkit_{name} {help_text}", f"# TYPE meshkit_{name} {kind}"])
      lines.append(f"meshkit_{name}{labels} {value}")

    add("score_requests_total", "counter", "Requests scored.", c["jobs"])
    add("scored_candidates_total", "counter", "Candidates scored.", c["candidates"])
    add("score_calls_total", "counter", "Compiled calls (each scores 1+ requests).", c["calls"])
    add("score_padding_total", "counter", "Padding rows the calls' buckets added.", c["padded"])
    add("score_errors_total", "counter", "Calls that raised (their requests got 500).",
        c["errors"])
    add("request_timeouts_total", "counter", "Requests answered 504 past --request_timeout.",
        self.counters["timeouts"])
    for status in REJECTED_STATUSES:
      add("requests_rejected_total", "counter", "Requests refused before queueing.",
          self.counters[f"rejected_{status}"], f'{{status="{status}"}}')
    add("queued_requests", "gauge", "Requests waiting for a call.", self.batcher.queue.qsize())
    add("compiled_shapes", "gauge", "Bucket sizes compiled.", self.batcher.scorer.traces)
    add("uptime_seconds", "gauge", "Seconds since start.", f"{time.time() - self.started:.1f}")
    lines.append(prometheus_client.generate_latest(self.registry).decode().rstrip("\n"))
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _settle(future: asyncio.Future, job: scoring.Job) -> None:
  if not future.done():
    future.set_result(job)


class ScoreServer(Listener):
  """The scoring loop's thread plus the ScoreService's routes."""

  def __init__(self, service: ScoreService, host: str = "127.0.0.1", port: int = 8000):
    self.batcher = service.batcher
    super().__init__(service, service.batcher.run, host, port)


def start(config, checkpoint: str, host: str, port: int, max_batch: int, max_wait_s: float,
          max_candidates: int, max_queue: int, request_timeout_s: float,
          log=print) -> ScoreServer:
  """Restores a click model's checkpoint onto `config`'s mesh, compiles every bucket and
  starts listening. ConfigError for a config that is not a click model's."""
  import optax  # pylint: disable=g-import-not-at-top
  from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
  from toolkit.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  spec = config_lib.resolve(config)
  params, model_cfg, mesh, rules, step = restore_params(config, checkpoint)
  layout = state_lib.layout(model_cfg, optax.identity(), rules, mesh)
  scorer = scoring.Scorer(layout.graphdef, params, mesh, rules, max_batch, spec.batch_ways)
  features = Features.of(config.data.source)
  log(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; "
      f"{len(model_cfg.table_rows)} tables; compiling {len(scorer.buckets)} call sizes "
      f"({', '.join(map(str, scorer.buckets))} candidates) before listening ...")
  started = time.perf_counter()
  scorer.warmup(len(features.dense), len(features.sparse), features.bag)
  log(f"compiled in {time.perf_counter() - started:.1f} s")
  batcher = scoring.ScoreBatcher(scorer, max_wait_s, max_queue)
  info = {"step": step, "max_batch": scorer.max_batch, "mesh": dict(mesh.shape),
          "rules": rules.name, "features": list(features.dense + features.sparse)}
  service = ScoreService(batcher, features, model_cfg.table_rows, model_cfg.hash_ids,
                         max_candidates, request_timeout_s, info)
  return ScoreServer(service, host, port).start()
