"""Rollouts (toolkit/post_training/rollouts.py): G sampled completions of each prompt from the
KV-cache engine on the training mesh, with the training parameters as they are. A rollout
equals the engine's `generate` of the same prompt and seed in another batch; its seeds are a
pure function of (seed, step, prompt, generation); the engine lays the parameters out as the
training step does, so it reads them where they are."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments import lm
from toolkit import training
from toolkit.inference import engine as engine_lib
from toolkit.inference.sampling import SamplingParams
from toolkit.inference.scheduler import generate
from toolkit.post_training import rollouts as rollouts_lib
from toolkit.training import state as state_lib

GENERATIONS, MAX_TOKENS, CACHE_LENGTH = 4, 6, 32
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
PROMPTS = [np.array([5, 6, 7], np.int32), np.array([9], np.int32),
           np.array([3, 1, 4, 1, 5, 9, 2], np.int32)]


@pytest.fixture(scope="module")
def trained():
  """The tiny LM on 8 devices (fsdp x tensor), its training layout and a fresh state."""
  config = lm.get_config("tiny")
  setup = training.build(config)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  return setup, state["params"]


@pytest.fixture(scope="module")
def rollouts(trained):
  setup, params = trained
  return rollouts_lib.Rollouts(setup.spec.model, params, setup.spec.mesh, setup.spec.rules,
                               CACHE_LENGTH, SAMPLING, GENERATIONS, batch_size=16)


def test_a_rollout_equals_generate_of_the_same_prompt_and_seed(trained, rollouts):
  setup, params = trained
  groups = rollouts(params, PROMPTS, seed=3, step=7)
  assert [len(g.results) for g in groups] == [GENERATIONS] * len(PROMPTS)
  # Each completion alone, in a batch of another size, on an engine of its own.
  alone = engine_lib.Engine(setup.spec.model, params, setup.spec.mesh, setup.spec.rules,
                            CACHE_LENGTH)
  for p, group in enumerate(groups):
    np.testing.assert_array_equal(group.prompt, PROMPTS[p])
    for g, result in enumerate(group.results):
      seed = rollouts_lib.completion_seed(3, 7, p, g)
      want = generate(alone, [PROMPTS[p]], [SamplingParams(max_tokens=MAX_TOKENS,
                                                           temperature=1.0, seed=seed)], 4)
      assert result.tokens == want[0].tokens, (p, g)
      assert len(result.tokens) == MAX_TOKENS  # no stop tokens: every completion is full
  # Sampled, not copied: a group's completions differ, and so does another step's rollout.
  assert len({tuple(r.tokens) for r in groups[0].results}) > 1
  again = rollouts(params, PROMPTS, seed=3, step=8)
  assert [r.tokens for r in again[0].results] != [r.tokens for r in groups[0].results]
  assert rollouts.tokens(groups) == len(PROMPTS) * GENERATIONS * MAX_TOKENS
  assert rollouts.engine.params is None  # nothing held past the call: the step donates them


def test_the_same_seed_and_step_sample_the_same_rollout(trained, rollouts):
  _, params = trained
  first = rollouts(params, PROMPTS[:2], seed=0, step=1)
  second = rollouts(params, PROMPTS[:2], seed=0, step=1)
  assert [[r.tokens for r in g.results] for g in first] == \
         [[r.tokens for r in g.results] for g in second]


def test_the_engine_lays_the_parameters_out_as_the_training_step(trained, rollouts):
  """So the engine's step reads the training state's arrays as they are (no copy): the
  shardings of the training layout are the ones the engine's own layout gives."""
  setup, params = trained
  served = state_lib.layout(rollouts.engine.model_cfg, setup.optimizer, setup.spec.rules,
                            setup.spec.mesh).shardings["params"]
  assert jax.tree.structure(served) == jax.tree.structure(params)
  for trained_array, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(served)):
    assert trained_array.sharding == sharding


def test_a_group_needs_two_completions(trained):
  setup, params = trained
  with pytest.raises(ValueError, match="generations=1: a group needs >= 2"):
    rollouts_lib.Rollouts(setup.spec.model, params, setup.spec.mesh, setup.spec.rules,
                          CACHE_LENGTH, SAMPLING, 1, batch_size=16)
