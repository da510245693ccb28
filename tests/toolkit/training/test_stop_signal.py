"""Stopping a run by signal: the first SIGINT/SIGTERM asks the loop to finish its step and
save; a second one (Ctrl-C twice) exits at once with one line and status 130, no traceback;
Ctrl-C outside the loop (start-up, compile) is one line too."""
from __future__ import annotations

import os
import signal

from tests import preloaded
from tests.toolkit.test_cli import MISTAKE_TIMEOUT_S, TINY, _env
from toolkit.training import stop_signal


class Exited(Exception):
  pass


def _exit(status: int) -> None:
  raise Exited(status)


def test_a_second_signal_exits_at_once_with_one_line(capsys):
  with stop_signal.StopSignal(exit=_exit) as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.should_stop(1)  # the first asks for a stop after the step
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      raise AssertionError("a second signal did not exit")
    except Exited as e:
      assert e.args == (stop_signal.INTERRUPTED_EXIT,) == (130,)
  out = capsys.readouterr().out.splitlines()
  assert out == ["received SIGINT: finishing this step, then saving",
                 "received SIGTERM again: exiting now without saving; committed checkpoints "
                 "are intact"]


def test_the_handlers_before_the_loop_come_back_after_it():
  before = signal.getsignal(signal.SIGINT)
  with stop_signal.StopSignal(exit=_exit):
    assert signal.getsignal(signal.SIGINT) is not before
  assert signal.getsignal(signal.SIGINT) is before


# Ctrl-C while the run compiles (before the loop installs its handler): KeyboardInterrupt
# escapes the command, as it would from any of its start-up work.
_INTERRUPTED_WHILE_COMPILING = """
import runpy, sys
from toolkit.training import loop
def compile_steps(*args, **kwargs):
  raise KeyboardInterrupt
loop.compile_steps = compile_steps
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__")
"""


def test_ctrl_c_outside_the_loop_is_one_line_and_status_130(tmp_path):
  result = preloaded.run(code=_INTERRUPTED_WHILE_COMPILING,
                         args=[TINY, f"--workdir={tmp_path / 'w'}"], env=_env(),
                         timeout=MISTAKE_TIMEOUT_S)
  assert result.returncode == 130, result.stdout + result.stderr
  assert "Traceback" not in result.stdout + result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      "error: interrupted (SIGINT) outside the training loop: nothing more was saved, "
      "committed checkpoints are intact; rerun the same command to resume")
