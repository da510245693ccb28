"""toolkit/xla_flags.py: the overlap flags' presets, how they join what the user set, the
`runtime.xla_flags` setting, the start-up line, and that the installed jaxlib and libtpu know
every flag name (an unknown one ends the process)."""
from __future__ import annotations

import os
import textwrap

import ml_collections
import pytest

from experiments import lm
from tests import extras, preloaded
from toolkit import runtime, xla_flags
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib

USER_TPU = "--xla_enable_async_all_gather=false --xla_tpu_scoped_vmem_limit_kib=98304"


def _without_ours(environ: dict) -> dict:
  """The environment without the flags tests/conftest.py added (as a user's shell has it)."""
  environ = dict(environ)
  for platform in xla_flags.VARIABLES:
    xla_flags.apply(platform, "none", environ=environ)
  return environ


def test_the_tpu_preset_joins_the_users_flags_and_theirs_win():
  environ = {"LIBTPU_INIT_ARGS": USER_TPU}
  applied = xla_flags.apply("tpu", environ=environ)
  tokens = environ["LIBTPU_INIT_ARGS"].split()
  assert tokens[:2] == USER_TPU.split()                     # the user's, first and unchanged
  assert [t for t in tokens if xla_flags.flag_name(t) == "xla_enable_async_all_gather"] == [
      "--xla_enable_async_all_gather=false"]                 # set once: theirs
  assert applied.yours == ("--xla_enable_async_all_gather=false",)
  assert set(applied.added) == {f.token for f in xla_flags.TPU} - {
      "--xla_enable_async_all_gather=true"}
  assert set(applied.added) <= set(tokens)
  # A libtpu without one of the names skips it (absl's undefok) instead of exiting.
  [undefok] = [t for t in tokens if t.startswith("--undefok=")]
  assert set(undefok.partition("=")[2].split(",")) == {xla_flags.flag_name(t)
                                                       for t in applied.added}
  # The start-up log's one line names every flag added and the user's that won.
  line = applied.line()
  assert "\n" not in line and line.startswith("overlap flags for TPU in LIBTPU_INIT_ARGS: ")
  assert all(token in line for token in applied.added) and "--undefok" not in line
  assert "yours kept: --xla_enable_async_all_gather=false" in line
  assert line.endswith("(turn off with --config.runtime.xla_flags=none)")
  # Again (a second start, or a process started from this one, inheriting the environment):
  # the same variable, and the preset's flags are not mistaken for the user's.
  before = dict(environ)
  assert xla_flags.apply("tpu", environ=environ) == applied and environ == before
  assert xla_flags.in_effect("tpu", environ) == {
      "variable": "LIBTPU_INIT_ARGS", "preset": list(applied.added),
      "yours": USER_TPU.split()}
  # none takes the preset's out again and leaves exactly what the user set.
  off = xla_flags.apply("tpu", "none", environ=environ)
  assert environ == {"LIBTPU_INIT_ARGS": USER_TPU}
  assert off.added == () and off.line().startswith("overlap flags: none (runtime.xla_flags=none)")
  # Nothing set by the user: the variable holds only the preset, and none removes it.
  empty: dict = {}
  xla_flags.apply("tpu", environ=empty)
  assert len(empty["LIBTPU_INIT_ARGS"].split()) == len(xla_flags.TPU) + 1   # + undefok
  xla_flags.apply("tpu", "none", environ=empty)
  assert empty == {}


def test_the_gpu_preset_goes_to_xla_flags_after_the_users():
  user = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false"
  environ = {"XLA_FLAGS": user, "LIBTPU_INIT_ARGS": "--xla_tpu_foo=1"}
  applied = xla_flags.apply("gpu", environ=environ)
  tokens = environ["XLA_FLAGS"].split()
  assert tokens[:2] == user.split() and len(tokens) == len(xla_flags.GPU) + 1
  assert applied.yours == ("--xla_gpu_enable_latency_hiding_scheduler=false",)
  assert not any(t.startswith("--undefok") for t in tokens)   # fatal in XLA_FLAGS
  assert environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_foo=1"       # the other platform's: untouched
  assert "--xla_gpu_all_gather_combine_threshold_bytes=134217728" in applied.line()
  assert xla_flags.apply("cpu", environ=environ) is None       # no preset: nothing done


def test_across_slices_the_tpu_preset_adds_the_data_parallel_overlap():
  one, two = xla_flags.preset("tpu", 1), xla_flags.preset("tpu", 2)
  assert {f.name for f in two} - {f.name for f in one} == {
      "xla_tpu_enable_data_parallel_all_reduce_opt",
      "xla_tpu_data_parallel_opt_different_sized_ops"}
  mesh = lambda dcn: ml_collections.ConfigDict(dict(ici="fsdp:-1", dcn=dcn))  # noqa: E731
  assert [xla_flags.slices_of(mesh(d)) for d in ("", "data:2", "data:2,fsdp:2", "data:-1")] == [
      1, 2, 4, 2]
  assert xla_flags.slices_of(None) == 1


def test_the_setting_is_checked_with_the_config():
  config = lm.get_config("tiny")
  assert config.runtime.xla_flags == "auto"
  config.runtime.xla_flags = "off"
  with pytest.raises(ConfigError, match=r"runtime.xla_flags='off' is unknown; use 'auto' .* "
                                        r"or 'none'"):
    config_lib.resolve(config)
  config.runtime.xla_flags = "none"
  config_lib.resolve(config)
  # A config saved before the field existed: the default.
  old = ml_collections.ConfigDict({k: v for k, v in lm.get_config("tiny").items()
                                   if k != "runtime"})
  assert xla_flags.setting_of(old) == "auto"
  config_lib.resolve(old)
  with pytest.raises(ConfigError, match="runtime.xla_flags"):
    xla_flags.apply("tpu", "yes", environ={})


def test_runtime_start_adds_nothing_on_the_cpu():
  lines: list[str] = []
  before = {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
  runtime.start(mesh=lm.get_config("tiny").mesh, log=lines.append)
  assert not any("overlap" in line for line in lines), lines
  assert {k: os.environ.get(k) for k in before} == before


_START = textwrap.dedent("""
    import os
    import jax
    from ml_collections import ConfigDict
    from toolkit import runtime
    mesh = ConfigDict(dict(ici="fsdp:-1", dcn="data:2"))
    runtime.start(mesh=mesh)                               # JAX_PLATFORMS=tpu: no backend yet
    print("LIBTPU_INIT_ARGS=" + os.environ["LIBTPU_INIT_ARGS"])
    jax.config.update("jax_platforms", "cuda")
    runtime.start(mesh=mesh, xla_flags="none")
    runtime.start(mesh=mesh)
    print("XLA_FLAGS=" + os.environ["XLA_FLAGS"])
    """)


def test_runtime_start_lists_the_flags_in_one_line_on_a_tpu_or_gpu():
  """runtime.start on an accelerator (JAX_PLATFORMS names it; nothing starts a backend): one
  line per start, the user's flags first and kept."""
  environ = _without_ours(os.environ)
  environ.update(JAX_PLATFORMS="tpu", LIBTPU_INIT_ARGS=USER_TPU)
  done = preloaded.run(code=_START, env=environ, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  lines = done.stdout.splitlines()
  tpu = lines[0]
  values = dict(line.split("=", 1) for line in lines
                if line.startswith(("LIBTPU_INIT_ARGS=", "XLA_FLAGS=")))
  assert tpu.startswith("overlap flags for TPU in LIBTPU_INIT_ARGS: ")
  assert "--xla_tpu_enable_data_parallel_all_reduce_opt=true" in tpu   # mesh.dcn: 2 slices
  assert "yours kept: --xla_enable_async_all_gather=false" in tpu
  assert values["LIBTPU_INIT_ARGS"].startswith(USER_TPU + " --undefok=")
  assert lines[2] == ("overlap flags: none (runtime.xla_flags=none); XLA_FLAGS holds only what "
                      "you set")
  assert lines[3].startswith("overlap flags for GPU in XLA_FLAGS: --xla_gpu_enable_latency_hiding")
  assert values["XLA_FLAGS"].split()[0] == os.environ["XLA_FLAGS"].split()[0]  # the suite's own
  assert values["XLA_FLAGS"].endswith(" ".join(f.token for f in xla_flags.GPU))


# --- the installed jaxlib and libtpu know every name (an unknown one ends the process) -------

@pytest.mark.smoke
def test_every_gpu_flag_is_known_to_the_installed_jaxlib():
  """XLA_FLAGS is parsed when the backend starts (the CPU's too: the GPU names are XLA's
  common debug options); an unknown name is a fatal "Unknown flag in XLA_FLAGS"."""
  code = "import jax; print(jax.devices()[0].platform)"
  base = os.environ.get("XLA_FLAGS", "")
  for extra, known in (("", True), (" --xla_gpu_not_a_flag_anywhere=true", False)):
    flags = f"{base} {' '.join(f.token for f in xla_flags.GPU)}{extra}"
    done = preloaded.run(code=code, env=dict(os.environ, XLA_FLAGS=flags), timeout=120)
    assert (done.returncode == 0) == known, done.stderr[-2000:]
    assert ("Unknown flag" in done.stderr) != known


_LOAD_LIBTPU = textwrap.dedent("""
    from jax.experimental import topologies
    from toolkit import accelerators
    kwargs = accelerators.accelerator("v5p-8").topology_desc_kwargs(num_slices=1)
    print("devices", len(topologies.get_topology_desc(**kwargs).devices))
    """)


@pytest.mark.smoke
@pytest.mark.tpu_aot
def test_every_tpu_flag_is_known_to_the_installed_libtpu(tmp_path, monkeypatch):
  """libtpu parses LIBTPU_INIT_ARGS when it loads: each name of the preset (both slice cases)
  is known; an unknown one ends the process, unless the --undefok `apply` writes lists it."""
  extras.require("libtpu")
  environ = _without_ours(os.environ)
  environ.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_LOG_DIR=str(tmp_path))

  def load(args: str):
    return preloaded.run(code=_LOAD_LIBTPU, env=dict(environ, LIBTPU_INIT_ARGS=args),
                         timeout=120)

  every = " ".join(f.token for f in xla_flags.preset("tpu", slices=2))
  done = load(every)
  assert done.returncode == 0 and "devices 4" in done.stdout, done.stderr[-2000:]
  unknown = load(every + " --xla_tpu_not_a_flag_anywhere=true")
  assert unknown.returncode != 0
  assert "Unknown command line flag 'xla_tpu_not_a_flag_anywhere'" in unknown.stderr
  monkeypatch.setattr(xla_flags, "TPU", xla_flags.TPU + (
      xla_flags.Flag("xla_tpu_not_a_flag_anywhere", "true"),))
  written: dict = {}
  xla_flags.apply("tpu", environ=written)
  done = load(written["LIBTPU_INIT_ARGS"])
  assert done.returncode == 0 and "devices 4" in done.stdout, done.stderr[-2000:]
