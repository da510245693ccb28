"""Population training: K trials in one program equal K separate runs; what it refuses."""
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments import vit
from tests.tiny_runs import TOLERANCE, assert_trees_close, tiny_config, train_steps
from toolkit.tuning import population, runner, search
from toolkit.errors import ConfigError

STEPS = 6
# Every value field a population varies per trial, seeds included (trials 0 and 3 share one,
# so both the shared and the per-trial data paths of init are exercised through the seeds).
TRIALS = [
    {"optimizer.learning_rate": 3e-3, "optimizer.weight_decay": 0.1,
     "optimizer.warmup_steps": 2, "optimizer.min_lr_ratio": 0.1, "model.init_std": 0.02,
     "seed": 0},
    {"optimizer.learning_rate": 1e-2, "optimizer.weight_decay": 0.0,
     "optimizer.warmup_steps": 4, "optimizer.min_lr_ratio": 0.5, "model.init_std": 0.05,
     "seed": 1},
    {"optimizer.learning_rate": 1e-3, "optimizer.weight_decay": 0.3,
     "optimizer.warmup_steps": 0, "optimizer.min_lr_ratio": 0.0, "model.init_std": 0.01,
     "seed": 2},
    {"optimizer.learning_rate": 5e-3, "optimizer.weight_decay": 0.1,
     "optimizer.warmup_steps": 3, "optimizer.min_lr_ratio": 0.1, "model.init_std": 0.02,
     "seed": 0},
]


def _configs(trials=TRIALS, ici="fsdp:-1,tensor:2"):
  base = tiny_config("fsdp_tp", ici, steps=STEPS)
  return [search.apply(base, t) for t in trials]


@pytest.mark.slow  # a population and each of its trials trained alone, ~30 s
def test_population_equals_separate_runs():
  configs = _configs()
  pop = population.build(configs)
  # 8 devices: the trial axis split 4 ways, the model's tensor split on the remaining 2.
  assert dict(pop.mesh.shape) == {"population": 4, "fsdp": 1, "tensor": 2}
  assert pop.shardings["params"]["embed"].spec == P("population", "tensor", "fsdp")
  assert not pop.shared_data
  state = pop.init()
  losses = []
  for s in range(STEPS):
    state, metrics = pop.train_step(state, pop.hparams, pop.batch(s))
    losses.append(metrics["loss"])
  losses = np.asarray(jax.device_get(losses))  # (steps, trials)
  for t, config in enumerate(configs):
    # The reference: the trial trained alone, unsharded, on one device.
    config.mesh.ici, config.sharding.preset = "data:1", "dp"
    ref_losses, ref_params, _ = train_steps(config, jax.devices()[:1])
    np.testing.assert_allclose(losses[:, t], ref_losses, err_msg=f"trial {t}", **TOLERANCE)
    assert_trees_close(jax.device_get(pop.take(state, t)["params"]), ref_params, **TOLERANCE)
  # The trials really differ (else the check above would say little).
  assert len({round(float(l), 3) for l in losses[-1]}) == len(TRIALS)


def test_schedule_matches_the_single_run_schedule():
  from toolkit.training import step as step_lib  # pylint: disable=g-import-not-at-top
  for trial in TRIALS:
    config = _configs([trial])[0]
    for total in (STEPS, 1, 3):
      expected = step_lib.learning_rate_schedule(config.optimizer, total)
      hparams = {f: np.asarray(trial.get(f, 0)) for f in population.VALUE_FIELDS}
      actual = population.schedule_from(hparams, total)
      for count in range(total + 2):
        np.testing.assert_allclose(actual(np.int32(count)), expected(np.int32(count)),
                                   rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("field,value,why", [
    ("model.d_model", 64, "changes a shape"),
    ("data.global_batch_size", 32, "changes a shape"),
    ("train.steps", 8, "is not a per-trial value"),
])
def test_refuses_fields_that_are_not_values(field, value, why):
  configs = _configs([{}, {field: value}])
  with pytest.raises(ConfigError, match=rf"population mode: the trials differ in {field} .*{why}"
                                        r".*--mode=processes"):
    population.build(configs)


def test_refuses_a_model_other_than_the_language_model_and_auto_runs_processes():
  """A ViT's trials (model.kind='vit') are refused by name before anything is built, and a
  sweep's --mode=auto falls back to processes with the reason in one line."""
  base = vit.get_config("tiny")
  configs = [search.apply(base, {"optimizer.learning_rate": lr}) for lr in (1e-3, 3e-3)]
  with pytest.raises(ConfigError, match=r"population mode: model.kind='vit': a population trains "
                                        r"the language model .* --mode=processes"):
    population.build(configs)
  lines = []
  loaded = types.SimpleNamespace(configs=configs)
  assert runner.choose_mode(loaded, "auto", lines.append) == "processes"
  assert lines == ["processes mode: model.kind='vit': a population trains the language model "
                   "(model.kind='llama') only; run this sweep with --mode=processes"]
  with pytest.raises(ConfigError, match="model.kind='vit'"):
    runner.choose_mode(loaded, "population", lines.append)


def test_population_axis_size():
  assert population.population_axis_size(8, "fsdp:-1", 8) == 8
  assert population.population_axis_size(8, "fsdp:-1,tensor:2", 8) == 4
  assert population.population_axis_size(6, "fsdp:-1", 8) == 2
  for trials, ici in ((3, "fsdp:2"), (4, "fsdp:3")):  # 3 trials and 4 devices left: no fit
    with pytest.raises(ConfigError, match=f"mesh.ici={ici!r} does not fit on 8 devices"):
      population.population_axis_size(trials, ici, 8)
