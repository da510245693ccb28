"""Benchmark: the server's throughput and latency under closed-loop clients, this checkout
against another (the decode batch that fits the load, issue 31).

  git worktree add /tmp/wt_before <commit>       # the commit to compare against
  python scripts/bench/bench_batch_fit.py --before=/tmp/wt_before
  python scripts/bench/bench_batch_fit.py --quick

The model is a 25 M-parameter random Llama written by scripts/data/tiny_hf_model.py (--size=25m:
vocabulary 32000, d_model 384, 8 layers of 6 heads, MLP 1024, tied embeddings) and imported
with `toolkit.convert import`; each checkout serves it with its own `python -m toolkit.serve`
on one CPU device in float32 (--batch_size=16, everything else the checkout's defaults), and
scripts/bench/load_test.py's clients send prompts of --prompt_tokens random token ids asking for
--max_tokens greedy tokens, each client its next request as soon as the last one is answered.
Rounds alternate between the checkouts, each round measuring every --clients count once. The
table gives, per checkout and client count, the median over rounds of completion tokens/s and
of the latency p50 and p99. --quick: the tiny Hugging Face model, 2 and 4 clients, 4 tokens, and the caller's XLA_FLAGS
kept (the full run drops them: each checkout compiles with XLA's default code generation).
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[2]
from scripts.bench import load_test

_BEFORE = flags.DEFINE_string("before", "", "A checkout to compare against (a worktree); "
                              "empty: this checkout only.")
_CLIENTS = flags.DEFINE_list("clients", ["4", "16"], "Closed-loop client counts.")
_REQUESTS = flags.DEFINE_integer("requests_per_client", 16, "Requests per client and count.",
                                 lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_tokens", 32, "Prompt length (random token ids).",
                               lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Greedy tokens per request.",
                                   lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds; each serves every checkout once.",
                               lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_batch_fit", "Where the model is written "
                               "and imported (reused when there).")
_SERVE = flags.DEFINE_string("serve", "--batch_size=16", "Further toolkit.serve flags, the same "
                             "for every checkout.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 900.0, "Seconds for a server to listen (it compiles "
                              "first), and for one request.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON here.")
_QUICK = flags.DEFINE_bool("quick", False, "The tiny model, 2 and 4 clients, 4 tokens.")

SERVING = re.compile(r"^serving on (http://\S+)")


def prepare(workdir: pathlib.Path, size: str) -> tuple[pathlib.Path, pathlib.Path]:
  """The Hugging Face folder and its imported checkpoint, made once."""
  folder, imported = workdir / f"hf_{size}", workdir / f"import_{size}"
  if not folder.exists():
    subprocess.run([sys.executable, str(REPO / "scripts" / "data" / "tiny_hf_model.py"),
                    f"--out={folder}", f"--size={size}"], check=True)
  if not imported.exists():
    subprocess.run([sys.executable, "-m", "toolkit.convert", "import", f"--hf={folder}",
                    f"--workdir={imported}"], cwd=REPO, check=True)
  return folder, imported


def measure(checkout: str, folder: pathlib.Path, imported: pathlib.Path,
            clients: list[int], vocab_size: int) -> dict[int, dict]:
  """Starts `checkout`'s server, runs every client count against it, stops it."""
  command = [sys.executable, "-m", "toolkit.serve", f"--config=experiments/hf.py:{folder}",
             f"--checkpoint={imported}", "--config.mesh.ici=fsdp:1", "--port=0",
             *_SERVE.value.split()]
  env = {**os.environ, "PYTHONPATH": checkout, "JAX_PLATFORMS": "cpu"}
  if not _QUICK.value:  # XLA's own code generation; --quick keeps the caller's flags (the
    env.pop("XLA_FLAGS", None)  # suite's turn LLVM's optimizations off: faster compiles)
  server = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  try:
    url, lines, deadline = None, [], time.monotonic() + _TIMEOUT.value
    while url is None and time.monotonic() < deadline:
      line = server.stdout.readline()
      if not line:
        break
      lines.append(line)
      url = (m := SERVING.match(line)) and m.group(1)
    if url is None:
      raise RuntimeError(f"no server from {checkout}:\n{''.join(lines)}")
    results = {}
    for count in clients:
      bodies = [load_test.request_body(i, _MAX_TOKENS.value, 0.0, _PROMPT.value, vocab_size)
                for i in range(count * _REQUESTS.value)]
      records, seconds = asyncio.run(load_test.run_load(url, bodies, count, _TIMEOUT.value))
      summary = load_test.summarize(records, seconds, count)
      if summary["ok"] < summary["requests"]:
        raise RuntimeError(f"{checkout}: failed requests {summary['statuses']}")
      results[count] = summary
      print(f"{checkout}, {count} clients: {summary['completion_tokens_per_second']:,.0f} "
            f"tokens/s, latency p50 {summary['latency_s']['0.5']:.3f} s, p99 "
            f"{summary['latency_s']['0.99']:.3f} s", flush=True)
    return results
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=60)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()


def main(argv) -> None:
  del argv
  if _QUICK.value:
    for name, value in (("clients", ["2", "4"]), ("requests_per_client", 2), ("max_tokens", 4),
                        ("prompt_tokens", 8), ("rounds", 1)):
      flags.FLAGS[name].value = value
  size = "tiny" if _QUICK.value else "25m"
  vocab_size = 256 if _QUICK.value else 32_000  # tiny_hf_model.py's: bytes; the 25m's
  folder, imported = prepare(pathlib.Path(_WORKDIR.value).resolve(), size)
  clients = [int(c) for c in _CLIENTS.value]
  checkouts = ([os.path.abspath(_BEFORE.value)] if _BEFORE.value else []) + [str(REPO)]
  runs = {checkout: [] for checkout in checkouts}
  for _ in range(_ROUNDS.value):
    for checkout in checkouts:
      runs[checkout].append(measure(checkout, folder, imported, clients, vocab_size))
  table = {checkout: {count: {key: statistics.median(pick(r[count]) for r in rounds)
                              for key, pick in (
                                  ("tokens_per_second",
                                   lambda s: s["completion_tokens_per_second"]),
                                  ("latency_p50_s", lambda s: s["latency_s"]["0.5"]),
                                  ("latency_p99_s", lambda s: s["latency_s"]["0.99"]))}
                      for count in clients} for checkout, rounds in runs.items()}
  print(f"\n{'checkout':<40} {'clients':>7} {'tokens/s':>9} {'p50 s':>7} {'p99 s':>7}")
  for checkout, rows in table.items():
    for count, row in rows.items():
      print(f"{checkout:<40} {count:>7} {row['tokens_per_second']:>9,.0f} "
            f"{row['latency_p50_s']:>7.3f} {row['latency_p99_s']:>7.3f}")
  if _BEFORE.value:
    before, after = table[checkouts[0]], table[checkouts[1]]
    for count in clients:
      ratio = lambda key, count=count: after[count][key] / before[count][key]
      print(f"{count} clients: {ratio('tokens_per_second'):.2f}x tokens/s, latency p99 "
            f"{ratio('latency_p99_s'):.2f}x")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"table": table, "runs": runs}, f, indent=2, default=str)


if __name__ == "__main__":
  app.run(main)
