"""The supervisor tests' helpers: a supervised job running in a thread, waits on its output
with one deadline, and the losses its metrics.jsonl recorded."""
from __future__ import annotations

import io
import json
import pathlib
import threading
import time

from toolkit.pod import supervisor as supervisor_lib


def losses(workdir: pathlib.Path) -> dict[int, float]:
  """Step -> train loss; fails when a step is recorded twice."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if r["kind"] == "train"]
  assert len(steps) == len(set(steps)), "a step recorded twice"
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


class Running:
  """`supervisor.run()` in a thread (a context: kills what is left of the job at the end),
  with its output (`out` and `err`, StringIO) and a deadline `timeout_s` from now."""

  def __init__(self, supervisor: supervisor_lib.Supervisor, timeout_s: float):
    assert isinstance(supervisor.out, io.StringIO) and isinstance(supervisor.err, io.StringIO)
    self.supervisor, self.outcome = supervisor, {}
    self.deadline = time.monotonic() + timeout_s
    self.thread = threading.Thread(target=lambda: self.outcome.update(code=supervisor.run()),
                                   daemon=True)

  def __enter__(self) -> Running:
    self.thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if self.supervisor.job is not None:
      self.supervisor.job.close()

  def text(self) -> str:
    return self.supervisor.out.getvalue() + self.supervisor.err.getvalue()

  def wait_for(self, predicate, what: str) -> None:
    while not predicate():
      assert time.monotonic() < self.deadline, \
          f"timed out waiting for {what}: {self.text()[-4000:]}"
      time.sleep(0.02)  # polling interval, not a wait for readiness

  def join(self) -> int | None:
    """The job's exit status once the supervisor returned (None: not by the deadline)."""
    self.thread.join(max(1.0, self.deadline - time.monotonic()))
    return self.outcome.get("code")
