"""Training LoRA adapters (toolkit/training/state.py's trainable/frozen split, step.py): the
frozen base comes out bitwise unchanged, the optimizer holds state for the adapters only,
sharded == one device with micro-batches and dropout on (each row's dropout key goes with the
row), and a killed run resumes bitwise from a checkpoint that names its base."""
import os

import jax
import numpy as np
import pytest

from models import lora
from tests.tiny_runs import (TOLERANCE, assert_resume_is_bitwise, assert_trees_close,
                             tiny_config)
from toolkit import training
from toolkit.training import state as state_lib, step as step_lib
from toolkit.training.checkpoints import checkpoint

STEPS = 6
LORA = ("model.lora_rank=4", "model.lora_alpha=8.0", "model.lora_dropout=0.1",
        "optimizer.learning_rate=0.01")


def lora_config(preset: str = "fsdp_tp", ici: str = "fsdp:4,tensor:2", microbatches: int = 1):
  config = tiny_config(preset, ici, steps=STEPS, microbatches=microbatches)
  config.model.update(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1)
  config.optimizer.learning_rate = 0.01
  return config


def _train(config, devices=None):
  """(losses, initial params, final state) on the host, `config.train.steps` steps."""
  setup = training.build(config, devices)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  initial = jax.device_get(state["params"])
  train_step, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                        setup.spec.mesh)
  losses = []
  for s in range(config.train.steps):
    state, metrics = train_step(state, setup.batches.batch(s))
    losses.append(metrics["loss"])
  return np.asarray(jax.device_get(losses)), initial, jax.device_get(state)


@pytest.fixture(scope="module")
def sharded():
  return _train(lora_config())


def test_only_the_adapters_train(sharded):
  _, initial, final = sharded
  trainable_before, frozen_before = state_lib.split_trainable(initial)
  trainable, frozen = state_lib.split_trainable(final["params"])
  jax.tree.map(np.testing.assert_array_equal, frozen, frozen_before)  # bitwise
  assert frozen and all(not lora.is_adapter(p) for p in _paths(frozen))
  # Every adapter matrix moved (B from zero, A with it).
  for path, (before, after) in zip(_paths(trainable), zip(jax.tree.leaves(trainable_before),
                                                           jax.tree.leaves(trainable))):
    assert lora.is_adapter(path) and not np.array_equal(before, after), path
  # The optimizer's arrays: AdamW's two moments of each adapter, and scalars (counts).
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(trainable))
  moments = sorted(x.shape for x in jax.tree.leaves(final["opt_state"]) if x.ndim)
  assert moments == sorted(adapter_shapes * 2)


def test_sharded_equals_one_device_with_microbatches_and_dropout(sharded):
  """8 devices (fsdp 4 x tensor 2) in one batch against one device in 2 micro-batches: the
  same losses and adapters, dropout on (masks per row, wherever the row is)."""
  losses, _, final = sharded
  reference_losses, _, reference = _train(lora_config("dp", "data:1", microbatches=2),
                                          jax.devices()[:1])
  np.testing.assert_allclose(losses, reference_losses, **TOLERANCE)
  assert_trees_close(final["params"], reference["params"], **TOLERANCE)
  assert len({round(float(x), 4) for x in losses}) > 1  # it trains


def _paths(tree) -> list[str]:
  return ["/".join(str(k.key) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow  # three training processes, ~40 s
def test_resume_is_bitwise_and_the_checkpoint_names_its_base(tmp_path):
  config = lora_config()
  assert_resume_is_bitwise(tmp_path, config, *LORA)
  manager = checkpoint.Checkpoints(os.path.join(tmp_path, "straight", "checkpoints"),
                                   read_only=True)
  base = manager.base(6)
  state = manager.restore(6, training.build(config).layout.abstract)[0]
  manager.close()
  assert base["init_from"] == "" and base["seed"] == config.seed
  assert base["fingerprint"] == checkpoint.base_fingerprint(state["params"])
  assert base["arrays"] == len(jax.tree.leaves(state_lib.split_trainable(state["params"])[1]))
