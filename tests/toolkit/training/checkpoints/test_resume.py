"""Damaged checkpoints: each kind of damage to the newest step makes the run fall back to the
step before (one warning naming the step and the cause, the damaged folder moved aside, never
deleted), and training from there equals the uninterrupted run bitwise. Silent corruption
(flipped bytes that still decode) is caught by the fingerprints. When nothing restores, or the
damage is in another run's checkpoint (train.resume_from), it is one error and nothing moves."""
from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
import tensorstore as ts

from tests.tiny_runs import tiny_config
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.training import step as step_lib
from toolkit.training.checkpoints import checkpoint, integrity, resume


def _array_files(step_dir: str) -> list[str]:
  """Every data file of the step's state. An OCDBT step holds several (state/d/* and
  state/ocdbt.process_0/d/*), and which of them a restore reads depends on how the save went:
  damaging only one (the biggest, say) could hit a file the restore never reads. Damaging all
  of them makes the damage certain to be read."""
  files = sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True))
  assert files, f"no array files under {step_dir}/state"
  return files


def _truncate_array_files(step_dir: str) -> None:
  for path in _array_files(step_dir):
    os.truncate(path, os.path.getsize(path) // 2)


def _delete_array_files(step_dir: str) -> None:
  for path in _array_files(step_dir):
    os.remove(path)


def _garbage(path: str) -> None:
  with open(path, "wb") as f:
    f.write(b"\x00garbage{{{" * 7)


def _zero(path: str) -> None:
  with open(path, "r+b") as f:
    f.write(b"\x00" * os.path.getsize(path))


def _flip_bytes(path: str, count: int = 64) -> None:
  """Flips bytes of an array file as stored: compressed (zstd) chunks, so depending on where the
  bytes land (which differs between machines) the chunk no longer decodes or decodes to wrong
  values. Either way the step must not be restored."""
  data = bytearray(open(path, "rb").read())
  # From a third into the file, every 7th byte; wrapped around (each byte flipped once) in a
  # file too small for `count` of them.
  for index in {(len(data) // 3 + i * 7) % len(data) for i in range(count)}:
    data[index] ^= 0xFF
  with open(path, "wb") as f:
    f.write(bytes(data))


def _flip_value_bytes(step_dir: str, name: str = "params.layers.mlp.w_down",
                      count: int = 64) -> None:
  """Silent corruption that still decodes: bytes of one array's values flipped under Orbax
  (rewritten through tensorstore into the step's OCDBT store, as bit rot below a checksum-free
  layer would leave them). Unlike flipping file bytes, this never depends on where a machine's
  compressed chunks happen to lie."""
  store = ts.open({"driver": "zarr", "kvstore": {
      "driver": "ocdbt", "base": f"file://{step_dir}/state/", "path": f"{name}/"}}).result()
  values = np.array(store.read().result())
  raw = values.view(np.uint8).reshape(-1)
  raw[np.arange(count) * 7 % raw.size] ^= 0xFF
  store.write(values).result()


def _empty_step(step_dir: str) -> None:
  shutil.rmtree(step_dir)
  os.mkdir(step_dir)  # what a crash on gcsfuse leaves: the folder, nothing in it


# damage kind -> (what it does to a step folder, a fragment of the cause the warning names)
DAMAGE = {
    "truncated_array_file": (_truncate_array_files, "its state"),
    "deleted_array_file": (_delete_array_files, "its state"),
    "garbage_checkpoint_metadata": (lambda d: _garbage(f"{d}/_CHECKPOINT_METADATA"),
                                    "_CHECKPOINT_METADATA is unreadable"),
    "garbage_state_metadata": (lambda d: _garbage(f"{d}/state/_METADATA"),
                               "state/_METADATA is unreadable"),
    "garbage_sharding_file": (lambda d: _garbage(f"{d}/state/_sharding"),
                              "state/_sharding is unreadable"),
    "garbage_config": (lambda d: _garbage(f"{d}/config/metadata"), "config/metadata"),
    "garbage_data_position": (lambda d: _garbage(f"{d}/data/metadata"), "data/metadata"),
    "garbage_fingerprints": (lambda d: _garbage(f"{d}/integrity/metadata"),
                             "integrity/metadata"),
    "zeroed_manifest": (lambda d: _zero(f"{d}/state/manifest.ocdbt"), "its state"),
    "garbage_manifest": (lambda d: _garbage(f"{d}/state/manifest.ocdbt"), "its state"),
    "empty_step_folder": (_empty_step, "its config"),
    "no_state": (lambda d: shutil.rmtree(f"{d}/state"), "its state"),
    "no_fingerprints_and_no_state": (lambda d: (shutil.rmtree(f"{d}/state"),
                                                shutil.rmtree(f"{d}/integrity")), "its state"),
    "flipped_value_bytes": (_flip_value_bytes, "does not match the one saved with it"),
    # Either the chunk no longer decodes (its state) or its values fail the fingerprint.
    "flipped_file_bytes": (lambda d: [_flip_bytes(path) for path in _array_files(d)],
                           ("its state", "does not match the one saved with it")),
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted 10-step run with checkpoints at 5 and 10, its losses, and the pieces to
  continue a restored state: (workdir, losses by step, setup, compiled train step)."""
  workdir = str(tmp_path_factory.mktemp("straight") / "w")
  config = tiny_config(steps=10)
  config.train.update(checkpoint_every=5, eval_every=10, sample_tokens=0)
  result = training.run(config, workdir)
  setup = training.build(config)
  train_step, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                        setup.spec.mesh)
  return workdir, config, result.train_losses, setup, train_step


def _copy(straight, tmp_path) -> str:
  workdir = str(tmp_path / "w")
  shutil.copytree(straight[0], workdir)
  return workdir


def _continue(state, setup, train_step, start: int, stop: int) -> dict[int, float]:
  losses = {}
  for s in range(start, stop):
    state, metrics = train_step(state, setup.batches.batch(s))
    losses[s + 1] = float(jax.device_get(metrics["loss"]))
  return losses


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(straight, tmp_path, kind):
  _, config, losses, setup, train_step = straight
  workdir = _copy(straight, tmp_path)
  damage, cause = DAMAGE[kind]
  damage(os.path.join(workdir, "checkpoints", "10"))
  lines = []
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"))
  state, position = resume.restore_or_init(config, setup, checkpoints, lines.append)
  checkpoints.close()

  warning, restored = lines
  assert warning.startswith("warning: checkpoint step 10 is damaged ("), warning
  causes = cause if isinstance(cause, tuple) else (cause,)
  assert any(c in warning for c in causes), warning
  assert warning.endswith(f"moved it to {workdir}/damaged_checkpoints/10 and resumed from step 5")
  assert restored == f"restored step 5 from {workdir}/checkpoints"
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["5"]
  assert os.listdir(os.path.join(workdir, "damaged_checkpoints")) == ["10"]  # kept, not deleted
  assert int(state["step"]) == 5 and position["step"] == 5
  # Training on from step 5 is the uninterrupted run, bitwise.
  assert _continue(state, setup, train_step, 5, 10) == {s: losses[s] for s in range(6, 11)}


def test_flipped_bytes_restore_without_an_error_but_not_past_the_fingerprints(straight, tmp_path):
  """The silent corruption of issue 16: Orbax restores the flipped bytes as values."""
  _, _, _, setup, _ = straight
  workdir = _copy(straight, tmp_path)
  _flip_value_bytes(os.path.join(workdir, "checkpoints", "10"))
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
  restored = checkpoints.manager.restore(10, args=checkpoint.ocp.args.Composite(
      state=checkpoint._tree_restore(setup.layout.abstract)))["state"]  # pylint: disable=protected-access
  expected = json.loads(open(os.path.join(workdir, "checkpoints", "10", "integrity",
                                          "metadata")).read())
  assert integrity.mismatches(restored, expected)
  with pytest.raises(checkpoint.DamagedCheckpoint, match="fingerprint of .* does not match"):
    checkpoints.restore(10, setup.layout.abstract)
  checkpoints.close()


def test_two_damaged_steps_both_move_aside(straight, tmp_path):
  _, config, _, setup, _ = straight
  workdir = _copy(straight, tmp_path)
  checkpoints_dir = os.path.join(workdir, "checkpoints")
  shutil.copytree(os.path.join(checkpoints_dir, "10"), os.path.join(checkpoints_dir, "15"))
  for step in ("10", "15"):
    _delete_array_files(os.path.join(checkpoints_dir, step))
  lines = []
  checkpoints = checkpoint.Checkpoints(checkpoints_dir)
  state, _ = resume.restore_or_init(config, setup, checkpoints, lines.append)
  checkpoints.close()
  assert [line.split(" is damaged")[0] for line in lines[:2]] == [
      "warning: checkpoint step 15", "warning: checkpoint step 10"]
  assert int(state["step"]) == 5
  assert sorted(os.listdir(os.path.join(workdir, "damaged_checkpoints"))) == ["10", "15"]


def test_when_no_checkpoint_restores_it_is_one_error_and_nothing_moves(straight, tmp_path):
  _, config, _, setup, _ = straight
  workdir = _copy(straight, tmp_path)
  for step in ("5", "10"):
    _garbage(os.path.join(workdir, "checkpoints", step, "config", "metadata"))
  before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"))
  with pytest.raises(ConfigError) as raised:
    resume.restore_or_init(config, setup, checkpoints, print)
  checkpoints.close()
  message = str(raised.value)
  assert message.startswith(f"no checkpoint in {workdir}/checkpoints can be restored (step 10: "
                            f"config/metadata is unreadable"), message
  assert "step 5: config/metadata is unreadable" in message and "nothing was moved" in message
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
  assert not os.path.exists(os.path.join(workdir, "damaged_checkpoints"))


def test_a_damaged_resume_from_is_an_error_not_a_fallback(straight, tmp_path):
  _, config, _, setup, _ = straight
  other = _copy(straight, tmp_path)
  _delete_array_files(os.path.join(other, "checkpoints", "10"))
  before = sorted(os.listdir(os.path.join(other, "checkpoints")))
  fresh = checkpoint.Checkpoints(str(tmp_path / "fresh" / "checkpoints"))
  config = config.copy_and_resolve_references()
  config.train.resume_from = other
  with pytest.raises(ConfigError, match=f"^train.resume_from='{other}': checkpoint "
                                        f"{other}/checkpoints step 10 cannot be restored"):
    resume.restore_or_init(config, setup, fresh, print)
  fresh.close()
  assert sorted(os.listdir(os.path.join(other, "checkpoints"))) == before


def test_another_model_is_a_config_error_not_damage(straight, tmp_path):
  """A checkpoint of a different model is the user's mistake: no step is set aside for it."""
  _, _, _, _, _ = straight
  workdir = _copy(straight, tmp_path)
  config = tiny_config(steps=10)
  config.model.d_model = 64
  setup = training.build(config)
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"))
  with pytest.raises(ConfigError, match="holds a different model: model.d_model=32 there"):
    resume.restore_or_init(config, setup, checkpoints, print)
  checkpoints.close()
  assert not os.path.exists(os.path.join(workdir, "damaged_checkpoints"))


def test_checkpoints_without_fingerprints_still_restore(straight, tmp_path):
  """Checkpoints written before fingerprints existed restore, said to be unverified."""
  _, config, _, setup, _ = straight
  workdir = _copy(straight, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "10", "integrity"))
  lines = []
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"))
  state, _ = resume.restore_or_init(config, setup, checkpoints, lines.append)
  checkpoints.close()
  assert lines == [f"restored step 10 from {workdir}/checkpoints (written before fingerprints "
                   f"existed: not verified)"]
  assert int(state["step"]) == 10
  np.testing.assert_array_equal(np.asarray(state["params"]["embed"]),
                                np.asarray(_restore_intact(straight, 10)["params"]["embed"]))


def _restore_intact(straight, step: int):
  workdir, _, _, setup, _ = straight
  manager = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
  state, _ = manager.restore(step, setup.layout.abstract)
  manager.close()
  return state


@pytest.mark.parametrize("steps, schedule_steps, warned", [(20, 0, True), (20, 10, False),
                                                           (10, 0, False), (10, 12, True)])
def test_a_resume_onto_another_schedule_length_says_so_once(straight, tmp_path, steps,
                                                            schedule_steps, warned):
  """Issue 32: resuming with another train.steps silently stretched warmup and decay."""
  _, config, _, setup, _ = straight
  workdir = _copy(straight, tmp_path)
  config = config.copy_and_resolve_references()
  config.train.steps, config.optimizer.schedule_steps = steps, schedule_steps
  lines = []
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"))
  resume.restore_or_init(config, setup, checkpoints, lines.append)
  checkpoints.close()
  assert lines[0] == f"restored step 10 from {workdir}/checkpoints"
  # A checkpoint at step 0 (toolkit.convert import's) has begun no schedule: nothing to say.
  assert resume.schedule_change(config, checkpoints, 0) is None
  if not warned:
    assert lines[1:] == []
    return
  now = schedule_steps or steps
  before, after = (float(step_lib.learning_rate_schedule(config.optimizer, n)(10))
                   for n in (10, now))
  assert before != after  # the lines below would not show a change
  assert lines[1:] == [
      f"warning: the learning-rate schedule was 10 steps long and is {now} now (train.steps or "
      f"optimizer.schedule_steps changed): warmup and decay stretch, and step 11 trains at lr "
      f"{after:.2e} instead of {before:.2e}; to keep the schedule the checkpoint trained on, "
      f"add --config.optimizer.schedule_steps=10"]
