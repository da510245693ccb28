"""Scoring throughput and latency of `toolkit.serve` with a recommendation checkpoint, against
the same model in plain PyTorch eager behind the same route (scripts/bench/torch_score_server.py).

  python -m toolkit.train --config=experiments/dlrm.py:cpu --workdir=runs/dlrm_cpu
  python scripts/bench/bench_score.py --config=experiments/dlrm.py:cpu --checkpoint=runs/dlrm_cpu

Both servers run on 127.0.0.1, started here and stopped at the end, one at a time. Closed-loop
clients (each sends its next request when the last is answered) send requests of a user's
context and --candidates candidate items (random ids) for --seconds, at each of --clients;
servers alternate for --rounds rounds and the median round is reported: scored candidates per
second, and p50 and p99 latency (ms) as the clients see it. Before timing, one request's scores
from both servers must agree within the project's float32 tolerance (rtol 1e-5, atol 1e-6):
the baseline is the same model. --json writes every round.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import aiohttp
import numpy as np
from absl import app, flags

from scripts.bench.started_server import StartedServer

_CONFIG = flags.DEFINE_string("config", "experiments/dlrm.py:cpu", "The checkpoint's experiment.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "runs/dlrm_cpu", "A click model's workdir.")
_CLIENTS = flags.DEFINE_list("clients", ["1", "16", "64"], "Concurrent clients, per level.")
_CANDIDATES = flags.DEFINE_integer("candidates", 100, "Candidates per request.", lower_bound=1)
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Seconds per level and round.", lower_bound=0.5)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds per server.", lower_bound=1)
_TIMEOUT = flags.DEFINE_float("timeout", 60.0, "Seconds a request may take.", lower_bound=1.0)
_START_TIMEOUT = flags.DEFINE_float("server_start_timeout", 600.0, "Seconds a server may take "
                                    "to listen.", lower_bound=1.0)
_SERVE_FLAGS = flags.DEFINE_string(
    "serve_flags", "--max_batch=2048 --config.mesh.ici=data:1", "Extra flags for toolkit.serve. "
    "The default serves on one CPU device, as the baseline runs: simulated devices split one "
    "machine's cores (for sharding proofs), which only slows a CPU server down.")
_JSON = flags.DEFINE_string("json", "", "Write every round here.")


def request_body(rng: np.random.Generator, candidates: int, source: str) -> dict:
  """A user and `candidates` items: MovieLens' table rows, or Criteo's 13 integers and hex
  ids (the user's 13 in the context, the item's 13 per candidate)."""
  if source == "movielens":
    context = {"user": int(rng.integers(0, 943)), "age": int(rng.integers(0, 7)),
               "gender": int(rng.integers(0, 2)), "occupation": int(rng.integers(0, 21)),
               "zip3": int(rng.integers(0, 300))}
    items = [{"item": int(rng.integers(0, 1682)), "genres": [int(rng.integers(0, 19))],
              "year": int(rng.integers(0, 70))} for _ in range(candidates)]
    return {"context": context, "candidates": items}
  context = {f"I{i}": int(rng.integers(0, 100)) for i in range(1, 14)}
  context.update({f"C{i}": f"{int(rng.integers(0, 2**32)):08x}" for i in range(1, 14)})
  items = [{f"C{i}": f"{int(rng.integers(0, 2**32)):08x}" for i in range(14, 27)}
           for _ in range(candidates)]
  return {"context": context, "candidates": items}


async def post(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> dict:
  async with session.post(url + "/v1/score", json=body,
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
    answer = await response.json()
    if response.status != 200:
      raise SystemExit(f"error: {url} answered {response.status}: {answer}")
    return answer


async def closed_loop(url: str, bodies: list[dict], clients: int, seconds: float,
                      timeout_s: float) -> dict:
  """`clients` clients sending bodies in turn for `seconds`: candidates/s, p50 and p99 ms."""
  latencies, scored = [], 0
  deadline = time.perf_counter() + seconds
  connector = aiohttp.TCPConnector(limit=clients)
  async with aiohttp.ClientSession(connector=connector) as session:

    async def client(index: int) -> None:
      nonlocal scored
      turn = index
      while time.perf_counter() < deadline:
        body = bodies[turn % len(bodies)]
        start = time.perf_counter()
        answer = await post(session, url, body, timeout_s)
        latencies.append(time.perf_counter() - start)
        scored += len(answer["scores"])
        turn += clients

    began = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - began
  return {"candidates_per_s": scored / elapsed, "requests": len(latencies),
          "p50_ms": 1000 * float(np.percentile(latencies, 50)),
          "p99_ms": 1000 * float(np.percentile(latencies, 99))}


def _start(name: str, config: str, checkpoint: str) -> StartedServer:
  flags_text = f"--config={config} --checkpoint={checkpoint}"
  if name == "meshkit":
    return StartedServer(f"{flags_text} {_SERVE_FLAGS.value}", _START_TIMEOUT.value)
  return StartedServer(flags_text, _START_TIMEOUT.value,
                       module="scripts.bench.torch_score_server")


def main(argv) -> None:
  del argv
  clients = [int(c) for c in _CLIENTS.value]
  bodies: list[dict] = []
  rounds = {name: {c: [] for c in clients} for name in ("meshkit", "pytorch")}
  check = {}
  for round_index in range(_ROUNDS.value):
    for name in ("meshkit", "pytorch"):
      server = _start(name, _CONFIG.value, _CHECKPOINT.value)
      try:
        if not bodies:  # the features the checkpoint's model takes: its server's /health
          source = "movielens" if "user" in asyncio.run(_health(server.url))["features"] else ""
          rng = np.random.default_rng(0)
          bodies = [request_body(rng, _CANDIDATES.value, source) for _ in range(256)]
        if name not in check:
          check[name] = asyncio.run(_one(server.url, bodies[0]))["scores"]
        for c in clients:
          result = asyncio.run(closed_loop(server.url, bodies, c, _SECONDS.value,
                                           _TIMEOUT.value))
          rounds[name][c].append(result)
          print(f"round {round_index + 1}/{_ROUNDS.value} {name:8s} {c:3d} clients: "
                f"{result['candidates_per_s']:10,.0f} candidates/s, p50 "
                f"{result['p50_ms']:7.1f} ms, p99 {result['p99_ms']:7.1f} ms", flush=True)
      finally:
        server.stop()
      if len(check) == 2 and round_index == 0 and name == "pytorch":
        ours, theirs = np.asarray(check["meshkit"]), np.asarray(check["pytorch"])
        if not np.allclose(ours, theirs, rtol=1e-5, atol=1e-6):  # the project's float32 bound
          gap = float(np.max(np.abs(ours - theirs)))
          raise SystemExit(f"error: the two servers' scores differ by up to {gap:.2e}; they "
                           f"do not serve the same model")
  print(f"\nmedian of {_ROUNDS.value} rounds, {_CANDIDATES.value} candidates a request, "
        f"{_CONFIG.value}:")
  print("| clients | meshkit candidates/s | p50 ms | p99 ms | PyTorch eager candidates/s | "
        "p50 ms | p99 ms | throughput ratio |")
  print("|---|---|---|---|---|---|---|---|")
  for c in clients:
    ours, theirs = (_median(rounds[n][c]) for n in ("meshkit", "pytorch"))
    print(f"| {c} | {ours['candidates_per_s']:,.0f} | {ours['p50_ms']:.1f} | "
          f"{ours['p99_ms']:.1f} | {theirs['candidates_per_s']:,.0f} | {theirs['p50_ms']:.1f} | "
          f"{theirs['p99_ms']:.1f} | {ours['candidates_per_s'] / theirs['candidates_per_s']:.2f}x |")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"config": _CONFIG.value, "candidates": _CANDIDATES.value, "rounds": rounds}, f,
                indent=1)


async def _health(url: str) -> dict:
  async with aiohttp.ClientSession() as session:
    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(
        total=_TIMEOUT.value)) as response:
      return await response.json()


async def _one(url: str, body: dict) -> dict:
  async with aiohttp.ClientSession() as session:
    return await post(session, url, body, _TIMEOUT.value)


def _median(results: list[dict]) -> dict:
  return {key: statistics.median(r[key] for r in results)
          for key in ("candidates_per_s", "p50_ms", "p99_ms")}


if __name__ == "__main__":
  app.run(main)
