"""`python -m toolkit.<command>` in a new process without paying for its imports each time.

A test that is about a process (its exit code and stderr, a signal, a kill and a resume, a
fresh interpreter's state) needs one, but most of such a process's time here was Python
starting and importing JAX, Flax, Orbax and the toolkit: 1-4 s per process on 2 busy cores,
for ~100 processes per suite. `run` and `start` hand the command to a server process that has
imported all of that once and forks a child per command: the child is a real process (its own
PID, signals, exit code, file descriptors 0-2 connected to the caller's pipes or files, its own
working directory and environment) that runs the module as `__main__` the way `python -m`
does, and exits through the interpreter's normal shutdown (threads joined, atexit, flushed
streams).

What a fork cannot give, a real interpreter does: a command whose environment changes a
variable that Python or JAX read while the server imported them (JAX_*, TPU_*, LIBTPU*,
PYTHON*), or any caller that asks with `fresh=True`, gets `subprocess` as before, except for
the Cloud Storage clients' settings (a server imported with them). XLA_FLAGS may differ: XLA
reads it when the child starts its backend. Keep a
handful of the tests on fresh interpreters (`fresh=True`): they check what a shell sees with
nothing preloaded.

The server starts on first use, one per pytest process, and ends with it (it exits when its
parent does).
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120  # the server's imports: ~3 s on a quiet machine
# Read by Python or JAX while the server imports them: a different value needs a fresh
# interpreter.
# Cloud Storage clients' settings (scripts/dev/gcs_emulator.py's environment): tests/conftest.py's
# gcs_server puts them in this process's environment for the rest of the session, so every
# later command whose environment is a copy of it differs from _BASE_ENV here. Such commands get
# a server imported in that environment (one, kept), not a new interpreter each. Every
# command of a pytest process after its first Cloud Storage test used to start a new
# interpreter: tests/toolkit/test_gcs_paths.py then test_cli.py in one process took 87 s, the
# CLI's one-error-line cases 37 s of it; 47 s and 6 s with the server.
_STORAGE = ("TENSORSTORE_", "GCSFS_", "FSSPEC_", "STORAGE_EMULATOR", "GOOGLE_", "GCE_", "NO_GCE")
_READ_AT_IMPORT = ("JAX_", "TPU_", "LIBTPU", "PYTHON", *_STORAGE)
# Set in this process's environment when a test loads libtpu (a TPU compile: JAX's TPU
# initialization and toolkit/planning/target.py) and read only when a process loads libtpu, which the
# server never does: ignored. They made every later command of a pytest process that had
# compiled for a TPU start a new interpreter: the CLI's one-error-line cases took 46 s in make
# test and 6 s without.
_SET_WHEN_LIBTPU_LOADS = ("TPU_LIBRARY_PATH", "TPU_SKIP_MDS_QUERY", "TPU_LOG_DIR")
# The environment the server imports in: this process's when the suite imported this module.
_BASE_ENV = dict(os.environ)
# What the server imports before it forks: everything a command's module imports at its top,
# and not the command modules themselves (each defines its absl flags when run).
_PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "grain",
            "tensorstore", "ml_collections", "absl.app", "absl.flags", "absl.logging",
            "matplotlib", "matplotlib.pyplot", "toolkit.training", "toolkit.inference",
            "toolkit.pod", "toolkit.tuning", "toolkit.conversion", "toolkit.command_line",
            "experiments.lm")

Argument = str | bytes


class Process:
  """A command running in a forked child: `pid`, `stdout`/`stderr` (pipes when asked for),
  `poll`, `wait`, `send_signal`, `kill`, `returncode` — as `subprocess.Popen`'s."""

  def __init__(self, connection: socket.socket, pid: int, stdout=None, stderr=None):
    self._connection = connection
    self.pid = pid
    self.stdout, self.stderr = stdout, stderr
    self.returncode: int | None = None
    self.args = None

  def _receive(self, timeout: float | None) -> None:
    self._connection.settimeout(timeout)
    try:
      data = self._connection.recv(64)
    except (socket.timeout, BlockingIOError):  # the latter for timeout 0
      return
    if not data:
      raise RuntimeError(f"the command server lost child {self.pid}")
    self.returncode = json.loads(data)["returncode"]
    self._connection.close()

  def poll(self) -> int | None:
    if self.returncode is None:
      self._receive(0.0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      self._receive(timeout)
      if self.returncode is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.returncode is None:
      os.kill(self.pid, signum)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class _Server:
  """The preloaded interpreter, listening on a Unix socket in a folder of its own."""

  def __init__(self, env: Mapping[str, str]):
    self.env = dict(env)
    self.folder = tempfile.mkdtemp(prefix="meshkit-preloaded-")
    self.address = os.path.join(self.folder, "socket")
    self.process = subprocess.Popen(
        [sys.executable, __file__, self.address, ",".join(_PRELOAD)], cwd=REPO, env=self.env,
        stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(self.address + ".ready"):
      if self.process.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise RuntimeError("the command server did not start")
      time.sleep(0.05)  # polling its ready file; its imports take seconds

  def start(self, request: dict, fds: Sequence[int]) -> Process:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(self.address)
    socket.send_fds(connection, [json.dumps(request).encode()], list(fds))
    connection.settimeout(START_TIMEOUT_S)
    reply = b""
    while not reply.endswith(b"\n"):
      chunk = connection.recv(64)
      if not chunk:
        raise RuntimeError("the command server did not start the command")
      reply += chunk
    return Process(connection, json.loads(reply)["pid"])

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    for name in (self.address, self.address + ".ready"):
      if os.path.exists(name):
        os.remove(name)
    os.rmdir(self.folder)


_servers: dict[tuple, _Server] = {}
_LOCK = threading.Lock()


def _read_at_import(env: Mapping[str, str]) -> dict[str, str]:
  return {k: v for k, v in env.items()
          if k.startswith(_READ_AT_IMPORT) and k not in _SET_WHEN_LIBTPU_LOADS}


def _server_for(env: Mapping[str, str], own: bool = False) -> _Server | None:
  """The server (started on first use, in `_BASE_ENV`), or when `env` differs from `_BASE_ENV`
  in a variable read at import: None (that needs a fresh interpreter), or with `own` a server
  that imported in `env` itself (started on first use and kept, one per such environment: for
  a caller whose many commands share one environment, such as the documented commands')."""
  key, base = (tuple(sorted(_read_at_import(e).items())) for e in (env, _BASE_ENV))
  differ = {name for name, _ in set(key) ^ set(base)}
  if differ and not own and not all(name.startswith(_STORAGE) for name in differ):
    return None
  with _LOCK:
    if key not in _servers:
      _servers[key] = _Server(_BASE_ENV if key == base else env)
    return _servers[key]


@atexit.register
def _stop_all() -> None:
  for server in _servers.values():
    server.stop()


def _encode(argument: Argument) -> str:
  """Arguments as the child's os.fsdecode would give them (bytes that are not UTF-8 too)."""
  return os.fsdecode(argument) if isinstance(argument, bytes) else argument


def _command(module: str | None, code: str | None, script: str | None) -> list[str]:
  if [module, code, script].count(None) != 2:
    raise ValueError("give one of module, code and script")
  if code is not None:
    return [sys.executable, "-c", code]
  return [sys.executable, script] if script is not None else [sys.executable, "-m", module]


def start(module: str | None = None, args: Sequence[Argument] = (), *,
          cwd: str | os.PathLike = REPO, env: Mapping[str, str] | None = None,
          code: str | None = None, script: str | None = None, stdout=None, stderr=None,
          text: bool = False, fresh: bool = False, own_server: bool = False):
  """Starts `python -m module *args` (or `python -c code *args`, `python script *args`) like
  `subprocess.Popen`; `stdout`/`stderr` are `subprocess.PIPE` (read as text with `text`), a
  file object or None (the caller's), and `stderr` may be `subprocess.STDOUT`. Returns a
  `Process`, or a `subprocess.Popen` when `fresh` or the environment needs a new interpreter
  (with `own_server`, a server preloaded in that environment instead: `_server_for`)."""
  env = dict(os.environ if env is None else env)
  command = _command(module, code, script)
  server = None if fresh else _server_for(env, own_server)
  if server is None:
    return subprocess.Popen(command + list(args), cwd=cwd, env=env, stdout=stdout,
                            stderr=stderr, text=text)
  pipes, fds = {}, []
  for name, target, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
    if target is subprocess.STDOUT:
      fds.append(fds[0])
    elif target is subprocess.PIPE:
      read, write = os.pipe()
      pipes[name] = os.fdopen(read, "r" if text else "rb")
      fds.append(write)
    elif target is None:
      fds.append(default)
    else:
      fds.append(target.fileno())
  request = {"module": module, "code": code, "script": script,
             "args": [_encode(a) for a in args], "cwd": str(cwd), "env": env}
  stdin = os.open(os.devnull, os.O_RDONLY)
  try:
    process = server.start(request, [stdin] + fds)
  finally:
    os.close(stdin)
    for name in pipes:
      os.close(fds[("stdout", "stderr").index(name)])
  process.stdout, process.stderr = pipes.get("stdout"), pipes.get("stderr")
  process.args = command + list(args)
  return process


def run(module: str | None = None, args: Sequence[Argument] = (), *, timeout: float,
        cwd: str | os.PathLike = REPO, env: Mapping[str, str] | None = None,
        code: str | None = None, script: str | None = None, text: bool = True,
        fresh: bool = False, own_server: bool = False) -> subprocess.CompletedProcess:
  """`subprocess.run(..., capture_output=True, timeout=timeout, check=False)` for
  `python -m module *args` (or `-c code`, `script`): stdout and stderr as text (or bytes with
  `text=False`). A command still running at `timeout` is killed and TimeoutExpired raised."""
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    process = start(module, args, cwd=cwd, env=env, code=code, script=script, stdout=out,
                    stderr=err, fresh=fresh, own_server=own_server)
    try:
      returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      raise
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
  if text:
    stdout, stderr = (s.decode(errors="replace") for s in (stdout, stderr))
  return subprocess.CompletedProcess(process.args, returncode, stdout, stderr)


_CALL = """
import importlib, json, sys
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))
with open(sys.argv[3], "w") as f:
  json.dump(result, f)
"""


def call(target: str, *args, timeout: float, env: Mapping[str, str] | None = None):
  """`module:function(*args)` run in a new process (forked as `run` does), for work that needs
  another environment than this process's (XLA_FLAGS, say): JSON-able arguments in, its
  JSON-able result out. Fails with the process's output when it does not return one; else
  prints its standard output (pytest shows it with -s, or -rP)."""
  with tempfile.TemporaryDirectory() as folder:
    out = os.path.join(folder, "result.json")
    done = run(code=_CALL, args=[target, json.dumps(args), out], env=env, timeout=timeout)
    if done.returncode != 0 or not os.path.exists(out):
      raise AssertionError(f"{target} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    print(done.stdout, end="", flush=True)
    with open(out) as f:
      return json.load(f)


# --- the server ------------------------------------------------------------------------------

def _serve(address: str, preload: Sequence[str]) -> dict:
  """Imports `preload`, then forks a child per request; returns the request in the child.
  Waits on the socket and on SIGCHLD (through a wake-up pipe), so a command's end is reported
  at once."""
  import importlib  # pylint: disable=g-import-not-at-top
  sys.path[0] = str(REPO)  # not tests/, whose packages share names with the repository's
  for name in preload:
    importlib.import_module(name)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(address)
  listener.listen(16)
  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  signal.set_wakeup_fd(wake_write)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  pathlib.Path(address + ".ready").touch()
  parent, children = os.getppid(), {}
  while os.getppid() == parent:
    ready = select.select([listener, wake_read], [], [], 1.0)[0]
    if wake_read in ready:
      os.read(wake_read, 512)
    if listener in ready:
      connection, _ = listener.accept()
      message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (wake_read, wake_write):
          os.close(fd)
        listener.close()
        connection.close()
        for target, fd in enumerate(fds):
          os.dup2(fd, target)
          os.close(fd)
        return json.loads(message)
      for fd in fds:
        os.close(fd)
      connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
      children[pid] = connection
    _report_ended(children)
  for pid in children:  # the parent is gone: so are its commands
    os.kill(pid, signal.SIGKILL)
  sys.exit(0)


def _report_ended(children: dict[int, socket.socket]) -> None:
  """Sends each ended child's exit status to its caller."""
  while children:
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid == 0:
      return
    connection = children.pop(pid, None)
    if connection is None:
      continue
    try:
      connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    except OSError:  # the caller is gone
      pass
    connection.close()


def _become(request: dict) -> None:
  """Turns the forked child into `python -m module` (or `-c code`) as the request says."""
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  if request["script"] is not None:
    script = os.path.abspath(request["script"])
    sys.path[0], sys.argv = os.path.dirname(script), [request["script"], *request["args"]]
  elif request["code"] is not None:
    sys.path[0], sys.argv = "", ["-c", *request["args"]]
  else:
    sys.path[0], sys.argv = os.getcwd(), [request["module"], *request["args"]]


def _run(request: dict) -> int:
  """Runs the request's module, code or script as `__main__`; its exit status, as the
  interpreter would give it (an uncaught exception printed by sys.excepthook: 1)."""
  import runpy  # pylint: disable=g-import-not-at-top
  try:
    if request["code"] is not None:
      exec(compile(request["code"], "<string>", "exec"),  # pylint: disable=exec-used
           {"__name__": "__main__", "__builtins__": __builtins__})
    elif request["script"] is not None:
      runpy.run_path(request["script"], run_name="__main__")
    else:
      runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
  except SystemExit as exit_:
    if exit_.code is None or isinstance(exit_.code, int):
      return exit_.code or 0
    print(exit_.code, file=sys.stderr)
    return 1
  except KeyboardInterrupt:  # as the interpreter ends on one: by SIGINT
    _finish(None)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  except BaseException:  # pylint: disable=broad-except
    sys.excepthook(*sys.exc_info())
    return 1
  return 0


def _finish(status: int | None) -> None:
  """The interpreter's shutdown up to the streams (non-daemon threads joined, atexit functions
  run, stdout and stderr flushed), then exit: tearing down the ~1,600 preloaded modules would
  take another 0.5 s per command and runs no code of the command's."""
  threading._shutdown()  # pylint: disable=protected-access  # what Py_FinalizeEx calls first
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # closed, or its reader gone
      pass
  if status is not None:
    os._exit(status)


if __name__ == "__main__":
  _request = _serve(sys.argv[1], sys.argv[2].split(","))
  _become(_request)
  _finish(_run(_request))
