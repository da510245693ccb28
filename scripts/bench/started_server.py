"""A server command started for a benchmark: `python -m toolkit.serve` (or another module that
prints the same `serving on URL` line) on 127.0.0.1 and a free port, its start-up shown and
bounded by a deadline, stopped by its PID at the end (scripts/bench/bench_serve.py,
bench_score.py)."""
from __future__ import annotations

import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time


class StartedServer:
  """`python -m toolkit.serve` (or `module`, which prints the same `serving on URL` line) on
  127.0.0.1 and a free port; `url` once it listens. Its
  start-up lines (the warm-up compile's, ~30 s) are shown as they come, marked [server]."""

  def __init__(self, serve_flags: str, timeout_s: float, module: str = "toolkit.serve"):
    argv = [sys.executable, "-m", module, *shlex.split(serve_flags),
            "--host=127.0.0.1", "--port=0"]
    print(f"starting {' '.join(shlex.quote(a) for a in argv[1:])}", flush=True)
    self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
    self.lines: queue.Queue = queue.Queue()
    self.output: list[str] = []
    threading.Thread(target=self._read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        self.stop()
        raise SystemExit(f"error: the server did not listen within {timeout_s:.0f} s "
                         f"(--server_start_timeout):\n" + "".join(self.output[-20:]))
      if line is None:
        raise SystemExit(f"error: the server exited ({self.process.wait()}):\n" +
                         "".join(self.output[-20:]))
      if (found := re.match(r"serving on (http://\S+) ", line)):
        self.url = found.group(1)
        return
      print(f"[server] {line}", end="", flush=True)  # its start-up: the compile's progress

  def _read(self) -> None:
    for line in self.process.stdout:  # drained to the end, so the server never blocks on it
      self.output.append(line)
      self.lines.put(line)
    self.lines.put(None)

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
