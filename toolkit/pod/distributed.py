"""Joining the processes of one job into one JAX runtime: `initialize()`, called once by an
entry point before anything starts JAX's backend.

Every worker of a TPU pod or GPU cluster runs the same command, and the devices of all of them
form one global mesh. Which process this is comes from, first match wins:

  1. explicit arguments (--coordinator_address, --num_processes, --process_id), for launchers
     that know them: scripts/launch/local_pod.py, a hand-written cluster script;
  2. Open MPI (OMPI_COMM_WORLD_SIZE > 1, inside `mpirun`) or SLURM (SLURM_NTASKS > 1, inside
     `srun`): JAX's own detection reads coordinator, count and rank from the environment (its
     Open MPI detection needs Open MPI < 5; with 5, give the three flags);
  3. a multi-host Cloud TPU slice: on a TPU VM whose worker list (GKE: TPU_WORKER_HOSTNAMES or
     TPU_PROCESS_ADDRESSES; GCE: the metadata server) has more than one host, or with several
     slices (MEGASCALE_NUM_SLICES > 1): `jax.distributed.initialize()` with no addresses;
  4. otherwise one process: nothing to do.

Failure is bounded, so a job never hangs on a dead or missing peer:
  * start-up: every process must connect within `initialization_timeout`, or it prints one
    `error:` line and exits 1 (a watchdog: JAX's own timeout aborts later, with a stack dump);
  * a peer that dies: JAX's coordination service notices missing heartbeats after
    `heartbeat_timeout` and terminates every other process (SIGABRT); a dead process 0, which
    hosts that service, takes the others down at once;
  * on the CPU backend a collective also gives up after `collective_timeout` with a Python
    exception (XLA's --xla_cpu_collective_timeout_seconds), which the entry point turns into
    one `error:` line — usually before the heartbeat verdict.

JAX's `jax_enable_recoverability` stays off. Measured with jax 0.10.2 on CPU: the catchable
exception comes from the collective timeout alone, with or without it; with it, a dead
worker's heartbeat verdict no longer ends the others (they waited for the collective timeout
instead), and the shutdown barrier no longer holds finished processes back, so a process that
finished after process 0 had exited was aborted on a clean run.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import sys
import threading

import jax

from toolkit.errors import ConfigError

# JAX's own default; a pod's workers may come up tens of seconds apart (pod scheduling, image
# pulls), and all of them must connect within this.
DEFAULT_INITIALIZATION_TIMEOUT_S = 300
# A peer that sent no heartbeat for this long is dead; the others stop ~this long after it died.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# How long a finished process waits at exit for the others to finish (process 0 writes the
# plot and the sample after the last collective).
DEFAULT_SHUTDOWN_TIMEOUT_S = 120
# CPU backend only: a collective waiting longer than this for a peer raises. Must exceed any
# legitimate skew between processes reaching the same collective: runs of the tiny and cpu
# configs (eval, checkpoints, sample; 2x4 and 4x2 devices, 2 loaded cores) passed with 1 s.
# `XLA_FLAGS` that set it already win.
DEFAULT_COLLECTIVE_TIMEOUT_S = 5
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


@dataclasses.dataclass(frozen=True)
class Processes:
  """Where this process stands in its job; str() is the one-line start-up report."""
  process_index: int
  process_count: int
  detected_by: str  # "flags", "SLURM", "Open MPI", "Cloud TPU", "single process"
  local_devices: int
  global_devices: int
  platform: str

  def __str__(self) -> str:
    return (f"process {self.process_index} of {self.process_count} ({self.detected_by}): "
            f"{self.local_devices} local / {self.global_devices} global {self.platform} devices")


def _int_env(environ, name: str) -> int:
  try:
    return int(environ.get(name, "0"))
  except ValueError:
    return 0


def _multihost_tpu_vm() -> bool:
  """True on a Cloud TPU VM that is one of several hosts (JAX's own detection decides)."""
  try:
    from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top
    from jax._src.clusters import cloud_tpu_cluster  # pylint: disable=g-import-not-at-top
  except ImportError:  # a JAX that moved these: TPU auto-detection is then off, flags still work
    return False
  if not cloud_tpu_init.running_in_cloud_tpu_vm:  # set when `import jax` found TPU chips
    return False
  for cluster in (cloud_tpu_cluster.GkeTpuCluster, cloud_tpu_cluster.GceTpuCluster):
    if cluster.is_env_present():
      return cluster.get_process_count() > 1
  return False


def detect(environ=os.environ) -> str | None:
  """The cluster environment that makes this a multi-process job, or None for one process."""
  # Open MPI first, as in JAX: `mpirun` inside a SLURM allocation sets both, and only its own
  # variables differ between the processes it starts.
  if _int_env(environ, "OMPI_COMM_WORLD_SIZE") > 1:
    return "Open MPI"
  if _int_env(environ, "SLURM_NTASKS") > 1:
    return "SLURM"
  if environ is os.environ and _multihost_tpu_vm():
    return "Cloud TPU"
  return None


# The names jax.distributed.initialize(cluster_detection_method=...) gives these environments.
_JAX_DETECTION_METHOD = {"SLURM": "slurm", "Open MPI": "ompi", "Cloud TPU": None}


def _platform() -> str:
  """The platform JAX will pick, found without starting a backend (that would be too late)."""
  chosen = (jax.config.jax_platforms or "").split(",")[0].strip()
  if chosen:
    return chosen
  try:
    from jax._src import cloud_tpu_init, hardware_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "unknown"
  if cloud_tpu_init.running_in_cloud_tpu_vm:
    return "tpu"
  if hardware_utils.has_visible_nvidia_gpu():
    return "gpu"
  return "cpu"


def bound_cpu_collectives(seconds: int) -> None:
  """Adds XLA's CPU collective timeout to XLA_FLAGS unless the user set one; read when the
  CPU backend starts, i.e. after this."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _COLLECTIVE_TIMEOUT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_COLLECTIVE_TIMEOUT_FLAG}={seconds}".strip()


def _is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _check_flags(coordinator_address, num_processes, process_id) -> None:
  given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
           "--process_id": process_id}
  if coordinator_address is not None:
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit():
      raise ConfigError(f"--coordinator_address={coordinator_address!r} is not HOST:PORT; give "
                        f"process 0's address and a free port, e.g. 10.0.0.2:8476")
  if num_processes is not None and num_processes < 1:
    raise ConfigError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} must be in 0..{num_processes - 1} "
                      f"(--num_processes={num_processes})")
  if process_id is not None and process_id < 0:
    raise ConfigError(f"--process_id={process_id} must be >= 0")
  if coordinator_address is not None or (num_processes or 1) > 1:
    missing = [name for name, value in given.items() if value is None]
    if missing and detect() is None:
      raise ConfigError(f"{' and '.join(missing)} missing: outside SLURM, Open MPI and Cloud TPU "
                        f"give all of --coordinator_address, --num_processes, --process_id")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               initialization_timeout: int = DEFAULT_INITIALIZATION_TIMEOUT_S,
               heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
               collective_timeout: int = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Processes:
  """Starts JAX's distributed runtime for the environment found (see the module docstring).

  Must run before anything starts a JAX backend (jax.devices(), any computation). Raises
  ConfigError for inconsistent flags. A process that cannot join within
  `initialization_timeout` seconds prints one `error:` line and exits 1.

  Returns:
    This process's place in the job; str() of it is a one-line report.
  """
  for name, value in (("--initialization_timeout", initialization_timeout),
                      ("--heartbeat_timeout", heartbeat_timeout)):
    if value < 1:
      raise ConfigError(f"{name}={value} must be >= 1 second")
  _check_flags(coordinator_address, num_processes, process_id)
  explicit = coordinator_address is not None or (num_processes or 1) > 1
  environment = detect()
  if not explicit and environment is None:
    return _describe("single process")
  detected_by = environment if not explicit else (
      "flags" if environment is None else f"flags and {environment}")

  if _platform() == "cpu":
    bound_cpu_collectives(collective_timeout)
  bind_address = None
  if coordinator_address is not None and _is_loopback(coordinator_address):
    # A job on one machine: keep the coordinator off the network (JAX binds to all interfaces).
    bind_address = "127.0.0.1:" + coordinator_address.rsplit(":", 1)[1]

  # JAX's own start-up timeout ends in an abort with a stack dump some seconds later; this
  # watchdog says it in one line, on time (jax.distributed.initialize releases the GIL).
  who = (f"process {process_id} of {num_processes}" if None not in (process_id, num_processes)
         else f"this process ({detected_by})")
  watchdog = threading.Timer(initialization_timeout, _give_up, args=(
      f"{who}: the distributed runtime did not start within --initialization_timeout="
      f"{initialization_timeout} s: not every process connected to the coordinator at "
      f"{coordinator_address or 'the address the environment gives'}; start the same command "
      f"on every worker, each with its own --process_id",))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id,
        cluster_detection_method=None if explicit else _JAX_DETECTION_METHOD[environment],
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
        coordinator_bind_address=bind_address)
  except ValueError as e:  # JAX found too little in the environment (say sbatch without srun)
    raise ConfigError(f"{detected_by}: the distributed runtime could not be configured ({e}); "
                      f"start each process with srun/mpirun, or give --coordinator_address, "
                      f"--num_processes and --process_id") from None
  finally:
    watchdog.cancel()
  return _describe(detected_by)


def _describe(detected_by: str) -> Processes:
  return Processes(process_index=jax.process_index(), process_count=jax.process_count(),
                   detected_by=detected_by, local_devices=jax.local_device_count(),
                   global_devices=jax.device_count(), platform=jax.devices()[0].platform)


def _give_up(message: str) -> None:
  """Ends this process at once with one `error:` line: after a peer failed, waiting for a clean
  shutdown would only wait for that peer."""
  sys.stdout.flush()
  print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access


# Words in a runtime error that mean another process failed, rather than this one.
_PEER_FAILURE_HINTS = ("Gloo", "peer", "heartbeat", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                       "Connection", "coordination service")


def abandon(error: BaseException) -> None:
  """Ends a multi-process run after the runtime reported `error` (a peer died, a collective
  timed out): one `error:` line naming it, exit status 1, no wait at the shutdown barrier
  (that would wait for the failed peer)."""
  first = next((line.strip() for line in str(error).splitlines() if line.strip()),
               type(error).__name__)
  hint = ("a peer process most likely died or hung (see its log); restart every process to "
          "resume from the last checkpoint"
          if any(word in first for word in _PEER_FAILURE_HINTS) else "every process stops")
  _give_up(f"process {jax.process_index()} of {jax.process_count()} stopped: the distributed "
           f"runtime failed ({first}); {hint}")
