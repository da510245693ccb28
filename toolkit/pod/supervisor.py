"""A supervisor for a training job: it starts the job's processes (a local pod, `local.Pod`),
and when the job fails it restarts it from the newest checkpoint, up to `max_restarts` times,
saying in one line each time why, how many steps were lost and how long recovery took.

What counts as what (the exit status of the first process to fail, and the hang markers the
watchdog leaves in WORKDIR/hang/):

  hang      a process exited with watchdog.HANG_EXIT (75) after no progress for
            train.hang_timeout_s; its marker names the last completed step
  crash     a process was killed by a signal, or failed after the job had trained a step
  mistake   the command line (exit 2), or a failure before the first step of an attempt (a
            config, workdir or checkpoint mistake): restarting would fail the same way, so the
            supervisor stops and passes the status on
  stopped   SIGINT/SIGTERM reached the job and it saved and stopped (exit 0), or Ctrl-C twice
            (130): not restarted
  resized   the job ran on fewer hosts than asked, the hosts file listed more again, and the
            supervisor stopped it (it saved) to restart it larger: not counted as a restart

With --hosts_file (toolkit/pod/elastic.py) the job is elastic: when a process failed and its
host is no longer listed, the supervisor waits up to `replace_timeout_s` for the list to grow
back, then restarts on the hosts listed: the largest job that fits them, with the same global
batch in more micro-batches; when the lost hosts are listed again, it grows back at the next
step (the job saves, then restarts on every host).

The job resumes by itself (the training command restores the newest checkpoint that restores);
the batches of step s are a function of (seed, s), so the restarted job trains the same steps
on the same data and its losses equal an uninterrupted run's. Each restart is one line

  [supervise] restart 1 of 3 after a crash (p0 killed by SIGKILL) at step 27: ...
  [supervise] recovered in 6.2 s: restored step 20, 7 steps lost (trained again)

and the job's lifetime goodput (where the time went across attempts) is the last line and a
`supervisor` record in WORKDIR/supervisor.jsonl.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from toolkit import workdir as workdir_lib
from toolkit.pod import elastic, local

HANG_EXIT = 75  # toolkit.training.watchdog.HANG_EXIT (pod/ does not import training/)
JOB_ENV = "MESHKIT_JOB"  # toolkit.training.goodput.JOB_ENV: what earlier attempts cost
USAGE_EXIT = 2
INTERRUPTED_EXIT = 130
_PROGRESS = re.compile(r"^step (\d+)/\d+ \|.*\| step ([\d.]+) (ms|s) \|")
_RESTORED = re.compile(r"^restored step (\d+) from ")


@dataclasses.dataclass
class Attempt:
  """One start of the job and how it ended."""
  number: int
  started: float  # time.monotonic()
  ended: float = 0.0
  returncode: int = 0
  first_progress: float | None = None  # when its first progress line arrived
  restored: int | None = None  # the step it resumed from (None: from scratch)
  last_step: int = 0  # the last step it logged
  log: str = ""  # WORKDIR/attempts/N.log: all its processes printed
  step_seconds: float = 0.0  # the step time of its last progress line
  cause: str = ""
  size: elastic.Size = elastic.Size(1)  # its processes and micro-batches
  detail: str = ""
  detection_s: float = 0.0  # a hang: how long the watchdog waited before it ended the process


def lifetime(attempts: Sequence[Attempt]) -> dict[str, float]:
  """What the failures among `attempts` (in order, each ended) cost: seconds waiting out
  hangs, seconds from each failure to the next attempt's first step (or its end), and the
  steps trained again (and their seconds at the restarted attempt's step time)."""
  pairs = list(zip(attempts, attempts[1:]))
  again = [max(0, a.last_step - (b.restored or 0)) for a, b in pairs]
  return {"hang_detection_s": sum(a.detection_s for a in attempts[:-1]),
          "restart_s": sum((b.first_progress or b.ended) - a.ended for a, b in pairs),
          "steps_trained_again": sum(again),
          "steps_trained_again_s": sum(n * b.step_seconds for n, (_, b) in zip(again, pairs))}


def workdir_of(train_args: Sequence[str]) -> str | None:
  for arg in train_args:
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
  return None


class Supervisor:
  """Runs `train_args` as a local pod of `processes` x `devices_per_process` until it finishes,
  restarting it after a crash or a hang (`run`)."""

  def __init__(self, processes: int, devices_per_process: int, train_args: Sequence[str], *,
               max_restarts: int = 3, restart_delay_s: float = 1.0, grace_s: float = 30.0,
               out: TextIO | None = None, err: TextIO | None = None, environ=None,
               hosts_file: str | None = None, replace_timeout_s: float = 300.0,
               poll_s: float = 1.0, elastic_batch: str = "global"):
    self.processes, self.devices_per_process = processes, devices_per_process
    self.hosts_file, self.replace_timeout_s, self.poll_s = hosts_file, replace_timeout_s, poll_s
    self.elastic_batch = elastic_batch  # what a smaller job keeps (toolkit/pod/elastic.py)
    self.train_args = list(train_args)
    self.max_restarts, self.restart_delay_s, self.grace_s = max_restarts, restart_delay_s, grace_s
    self.out, self.err = out or sys.stdout, err or sys.stderr
    self.environ = environ
    self.workdir = workdir_of(train_args)
    self.attempts: list[Attempt] = []
    self.job: local.Pod | None = None  # the attempt running now
    self._stop_requested = False
    self._resizing = False  # the supervisor stopped the job to restart it on more hosts
    self._started_unix = time.time()  # when `run` began (set again there)

  @property
  def stop_requested(self) -> bool:
    return self._stop_requested

  def say(self, line: str) -> None:
    self.err.write(f"[supervise] {line}\n")
    self.err.flush()

  def request_stop(self) -> None:
    """SIGINT/SIGTERM to the supervisor: the job stops after a step and saves; no restart. Each
    process gets SIGINT, as from a Ctrl-C of its own (toolkit/training/stop_signal.py), so a
    second request hurries the stop as Ctrl-C twice does: each process saves the step it is in
    and exits 130, which the supervisor passes on."""
    self._stop_requested = True
    if self.job is not None:
      self.job.signal_all(signal.SIGINT)

  def run(self) -> int:
    """The job to its end; the exit status of its last attempt."""
    started, self._started_unix = time.monotonic(), time.time()
    size = self._size(None)
    while size is not None:
      attempt = self._attempt(len(self.attempts) + 1, size)
      self.attempts.append(attempt)
      if attempt.cause in ("finished", "stopped", "mistake") or self._stop_requested:
        break
      if attempt.cause == "resized":
        size = self._size(attempt)
        continue
      restarts = sum(a.cause in ("crash", "hang") for a in self.attempts)
      if restarts > self.max_restarts:
        self.say(f"{attempt.cause} ({attempt.detail}) after {restarts - 1} restart(s): giving "
                 f"up (--max_restarts={self.max_restarts}); rerun the same command to resume")
        break
      log = (f" (its output: {attempt.log})" if attempt.log else "")
      self.say(f"restart {restarts} of {self.max_restarts} after a {attempt.cause} "
               f"({attempt.detail}) at step {attempt.last_step}: starting the job again from "
               f"its newest checkpoint{log}")
      time.sleep(self.restart_delay_s)
      size = self._size(attempt)
    if not self.attempts:
      return 1  # the hosts file said why, in one line
    self._summary(time.monotonic() - started)
    return self.attempts[-1].returncode

  def _hosts(self) -> int:
    return len(elastic.read_hosts(self.hosts_file))

  def _size(self, failed: Attempt | None) -> elastic.Size | None:
    """The next attempt's size: every process without a hosts file; else, after a failure on
    fewer hosts than asked, the hosts listed within replace_timeout_s, and the largest job that
    fits them. None (after one line) when none does, or when a stop was requested."""
    if self._stop_requested:
      return None  # SIGINT/SIGTERM between attempts: no restart (the handler said so)
    if self.hosts_file is None:
      return elastic.Size(self.processes)
    try:
      listed = self._hosts()
      if failed is not None and failed.cause != "resized" and listed < self.processes:
        self.say(f"{listed} of {self.processes} hosts listed in {self.hosts_file}: waiting up "
                 f"to {self.replace_timeout_s:g} s for the lost host(s) to be replaced")
        deadline = time.monotonic() + self.replace_timeout_s
        while (listed < self.processes and time.monotonic() < deadline
               and not self._stop_requested):
          time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
          listed = self._hosts()
        if self._stop_requested:
          return None
      if listed >= self.processes:
        return elastic.Size(self.processes)
      size = elastic.fit(self.train_args, listed, self.processes, self.devices_per_process,
                         self.elastic_batch)
    except elastic.HostsError as e:
      self.say(f"error: {e}")
      return None
    batches = ("" if size.microbatches is None else
               f", the same global batch in train.microbatches={size.microbatches}")
    if size.global_batch is not None:
      batches = (f", {size.global_batch} rows a step instead of "
                 f"{elastic.job_config(self.train_args).data.global_batch_size} (the same rows "
                 f"a device): each step trains on fewer examples, and other ones than the "
                 f"uninterrupted run's")
    self.say(f"running on {size.processes} of {self.processes} hosts ({listed} listed): "
             f"{size.processes * self.devices_per_process} devices{batches}; it grows back "
             f"when the hosts file lists more")
    return size

  def _attempt(self, number: int, size: elastic.Size) -> Attempt:
    attempt = Attempt(number, time.monotonic(), size=size)
    log = self._attempt_log(number)
    attempt.log = log.name if log is not None else ""
    job = local.Pod(size.processes, self.devices_per_process,
                    elastic.with_size(self.train_args, size),
                    grace_s=self.grace_s, environ=self._job_environ(attempt), out=self.out,
                    err=self.err, log=log)
    self.job, self._resizing = job, False
    previous = self.attempts[-1] if self.attempts else None
    watcher = threading.Thread(target=self._announce_recovery, args=(previous, job),
                               name="supervise: recovery", daemon=True)
    grower = threading.Thread(target=self._grow_when_hosts_return, args=(size, job),
                              name="supervise: hosts", daemon=True)
    try:
      job.start()
      watcher.start()
      if size.processes < self.processes:
        grower.start()
      attempt.returncode = job.wait()
    finally:
      job.close()
      self.job = None
      if log is not None:
        log.close()
    watcher.join(5)
    if grower.is_alive():
      grower.join(self.poll_s + 5)
    attempt.ended = time.monotonic()
    self._read_output(attempt, job)
    attempt.cause, attempt.detail = self._classify(attempt, job)
    return attempt

  def _attempt_log(self, number: int):
    """WORKDIR/attempts/N.log, every line attempt N's processes printed (the runtime's error
    lines about a peer that died are kept out of the terminal, there), open for writing; None
    without a local workdir."""
    if self.workdir is None or workdir_lib.is_url(self.workdir):
      return None
    folder = os.path.join(self.workdir, "attempts")
    try:
      os.makedirs(folder, exist_ok=True)
      return open(os.path.join(folder, f"{number}.log"), "w", encoding="utf-8")
    except OSError:
      return None  # the job's own start reports an unusable workdir in one line

  def _grow_when_hosts_return(self, size: elastic.Size, job: local.Pod) -> None:
    """While `job` runs on fewer processes than asked: once the hosts file lists enough hosts
    for a larger job, stop it (SIGTERM: it saves after its step) to restart it larger."""
    while all(proc.poll() is None for proc in job.procs) and not self._stop_requested:
      time.sleep(self.poll_s)
      try:
        listed = min(self._hosts(), self.processes)
        larger = listed > size.processes and (
            listed == self.processes or elastic.fit(self.train_args, listed, self.processes,
                                                    self.devices_per_process,
                                                    self.elastic_batch).processes
            > size.processes)
      except elastic.HostsError:
        continue  # the file is being rewritten, or no larger job fits yet
      if larger:
        self.say(f"{listed} of {self.processes} hosts listed again: stopping the job after its "
                 f"step (it saves) to restart it on them")
        self._resizing = True
        job.signal_all(signal.SIGTERM)
        return

  def _job_environ(self, attempt: Attempt) -> dict[str, str]:
    """The environment of `attempt`'s processes: the supervisor's, and JOB_ENV with what the
    attempts before it cost (the run's goodput line adds its own share)."""
    before = lifetime(self.attempts)
    previous = self.attempts[-1] if self.attempts else None
    job = {"attempt": attempt.number, "job_started_unix": self._started_unix,
           "attempt_started_unix": time.time(),
           "hang_detection_s": sum(a.detection_s for a in self.attempts),
           # The restarts so far, and the delay before this one (its start-up it times itself).
           "restart_s": before["restart_s"] + (attempt.started - previous.ended
                                               if previous else 0.0),
           "steps_trained_again": before["steps_trained_again"],
           "steps_trained_again_s": before["steps_trained_again_s"],
           "last_step": previous.last_step if previous else 0}
    return {**(os.environ if self.environ is None else self.environ), JOB_ENV: json.dumps(job)}

  def _read_output(self, attempt: Attempt, job: local.Pod) -> None:
    """The step it resumed from, its last logged step and step time, when it first logged."""
    for line in job.lines[0]:
      if (restored := _RESTORED.match(line)) and attempt.restored is None:
        attempt.restored = int(restored.group(1))
      if progress := _PROGRESS.match(line):
        attempt.last_step = int(progress.group(1))
        value, unit = float(progress.group(2)), progress.group(3)
        attempt.step_seconds = value / 1e3 if unit == "ms" else value
    attempt.first_progress = job.first_progress_at

  def _classify(self, attempt: Attempt, job: local.Pod) -> tuple[str, str]:
    code = attempt.returncode
    if code == 0:
      if self._resizing and not self._stop_requested:
        return "resized", "stopped to grow back onto the hosts listed again"
      return ("stopped" if self._stop_requested else "finished"), "exit status 0"
    # The first to fail; of those seen failing at the same poll, one a signal ended before the
    # ones whose exit status says a peer died (a SIGKILLed host and the peers it took down).
    failed = min(job.exit_times, key=lambda i: (job.procs[i].returncode == 0, job.exit_times[i],
                                                job.procs[i].returncode > 0))
    detail = f"p{failed} {local.describe_status(job.procs[failed].returncode)}"
    if code == INTERRUPTED_EXIT:
      return "stopped", detail
    first = job.procs[failed].returncode
    if code == HANG_EXIT or first == HANG_EXIT:
      return "hang", self._hang_detail(attempt) or detail
    if getattr(job, "stopped", None):  # a peer that could not run: the others timed out on it
      return "hang", f"p{min(job.stopped)} stopped: no progress (its peers: {detail})"
    if first is not None and first < 0:
      return "crash", detail  # killed first: a peer's watchdog that fired after is its effect
    # A hung process's peers can fail first on the CPU's collective timeout (exit 1).
    if any(p.returncode == HANG_EXIT for p in job.procs):
      return "hang", self._hang_detail(attempt) or detail
    if code < 0:
      return "crash", detail
    if code == USAGE_EXIT or attempt.first_progress is None:
      return "mistake", detail
    return "crash", detail

  def _hang_detail(self, attempt: Attempt) -> str | None:
    """What the watchdog's marker of this attempt says (the first process's that hung)."""
    if self.workdir is None:
      return None
    for i in range(attempt.size.processes):
      path = workdir_lib.join(self.workdir, "hang", f"process_{i}.json")
      try:
        marker = json.loads(workdir_lib.read_text(path))
      except (OSError, ValueError):
        continue
      if marker.get("time", 0) >= time.time() - (time.monotonic() - attempt.started):
        attempt.detection_s = float(marker.get("idle_s", 0.0))
        return (f"p{i}: no progress for {attempt.detection_s:.1f} s after step "
                f"{marker.get('step')}")
    return None

  def _announce_recovery(self, failed: Attempt | None, job: local.Pod) -> None:
    """After a restart: one line once the job trains again (its first progress line)."""
    if failed is None:
      return
    while job.first_progress_at is None:
      if all(proc.poll() is not None for proc in job.procs):
        return  # ended before it trained a step
      time.sleep(0.05)
    restored = next((int(m.group(1)) for line in list(job.lines[0])
                     if (m := _RESTORED.match(line))), 0)
    self.say(f"recovered in {job.first_progress_at - failed.ended:.1f} s: restored step "
             f"{restored}, {max(0, failed.last_step - restored)} step(s) lost (trained again)")

  def _summary(self, wall_s: float) -> None:
    """The job's lifetime: attempts, causes, and the time failures cost."""
    failures = self.attempts[:-1]
    costs = lifetime(self.attempts)
    restart_s, detection_s = costs["restart_s"], costs["hang_detection_s"]
    lost_steps, redo_s = costs["steps_trained_again"], costs["steps_trained_again_s"]
    record = {"attempts": len(self.attempts), "causes": [a.cause for a in failures],
              "final": self.attempts[-1].cause, "wall_s": round(wall_s, 3),
              "hang_detection_s": round(detection_s, 3),
              "restart_and_restore_s": round(restart_s, 3), "steps_trained_again": lost_steps,
              "steps_trained_again_s": round(redo_s, 3)}
    causes = ", ".join(c for c in record["causes"] if c != "resized") or "none"
    if resized := record["causes"].count("resized"):
      causes += f"; grown back {resized} time(s)"
    ended = {"finished": "finished", "stopped": "stopped on request",
             "mistake": "failed before training a step (not retried)"}.get(record["final"],
                                                                           "failed")
    self.say(f"job {ended} after {len(self.attempts)} attempt(s) (failures: {causes}) "
             f"in {wall_s:.1f} s: {detection_s:.1f} s waiting out hangs, {restart_s:.1f} s "
             f"restarting and restoring, {lost_steps} step(s) trained again (~{redo_s:.1f} s)")
    if self.workdir is not None and workdir_lib.exists(self.workdir):
      path = workdir_lib.join(self.workdir, "supervisor.jsonl")
      previous = workdir_lib.read_text(path) if workdir_lib.exists(path) else ""
      workdir_lib.write_text(path, previous + json.dumps(record) + "\n")


def supervise(processes: int, devices_per_process: int, train_args: Sequence[str],
              max_restarts: int, restart_delay_s: float, hosts_file: str | None = None,
              replace_timeout_s: float = 300.0, elastic_batch: str = "global") -> int:
  """The `toolkit.supervise` command: a supervisor with SIGINT/SIGTERM passed on as a stop."""
  supervisor = Supervisor(processes, devices_per_process, train_args, max_restarts=max_restarts,
                          restart_delay_s=restart_delay_s, hosts_file=hosts_file,
                          replace_timeout_s=replace_timeout_s, elastic_batch=elastic_batch)

  def handle(signum, frame):
    del frame
    name = signal.Signals(signum).name
    supervisor.say(f"{name} again: hurrying the job's stop (each process saves its step and "
                   f"exits)" if supervisor.stop_requested else
                   f"{name}: stopping the job (it saves), no restart; again to hurry it")
    supervisor.request_stop()

  previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    return supervisor.run()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
