"""The report of scripts/bench/bench_serve.py: its Markdown table, the long_prompt workload's line
and its warm-up error, the JSON it writes and the latency plot (a module of its own beside the
benchmark's requests, importable without its flags)."""
from __future__ import annotations

import asyncio
import math

import numpy as np

STATS = ("ttft", "tpot", "itl", "e2e")


def jsonable(value):
  """inf as "inf": JSON has no infinity."""
  if isinstance(value, float) and math.isinf(value):
    return "inf"
  if isinstance(value, dict):
    return {k: jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  return value


def _cell(stats: dict) -> str:
  return " / ".join("-" if stats[k] is None else f"{stats[k]:.1f}"
                    for k in ("mean", "p50", "p90", "p99"))


def table(runs: list[dict]) -> str:
  """A Markdown table: one row per run, latencies as mean / p50 / p90 / p99 in ms."""
  header = ["rate (req/s)", "concurrency", "completed", "failed", "req/s", "output tok/s",
            "total tok/s", *(f"{name.upper()} ms mean / p50 / p90 / p99" for name in STATS)]
  rows = [[f"{run['rate']:g}", str(run["max_concurrency"] or "-"), str(run["completed"]),
           str(run["failed"]), f"{run['request_throughput']:.2f}",
           f"{run['output_throughput']:.1f}", f"{run['total_token_throughput']:.1f}",
           *(_cell(run[f"{name}_ms"]) for name in STATS)] for run in runs]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def long_prompt_lines(run: dict) -> str:
  ratio = run["itl_p99_ratio"]
  return (f"long prompt of {run['long_prompt_len']} tokens: TTFT "
          f"{run['long_prompt_ttft_ms']:.1f} ms; ITL of the {run['max_concurrency']} running "
          f"requests (ms, mean / p50 / p90 / p99): before it {_cell(run['itl_before_ms'])}, "
          f"while it is prefilled {_cell(run['itl_during_ms'])}; p99 ratio "
          f"{'-' if ratio is None else f'{ratio:.2f}x'}")


def plot(runs: list[dict], path: str, title: str) -> None:
  """TTFT, TPOT, ITL and E2E (p50 and p99) against request rate; inf drawn after the rest."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  finite = [r["rate"] for r in runs if math.isfinite(r["rate"])]
  at_inf = 2 * max(finite) if finite else 1.0
  xs = [r["rate"] if math.isfinite(r["rate"]) else at_inf for r in runs]
  figure, axes = plt.subplots(1, len(STATS), figsize=(4 * len(STATS), 3.5))
  for axis, name in zip(axes, STATS):
    for quantile, style in (("p50", "o-"), ("p99", "s--")):
      ys = [r[f"{name}_ms"][quantile] for r in runs]
      axis.plot(xs, [np.nan if y is None else y for y in ys], style, label=quantile)
    axis.set(title=name.upper(), xlabel="request rate (req/s)", ylabel="ms")
    axis.set_xticks(xs, [f"{r['rate']:g}" for r in runs])
    axis.legend()
  figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def warm_up_failure(tasks: list[asyncio.Task], counts: list[int], warm_tokens: int,
                    timeout_s: float) -> str:
  """The error line when the running requests did not all stream `warm_tokens` chunks: the
  first that failed or ended, else the deadline."""
  for i, task in enumerate(tasks):
    if not task.done() or task.cancelled():
      continue
    record = task.result()
    if record["error"]:
      return f"error: running request {i} of {len(tasks)} failed: {record['error']}"
    return (f"error: running request {i} of {len(tasks)} ended after {len(record['chunks'])} "
            f"tokens, before every running request had streamed {warm_tokens} (the fewest: "
            f"{min(counts)}); give a longer --output_len or fewer --warm_tokens")
  return (f"error: the running requests did not all stream {warm_tokens} tokens within "
          f"{timeout_s:.0f} s (--timeout); the fewest streamed {min(counts)}")
