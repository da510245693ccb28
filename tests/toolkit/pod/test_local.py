"""The local pod's output filter (the processes themselves are tested in test_multiprocess)."""

from toolkit.pod import local as pod

GLOO = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def forwarded(lines: list[str]) -> list[str]:
  kept, after_gloo = [], False
  for line in lines:
    after_gloo = pod.is_gloo_noise(line, after_gloo)
    if not after_gloo:
      kept.append(line)
  return kept


def test_gloo_lines_and_their_interleaved_pieces_are_dropped():
  # Two Gloo threads writing at once: both messages on one line, the second newline alone,
  # or one thread's rank number split off onto a line of its own.
  assert forwarded(["process 1 of 2", GLOO + GLOO, "", "step 1"]) == ["process 1 of 2", "step 1"]
  assert forwarded([GLOO[:-1] + GLOO[:-1], "1", "1", "sample:"]) == ["sample:"]
  assert forwarded(["[Gloo] Rank 0 is connected to ", "1 peer ranks. ", "x"]) == ["x"]


def test_blank_and_numeric_lines_of_the_program_itself_are_kept():
  assert forwarded(["sample:", "", "12", "The end"]) == ["sample:", "", "12", "The end"]


def test_a_dead_peers_runtime_errors_go_to_the_log_not_the_terminal(tmp_path):
  """Issue 62: when a peer is killed, JAX's runtime in the survivors prints E/F log lines about
  it (the coordination service, the collectives); under the supervisor they are kept out of
  the terminal, in the attempt's log, which holds every line. Before a peer died they show."""
  import io  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  # The peer exits only after the survivor's first line (a file says so), and the survivor's
  # second line waits until the peer is on its way out: the order cannot depend on start-up.
  wait_for = ("def wait_for(name):\n"
              "  end = time.monotonic() + 60\n"
              "  while not os.path.exists(name):\n"
              "    assert time.monotonic() < end, name\n"
              "    time.sleep(0.05)\n")
  survivor = ("import os, sys, time\n" + wait_for +
              "print('E1207 12:00:00.000000 1 a.cc:1] before any peer died', file=sys.stderr, "
              "flush=True)\n"
              "open('printed', 'w').close()\n"
              "wait_for('peer_exits')\n"
              "time.sleep(3)\n"  # the peer below has exited by then
              "print('F1207 12:00:03.000000 1 b.cc:2] the peer stopped sending heartbeats', "
              "file=sys.stderr, flush=True)\n"
              "print('step 1/2 | plain output', flush=True)\n"
              "sys.exit(1)\n")
  peer = ("import os, time\n" + wait_for +
          "wait_for('printed')\nopen('peer_exits', 'w').close()\nraise SystemExit(3)\n")
  err, out, log = io.StringIO(), io.StringIO(), io.StringIO()
  job = pod.Pod(2, 1, [], out=out, err=err, log=log, cwd=str(tmp_path))
  job.commands = [[sys.executable, "-c", survivor], [sys.executable, "-c", peer]]
  job.start()
  try:
    job.wait(timeout_s=60)
  finally:
    job.close()
  terminal = err.getvalue() + out.getvalue()
  assert "before any peer died" in terminal
  assert "the peer stopped sending heartbeats" not in terminal
  assert "[p0] F1207 12:00:03.000000 1 b.cc:2] the peer stopped sending heartbeats" in \
      log.getvalue()
  assert "[p0] step 1/2 | plain output" in terminal and "[p0] step 1/2" in log.getvalue()


def test_a_stopped_peer_is_named_when_the_others_end(tmp_path):
  """Issue 62: a peer stopped by SIGSTOP makes the others fail (their collectives time out,
  exit 1) and was reported as a crash. The pod notes the stopped process when it ends the
  rest; the supervisor calls that a hang."""
  import io  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from toolkit.pod import supervisor as supervisor_lib  # pylint: disable=g-import-not-at-top
  err = io.StringIO()
  job = pod.Pod(2, 1, [], out=io.StringIO(), err=err, grace_s=1.0, cwd=str(tmp_path))
  job.commands = [[sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(1)"],
                  [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                                         "signal.SIGSTOP)"]]
  job.start()
  try:
    assert job.wait(timeout_s=60) == 1
  finally:
    job.close()
  assert job.stopped == {1}
  assert "[pod] p1 is stopped (SIGSTOP, or a debugger): it made no progress" in err.getvalue()
  supervisor = supervisor_lib.Supervisor(2, 1, ["--config=experiments/lm.py:tiny"])
  attempt = supervisor_lib.Attempt(1, 0.0, returncode=1, first_progress=1.0)
  assert supervisor._classify(attempt, job) == (
      "hang", "p1 stopped: no progress (its peers: p0 exit status 1)")
  # Without a stopped process the same exit is a crash, as before.
  crashed = types.SimpleNamespace(procs=job.procs, exit_times=job.exit_times, stopped=set())
  assert supervisor._classify(attempt, crashed)[0] == "crash"
