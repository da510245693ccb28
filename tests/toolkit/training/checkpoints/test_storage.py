"""Storage faults: a disk that fills up or turns read-only during a run ends it with one `error:`
line naming the folder and the cause, exit 1 within 60 s of the fault, no partial checkpoint
folder, the earlier checkpoints intact (they restore, fingerprints verified); a read-only
folder is refused before training; a metrics, TensorBoard or plot write that fails neither
hangs nor hides the cause.

The faults are real where this process may mount a small tmpfs (root, as on the project's
machines); elsewhere the same errors are injected where Orbax writes a checkpoint
(tests/toolkit/training/checkpoints/storage_faults.py)."""
from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import subprocess
import threading
import time
import types

import pytest

from tests import preloaded
from tests.tiny_runs import tiny_config
from tests.toolkit.test_cli import RUN_TIMEOUT_S, TINY, _env, checkpoint_steps, the_error_line
from toolkit import training, workdir as workdir_lib
from toolkit.training import loop, metrics
from toolkit.training.checkpoints import checkpoint, storage

FAULT_TO_EXIT_S = 60
_INJECT = "from tests.toolkit.training.checkpoints import storage_faults; storage_faults.train({code}, {step})"


def _mount(*args: str) -> bool:
  return subprocess.run(["mount", *args], capture_output=True, check=False).returncode == 0


@contextlib.contextmanager
def small_disk(path: pathlib.Path, size: str, read_only: bool = False):
  """A tmpfs of `size` at `path` (True), or nothing when mounting is not allowed (False)."""
  path.mkdir(parents=True, exist_ok=True)
  mounted = _mount("-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""), "tmpfs",
                   str(path))
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


class Run:
  """`toolkit.train` in a subprocess; stdout read line by line with the time each arrived."""

  def __init__(self, args: list[str], inject: tuple[int, int] | None = None):
    target = (dict(code=_INJECT.format(code=inject[0], step=inject[1])) if inject
              else dict(module="toolkit.train"))
    self.process = preloaded.start(**target, args=args, env=_env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    self.lines: list[tuple[float, str]] = []
    self.stderr = ""
    self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                     threading.Thread(target=self._read_stderr, daemon=True)]
    for reader in self._readers:
      reader.start()

  def _read_stdout(self):
    for line in self.process.stdout:
      self.lines.append((time.monotonic(), line.rstrip("\n")))

  def _read_stderr(self):
    self.stderr = self.process.stderr.read()

  def wait(self) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished process, when it ended)."""
    try:
      self.process.wait(timeout=RUN_TIMEOUT_S)
    finally:
      if self.process.poll() is None:
        self.process.kill()
    ended = time.monotonic()
    for reader in self._readers:
      reader.join(10)
    stdout = "".join(line + "\n" for _, line in self.lines)
    return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout,
                                       self.stderr), ended


def _assert_nothing_lost(workdir: pathlib.Path, at_least: set[int]) -> None:
  """The checkpoints left are at least `at_least`, no partial folder, each restores verified."""
  steps = checkpoint_steps(workdir)
  assert at_least <= steps, steps
  leftovers = [p.name for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
  assert not leftovers, leftovers
  setup = training.build(tiny_config())
  manager = checkpoint.Checkpoints(str(workdir / "checkpoints"), read_only=True)
  for step in steps:
    assert manager.has_fingerprints(step)
    state, _ = manager.restore(step, setup.layout.abstract)  # raises if damaged
    assert int(state["step"]) == step
  manager.close()


def test_disk_full_during_the_run(tmp_path):
  disk = tmp_path / "disk"
  with small_disk(disk, "1200k") as mounted:  # room for the first checkpoint, not the second
    workdir = disk / "w"
    run = Run([TINY, f"--workdir={workdir}", "--config.train.checkpoint_every=2",
               "--config.train.steps=40"], inject=None if mounted else (errno.ENOSPC, 4))
    result, ended = run.wait()
    line = the_error_line(result)
    assert "(No space left on device)" in line and str(workdir) in line, line
    assert "then rerun the same command to resume" in line
    # From the last progress line (the fault comes at the next save) to the exit.
    assert ended - run.lines[-1][0] < FAULT_TO_EXIT_S
    _assert_nothing_lost(workdir, {2})
    print(line, "(tmpfs)" if mounted else "(injected)")


def test_checkpoint_folder_turns_read_only_during_the_run(tmp_path):
  workdir = tmp_path / "w"
  with small_disk(workdir / "checkpoints", "20m") as mounted:
    run = Run([TINY, f"--workdir={workdir}", "--config.train.checkpoint_every=2",
               "--config.train.steps=3000"], inject=None if mounted else (errno.EROFS, 4))
    if mounted:
      deadline = time.monotonic() + RUN_TIMEOUT_S
      while not (workdir / "checkpoints" / "2").is_dir():
        assert run.process.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.05)  # polling interval, not a wait for readiness
      # A remount to read-only fails (busy) while a save holds a file open for writing: retry
      # until it lands between two saves.
      while not _mount("-o", "remount,ro", str(workdir / "checkpoints")):
        assert run.process.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.05)  # polling interval, not a wait for readiness
    fault = time.monotonic()
    result, ended = run.wait()
    line = the_error_line(result)
    assert f"a checkpoint could not be written to {workdir}/checkpoints (Read-only file " \
           f"system)" in line, line
    assert ended - fault < FAULT_TO_EXIT_S
    if mounted:  # Nothing can be removed from a read-only disk: Orbax's temporary folder of
      assert _mount("-o", "remount,rw", str(workdir / "checkpoints"))  # the failed save stays;
      checkpoint.Checkpoints(str(workdir / "checkpoints")).close()  # the next run removes it.
    _assert_nothing_lost(workdir, {2})


def test_read_only_checkpoint_folder_is_refused_before_training(tmp_path, monkeypatch):
  workdir = tmp_path / "w"
  with small_disk(workdir / "checkpoints", "1m", read_only=True) as mounted:
    if mounted:
      result = preloaded.run("toolkit.train", [TINY, f"--workdir={workdir}"], env=_env(),
                             timeout=RUN_TIMEOUT_S)
      line = the_error_line(result)
      assert line == (f"error: {workdir}/checkpoints is not writable (Read-only file system); "
                      f"mount it writable or choose another --workdir")
      return
  # Without a mount: what the check sees on a read-only disk, in this process.
  monkeypatch.setattr(os, "access", lambda *_: False)
  monkeypatch.setattr(os, "statvfs", lambda _: types.SimpleNamespace(f_flag=os.ST_RDONLY))
  with pytest.raises(storage.StorageError, match=r"is not writable \(Read-only file system\)"):
    storage.check_writable(str(workdir / "checkpoints"))


def test_metrics_and_tensorboard_write_failures_are_one_storage_error(tmp_path):
  threads = threading.active_count()
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, "train", {"loss": 2.0})
  os.remove(tmp_path / "metrics.jsonl")
  os.mkdir(tmp_path / "metrics.jsonl")  # now every append fails (EISDIR)
  with pytest.raises(storage.StorageError, match=r"^metrics could not be written to "
                                                 rf"{tmp_path}/metrics.jsonl \(Is a directory\)"):
    writer.write(2, "train", {"loss": 1.0})
  writer.close()

  other = tmp_path / "other"
  other.mkdir()
  (other / "tensorboard").write_text("a file where the folder goes")
  writer = metrics.MetricWriter(str(other))
  with pytest.raises(storage.StorageError, match=r"written to .*tensorboard \(File exists\)"):
    writer.write(1, "train", {"loss": 2.0})
  writer.close()  # never raises
  assert threading.active_count() == threads  # no writer thread that could block exit


def test_storage_calls_run_within_the_deadline(monkeypatch):
  monkeypatch.setattr(workdir_lib, "_deadline_s", 0.3)
  assert workdir_lib.bounded(lambda: 7, "x") == 7
  with pytest.raises(KeyError):
    workdir_lib.bounded(lambda: {}["k"], "x")
  release = threading.Event()
  start = time.monotonic()
  with pytest.raises(TimeoutError) as raised:
    workdir_lib.bounded(release.wait, "gs://b/w/metrics.jsonl")
  release.set()
  assert 0.3 <= time.monotonic() - start < 5
  assert (raised.value.errno, raised.value.strerror, raised.value.filename) == (
      errno.ETIMEDOUT, "no answer within 0.3 s", "gs://b/w/metrics.jsonl")


def test_a_metrics_write_that_hangs_is_one_storage_error_after_the_deadline(tmp_path,
                                                                            monkeypatch):
  """Issue 32: a store that stopped answering held the run at 0 % CPU for minutes inside a
  metrics write. Here the hang is a named pipe in metrics.jsonl's place: opening it to append
  blocks until a reader comes, as a write to a disk or object store that never answers."""
  monkeypatch.setattr(workdir_lib, "_deadline_s", 0.5)
  writer = metrics.MetricWriter(str(tmp_path))
  fifo = tmp_path / "metrics.jsonl"
  os.mkfifo(fifo)
  start = time.monotonic()
  with pytest.raises(storage.StorageError) as raised:
    writer.write(1, "train", {"loss": 2.0})
  assert time.monotonic() - start < 5
  assert str(raised.value) == (
      f"metrics could not be written to {fifo} (no answer within 0.5 s); check the network and "
      f"the storage service (STORAGE_EMULATOR_HOST, if set) or raise train.storage_timeout_s, "
      f"then rerun the same command to resume from the latest checkpoint")
  os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # lets the hung write finish
  writer.close()


def test_a_plot_that_cannot_be_written_is_a_warning(tmp_path, capsys):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 2.0}\n'
                                          '{"step": 2, "kind": "tra')  # cut short by a full disk
  (tmp_path / "loss.png").mkdir()  # the plot cannot be written
  run = types.SimpleNamespace(writer=types.SimpleNamespace(path=str(tmp_path / "metrics.jsonl")),
                              result=types.SimpleNamespace(confusion=None),
                              units=metrics.Units())
  loop.write_plots(run, str(tmp_path))
  assert capsys.readouterr().out == (f"warning: a plot could not be written into {tmp_path} "
                                     f"(Is a directory)\n")


def test_free_space_warning(tmp_path):
  free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
  assert storage.free_space_warning(str(tmp_path), free // 4) is None
  warning = storage.free_space_warning(str(tmp_path), free)
  assert warning.startswith(f"{tmp_path} has ") and "less than twice a checkpoint" in warning


def test_causes_are_the_os_words():
  tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "x": Failed to write 41558 bytes '
                           "to file 7: No space left on device [os_error_code='28']")
  assert storage.cause(tensorstore) == "No space left on device"
  assert storage.fix(tensorstore) == "free space on that disk"
  wrapped = RuntimeError("Encountered error while reading array index: (slice(0, 2, 1),)")
  wrapped.__cause__ = ValueError("OUT_OF_RANGE: Error reading \"a/0.0\": Requested byte range "
                                 "[8108, 10466) is not valid for value of size 1000")
  assert storage.cause(wrapped).startswith("OUT_OF_RANGE: Error reading")


def test_the_late_io_callback_race_is_not_printed():
  """A closed event loop's call_soon_threadsafe (TensorStore finishing a write of a save that
  already failed) is dropped; any other unraisable exception reaches the previous hook."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  seen = []
  hook = command_line._without_late_io_callbacks(lambda u: seen.append(u.exc_value))  # pylint: disable=protected-access
  event_loop = asyncio.new_event_loop()
  event_loop.close()
  try:
    event_loop.call_soon_threadsafe(print)
  except RuntimeError as e:  # as TensorStore's thread reports it: from call_soon_threadsafe on
    hook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=e,
                               exc_traceback=e.__traceback__.tb_next, object=None))
  other = RuntimeError("Event loop is closed")
  hook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=other, exc_traceback=None,
                             object=None))
  assert seen == [other]


def _failed_task_logs(filename: str, caplog) -> list[str]:
  """What asyncio logs for a task that failed with ENOSPC and was never awaited, its coroutine
  compiled as if it lived in `filename`."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  namespace = {}
  exec(compile("async def save():\n  raise OSError(28, 'No space left on device')\n",  # pylint: disable=exec-used
               filename, "exec"), namespace)
  asyncio_logger = logging.getLogger("asyncio")
  asyncio_logger.addFilter(command_line._drop_unretrieved_orbax_tasks)  # pylint: disable=protected-access
  event_loop = asyncio.new_event_loop()
  try:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
      caplog.clear()
      task = event_loop.create_task(namespace["save"]())
      event_loop.run_until_complete(asyncio.sleep(0.01))
      del task
      gc.collect()  # the task's finalizer reports the exception nobody retrieved
      return [record.getMessage() for record in caplog.records]
  finally:
    event_loop.close()
    asyncio_logger.removeFilter(command_line._drop_unretrieved_orbax_tasks)  # pylint: disable=protected-access


def test_an_orbax_task_that_failed_on_a_full_disk_prints_no_traceback(caplog):
  """Issue 32: a disk that filled during a save sometimes printed asyncio's "Task exception was
  never retrieved" with an 18-line traceback before the run's one error line."""
  assert _failed_task_logs("/site-packages/orbax/checkpoint/_src/save.py", caplog) == []
  assert [m.splitlines()[0] for m in _failed_task_logs("/elsewhere/job.py", caplog)] == [
      "Task exception was never retrieved"]  # anyone else's: still shown


# The store stops answering during the last save: Orbax's wait for it never returns.
_LAST_SAVE_HANGS = """
import runpy, sys, time
from toolkit.training.checkpoints import checkpoint
close = checkpoint.Checkpoints.close
def hanging_close(self, timeout_s=None):
  if timeout_s is None:  # the run's own end, not the bounded close after a failure
    self.manager.wait_until_finished = lambda: time.sleep(3600)
  return close(self, timeout_s)
checkpoint.Checkpoints.close = hanging_close
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__")
"""


@pytest.mark.slow  # a tiny run, then the 3 s deadline: ~15 s quiet; make test is at its budget
def test_a_last_save_that_never_finishes_is_one_storage_line_within_the_deadline(tmp_path):
  """Issue 62: the wait for the last checkpoint (Checkpoints.close) ended only through the hang
  watchdog (exit 75 after 631 s, then the thread stacks). It is bounded by
  train.storage_timeout_s (plus twice the longest earlier save): one storage line, exit 1, the
  earlier checkpoint intact."""
  workdir = tmp_path / "w"
  start = time.monotonic()
  result = preloaded.run(code=_LAST_SAVE_HANGS, args=[
      "--config=experiments/lm.py:tiny", f"--workdir={workdir}", "--config.train.steps=4",
      "--config.train.checkpoint_every=2", "--config.train.eval_every=4",
      "--config.train.storage_timeout_s=3", "--config.train.sample_tokens=0"],
      env=dict(os.environ), timeout=300)
  seconds = time.monotonic() - start
  output = result.stdout + result.stderr
  assert result.returncode == 1, output
  assert "Traceback" not in output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(
      f"error: the last checkpoint could not be written to {workdir}/checkpoints (no answer "
      "within "), errors[0]
  assert "the checkpoints committed before it are intact; check the network" in errors[0]
  assert "raise train.storage_timeout_s" in errors[0]
  # (Only the wait hangs here, so the last save may have committed too.)
  assert 2 in checkpoint_steps(workdir)
  assert seconds < 120, f"{seconds:.0f} s"  # a tiny run, then at most 3 s + 2 x its first save
