"""Serving benchmark in the manner of `vllm bench serve`: streaming requests against the OpenAI
completions endpoint, timed token by token on the client.

  python scripts/bench/bench_serve.py --quick \
    --serve="--config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --batch_size=4 --cache_length=64"

Without --url it starts `python -m toolkit.serve` itself with the flags of --serve (default:
the `cpu` model of runs/lm_cpu, 16 slots) on 127.0.0.1 and a free port, and stops it at the
end; with --url=http://127.0.0.1:PORT it measures a running server (this machine's only).
Every wait has a deadline (--timeout per request, --server_start_timeout for the server).
Needs aiohttp, numpy and matplotlib (for --plot), not JAX. Mistakes are one `error:` line.

Workloads (--workload):
  random         prompt lengths drawn from --input_len, output lengths from --output_len
                 (MIN,MAX, inclusive, or one number), random token ids
  shared_prefix  every prompt is the same --prefix_len tokens followed by a random suffix of
                 --input_len tokens (what prefix caching reuses)
  long_prompt    --max_concurrency requests decode --output_len's MAX tokens each; once each
                 has streamed a few tokens, one --long_prompt_len-token prompt arrives. Reports
                 the inter-token latency of the running requests while it is prefilled (the
                 gaps that overlap its submission .. first token) against before it arrived
For random and shared_prefix, --num_prompts requests are sent at each of --rates (requests/s,
Poisson arrivals; `inf` sends them all at once) with at most --max_concurrency in flight
(0: no limit; with rate inf that is a closed loop of that many clients).

Each request: prompt as token ids, max_tokens its output length, ignore_eos (so it produces
exactly that many tokens), temperature --temperature, seed its index, stream with
stream_options.include_usage. Reported per rate, as a table and in --json: completed and
failed requests, request throughput, output-token and total-token throughput, and mean,
p50, p90, p99 (ms) of
  TTFT  request sent -> first chunk            TPOT  (E2E - TTFT) / (output tokens - 1)
  ITL   between consecutive chunks             E2E   request sent -> [DONE]
as vllm bench serve defines them. --plot writes latency (p50, p99) against request rate.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import urllib.parse

import aiohttp
import numpy as np
from absl import app, flags

from scripts.bench import serve_report
from scripts.bench.started_server import StartedServer
from scripts.bench.serve_report import STATS

DEFAULT_SERVE = ("--config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --batch_size=16 "
                 "--cache_length=256")
_URL = flags.DEFINE_string("url", "", "A running server (http://127.0.0.1:PORT); empty: start "
                           "one with --serve.")
_SERVE = flags.DEFINE_string("serve", DEFAULT_SERVE, "python -m toolkit.serve flags for the "
                             "server this script starts (host and port are its own).")
_SERVER_START = flags.DEFINE_float("server_start_timeout", 900.0, "Seconds for the started "
                                   "server to listen (it compiles first).", lower_bound=1.0)
_MODEL = flags.DEFINE_string("model", "", "Model name; default: the server's (GET /v1/models).")
_VOCAB = flags.DEFINE_integer("vocab_size", 0, "Token ids are drawn below this; default: the "
                              "server's (GET /v1/models).", lower_bound=0)
_WORKLOAD = flags.DEFINE_enum("workload", "random", ["random", "shared_prefix", "long_prompt"],
                              "What the requests look like (see the docstring).")
_INPUT_LEN = flags.DEFINE_list("input_len", ["32", "128"], "Prompt tokens: MIN,MAX or N.")
_OUTPUT_LEN = flags.DEFINE_list("output_len", ["32", "64"], "Output tokens: MIN,MAX or N.")
_PREFIX_LEN = flags.DEFINE_integer("prefix_len", 512, "shared_prefix: tokens every prompt "
                                   "starts with.", lower_bound=1)
_LONG_PROMPT = flags.DEFINE_integer("long_prompt_len", 2048, "long_prompt: tokens of the "
                                    "prompt that arrives while the others decode.",
                                    lower_bound=1)
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 64, "Requests per rate.", lower_bound=1)
_RATES = flags.DEFINE_list("rates", ["1", "2", "4", "8", "inf"], "Request rates (requests/s) "
                           "with Poisson arrivals; inf sends every request at once.")
_CONCURRENCY = flags.DEFINE_integer("max_concurrency", 0, "Requests in flight at most (0: no "
                                    "limit); long_prompt: the running requests.", lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 greedy).",
                                  lower_bound=0.0)
_TIMEOUT = flags.DEFINE_float("timeout", 300.0, "Seconds per request before it counts as "
                              "failed.", lower_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the lengths, token ids and arrivals.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_PLOT = flags.DEFINE_string("plot", "", "Write latency vs request rate as a PNG to this path.")
_WARM = flags.DEFINE_integer("warm_tokens", 16, "long_prompt: chunks every running request "
                             "streams before the long prompt is sent; the ITL before it counts "
                             "the gaps after the first half of these.", lower_bound=2)
_QUICK = flags.DEFINE_bool("quick", False, "Seconds: 8 short requests at 2 rates (long_prompt: "
                           "3 running requests of 40 tokens, a 32-token prompt).")

QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99))
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def _apply_quick() -> None:
  for name, value in (("input_len", ["8", "16"]), ("output_len", ["8", "12"]),
                      ("num_prompts", 8), ("rates", ["16", "inf"]), ("max_concurrency", 3),
                      ("prefix_len", 16), ("long_prompt_len", 32), ("warm_tokens", 4)):
    if not flags.FLAGS[name].present:
      flags.FLAGS[name].value = value
  if _WORKLOAD.value == "long_prompt" and not flags.FLAGS["output_len"].present:
    # The running requests must all have streamed --warm_tokens while none has ended, and
    # their starts can be many engine steps apart on a busy machine (in one CI run a request
    # ended or failed first; likely a 12-token one, before the last had streamed 4).
    # 16 + 40 tokens fit --cache_length=64.
    flags.FLAGS["output_len"].value = ["40"]


def length_range(values: list[str], flag: str) -> tuple[int, int]:
  try:
    low, high = (int(values[0]), int(values[-1]))
  except (ValueError, IndexError):
    raise SystemExit(f"error: --{flag}={','.join(values)}: give MIN,MAX or N") from None
  if not 1 <= low <= high or len(values) > 2:
    raise SystemExit(f"error: --{flag}={','.join(values)}: need 1 <= MIN <= MAX")
  return low, high


def parse_rates(values: list[str]) -> list[float]:
  try:
    rates = [float(v) for v in values]
  except ValueError:
    raise SystemExit(f"error: --rates={','.join(values)}: give numbers or inf") from None
  if not rates or any(not r > 0 for r in rates):
    raise SystemExit(f"error: --rates={','.join(values)}: rates must be > 0")
  return rates


# --- one streamed request ----------------------------------------------------------------------

async def stream_request(session: aiohttp.ClientSession, url: str, body: dict,
                         timeout_s: float, on_chunk=None) -> dict:
  """POSTs a streaming completion; returns its timings ("ok", "error", "start", "chunks": the
  arrival times of chunks with choices, "end", "output_tokens" from the usage chunk).
  `on_chunk(count)` is called after each such chunk."""
  record = {"ok": False, "error": "", "start": time.perf_counter(), "chunks": [],
            "end": None, "output_tokens": None, "input_len": len(body["prompt"])}
  try:
    async with session.post(f"{url}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
      if response.status != 200:
        record["error"] = f"HTTP {response.status}: {(await response.text())[:300]}"
        return record
      async for line in response.content:
        if not line.startswith(b"data:"):
          continue  # blank separators and ": ping" comments
        data = line[5:].strip()
        if data == b"[DONE]":
          record["ok"] = record["error"] == ""
          break
        chunk = json.loads(data)
        if "error" in chunk:
          record["error"] = str(chunk["error"].get("message", chunk["error"]))[:300]
        elif chunk.get("choices"):
          record["chunks"].append(time.perf_counter())
          if on_chunk is not None:
            on_chunk(len(record["chunks"]))
        if chunk.get("usage"):
          record["output_tokens"] = chunk["usage"]["completion_tokens"]
  except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
    record["error"] = f"{type(e).__name__}: {e}"
  record["end"] = time.perf_counter()
  if record["ok"] and not record["chunks"]:
    record["ok"], record["error"] = False, "no chunk came"
  return record


def request_stats(record: dict) -> dict:
  """TTFT, TPOT, E2E (s) and the ITL gaps of one completed request, as vllm defines them."""
  chunks = record["chunks"]
  output = record["output_tokens"] or len(chunks)
  ttft, e2e = chunks[0] - record["start"], record["end"] - record["start"]
  return {"ttft": ttft, "e2e": e2e, "itl": list(np.diff(chunks)), "output_tokens": output,
          "tpot": (e2e - ttft) / (output - 1) if output > 1 else None}


def describe(values: list[float]) -> dict:
  """mean, p50, p90, p99 in milliseconds (None without values)."""
  if not values:
    return {"mean": None, **{name: None for name, _ in QUANTILES}}
  ms = np.asarray(values, np.float64) * 1000
  return {"mean": float(ms.mean()),
          **{name: float(np.percentile(ms, q)) for name, q in QUANTILES}}


def summarize(records: list[dict], rate: float, concurrency: int) -> dict:
  done = [r for r in records if r["ok"]]
  stats = [request_stats(r) for r in done]
  start = min(r["start"] for r in records)
  duration = max(max(r["end"] for r in records) - start, 1e-9)
  output = sum(s["output_tokens"] for s in stats)
  prompt = sum(r["input_len"] for r in done)
  summary = {"rate": rate, "max_concurrency": concurrency, "requests": len(records),
             "completed": len(done), "failed": len(records) - len(done),
             "duration_s": duration, "request_throughput": len(done) / duration,
             "output_throughput": output / duration,
             "total_token_throughput": (prompt + output) / duration,
             "errors": sorted({r["error"] for r in records if r["error"]})[:5]}
  for name in STATS:
    values = ([g for s in stats for g in s["itl"]] if name == "itl" else
              [s[name] for s in stats if s[name] is not None])
    summary[f"{name}_ms"] = describe(values)
  return summary


# --- workloads -----------------------------------------------------------------------------

def make_prompts(rng: np.random.Generator, count: int, vocab: int, input_len, prefix_len: int
                 ) -> list[list[int]]:
  """Random token-id prompts (ids from 32 up: no control bytes or low special ids), after a
  shared prefix of `prefix_len` tokens when it is > 0."""
  low = min(32, vocab - 1)
  prefix = rng.integers(low, vocab, prefix_len).tolist() if prefix_len else []
  lengths = rng.integers(input_len[0], input_len[1] + 1, count)
  return [prefix + rng.integers(low, vocab, n).tolist() for n in lengths]


def request_body(model: str, prompt: list[int], output_len: int, seed: int) -> dict:
  return {"model": model, "prompt": prompt, "max_tokens": int(output_len),
          "temperature": _TEMPERATURE.value, "seed": seed % 2**32, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}


async def run_rate(url: str, bodies: list[dict], rate: float, concurrency: int,
                   rng: np.random.Generator) -> dict:
  """Sends `bodies` with Poisson arrivals at `rate`, at most `concurrency` in flight."""
  arrivals = (np.zeros(len(bodies)) if math.isinf(rate) else
              np.cumsum(rng.exponential(1 / rate, len(bodies))))
  limit = asyncio.Semaphore(concurrency) if concurrency else None
  connector = aiohttp.TCPConnector(limit=concurrency or len(bodies))

  async with aiohttp.ClientSession(connector=connector) as session:
    async def send(body: dict, at: float) -> dict:
      await asyncio.sleep(at)  # the arrival schedule, not a wait for a condition
      if limit is None:
        return await stream_request(session, url, body, _TIMEOUT.value)
      async with limit:
        return await stream_request(session, url, body, _TIMEOUT.value)

    bound = float(arrivals[-1]) + _TIMEOUT.value * (1 + len(bodies) / max(1, concurrency or
                                                                          len(bodies)))
    records = await asyncio.wait_for(
        asyncio.gather(*(send(b, float(t)) for b, t in zip(bodies, arrivals))), bound)
  return summarize(records, rate, concurrency)


async def run_long_prompt(url: str, running: list[dict], long_body: dict) -> dict:
  """The running requests stream; once each has --warm_tokens chunks the long prompt is sent.
  ITL of the running requests before it arrived vs while it was prefilled."""
  warm, warm_tokens = asyncio.Event(), _WARM.value
  counts = [0] * len(running)

  def on_chunk(i, count):
    counts[i] = count
    if min(counts) >= warm_tokens:
      warm.set()

  async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
    tasks = [asyncio.create_task(stream_request(session, url, body, _TIMEOUT.value,
                                                lambda c, i=i: on_chunk(i, c)))
             for i, body in enumerate(running)]
    waiting = asyncio.create_task(warm.wait())
    await asyncio.wait([waiting, *tasks], timeout=_TIMEOUT.value,
                       return_when=asyncio.FIRST_COMPLETED)
    if not warm.is_set():
      waiting.cancel()
      for task in tasks:
        task.cancel()  # before the session closes their connections under them
      raise SystemExit(serve_report.warm_up_failure(tasks, counts, warm_tokens,
                                                    _TIMEOUT.value))
    long_record = await stream_request(session, url, long_body, _TIMEOUT.value)
    records = await asyncio.wait_for(asyncio.gather(*tasks), _TIMEOUT.value)
  if not long_record["ok"]:
    raise SystemExit(f"error: the long prompt failed: {long_record['error']}")
  sent, first = long_record["start"], long_record["chunks"][0]
  before, during = [], []
  for record in records:
    settled = record["chunks"][warm_tokens // 2:]  # past the others' prefills at the start
    for a, b in zip(settled, settled[1:]):
      (before if b <= sent else during if a < first else []).append(b - a)
  summary = summarize(records, math.inf, len(running))
  summary.update(long_prompt_len=len(long_body["prompt"]),
                 long_prompt_ttft_ms=(first - sent) * 1000, itl_before_ms=describe(before),
                 itl_during_ms=describe(during))
  p99_before, p99_during = summary["itl_before_ms"]["p99"], summary["itl_during_ms"]["p99"]
  summary["itl_p99_ratio"] = (p99_during / p99_before if p99_before and p99_during is not None
                              else None)
  return summary


# --- the server ----------------------------------------------------------------------------

def local_url(url: str) -> str:
  parsed = urllib.parse.urlparse(url)
  if parsed.scheme != "http" or parsed.hostname not in LOCAL_HOSTS:
    raise SystemExit(f"error: --url={url}: give http://127.0.0.1:PORT; this benchmark talks "
                     f"to a server on this machine only")
  return url.rstrip("/")


async def served_model(url: str) -> dict:
  """The first model of GET /v1/models."""
  try:
    async with aiohttp.ClientSession() as session:
      async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=60)) as r:
        return (await r.json())["data"][0]
  except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
    raise SystemExit(f"error: GET {url}/v1/models failed ({type(e).__name__}: {e}); is an "
                     f"OpenAI-compatible server running there?") from None


# --- main ----------------------------------------------------------------------------------

async def benchmark(url: str) -> dict:
  model = await served_model(url)
  name, vocab = _MODEL.value or model["id"], _VOCAB.value or model.get("vocab_size")
  if not vocab:
    raise SystemExit("error: the server does not say its vocab_size; give --vocab_size")
  rng = np.random.default_rng(_SEED.value)
  input_len, output_len = (length_range(_INPUT_LEN.value, "input_len"),
                           length_range(_OUTPUT_LEN.value, "output_len"))
  config = {"url": url, "model": name, "workload": _WORKLOAD.value, "input_len": input_len,
            "output_len": output_len, "temperature": _TEMPERATURE.value, "seed": _SEED.value}
  if _WORKLOAD.value == "long_prompt":
    count = _CONCURRENCY.value or 8
    prompts = make_prompts(rng, count, vocab, input_len, 0)
    running = [request_body(name, p, output_len[1], i) for i, p in enumerate(prompts)]
    long_body = request_body(name, make_prompts(rng, 1, vocab, (_LONG_PROMPT.value,) * 2,
                                                0)[0], 1, count)
    config.update(long_prompt_len=_LONG_PROMPT.value, warm_tokens=_WARM.value)
    return {"config": config, "runs": [await run_long_prompt(url, running, long_body)]}
  prefix = _PREFIX_LEN.value if _WORKLOAD.value == "shared_prefix" else 0
  config.update(prefix_len=prefix, num_prompts=_NUM_PROMPTS.value,
                max_concurrency=_CONCURRENCY.value)
  runs = []
  for rate in parse_rates(_RATES.value):
    prompts = make_prompts(rng, _NUM_PROMPTS.value, vocab, input_len, prefix)
    outputs = rng.integers(output_len[0], output_len[1] + 1, len(prompts))
    bodies = [request_body(name, p, o, i) for i, (p, o) in enumerate(zip(prompts, outputs))]
    runs.append(await run_rate(url, bodies, rate, _CONCURRENCY.value, rng))
    print(f"rate {rate:g}: {runs[-1]['completed']}/{runs[-1]['requests']} completed in "
          f"{runs[-1]['duration_s']:.1f} s", flush=True)
  return {"config": config, "runs": runs}


def main(argv) -> None:
  del argv
  if _QUICK.value:
    _apply_quick()
  # The flags' mistakes before a server starts.
  length_range(_INPUT_LEN.value, "input_len")
  output_len = length_range(_OUTPUT_LEN.value, "output_len")
  if _WORKLOAD.value == "long_prompt" and _WARM.value >= output_len[1]:
    raise SystemExit(f"error: --warm_tokens={_WARM.value}: the running requests stream "
                     f"--output_len's MAX ({output_len[1]}) tokens each, so the long prompt "
                     f"must come before that; give fewer --warm_tokens or a longer --output_len")
  parse_rates(_RATES.value)
  if _URL.value:
    local_url(_URL.value)
  server = None if _URL.value else StartedServer(_SERVE.value, _SERVER_START.value)
  try:
    url = local_url(_URL.value or server.url)
    results = asyncio.run(benchmark(url))
  finally:
    if server is not None:
      server.stop()
  runs = results["runs"]
  print(serve_report.table(runs), flush=True)
  if _WORKLOAD.value == "long_prompt":
    print(serve_report.long_prompt_lines(runs[0]), flush=True)
  for run in runs:
    for error in run["errors"]:
      print(f"failed request: {error}", file=sys.stderr)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(serve_report.jsonable(results), f, indent=2)
  if _PLOT.value:
    serve_report.plot(runs, _PLOT.value,
                      f"{results['config']['model']}, {_WORKLOAD.value} workload")
  if any(run["failed"] for run in runs):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
