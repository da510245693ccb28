"""Load test for `toolkit.serve`: N concurrent clients send a bounded number of requests.

  python -m toolkit.serve --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --port=8000 &
  python scripts/bench/load_test.py --url=http://127.0.0.1:8000 --clients=16 --requests=200

Request i has a prompt cut from a fixed English text (offset and length vary with i, 4-44
bytes), or with --prompt_tokens=N N random token ids below --vocab_size (seeded by i), max_tokens
--max_tokens, temperature --temperature and seed i, and carries "id": i,
which the server echoes; a response with another id counts as mixed up. Reports throughput
(requests/s, completion tokens/s) and latency p50/p90/p99/max as seen by the clients, plus
the server's time to first token. Exit status 1 when any request failed or came back mixed up.
Needs only aiohttp and numpy (no JAX).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import numpy as np
from absl import app, flags

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, "
        "it was the season of Light, it was the season of Darkness, it was the spring of hope, "
        "it was the winter of despair. ")


def request_body(index: int, max_tokens: int, temperature: float, prompt_tokens: int = 0,
                 vocab_size: int = 256) -> dict:
  body = {"id": index, "max_tokens": max_tokens, "temperature": temperature, "seed": index}
  if prompt_tokens:
    ids = np.random.default_rng(index).integers(0, vocab_size, prompt_tokens)
    return {**body, "tokens": [int(t) for t in ids]}
  start = (index * 37) % (len(TEXT) - 50)
  length = 4 + (index * 13) % 41
  return {**body, "prompt": TEXT[start:start + length]}


async def _client(session: aiohttp.ClientSession, url: str, work: asyncio.Queue,
                  records: list, timeout_s: float) -> None:
  while True:
    try:
      index, body = work.get_nowait()
    except asyncio.QueueEmpty:
      return
    start = time.perf_counter()
    try:
      async with session.post(f"{url}/generate", json=body,
                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        status, payload = response.status, await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
      status, payload = 0, {"error": f"{type(e).__name__}: {e}"}
    records.append({"index": index, "request": body, "status": status, "response": payload,
                    "latency_s": time.perf_counter() - start})


async def run_load(url: str, bodies: list[dict], clients: int, timeout_s: float
                   ) -> tuple[list[dict], float]:
  """Sends `bodies` from `clients` concurrent clients; returns (records by index, seconds)."""
  work: asyncio.Queue = asyncio.Queue()
  for index, body in enumerate(bodies):
    work.put_nowait((index, body))
  records: list[dict] = []
  connector = aiohttp.TCPConnector(limit=clients)
  async with aiohttp.ClientSession(connector=connector) as session:
    start = time.perf_counter()
    await asyncio.gather(*(_client(session, url, work, records, timeout_s)
                           for _ in range(clients)))
    seconds = time.perf_counter() - start
  return sorted(records, key=lambda r: r["index"]), seconds


def summarize(records: list[dict], seconds: float, clients: int) -> dict:
  ok = [r for r in records if r["status"] == 200]
  mixed = [r["index"] for r in ok if r["response"].get("id") != r["request"]["id"]]
  latencies = np.array([r["latency_s"] for r in ok]) if ok else np.array([np.nan])
  first = np.array([r["response"]["time_to_first_token_s"] for r in ok]) if ok else np.array(
      [np.nan])
  tokens = sum(r["response"]["completion_tokens"] for r in ok)
  statuses: dict[str, int] = {}
  for r in records:
    statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
  return {
      "clients": clients, "requests": len(records), "ok": len(ok), "statuses": statuses,
      "mixed_up": mixed, "seconds": seconds, "requests_per_second": len(ok) / seconds,
      "completion_tokens": tokens, "completion_tokens_per_second": tokens / seconds,
      "latency_s": {q: float(np.quantile(latencies, float(q))) for q in ("0.5", "0.9", "0.99")}
                   | {"max": float(latencies.max())},
      "time_to_first_token_s": {q: float(np.quantile(first, float(q))) for q in ("0.5", "0.99")},
  }


def format_summary(s: dict) -> str:
  lat, ttft = s["latency_s"], s["time_to_first_token_s"]
  return (f"{s['ok']}/{s['requests']} ok from {s['clients']} clients in {s['seconds']:.2f} s "
          f"(statuses {s['statuses']}; mixed up: {len(s['mixed_up'])})\n"
          f"throughput: {s['requests_per_second']:.1f} requests/s, "
          f"{s['completion_tokens_per_second']:,.0f} completion tokens/s\n"
          f"latency: p50 {lat['0.5'] * 1000:.0f} ms, p90 {lat['0.9'] * 1000:.0f} ms, "
          f"p99 {lat['0.99'] * 1000:.0f} ms, max {lat['max'] * 1000:.0f} ms; "
          f"server time to first token p50 {ttft['0.5'] * 1000:.0f} ms, "
          f"p99 {ttft['0.99'] * 1000:.0f} ms")


def define_flags() -> None:
  """Defined only when this file runs as a script: importing it defines no flags."""
  flags.DEFINE_string("url", "http://127.0.0.1:8000", "Server base URL.")
  flags.DEFINE_integer("clients", 16, "Concurrent clients.", lower_bound=1)
  flags.DEFINE_integer("requests", 200, "Requests in all.", lower_bound=1)
  flags.DEFINE_integer("max_tokens", 32, "max_tokens per request.", lower_bound=1)
  flags.DEFINE_integer("prompt_tokens", 0, "Prompts of this many random token ids; 0: text "
                       "cut from a fixed English text.", lower_bound=0)
  flags.DEFINE_integer("vocab_size", 256, "--prompt_tokens draws ids below this.",
                       lower_bound=1)
  flags.DEFINE_float("temperature", 0.0, "Temperature per request (seed = i).",
                     lower_bound=0.0)
  flags.DEFINE_float("timeout", 300.0, "Seconds per request before it counts as failed.",
                     lower_bound=1.0)
  flags.DEFINE_string("json", "", "Write the summary as JSON to this path.")
  flags.DEFINE_string("responses", "", "Write every request and its response as JSON lines to "
                      "this path.")


def main(argv) -> None:
  del argv
  bodies = [request_body(i, flags.FLAGS.max_tokens, flags.FLAGS.temperature,
                         flags.FLAGS.prompt_tokens, flags.FLAGS.vocab_size)
            for i in range(flags.FLAGS.requests)]
  url = flags.FLAGS.url.rstrip("/")
  try:
    records, seconds = asyncio.run(run_load(url, bodies, flags.FLAGS.clients,
                                            flags.FLAGS.timeout))
  except OSError as e:
    print(f"error: cannot reach {url} ({e}); start the server first (python -m toolkit.serve)",
          file=sys.stderr)
    sys.exit(1)
  summary = summarize(records, seconds, flags.FLAGS.clients)
  print(format_summary(summary), flush=True)
  if flags.FLAGS.json:
    with open(flags.FLAGS.json, "w") as f:
      json.dump(summary, f, indent=2)
  if flags.FLAGS.responses:
    with open(flags.FLAGS.responses, "w") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
  if summary["ok"] < summary["requests"] or summary["mixed_up"]:
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
