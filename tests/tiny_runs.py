"""Shared test helpers: a few training steps through the same pieces `train.run` uses, and a
resume in fresh `toolkit.train` processes."""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from experiments import lm
from tests import codegen, preloaded
from toolkit import training
from toolkit.training import dpo_reference, state as state_lib, step as step_lib
from toolkit.training.checkpoints import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
  dpo_reference.prepare(setup, state["params"], workdir=None)  # DPO's, when precomputed
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


def default_codegen_env(devices: int | None = None) -> dict[str, str]:
  """The suite's environment (tests/conftest.py) with XLA's default code generation, which the
  suite changes to compile faster (tests/codegen.py): for a long run, whose time is its steps'
  (the CPU demo's step is ~1.8x slower without LLVM's optimizations), and for results
  documented as a user's run computes them. With `devices`, that many CPU devices instead of
  the suite's 8: a command whose mesh has one device simulates none, and XLA:CPU then splits an
  op over the host's cores (2 threads here) instead of the 8 threads of 8 devices."""
  flags = [f for f in codegen.without(os.environ.get("XLA_FLAGS", ""))
           if not (devices and f.startswith("--xla_force_host_platform_device_count"))]
  if devices:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return {**os.environ, "XLA_FLAGS": " ".join(flags)}


def train_process(workdir: str, steps: int, *overrides: str) -> str:
  """`python -m toolkit.train` on the tiny LM in a new process on 8 CPU devices (a 6-step
  schedule, a checkpoint every 2 steps, `overrides` as --config.* flags): its stdout. The
  process is forked from one that has imported the toolkit (tests/preloaded.py)."""
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  args = ["--config=experiments/lm.py:tiny", f"--workdir={workdir}",
          "--config.optimizer.schedule_steps=6", "--config.train.checkpoint_every=2",
          f"--config.train.steps={steps}", *(f"--config.{o}" for o in overrides)]
  proc = preloaded.run("toolkit.train", args, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def train_losses(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def assert_resume_is_bitwise(tmp_path, config, *overrides: str) -> None:
  """6 steps straight against 4 steps, killed, resumed to 6 (`train_process` with
  `overrides`): the same losses and, restored with `config`, every state array `==`."""
  straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
  train_process(straight, 6, *overrides)
  train_process(interrupted, 4, *overrides)
  assert "restored step 4" in train_process(interrupted, 6, *overrides)
  assert train_losses(interrupted) == train_losses(straight)
  states = []
  for workdir in (straight, interrupted):
    setup = training.build(config)
    manager = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
    states.append(manager.restore(6, setup.layout.abstract)[0])
    manager.close()
  for x, y in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
