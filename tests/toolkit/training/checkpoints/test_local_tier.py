"""The local checkpoint tier (toolkit/training/checkpoints/tiers.py): a run that crashes resumes from the
newer local step and trains bitwise like an uninterrupted run; a damaged local step is set
aside and the run falls back to the workdir's checkpoints with one warning; the folder is
refused where it cannot serve."""
from __future__ import annotations

import json
import os

import pytest

from tests.tiny_runs import tiny_config, train_losses
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.training import loop
from toolkit.training.checkpoints import tiers

STEPS, PERSISTENT_EVERY, LOCAL_EVERY, CRASH_AT = 6, 3, 2, 5


class Crash(Exception):
  pass


def _config(local_dir: str = ""):
  config = tiny_config(steps=STEPS)
  config.train.update(checkpoint_every=PERSISTENT_EVERY, eval_every=STEPS, log_every=1,
                      local_checkpoint_dir=local_dir, local_checkpoint_every=LOCAL_EVERY)
  return config


def _crash(run_, state, step):
  del run_, state
  if step == CRASH_AT:
    raise Crash(f"crashed after step {step}")


def _crashed_run(tmp_path):
  """A run with the local tier that crashes after step 5: workdir checkpoint 3, local 2 and 4."""
  workdir, local = str(tmp_path / "run"), str(tmp_path / "shm")
  with pytest.raises(Crash):
    training.run(_config(local), workdir, periodic=[loop.Every(CRASH_AT, _crash)])
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  assert sorted(os.listdir(os.path.join(local, "checkpoints"))) == ["2", "4"]
  return workdir, local


def _save_records(workdir: str) -> dict[str, set[int]]:
  """The steps of metrics.jsonl's save records, by kind (the local tier's have their own)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return {kind: {r["step"] for r in records if r["kind"] == kind}
          for kind in ("checkpoint", "local_checkpoint")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight") / "run")
  training.run(_config(), workdir)
  return train_losses(workdir)


def test_a_crashed_run_resumes_from_the_newer_local_step(tmp_path, straight, capsys):
  workdir, local = _crashed_run(tmp_path)
  capsys.readouterr()
  training.run(_config(local), workdir)
  out = capsys.readouterr().out
  assert f"restored step 4 from {os.path.join(local, 'checkpoints')}" in out, out
  assert train_losses(workdir) == straight   # bitwise: floats compared ==
  # The workdir got its step 6 (beside 3); the local tier kept 2 and 4: 6 was a workdir step.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
  assert sorted(os.listdir(os.path.join(local, "checkpoints"))) == ["2", "4"]
  saves = _save_records(workdir)
  assert 6 in saves["checkpoint"] and saves["local_checkpoint"] <= {2, 4}


def test_a_damaged_local_step_falls_back_to_the_workdir(tmp_path, straight, capsys):
  workdir, local = _crashed_run(tmp_path)
  # The local step 4 loses its state's files (a RAM disk that filled, a host that rebooted).
  state_dir = os.path.join(local, "checkpoints", "4", "state")
  for name in os.listdir(state_dir):
    path = os.path.join(state_dir, name)
    if os.path.isfile(path):
      os.remove(path)
  capsys.readouterr()
  training.run(_config(local), workdir)
  out = capsys.readouterr().out
  assert "warning: no step of the local tier newer than the workdir's restores (step 4: " in out
  assert f"moved it to {os.path.join(local, 'damaged_checkpoints')} and resumed from" in out, out
  assert f"restored step 3 from {os.path.join(workdir, 'checkpoints')}" in out, out
  assert train_losses(workdir) == straight
  # The steps trained again saved anew: the local tier's 4 (the damaged one set aside).
  assert sorted(os.listdir(os.path.join(local, "checkpoints"))) == ["2", "4"]
  assert 4 in _save_records(workdir)["local_checkpoint"]


def test_the_folder_is_refused_where_it_cannot_serve(tmp_path):
  config = _config(str(tmp_path / "shm"))
  tiers.open_tier(config, str(tmp_path / "a")).close()
  with pytest.raises(ConfigError, match=r"^train.local_checkpoint_dir=\S+ holds the local "
                                        r"checkpoints of another run \(workdir \S+/a\); give"):
    tiers.open_tier(config, str(tmp_path / "b"))
  config.train.local_checkpoint_dir = "gs://bucket/shm"
  with pytest.raises(ConfigError, match="is an object store; the local tier is this host's"):
    tiers.open_tier(config, str(tmp_path / "a"))
  assert tiers.open_tier(_config(""), str(tmp_path / "a")) is None
  assert [s for s in range(1, 7) if tiers.due(_config("x"), s)] == [2, 4, 6]
