"""Every command runs with the huge-page malloc setting `make` gives it (toolkit/allocator.py):
a command typed without GLIBC_TUNABLES re-starts itself once with it; a user's own value is kept
and one that sets the huge-page tunable wins; MESHKIT_HUGE_PAGES=0 opts out; a library import
never re-starts."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from toolkit import allocator

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def test_the_setting_is_added_to_the_users_own_and_theirs_wins():
  assert allocator.tunables(None) == allocator.tunables("") == "glibc.malloc.hugetlb=1"
  assert allocator.tunables("glibc.malloc.arena_max=2") == \
      "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  assert allocator.tunables("glibc.malloc.hugetlb=0") is None  # the user's choice
  assert allocator.is_command(["python", "-m", "toolkit.train", "--workdir=w"])
  assert allocator.is_command(["/v/bin/python", "/v/bin/meshkit-serve", "--port=1"])
  assert not allocator.is_command(["python", "-m", "pytest"])
  assert not allocator.is_command(["python", "-c", "import toolkit"])


def _tunables_of_a_command(env: dict[str, str]) -> str | None:
  """GLIBC_TUNABLES as a command sees it once started (`python -m toolkit.malloc_setting` prints
  it; the process's /proc environ cannot say: glibc rewrites its own copy of the variable)."""
  done = subprocess.run([sys.executable, "-m", "toolkit.malloc_setting"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert done.returncode == 0 and done.stderr == "", done.stderr  # calm: no runpy warning
  value = done.stdout.strip().removeprefix("GLIBC_TUNABLES=")
  return value or None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables: Linux")
@pytest.mark.parametrize("given, expected", [
    (None, "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
], ids=["unset", "the users own", "the users choice"])
def test_a_command_runs_with_the_setting(given, expected):
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.OPT_OUT)}
  if given is not None:
    env["GLIBC_TUNABLES"] = given
  assert _tunables_of_a_command(env) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables: Linux")
def test_the_opt_out_and_a_library_import_leave_the_process_alone():
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  assert _tunables_of_a_command(env | {allocator.OPT_OUT: "0"}) is None
  done = subprocess.run([sys.executable, "-c", "import os, toolkit; "
                         "print(os.environ.get('GLIBC_TUNABLES'))"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert done.stdout.strip() == "None", done.stderr
