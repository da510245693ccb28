"""toolkit/runtime.py on a machine that shows an NVIDIA GPU: without JAX's CUDA plugin (the plain
`jax` wheel `make demo` installs) one line says how to install it and the run goes on as on a
CPU-only machine (JAX pinned to the CPU, the mesh's devices simulated); with the plugin JAX's
own discovery sizes the mesh from the GPUs. JAX's GPU probe and the plugin check are faked.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import ml_collections
import pytest
from jax._src import hardware_utils

from tests import codegen
from toolkit import runtime

REPO = pathlib.Path(__file__).resolve().parents[2]
MESH = ml_collections.ConfigDict({"ici": "data:1,fsdp:-1,tensor:2", "dcn": ""})
JAX_FALLBACK = "CUDA-enabled jaxlib is not installed"  # JAX's own warning, then a 1-device CPU


@pytest.fixture
def before_jax_starts(monkeypatch):
  """A command's process before its first JAX array: no JAX_PLATFORMS, no device count in
  XLA_FLAGS, jax_platforms unset. This process's backend is up already (8 CPU devices, and
  jax_num_cpu_devices can no longer change), so the settings the code under test makes are
  recorded instead: the fixture yields them, name -> value."""
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  # toolkit.xla_flags remembers the flags it adds here (a GPU run's preset): forget them after.
  monkeypatch.delenv("MESHKIT_ADDED_XLA_FLAGS", raising=False)
  real_update, platforms = jax.config.update, jax.config.jax_platforms
  real_update("jax_platforms", None)
  updates: dict[str, object] = {}
  monkeypatch.setattr(jax.config, "update", updates.__setitem__)
  yield updates
  real_update("jax_platforms", platforms)


def fake_machine(monkeypatch, *, nvidia_gpu: bool, cuda_plugin: bool, tpu_chips: int = 0):
  monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: nvidia_gpu)
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                      lambda: (tpu_chips, None))
  monkeypatch.setattr(hardware_utils, "num_available_amd_gpus", lambda stop_at=None: 0)
  monkeypatch.setattr(runtime, "cuda_plugin_installed", lambda: cuda_plugin)


def test_a_gpu_without_the_cuda_plugin_runs_as_a_cpu_machine(monkeypatch, before_jax_starts):
  fake_machine(monkeypatch, nvidia_gpu=True, cuda_plugin=False)
  lines = []
  runtime.start(mesh=MESH, log=lines.append)
  assert lines[0] == runtime.NO_CUDA_PLUGIN
  assert "pip install -e '.[cuda]'" in lines[0] and "continues on the CPU" in lines[0]
  assert lines[1].startswith("no CUDA plugin for the GPU: simulating 8 CPU devices for "
                             "mesh.ici=data:1,fsdp:-1,tensor:2")
  assert len(lines) == 2
  assert before_jax_starts == {"jax_platforms": "cpu", "jax_num_cpu_devices": 8}
  assert os.environ["JAX_PLATFORMS"] == "cpu"  # and for the processes it starts


def test_a_gpu_with_the_cuda_plugin_keeps_jax_discovery(monkeypatch, before_jax_starts):
  fake_machine(monkeypatch, nvidia_gpu=True, cuda_plugin=True)
  lines = []
  runtime.start(mesh=MESH, log=lines.append)
  # No pin and no simulated devices (the GPU's own start-up lines, such as its XLA flags, may
  # come).
  assert "jax_platforms" not in before_jax_starts
  assert "jax_num_cpu_devices" not in before_jax_starts
  assert "JAX_PLATFORMS" not in os.environ
  assert not any("CUDA plugin" in line or "simulating" in line for line in lines), lines


@pytest.mark.parametrize("machine,reason", [
    ({"nvidia_gpu": False, "cuda_plugin": False, "tpu_chips": 4}, None),  # a TPU VM: unchanged
    ({"nvidia_gpu": False, "cuda_plugin": False}, "no TPU or GPU here"),  # CPU-only: unchanged
])
def test_tpu_and_cpu_machines_are_unchanged(monkeypatch, before_jax_starts, machine, reason):
  fake_machine(monkeypatch, **machine)
  lines = []
  assert runtime.cpu_run_reason(log=lines.append) == reason
  assert lines == []
  assert before_jax_starts == ({} if reason is None else {"jax_platforms": "cpu"})


def test_the_users_platform_wins_on_a_gpu_without_the_plugin(monkeypatch, before_jax_starts):
  fake_machine(monkeypatch, nvidia_gpu=True, cuda_plugin=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # JAX then fails with its own message
  lines = []
  assert runtime.cpu_run_reason(log=lines.append) is None
  assert lines == [] and before_jax_starts == {}


def test_the_cpu_named_in_the_environment_after_jax_started_is_pinned(monkeypatch,
                                                                      before_jax_starts):
  """A script that sets JAX_PLATFORMS=cpu itself, in a process that imported JAX before (a
  notebook, a forked test process): JAX read the variable at import, so the pin goes to its
  config too (else its first array would probe for a TPU and load libtpu)."""
  fake_machine(monkeypatch, nvidia_gpu=False, cuda_plugin=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert runtime.cpu_run_reason(log=print) == "no TPU or GPU here"
  assert before_jax_starts == {"jax_platforms": "cpu"}


def test_the_cuda_plugin_is_found_where_jax_looks(monkeypatch, tmp_path):
  """JAX registers its "cuda" backend from the jax_plugins.xla_cuda12 (or 13) module the
  jax-cuda12-pjrt wheel installs, or from PJRT_NAMES_AND_LIBRARY_PATHS."""
  monkeypatch.delenv("PJRT_NAMES_AND_LIBRARY_PATHS", raising=False)
  had_namespace = "jax_plugins" in sys.modules
  try:
    assert not runtime.cuda_plugin_installed()  # this venv: the plain jax wheel
    monkeypatch.setenv("PJRT_NAMES_AND_LIBRARY_PATHS", "other:/x/other.so")
    assert not runtime.cuda_plugin_installed()
    monkeypatch.setenv("PJRT_NAMES_AND_LIBRARY_PATHS", "other:/x/other.so,cuda:/x/cuda.so")
    assert runtime.cuda_plugin_installed()
    monkeypatch.delenv("PJRT_NAMES_AND_LIBRARY_PATHS")
    plugin = tmp_path / "jax_plugins" / "xla_cuda12"
    plugin.mkdir(parents=True)
    # Found, not imported: importing it would load the CUDA libraries.
    (plugin / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert runtime.cuda_plugin_installed()
  finally:
    if not had_namespace:
      sys.modules.pop("jax_plugins", None)


# Fakes JAX's GPU probe in a new interpreter (Python imports sitecustomize at start-up), and
# hides any CUDA plugin, so that the machine reads as a GPU with the plain jax wheel.
SITECUSTOMIZE = """
from jax._src import hardware_utils
hardware_utils.has_visible_nvidia_gpu = lambda: True
from toolkit import runtime
runtime.cuda_plugin_installed = lambda: False
"""
# What a command does first: start-up for its config's mesh, then the mesh (where the run used
# to stop: JAX fell back to one CPU device).
COMMAND = """
from experiments import lm
from toolkit import runtime
from toolkit.training import config as config_lib
config = lm.get_config("cpu")
runtime.start(compilation_cache="off", mesh=config.mesh)
import jax
print("mesh", dict(config_lib._mesh(config.mesh, None).shape), jax.default_backend())
"""


def test_a_new_process_on_a_gpu_without_the_plugin_says_one_line_and_runs(tmp_path):
  (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
  env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
  env["XLA_FLAGS"] = " ".join(codegen.flags())  # the suite's; no device count: a new shell's
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(COMMAND)], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  output = done.stdout + done.stderr
  assert output.count(runtime.NO_CUDA_PLUGIN) == 1, output
  assert "mesh {'data': 1, 'fsdp': 4, 'tensor': 2} cpu" in done.stdout, output
  assert JAX_FALLBACK not in output
  for libtpu_noise in ("libtpu", "TPU_ACCELERATOR_TYPE", "E0000", "InitGoogle"):
    assert libtpu_noise not in output, output


def test_several_cpu_processes_compile_their_own_programs(monkeypatch, before_jax_starts):
  """JAX writes cache entries from process 0 only and the others' keys differ: with the cache
  on, a restarted simulated pod's process 0 read its programs back and ran ahead of the others
  into a collective (Gloo's 5 s timeout). Off for several CPU processes; kept for one process
  and on a TPU pod."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert jax.config.jax_compilation_cache_dir  # the suite's own (tests/conftest.py)
  lines: list[str] = []
  assert runtime.cache_off_for_cpu_processes(2, lines.append)
  assert before_jax_starts == {"jax_enable_compilation_cache": False}
  assert lines == ["compilation cache off: with several CPU processes only process 0 would "
                   "read its programs back, and run ahead of the others into their collectives"]
  before_jax_starts.clear()
  assert not runtime.cache_off_for_cpu_processes(1, lines.append)
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  assert not runtime.cache_off_for_cpu_processes(4, lines.append)
  assert before_jax_starts == {} and len(lines) == 1


@pytest.mark.parametrize("setting", ["cuda,cpu", "tpu,cpu", "gpu"])
def test_an_accelerator_the_setting_names_must_be_the_one_in_use(monkeypatch, capsys, setting):
  """command_line.check_platform after JAX started on the CPU (as it does here, where JAX
  skips a listed accelerator it cannot start): one error line naming the setting; a setting
  that names only the CPU passes."""
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  assert jax.devices()[0].platform == "cpu"
  monkeypatch.setenv("JAX_PLATFORMS", setting)
  with pytest.raises(SystemExit) as stopped:
    command_line.check_platform()
  assert stopped.value.code == 1
  error = capsys.readouterr().err.strip()
  assert error.startswith(f"error: JAX_PLATFORMS={setting!r} asks for ") and "\n" not in error
  assert "would run on the CPU" in error and "unset JAX_PLATFORMS" in error
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  command_line.check_platform()
