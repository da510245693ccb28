"""Checkpoints: exact resume in a new process, restore onto another mesh, refusal of others."""
import os

import jax
import numpy as np
import pytest

from tests import preloaded
from tests.tiny_runs import tiny_config, train_losses
from toolkit.training import state as state_lib, step as step_lib
from toolkit.training.checkpoints import checkpoint, resume
from toolkit import training
from toolkit.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))


def _train_cli(workdir, *overrides, timeout=240):
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  args = ["--config=experiments/lm.py:tiny", f"--workdir={workdir}",
          "--config.optimizer.schedule_steps=10", "--config.train.checkpoint_every=2",
          "--config.train.keep_checkpoints=2", *overrides]
  proc = preloaded.run("toolkit.train", args, env=env, timeout=timeout)  # a new process
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def _restore(workdir, step, config=None, devices=None):
  setup = training.build(config or tiny_config(), devices)
  manager = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
  state, data_position = manager.restore(step, setup.layout.abstract)
  manager.close()
  return state, data_position, setup


@pytest.mark.smoke
def test_resume_in_a_new_process_is_bitwise_identical(tmp_path):
  straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
  _train_cli(straight, "--config.train.steps=10")
  _train_cli(interrupted, "--config.train.steps=6")
  assert sorted(os.listdir(os.path.join(interrupted, "checkpoints"))) == ["4", "6"]
  out = _train_cli(interrupted, "--config.train.steps=10")
  assert "restored step 6" in out
  # keep_checkpoints=2 keeps the last two.
  assert sorted(os.listdir(os.path.join(straight, "checkpoints"))) == ["10", "8"]

  assert train_losses(interrupted) == train_losses(straight)  # bitwise: floats compared ==
  a, data_a, _ = _restore(straight, 10)
  b, data_b, _ = _restore(interrupted, 10)
  assert data_a == data_b == {"step": 10, "seed": 0, "source": "stdlib_docs"}
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  # resume_from: a fresh workdir starts from another run's latest checkpoint...
  other = str(tmp_path / "other")
  before = sorted(os.listdir(os.path.join(straight, "checkpoints")))
  out = _train_cli(other, "--config.train.steps=12", f"--config.train.resume_from={straight}")
  assert "restored step 10" in out
  assert sorted(os.listdir(os.path.join(other, "checkpoints"))) == ["12"]
  # ...and leaves that run's checkpoints alone.
  assert sorted(os.listdir(os.path.join(straight, "checkpoints"))) == before


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
  """A checkpoint of a *trained* state on fsdp=4 x tensor=2: three real steps, so the step
  counter is 3 and Adam's moments are nonzero (a fresh init would restore zeros and prove
  little), and the host copy of that state."""
  source = training.build(tiny_config("fsdp_tp", "fsdp:4,tensor:2"))
  state = state_lib.create(source.spec.model, source.optimizer, source.layout, seed=3)
  train_step, _ = step_lib.compile_step(source.step, source.layout, source.batches.abstract(),
                                        source.spec.mesh)
  for step in range(3):
    state, _ = train_step(state, source.batches.batch(step))
  directory = tmp_path_factory.mktemp("trained")
  manager = checkpoint.Checkpoints(str(directory / "checkpoints"))
  manager.save(3, state, {"model": {}}, {"step": 3})
  manager.close()
  host = jax.device_get(state)
  assert int(host["step"]) == 3
  moments = [x for x in jax.tree.leaves(host["opt_state"])
             if np.issubdtype(np.asarray(x).dtype, np.floating)]
  assert moments and all(np.any(np.asarray(x) != 0) for x in moments)
  return directory, host


@pytest.mark.parametrize("target_ici,target_preset,devices", [
    ("data:2,fsdp:2,tensor:2", "fsdp_tp", 8), ("fsdp:8", "fsdp", 8), ("data:1", "dp", 1),
    ("fsdp:2,sequence:4", "fsdp_cp", 8)])
def test_restore_onto_a_different_mesh(trained_checkpoint, target_ici, target_preset, devices):
  directory, state = trained_checkpoint
  target_config = tiny_config(target_preset, target_ici)
  restored, data_position, target = _restore(str(directory), 3, target_config,
                                             jax.devices()[:devices])
  assert data_position == {"step": 3}
  assert int(restored["step"]) == 3
  for got, want, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                                 jax.tree.leaves(target.layout.shardings)):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_check_compatible_names_the_field():
  model = tiny_config().model
  from models import LlamaConfig  # pylint: disable=g-import-not-at-top
  cfg = LlamaConfig(**model.to_dict())
  saved = {"model": {**model.to_dict(), "d_model": 64}}
  with pytest.raises(ConfigError, match=r"model\.d_model=64 there, 32 here.*--config\.model\.d_model=64"):
    checkpoint.check_compatible(saved, cfg, "W step 5")
  checkpoint.check_compatible({"model": model.to_dict()}, cfg, "W step 5")  # same model: fine


def test_resume_from_without_checkpoints_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="train.resume_from=.*holds no checkpoint"):
    resume.restore_other_run(str(tmp_path), setup=None, log=print)
