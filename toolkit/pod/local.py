"""A pod simulated on one machine: N processes of `python -m toolkit.train` with M CPU devices
each, joined on 127.0.0.1 into one job of N x M devices. scripts/launch/local_pod.py is its command
line; the multi-process tests use it too.

Each process runs the normal training command plus --coordinator_address, --num_processes and
--process_id, exactly as a worker of a real pod would, and every line it prints is prefixed
with `[p<i>]`. SIGINT and SIGTERM reach every process as SIGTERM (the training loop then stops
all of them after the same step and saves); a second signal kills them. When one process
fails, the others get `grace_s` to stop on their own (the runtime ends them within its
heartbeat or collective timeout) before they are terminated. Processes run in their own
session, so a terminal's Ctrl-C reaches only the launcher; if the launcher itself is killed
(SIGKILL), process 0 fails on its next output line (a closed pipe) and the runtime ends the
others (measured: all gone 6 s after, with a progress line every 5 steps).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Gloo, the CPU backend's collectives, prints "[Gloo] Rank R is connected to N peer ranks.
# Expected number of connected peer ranks is : N" on stderr for every device of every new
# communicator, from several threads at once, so the pieces of these lines can interleave.
# When two threads interleave, pieces of these lines (a lone rank number, an empty line left by
# the second thread's newline) can land on lines of their own, right after a Gloo line.
_GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank|connected peer ranks")
_GLOO_PIECES = re.compile(r"\[Gloo\]|Rank|is connected to|peer ranks\.?|Expected number of|"
                          r"connected|is :|[\d\s.:]")


_PROGRESS = re.compile(r"step \d+/\d+ \|")  # the training loop's progress line


def is_gloo_noise(line: str, after_gloo: bool) -> bool:
  """Whether `line` is (a piece of) Gloo's connection chatter; `after_gloo`: the line before
  it on the same stream was."""
  if _GLOO_CONNECTED.search(line):
    return True
  return after_gloo and not _GLOO_PIECES.sub("", line)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(devices_per_process: int, environ=None) -> dict[str, str]:
  """`environ` with JAX on the CPU backend and `devices_per_process` simulated devices."""
  env = dict(os.environ if environ is None else environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"  # lines appear as they are printed, in order per process
  return env


def process_command(process_id: int, processes: int, port: int,
                    train_args: Sequence[str]) -> list[str]:
  return [sys.executable, "-m", "toolkit.train", f"--coordinator_address=127.0.0.1:{port}",
          f"--num_processes={processes}", f"--process_id={process_id}", *train_args]


# An absl/C++ log line of JAX's runtime at ERROR or FATAL ("E1207 14:43:10.018011 ...").
_RUNTIME_LOG = re.compile(r"^[EF]\d{4} \d\d:\d\d:\d\d")


def _is_stopped(pid: int) -> bool:
  """Whether process `pid` is stopped (state T or t in /proc; False where there is none)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


def describe_status(returncode: int) -> str:
  if returncode < 0:
    return f"killed by {signal.Signals(-returncode).name}"
  return f"exit status {returncode}"


class Pod:
  """N local training processes; `start()`, then `wait()`; `close()` kills what is left."""

  def __init__(self, processes: int, devices_per_process: int, train_args: Sequence[str], *,
               grace_s: float = 30.0, port: int | None = None, environ=None,
               out: TextIO | None = None, err: TextIO | None = None, cwd: str = REPO,
               log: TextIO | None = None):
    if processes < 1 or devices_per_process < 1:
      raise ValueError("processes and devices_per_process must be >= 1")
    self.count, self.grace_s = processes, grace_s
    self.port = port or free_port()
    self.env = process_env(devices_per_process, environ)
    self.commands = [process_command(i, processes, self.port, train_args)
                     for i in range(processes)]
    self.cwd, self.out, self.err = cwd, out or sys.stdout, err or sys.stderr
    self.log = log  # every line of every process, the ones kept off the terminal included
    self.procs: list[subprocess.Popen] = []
    self.lines: list[list[str]] = [[] for _ in range(processes)]  # every line, per process
    self.exit_times: dict[int, float] = {}  # process -> time.monotonic() it was seen to exit
    self.stopped: set[int] = set()  # processes found stopped (SIGSTOP) when the rest were ended
    self._lock = threading.RLock()  # the signal handler writes too, in the main thread
    self._pumps: list[threading.Thread] = []
    self._signals = 0
    self.first_progress_at: float | None = None  # time.monotonic() of p0's first step line

  def start(self, only: Sequence[int] | None = None) -> Pod:
    """Starts the processes (`only` these ids: a test's missing peer)."""
    self.started_at = time.monotonic()
    for i, command in enumerate(self.commands):
      if only is not None and i not in only:
        continue
      # Its own session: a Ctrl-C in the terminal reaches the launcher only, which passes it on.
      proc = subprocess.Popen(command, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                              start_new_session=True)
      proc.process_id = i
      self.procs.append(proc)
      for stream, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
        pump = threading.Thread(target=self._pump, args=(i, stream, sink), daemon=True)
        pump.start()
        self._pumps.append(pump)
    self._note(f"{len(self.procs)} of {self.count} processes on 127.0.0.1:{self.port}, pids " +
               " ".join(f"p{proc.process_id}={proc.pid}" for proc in self.procs))
    return self

  def _pump(self, i: int, stream, sink: TextIO) -> None:
    after_gloo = False
    for line in stream:
      with self._lock:
        text = f"[p{i}] {line if line.endswith(chr(10)) else line + chr(10)}"
        self.lines[i].append(line.rstrip("\n"))
        if self.log is not None:
          self.log.write(text)
          self.log.flush()
        if i == 0 and self.first_progress_at is None and _PROGRESS.match(line):
          self.first_progress_at = time.monotonic()
        after_gloo = is_gloo_noise(line.rstrip("\n"), after_gloo)
        if after_gloo:
          continue  # one line per device and communicator: noise, kept in self.lines only
        if self.log is not None and _RUNTIME_LOG.match(line) and self._a_peer_exited(i):
          continue  # JAX's E/F lines about the peer that died: the log has them
        sink.write(text)
        sink.flush()

  def _a_peer_exited(self, i: int) -> bool:
    return any(p.process_id != i and p.poll() is not None for p in self.procs)

  def output(self, i: int) -> str:
    with self._lock:
      return "\n".join(self.lines[i])

  def _note(self, message: str) -> None:
    with self._lock:
      self.err.write(f"[pod] {message}\n")
      self.err.flush()

  def signal_all(self, sig: int) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.kill(proc.pid, sig)

  def forward_signals(self):
    """Context: SIGINT/SIGTERM to the launcher reach every process as SIGTERM; a second one
    kills them."""
    def handle(signum, frame):
      del frame
      self._signals += 1
      if self._signals == 1:
        self._note(f"{signal.Signals(signum).name}: asking every process to stop (SIGTERM); "
                   f"again to kill them")
        self.signal_all(signal.SIGTERM)
      else:
        self.signal_all(signal.SIGKILL)

    @contextlib.contextmanager
    def installed():
      previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield self
      finally:
        for sig, handler in previous.items():
          signal.signal(sig, handler)
    return installed()

  def wait(self, timeout_s: float | None = None) -> int:
    """Waits for every process; returns 0 if all succeeded, else the first failure's status
    (128 + signal number for a signal). After a failure the others get `grace_s` seconds,
    then SIGTERM, then SIGKILL 5 s later; past `timeout_s` all are killed."""
    deadline = None if timeout_s is None else self.started_at + timeout_s
    first_failure, failed_at, terminated = None, None, False
    while True:
      now = time.monotonic()
      for proc in self.procs:
        if proc.process_id in self.exit_times or proc.poll() is None:
          continue
        self.exit_times[proc.process_id] = now
        code = proc.returncode
        self._note(f"p{proc.process_id} {describe_status(code)} after "
                   f"{now - self.started_at:.1f} s")
        # A signal's end (a killed host) wins over an exit status seen at the same poll (the
        # peers it took down): it is the cause.
        if code != 0 and (first_failure is None or (failed_at == now and code < 0 < first_failure)):
          first_failure, failed_at = code, now
      if len(self.exit_times) == len(self.procs):
        break
      if deadline is not None and now > deadline:
        self._note(f"still running after {timeout_s:.0f} s: killing every process")
        self.signal_all(signal.SIGKILL)
        first_failure = first_failure or -signal.SIGKILL
        deadline = None
      elif failed_at is not None and now - failed_at > self.grace_s + (5 if terminated else 0):
        if not terminated:
          self.stopped = {p.process_id for p in self.procs
                          if p.poll() is None and _is_stopped(p.pid)}
          for i in sorted(self.stopped):
            self._note(f"p{i} is stopped (SIGSTOP, or a debugger): it made no progress")
          self._note(f"a process failed {self.grace_s:.0f} s ago: terminating the rest")
          self.signal_all(signal.SIGTERM)
          terminated = True
        else:
          self.signal_all(signal.SIGKILL)
      time.sleep(0.05)
    for pump in self._pumps:
      pump.join(timeout=5)
    if first_failure is None:
      return 0
    return 128 - first_failure if first_failure < 0 else first_failure

  def close(self) -> None:
    """Kills (by PID) every process still running and reaps it."""
    self.signal_all(signal.SIGKILL)
    for proc in self.procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)

  def __enter__(self) -> Pod:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def run(processes: int, devices_per_process: int, train_args: Sequence[str],
        grace_s: float = 30.0) -> int:
  """Runs a local pod to the end, passing signals on; returns the exit status for the shell."""
  with Pod(processes, devices_per_process, train_args, grace_s=grace_s) as pod:
    with pod.forward_signals():
      pod.start()
      return pod.wait()
