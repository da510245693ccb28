"""toolkit.distributed without starting a second process: environment detection, flag checks
(each a one-line error on the command line), and which rows of a batch a process loads.
The multi-process behaviour itself is in test_multiprocess.py."""
from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

from tests import preloaded
from toolkit import data

from toolkit.pod import distributed
from toolkit.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    ({"SLURM_NTASKS": "1"}, None),            # one task: nothing to join
    ({"SLURM_NTASKS": "4"}, "SLURM"),
    ({"SLURM_NTASKS": "four"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"SLURM_NTASKS": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),  # mpirun in SLURM
])
def test_detects_the_cluster_environment(environ, expected):
  assert distributed.detect(environ) == expected


def test_a_single_process_initializes_nothing(monkeypatch):
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  processes = distributed.initialize()  # JAX's backend is already up here: nothing to start
  assert str(processes) == "process 0 of 1 (single process): 8 local / 8 global cpu devices"
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("kwargs,fragments", [
    (dict(coordinator_address="10.0.0.2", num_processes=2, process_id=0),
     ["--coordinator_address='10.0.0.2' is not HOST:PORT"]),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2),
     ["--process_id=2 must be in 0..1"]),
    (dict(coordinator_address="127.0.0.1:1234"),
     ["--num_processes and --process_id missing", "give all of"]),
    (dict(num_processes=2, process_id=0), ["--coordinator_address missing"]),
    (dict(initialization_timeout=0), ["--initialization_timeout=0 must be >= 1"]),
])
def test_inconsistent_flags_are_refused_before_anything_starts(monkeypatch, kwargs, fragments):
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(ConfigError) as error:
    distributed.initialize(**kwargs)
  for fragment in fragments:
    assert fragment in str(error.value)


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1:8476", True), ("localhost:1", True), ("[::1]:8476", True),
    ("10.0.0.2:8476", False), ("worker-0:8476", False)])
def test_the_coordinator_stays_on_loopback_for_a_loopback_address(address, loopback):
  assert distributed._is_loopback(address) == loopback  # pylint: disable=protected-access


def test_cpu_collectives_are_bounded_unless_the_user_chose(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  distributed.bound_cpu_collectives(5)
  assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 "
                                     "--xla_cpu_collective_timeout_seconds=5")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=60")
  distributed.bound_cpu_collectives(5)
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_collective_timeout_seconds=60"


class _Sharding:
  """The one method `local_rows` calls, for a process whose devices hold `blocks` of rows."""

  def __init__(self, blocks):
    self.blocks = blocks

  def addressable_devices_indices_map(self, shape):
    return {device: (slice(*block), slice(None)) for device, block in enumerate(self.blocks)}


@pytest.mark.parametrize("blocks,rows", [
    ([(0, 4), (4, 8)], list(range(0, 8))),
    ([(8, 12), (0, 4), (0, 4), (8, 12)], [*range(0, 4), *range(8, 12)]),  # two separate blocks
    ([(None, None)], list(range(16))),                                    # replicated
])
def test_a_process_loads_exactly_the_rows_its_devices_hold(blocks, rows):
  np.testing.assert_array_equal(data.local_rows(_Sharding(blocks), (16, 32)), rows)


@pytest.mark.parametrize("flag,fragments", [
    ("--coordinator_address=nohost", ["--coordinator_address='nohost' is not HOST:PORT"]),
    ("--process_id=-1", ["--process_id=-1", "is not a non-negative integer"]),
])
def test_a_bad_distributed_flag_is_one_error_line(tmp_path, flag, fragments):
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  result = preloaded.run(
      "toolkit.train", ["--config=experiments/lm.py:tiny", f"--workdir={tmp_path / 'w'}",
                        "--num_processes=2", flag], env=env, timeout=120)
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
  for fragment in fragments:
    assert fragment in result.stderr
  assert not (tmp_path / "w").exists()
