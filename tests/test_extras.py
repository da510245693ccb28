"""tests/extras.py: a missing test extra skips a test on a developer's machine and fails it under
CI=true, both naming the install command; an installed one is simply imported."""
from __future__ import annotations

import json

import pytest

from tests import extras

NOT_INSTALLED = "meshkit_no_such_test_extra"


@pytest.mark.parametrize("ci", ["true", "True", "1"])
def test_a_missing_extra_fails_under_ci(monkeypatch, ci):
  monkeypatch.setenv("CI", ci)
  with pytest.raises(pytest.fail.Exception) as failed:
    extras.require(NOT_INSTALLED)
  message = str(failed.value)
  assert NOT_INSTALLED in message and "pip install -e '.[test]'" in message, message
  assert "CI=true" in message, message


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_missing_extra_skips_outside_ci(monkeypatch, ci):
  if ci is None:
    monkeypatch.delenv("CI", raising=False)
  else:
    monkeypatch.setenv("CI", ci)
  with pytest.raises(pytest.skip.Exception) as skipped:
    extras.require(NOT_INSTALLED)
  message = str(skipped.value)
  assert NOT_INSTALLED in message and "pip install -e '.[test]'" in message, message


def test_an_installed_module_is_returned(monkeypatch):
  monkeypatch.setenv("CI", "true")
  assert extras.require("json") is json
