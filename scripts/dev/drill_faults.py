"""Fault drill (issue 32): a supervised CPU job with one crash and one hang against the same job
without faults, what each failure cost, and the goodput of both (the table in docs/pods.md).

  python scripts/dev/drill_faults.py                # 200 steps, 2 processes x 4 devices: ~3 minutes
  python scripts/dev/drill_faults.py --steps=60 --keep=runs/drill   # shorter; keeps both jobs

Both jobs are `toolkit.supervise`'s Supervisor running experiments/lm.py:tiny, the workdir
checkpointed every --checkpoint_every steps and the local tier (toolkit/training/checkpoints/tiers.py) every
--local_every steps into a temporary folder. In the faulted job process 1 is SIGKILLed once
both hosts hold a local step past 30 % of the steps and its local folder deleted (a crash on a
host replaced with an empty disk: the restart restores that step, process 1's shards from the
copy on process 0's host), and SIGSTOPped past 70 % (a hang: process 0 waits in a collective
until its watchdog ends it after --hang_timeout_s). Each job prints one row: wall time,
attempts, seconds waiting out hangs, seconds restarting and restoring, steps trained again
(toolkit.supervise's record), and its goodput: the job's steps at the last attempt's step time
over the job's wall time. Exits 1 when the clean job failed, a fault did not happen
or restart as planned, or the faulted job's losses differ from the clean one's (the same mesh:
bitwise). With --keep=DIR both jobs stay in DIR: their workdirs (`clean`, `faulted`: metrics.jsonl,
supervisor.jsonl, checkpoints), local tiers (`*-shm`) and whole output (`clean.log`,
`faulted.log`); tests/toolkit/pod/test_supervisor.py checks them.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

from absl import app, flags


from toolkit.pod import distributed
from toolkit.pod import supervisor as supervisor_lib

_STEPS = flags.DEFINE_integer("steps", 200, "steps of each job")
_PROCESSES = flags.DEFINE_integer("processes", 2, "processes of each job")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "simulated CPU devices per process")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 50, "workdir checkpoint interval")
_LOCAL_EVERY = flags.DEFINE_integer("local_every", 10, "local tier interval")
# The longest wait without progress on a quiet machine was ~1 s (a step of this 2-process job
# waited on in polls, a local save); on the loaded CI machine 3 s once ended the clean job as a
# hang. A stopped peer must end as a hang (process 0's watchdog), so the processes' other waits
# on a silent peer are longer here: the CPU collectives' timeout (toolkit/pod/distributed.py, 5 s
# by default; accelerators have none) and the coordination service's heartbeat timeout (10 s).
_HANG_TIMEOUT_S = flags.DEFINE_float("hang_timeout_s", 6.0, "train.hang_timeout_s")
_PEER_TIMEOUT_S = flags.DEFINE_integer(
    "peer_timeout_s", 30, "how long both jobs' processes wait on a silent peer: the CPU "
    "collectives' timeout (XLA's --xla_cpu_collective_timeout_seconds, unless XLA_FLAGS sets "
    "it) and toolkit.train's --heartbeat_timeout; above --hang_timeout_s")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 900.0, "deadline for each job")
_KEEP = flags.DEFINE_string("keep", "", "a new folder to keep both jobs in (workdirs, local "
                            "tiers, output); by default a temporary one, removed at the end")


class Job:
  """A supervised job in a thread, its output, and waits bounded by one deadline."""

  def __init__(self, workdir: pathlib.Path, local: pathlib.Path):
    self.workdir, self.local = workdir, local
    args = ["--config=experiments/lm.py:tiny", f"--config.train.steps={_STEPS.value}",
            f"--config.train.checkpoint_every={_CHECKPOINT_EVERY.value}",
            "--config.train.log_every=1", f"--config.train.eval_every={_STEPS.value}",
            "--config.train.sample_tokens=0", f"--workdir={workdir}",
            f"--config.train.local_checkpoint_dir={local}",
            f"--config.train.local_checkpoint_every={_LOCAL_EVERY.value}",
            f"--config.train.hang_timeout_s={_HANG_TIMEOUT_S.value}",
            f"--heartbeat_timeout={_PEER_TIMEOUT_S.value}"]
    self.supervisor = supervisor_lib.Supervisor(
        _PROCESSES.value, _DEVICES.value, args, restart_delay_s=1.0, grace_s=2.0,
        out=io.StringIO(), err=io.StringIO())
    self.code: int | None = None
    self.deadline = time.monotonic() + _TIMEOUT_S.value
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self) -> None:
    self.code = self.supervisor.run()

  def text(self) -> str:
    return self.supervisor.out.getvalue() + self.supervisor.err.getvalue()

  def wait_for(self, predicate, what: str) -> None:
    while not predicate():
      if time.monotonic() > self.deadline or not self.thread.is_alive():
        raise RuntimeError(f"the drill never saw {what}:\n{self.text()[-3000:]}")
      time.sleep(0.05)  # polling interval, not a wait for readiness

  def last_step(self) -> int:
    return max(map(int, re.findall(r"^\[p0\] step (\d+)/", self.text(), re.M)), default=0)

  def local_step_on_every_host(self) -> int:
    held = []
    for process in range(_PROCESSES.value):
      folder = self.local / f"process_{process}" / "checkpoints"
      held.append({int(n) for n in os.listdir(folder) if n.isdigit()} if folder.exists()
                  else set())
    return max(set.intersection(*held), default=0)

  def finish(self) -> dict:
    self.thread.join(max(1.0, self.deadline - time.monotonic()))
    if self.code != 0:
      if self.supervisor.job is not None:
        self.supervisor.job.close()
      raise RuntimeError(f"the job ended with {self.code}:\n{self.text()[-3000:]}")
    records = [json.loads(l) for l in (self.workdir / "metrics.jsonl").read_text().splitlines()]
    [summary] = [json.loads(l) for l in
                 (self.workdir / "supervisor.jsonl").read_text().splitlines()]
    goodput = [r for r in records if r["kind"] == "goodput"][-1]
    per_step = goodput["steps_seconds"] / max(1, _STEPS.value - _restored(self.text()))
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    return {"summary": summary, "losses": losses,
            "goodput": per_step * _STEPS.value / summary["wall_s"]}


def _restored(text: str) -> int:
  """The step the last attempt restored (0: it started fresh)."""
  return ([int(s) for s in re.findall(r"^\[p0\] restored step (\d+) from", text, re.M)]
          or [0])[-1] if "[supervise] restart" in text else 0


def faulted(job: Job) -> int:
  """A crash past 30 % of the steps (after a local save on every host) whose host comes back
  with an empty local folder, a hang past 70 %; returns the local step saved before the crash."""
  crash_at = _STEPS.value * 3 // 10
  job.wait_for(lambda: job.local_step_on_every_host() >= crash_at, f"local step {crash_at}")
  saved = job.local_step_on_every_host()
  os.kill(job.supervisor.job.procs[1].pid, signal.SIGKILL)
  shutil.rmtree(job.local / "process_1")  # a replaced host: its RAM disk is empty
  job.wait_for(lambda: "recovered in" in job.text(), "the crash's recovery")
  hang_at = _STEPS.value * 7 // 10
  job.wait_for(lambda: job.last_step() >= hang_at, f"step {hang_at}")
  os.kill(job.supervisor.job.procs[1].pid, signal.SIGSTOP)
  job.wait_for(lambda: job.text().count("recovered in") == 2, "the hang's recovery")
  return saved


def from_the_peer_copy(job: Job, saved: int) -> str | None:
  """What is wrong with the crash's restart (None: it restored the local step saved before
  the crash, process 1's shards from the copy on process 0's host, or a newer one)."""
  folder = re.escape(str(job.local / "process_0" / "checkpoints"))
  restored = re.search(rf"^\[p0\] restored step (\d+) from {folder} \(process 1's shards from "
                       rf"the copy on process 0's host\)$", job.text(), re.M)
  if restored is None:
    return "the crash's restart did not restore from the peer's copy"
  if int(restored[1]) < saved:
    return f"the crash's restart restored step {restored[1]}, older than the local {saved}"
  return None

def main(argv: list[str]) -> int:
  del argv
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if _PEER_TIMEOUT_S.value <= _HANG_TIMEOUT_S.value:
    print(f"error: --peer_timeout_s={_PEER_TIMEOUT_S.value} must exceed "
          f"--hang_timeout_s={_HANG_TIMEOUT_S.value:g} (a stopped peer must end as a hang)",
          file=sys.stderr)
    return 2
  # Into the environment the processes inherit; their distributed.initialize keeps it.
  distributed.bound_cpu_collectives(_PEER_TIMEOUT_S.value)
  rows, results = [], {}
  if _KEEP.value and os.path.exists(_KEEP.value) and os.listdir(_KEEP.value):
    print(f"error: --keep={_KEEP.value} is not empty; name a new folder", file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory(prefix="meshkit-drill-") as scratch:
    root = _KEEP.value or scratch
    os.makedirs(root, exist_ok=True)
    for name in ("clean", "faulted"):
      job = Job(pathlib.Path(root) / name, pathlib.Path(root) / f"{name}-shm")
      saved = faulted(job) if name == "faulted" else 0
      try:
        results[name] = result = job.finish()
      finally:
        if _KEEP.value:
          (pathlib.Path(root) / f"{name}.log").write_text(job.text())
      if name == "faulted":
        result["problem"] = from_the_peer_copy(job, saved)
      s = result["summary"]
      rows.append(f"| {name} | {s['wall_s']:.1f} | {s['attempts']} "
                  f"({', '.join(s['causes']) or 'no failure'}) | {s['hang_detection_s']:.1f} | "
                  f"{s['restart_and_restore_s']:.1f} | {s['steps_trained_again']} | "
                  f"{result['goodput']:.1%} |")
      print("\n".join(l for l in job.text().splitlines()
                      if l.startswith("[supervise]") or "error:" in l))
  print(f"\n{_STEPS.value} steps, {_PROCESSES.value} processes x {_DEVICES.value} devices, "
        f"workdir every {_CHECKPOINT_EVERY.value}, local tier every {_LOCAL_EVERY.value}, "
        f"hang_timeout_s {_HANG_TIMEOUT_S.value:g}, peer_timeout_s {_PEER_TIMEOUT_S.value}\n")
  print("| job | wall s | attempts | waiting out hangs s | restarting and restoring s | "
        "steps trained again | goodput |\n|---|---|---|---|---|---|---|")
  print("\n".join(rows))
  same = results["faulted"]["losses"] == results["clean"]["losses"]
  causes = results["faulted"]["summary"]["causes"]
  clean_causes = results["clean"]["summary"]["causes"]
  print(f"\nfaulted job's losses equal the clean job's, bitwise: {same}")
  problem = results["faulted"]["problem"]
  if clean_causes:
    problem = "; ".join(filter(None, [problem, f"the clean job failed too: {clean_causes}"]))
  if not same or causes != ["crash", "hang"] or problem:
    print(f"error: the drill did not go as planned (failures {causes}, losses equal: {same}"
          f"{'; ' + problem if problem else ''})")
    return 1
  return 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
