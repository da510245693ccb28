"""The program cache: a restart reads the compiled init, train and eval programs back instead of
tracing them, and trains bit for bit as the run that compiled them; any change of config,
arguments or code is a new key; a damaged entry is compiled again; only programs JAX compiled
in the call are stored."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from tests import preloaded
from tests.tiny_runs import tiny_config
from toolkit import training
from toolkit.training import programs as programs_lib, state as state_lib, step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture(autouse=True)
def jax_cache(tmp_path):
  """JAX's persistent cache on, in a folder of the test's own, as `--compilation_cache` turns
  it on; off again afterwards. Programs stores only what JAX reports compiling, which it
  reports through its cache."""
  previous = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  compilation_cache.reset_cache()
  jax.clear_caches()  # nothing compiled earlier in the process is reused from memory
  yield
  jax.config.update("jax_compilation_cache_dir", previous[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
  compilation_cache.reset_cache()


def three_steps(config, programs, devices):
  """A fresh state, three train steps and one eval batch; returns (losses, params, eval
  output, setup, the state first passed to the step)."""
  setup = training.build(config, devices)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed, programs)
  train_step, eval_step = step_lib.compile_step(setup.step, setup.layout,
                                                setup.batches.abstract(), setup.spec.mesh,
                                                programs)
  evaluated = jax.device_get(eval_step(state, setup.batches.eval_batch(0)))
  first_state, losses = state, []
  iterator = setup.batches.iterator(0, None, 0)
  for _ in range(3):
    state, metrics = train_step(state, next(iterator))
    losses.append(float(metrics["loss"]))
  iterator.close()
  return losses, jax.device_get(state["params"]), evaluated, setup, first_state


def test_a_restart_reads_the_programs_back_and_computes_the_same_bits(tmp_path):
  # Four of the eight devices, the last four: the entry must run on the devices it names.
  devices = jax.devices()[4:]
  config = tiny_config("fsdp_tp", "fsdp:2,tensor:2")
  first = programs_lib.Programs(str(tmp_path / "programs"), "context")
  losses, params, evaluated, setup, _ = three_steps(config, first, devices)
  assert setup.step.traces == 1 and first.loaded == []
  assert sorted(f.split("-")[0] for f in os.listdir(tmp_path / "programs")) == [
      "eval_step", "init", "train_step"]

  again = programs_lib.Programs(str(tmp_path / "programs"), "context")
  losses2, params2, evaluated2, setup2, first_state = three_steps(config, again, devices)
  assert setup2.step.traces == 0, "the train step was traced again"
  assert again.loaded == ["init", "train_step", "eval_step"]
  assert losses2 == losses
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  jax.tree.map(np.testing.assert_array_equal, evaluated2, evaluated)
  assert all(x.is_deleted() for x in jax.tree.leaves(first_state)), "the state was not donated"


def test_a_new_config_arguments_or_environment_is_a_new_key(tmp_path, monkeypatch):
  traces = []

  def double(x):
    traces.append(x.shape)
    return 2 * x

  def compile_double(context, shape):
    return programs_lib.Programs(str(tmp_path / "programs"), context).compile(
        "double", jax.jit(lambda x: double(x)), jax.ShapeDtypeStruct(shape, jnp.float32))

  compiled = compile_double("a", (4,))
  np.testing.assert_array_equal(compiled(jnp.arange(4.0)), [0, 2, 4, 6])
  compile_double("a", (4,))
  assert len(traces) == 1
  compile_double("b", (4,))  # another config
  compile_double("a", (5,))  # another argument shape
  assert len(traces) == 3
  monkeypatch.setattr(programs_lib, "environment_fingerprint", lambda: "other code")
  compile_double("a", (4,))
  assert len(traces) == 4


def test_only_programs_jax_compiled_in_the_call_are_stored(tmp_path):
  """Not one JAX reused from memory or read from its own cache: on the CPU those serialize
  without their kernels."""
  abstract = jax.ShapeDtypeStruct((3,), jnp.float32)
  jitted = jax.jit(lambda x: x + 1)
  programs_lib.Programs(str(tmp_path / "a"), "").compile("inc", jitted, abstract)  # compiled
  programs_lib.Programs(str(tmp_path / "b"), "").compile("inc", jitted, abstract)  # from memory
  jax.clear_caches()
  compiled = programs_lib.Programs(str(tmp_path / "c"), "").compile(  # from JAX's cache
      "inc", jax.jit(lambda x: x + 1), abstract)
  np.testing.assert_array_equal(compiled(jnp.zeros(3)), [1, 1, 1])
  assert len(os.listdir(tmp_path / "a")) == 1
  assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
  programs = programs_lib.Programs(str(tmp_path / "programs"), "")
  programs.compile("square", jax.jit(jnp.square), jax.ShapeDtypeStruct((3,), jnp.float32))
  entry, = (tmp_path / "programs" / name for name in os.listdir(tmp_path / "programs"))
  for damage in (b"", b"not a pickle", entry.read_bytes()[:1000]):
    entry.write_bytes(damage)
    shutil.rmtree(tmp_path / "jax_cache")  # so that JAX compiles it again, and it is stored
    compilation_cache.reset_cache()
    jax.clear_caches()
    again = programs_lib.Programs(str(tmp_path / "programs"), "")
    compiled = again.compile("square", jax.jit(jnp.square),
                             jax.ShapeDtypeStruct((3,), jnp.float32))
    assert again.loaded == []
    np.testing.assert_array_equal(compiled(jnp.arange(3.0)), [0, 1, 4])
    assert entry.stat().st_size > 1000, "the damaged entry was not replaced"


def test_the_source_digest_changes_with_any_module(tmp_path):
  package = tmp_path / "package"
  shutil.copytree(os.path.join(ROOT, "sharding"), package)
  before = programs_lib.source_digest(str(package))
  assert programs_lib.source_digest(str(package)) == before
  module = next(package.glob("*.py"))
  module.write_text(module.read_text() + "\n# an edit\n")
  assert programs_lib.source_digest(str(package)) != before


def test_entries_beyond_keep_are_removed_oldest_first(tmp_path, monkeypatch):
  monkeypatch.setattr(programs_lib, "KEEP", 2)
  traces = []

  def compile_zeros(size):
    programs_lib.Programs(str(tmp_path / "programs"), "").compile(
        "zeros", jax.jit(lambda x: traces.append(size) or jnp.zeros_like(x)),
        jax.ShapeDtypeStruct((size,), jnp.int32))

  seen = set()
  for size in (1, 2, 3):
    compile_zeros(size)
    new, = set(os.listdir(tmp_path / "programs")) - seen
    seen.add(new)
    os.utime(tmp_path / "programs" / new, (1e9 + size, 1e9 + size))  # last use: in the order written
  assert len(os.listdir(tmp_path / "programs")) == 2
  compile_zeros(3)
  compile_zeros(2)
  assert traces == [1, 2, 3], "a recent entry was removed"
  compile_zeros(1)
  assert traces == [1, 2, 3, 1], "the oldest entry was kept"
  monkeypatch.setattr(programs_lib, "KEEP_BYTES", 1)  # room for the newest entry only
  compile_zeros(4)
  assert len(os.listdir(tmp_path / "programs")) == 1
  compile_zeros(4)
  assert traces == [1, 2, 3, 1, 4]


def test_a_measurement_is_made_once(tmp_path):
  calls = []
  for _ in range(2):
    value = programs_lib.Programs(str(tmp_path / "programs"), "any config").value(
        "peak", lambda: calls.append(1) or 1.5e11)
    assert value == 1.5e11
  assert len(calls) == 1
  assert programs_lib.Programs(None, "").value("peak", lambda: 2.0) == 2.0


@pytest.mark.slow  # 23 s; the default suite stays near its budget (docs/testing.md)
def test_the_command_reads_the_step_back_on_a_restart(tmp_path):
  """`python -m toolkit.train` twice into new workdirs with one cache: the second run says it
  read the step back, and its metrics are the first run's to the bit. Then with the programs
  gone but JAX's cache kept: JAX's copies are read, and not stored again (on the CPU they would
  be stored without their kernels), so a fourth run trains as well."""
  cache = tmp_path / "cache"
  folder = cache / programs_lib.SUBFOLDER
  outputs, records = [], []
  for name in ("first", "second", "third", "fourth"):
    if name == "third":
      shutil.rmtree(folder)
    args = ["--config=experiments/lm.py:tiny", f"--workdir={tmp_path / name}",
            f"--compilation_cache={cache}", "--config.train.steps=4",
            "--config.train.checkpoint_every=4"]
    done = preloaded.run("toolkit.train", args, cwd=ROOT, timeout=300,  # a new process each
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 0, done.stderr[-2000:]
    outputs.append(done.stdout)
    with open(tmp_path / name / "metrics.jsonl") as f:
      records.append([{k: v for k, v in json.loads(line).items()
                       if "seconds" not in k and "per_second" not in k and k != "mfu"
                       and "fraction" not in k}
                      for line in f])
    if name == "second":
      assert {entry.split("-")[0] for entry in os.listdir(folder)} == {
          "init", "train_step", "eval_step", "fingerprints", "cpu_matmul_peak"}
  read_back = ["(read back from the compilation cache)" in output for output in outputs]
  assert read_back == [False, True, False, False]
  assert all(r == records[0] for r in records) and len(records[0]) >= 3
  assert [entry.split("-")[0] for entry in os.listdir(folder)] == ["cpu_matmul_peak"]
