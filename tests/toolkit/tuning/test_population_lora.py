"""A population of LoRA trials (toolkit/tuning/population.py, trial_state.py): K adapters with
their own learning rate, alpha and dropout in one program on ONE frozen base, held once (no
trial axis, one copy in memory), each trial equal to its own single run."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models import lora
from tests.tiny_runs import TOLERANCE, assert_trees_close, train_steps
from tests.toolkit.training.test_lora import STEPS, lora_config
from toolkit.errors import ConfigError
from toolkit.training import state as state_lib
from toolkit.tuning import population, search

TRIALS = [
    {"optimizer.learning_rate": 1e-2, "model.lora_alpha": 8.0, "model.lora_dropout": 0.0},
    {"optimizer.learning_rate": 3e-3, "model.lora_alpha": 16.0, "model.lora_dropout": 0.1},
    {"optimizer.learning_rate": 1e-2, "model.lora_alpha": 4.0, "model.lora_dropout": 0.2},
    {"optimizer.learning_rate": 5e-3, "model.lora_alpha": 8.0, "model.lora_dropout": 0.1},
]


def _configs(trials=TRIALS):
  base = lora_config("fsdp_tp", "fsdp:-1,tensor:2")
  return [search.apply(base, t) for t in trials]


def test_the_base_is_held_once():
  pop = population.build(_configs())
  assert dict(pop.mesh.shape) == {"population": 4, "fsdp": 1, "tensor": 2}
  single = pop.setup.layout.abstract["params"]
  trainable, frozen = state_lib.split_trainable(pop.abstract["params"])
  # The base: its single-run shape and sharding (no trial axis); the adapters: K of each.
  single_trainable, single_frozen = state_lib.split_trainable(single)
  for a, s in zip(jax.tree.leaves(frozen), jax.tree.leaves(single_frozen), strict=True):
    assert (a.shape, a.sharding.spec) == (s.shape, s.sharding.spec)
  for a, s in zip(jax.tree.leaves(trainable), jax.tree.leaves(single_trainable), strict=True):
    assert a.shape == (4,) + s.shape
  assert pop.shardings["params"]["layers"]["attention"]["lora_q"]["a"].spec[0] == "population"
  assert pop.shardings["params"]["embed"].spec == P("tensor", "fsdp")
  # Parameter bytes in all: one base and four sets of adapters.
  table = population.sharding_table(pop)
  adapters = sum(r.total_bytes for r in table.rows if lora.is_adapter(r.path))
  base = sum(r.total_bytes for r in table.rows if not lora.is_adapter(r.path))
  single_rows = pop.setup.layout.report.rows
  assert base == sum(r.total_bytes for r in single_rows if not lora.is_adapter(r.path))
  assert adapters == 4 * sum(r.total_bytes for r in single_rows if lora.is_adapter(r.path))
  # The optimizer state holds the adapters' moments only.
  moments = [x for x in jax.tree.leaves(pop.abstract["opt_state"]) if x.ndim > 1]
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(trainable))


@pytest.mark.parametrize("field,value,message", [
    ("seed", 1, r"differ in seed and have no train.init_from"),
    ("model.init_std", 0.05, r"differ in model.init_std, which only draws the base"),
])
def test_refuses_trials_that_would_need_their_own_base(field, value, message):
  with pytest.raises(ConfigError, match=message):
    population.build(_configs([{}, {field: value}]))


@pytest.mark.slow  # a population and each of its 4 trials trained alone, ~30 s
def test_lora_population_equals_separate_runs():
  configs = _configs()
  pop = population.build(configs)
  state = pop.init()
  base = jax.device_get(state_lib.split_trainable(state["params"])[1])  # (the step donates)
  losses = []
  for s in range(STEPS):
    state, metrics = pop.train_step(state, pop.hparams, pop.batch(s))
    losses.append(metrics["loss"])
  losses = np.asarray(jax.device_get(losses))  # (steps, trials)
  # The base went through every step untouched, and each trial's state holds that one copy.
  after = state_lib.split_trainable(state["params"])[1]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(after), base)
  for t, config in enumerate(configs):
    trial = pop.take(state, t)
    assert all(x is y for x, y in zip(jax.tree.leaves(state_lib.split_trainable(
        trial["params"])[1]), jax.tree.leaves(after)))
    # The reference: the trial trained alone, unsharded, on one device.
    config.mesh.ici, config.sharding.preset = "data:1", "dp"
    ref_losses, ref_params, _ = train_steps(config, jax.devices()[:1])
    np.testing.assert_allclose(losses[:, t], ref_losses, err_msg=f"trial {t}", **TOLERANCE)
    assert_trees_close(jax.device_get(trial["params"]), ref_params, **TOLERANCE)
  assert len({round(float(x), 4) for x in losses[-1]}) == len(TRIALS)  # they differ


def _draws_dropout_masks(trials) -> bool:
  """Whether the population's train step draws random bits (the adapters' dropout masks; the
  rows' dropout keys are split, not drawn)."""
  pop = population.build(_configs(trials))
  traced = pop.train_step.trace(pop.abstract, pop.hparams, pop.batch(0))
  return "random_bits" in str(traced.jaxpr)


def test_dropout_masks_are_drawn_only_where_a_trial_has_dropout():
  # A rate the trials share is the config's constant: at 0 no mask is drawn (a traced rate
  # drew every adapter input's mask even at 0, and made a CPU population 1.4x slower).
  assert not _draws_dropout_masks([{**t, "model.lora_dropout": 0.0} for t in TRIALS])
  assert _draws_dropout_masks([{**t, "model.lora_dropout": 0.1} for t in TRIALS])
  assert _draws_dropout_masks(TRIALS)  # per-trial rates: traced
