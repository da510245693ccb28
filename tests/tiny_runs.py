"""Shared test helpers: a few training steps through the same pieces `train.run` uses."""
from __future__ import annotations

import jax
import numpy as np

from experiments import lm
from toolkit.training import state as state_lib, step as step_lib

# float32 tolerance for "the same computation, different sharding / accumulation order",
from toolkit import training

# float32 tolerance for "the same computation, different sharding / accumulation order",
# stated once. Measured over 12 steps of the tiny model: |d loss| <= 2.4e-6 (relative 4e-7),
# |d param| <= 1.2e-7, i.e. ~20x inside these bounds.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def tiny_config(preset: str = "fsdp_tp", ici: str = "fsdp:4,tensor:2", steps: int = 12,
                microbatches: int = 1):
  config = lm.get_config("tiny")
  config.sharding.preset = preset
  config.mesh.ici = ici
  config.train.steps = steps
  config.train.microbatches = microbatches
  return config


def train_steps(config, devices=None, steps: int | None = None):
  """Trains `steps` steps from scratch; returns (losses, host params, setup)."""
  setup = training.build(config, devices)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  train_step, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                        setup.spec.mesh)
  losses = []
  for s in range(config.train.steps if steps is None else steps):
    state, metrics = train_step(state, setup.batches.batch(s))
    losses.append(metrics["loss"])
  return np.asarray(jax.device_get(losses)), jax.device_get(state["params"]), setup


def assert_trees_close(actual, expected, **tolerance) -> None:
  paths_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  leaves_e = jax.tree.leaves(expected)
  assert len(paths_a) == len(leaves_e)
  for (path, a), e in zip(paths_a, leaves_e):
    np.testing.assert_allclose(a, e, err_msg=jax.tree_util.keystr(path), **tolerance)
