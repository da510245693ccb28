"""scripts/bench/bench_serve.py's long_prompt workload names why its running requests did not all
warm up (one failed, one ended first, or the deadline), and refuses a --warm_tokens its
running requests cannot reach before it contacts a server. The benchmark against a served
model: tests/toolkit/serving/test_openai_api.py. (bench_serve itself is not imported: its
absl flags would clash with another script's in the same pytest process.)"""
import asyncio
import pathlib
import subprocess
import sys

from scripts.bench import serve_report

REPO = pathlib.Path(__file__).resolve().parents[2]


def _record(chunks: int, error: str = "") -> dict:
  return {"ok": not error, "error": error, "chunks": [0.0] * chunks}


def _failure(records: list[dict | None], counts: list[int]) -> str:
  async def main():
    async def finished(record):
      return record
    tasks = [asyncio.create_task(finished(r) if r else asyncio.sleep(60)) for r in records]
    await asyncio.sleep(0)  # the finished ones finish
    try:
      return serve_report.warm_up_failure(tasks, counts, 4, 300.0)
    finally:
      for task in tasks:
        task.cancel()
  return asyncio.run(main())


def test_warm_up_failure_names_the_request_that_failed_or_ended_else_the_deadline():
  assert _failure([None, _record(1, "HTTP 400: too long"), None], [3, 1, 2]) == (
      "error: running request 1 of 3 failed: HTTP 400: too long")
  assert _failure([_record(12), None, None], [12, 2, 0]) == (
      "error: running request 0 of 3 ended after 12 tokens, before every running request had "
      "streamed 4 (the fewest: 0); give a longer --output_len or fewer --warm_tokens")
  assert _failure([None, None], [5, 3]) == (
      "error: the running requests did not all stream 4 tokens within 300 s (--timeout); the "
      "fewest streamed 3")


def test_warm_tokens_beyond_the_running_outputs_is_one_error_before_any_request():
  done = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "bench" / "bench_serve.py"), "--workload=long_prompt",
       "--quick", "--output_len=4", "--url=http://127.0.0.1:1"],  # nothing listens on port 1
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 1 and done.stdout == "", done
  assert done.stderr.strip() == (
      "error: --warm_tokens=4: the running requests stream --output_len's MAX (4) tokens each, "
      "so the long prompt must come before that; give fewer --warm_tokens or a longer "
      "--output_len")
