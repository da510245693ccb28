"""toolkit/runtime.py: where compiled programs go, and the suite's own cache folder."""
from __future__ import annotations

import os
import pathlib

from tests import preloaded
from toolkit import runtime


def test_the_cache_folder_follows_jax_then_xdg_then_home(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert runtime.default_cache_dir() == str(tmp_path / "xdg" / "meshkit" /
                                            "jax_compilation_cache")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert runtime.default_cache_dir() == str(tmp_path / "home" / ".cache" / "meshkit" /
                                            "jax_compilation_cache")
  # JAX's own variable wins: --compilation_cache's default no longer overrides it.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
  assert runtime.default_cache_dir() == str(tmp_path / "jax")


def test_the_suite_and_its_commands_share_one_fresh_cache_folder():
  """tests/conftest.py: the session's cache is a folder of its own, not the user's, and a
  command the tests start sees the same one."""
  folder = pathlib.Path(os.environ["XDG_CACHE_HOME"])
  assert folder == pathlib.Path(os.environ["MESHKIT_TEST_CACHE"])
  assert folder != pathlib.Path.home() / ".cache" and folder.is_dir()
  assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
  code = "from toolkit import runtime; print(runtime.default_cache_dir())"
  for fresh in (False, True):
    done = preloaded.run(code=code, timeout=120, fresh=fresh)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder / "meshkit" / "jax_compilation_cache")
