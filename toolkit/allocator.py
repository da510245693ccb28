"""glibc's malloc with transparent huge pages for every command, as `make` gives it.

XLA:CPU maps a step's temporaries afresh at every step, and faulting them in 4 KiB pages was
about a third of a CPU run's time on 2 cores (docs/benchmarks.md, CPU runs with transparent
huge pages). glibc reads its tunables once, when a process starts, so a command typed without
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 starts itself once more with it (`os.execv`: the same
process id, arguments, standard streams), before it imports anything heavy. A
GLIBC_TUNABLES of the user's own is kept (the setting is added to it) and one that sets
glibc.malloc.hugetlb wins; MESHKIT_HUGE_PAGES=0 turns the re-start off. Only a command started
as `python -m toolkit.NAME` or as a `meshkit-*` script re-starts: a library import never does.
"""
from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "MESHKIT_HUGE_PAGES"


def tunables(current: str | None) -> str | None:
  """GLIBC_TUNABLES with the huge-page setting added; None when `current` sets it already."""
  if current and "glibc.malloc.hugetlb" in current:
    return None
  return f"{current}:{TUNABLE}" if current else TUNABLE


def is_command(argv: list[str]) -> bool:
  """Whether `argv` (sys.orig_argv) started a toolkit command: `python -m toolkit.NAME ...`
  or a `meshkit-*` console script."""
  if len(argv) >= 3 and argv[1] == "-m" and argv[2].startswith("toolkit."):
    return True
  return len(argv) >= 2 and os.path.basename(argv[1]).startswith("meshkit-")


def restart_with_huge_pages() -> None:
  """Re-executes this command with the huge-page tunable when it lacks it (module docstring);
  returns when there is nothing to do."""
  if (os.environ.get(OPT_OUT, "1") == "0" or not sys.platform.startswith("linux")
      or not is_command(getattr(sys, "orig_argv", []))):
    return
  value = tunables(os.environ.get("GLIBC_TUNABLES"))
  if value is None:
    return
  os.environ["GLIBC_TUNABLES"] = value
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
