"""Eight simulated CPU devices for every test, set before JAX is imported."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"


# --- a local Cloud Storage (scripts/gcs_emulator.py) -------------------------------------------
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from scripts import gcs_emulator  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
  """fake-gcs-server on 127.0.0.1 for the session, with this process's clients pointed at it."""
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
