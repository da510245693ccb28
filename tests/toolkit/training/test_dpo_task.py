"""Preference tuning as a training task (data.source="preference", toolkit/training/objectives/tasks.py):
the reference is the base model without its adapters, bitwise, the starting weights'
precomputed log-probabilities, or a frozen copy of them in the train state (a LoRA run trains
the same with each; a full fine-tune the same with the last two); the step sharded and in
micro-batches equals one device's; a stopped run resumes exactly (the reference read back);
each setting it cannot run is one error naming its field."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import optax
import pytest

from experiments import dpo as dpo_experiment
from tests.tiny_runs import TOLERANCE, assert_trees_close, train_steps
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib, dpo_reference, state as state_lib
from toolkit.training.objectives import tasks
from toolkit.tuning import population, search

STEPS = 6


def _config(ici: str = "fsdp:4,tensor:2", preset: str = "fsdp_tp", microbatches: int = 1,
            reference: str = "auto", lora_rank: int = dpo_experiment.LORA_RANK):
  config = dpo_experiment.get_config("tiny")
  config.mesh.ici, config.sharding.preset = ici, preset
  config.train.update(steps=STEPS, microbatches=microbatches)
  config.dpo.reference, config.model.lora_rank = reference, lora_rank
  config.optimizer.warmup_steps = 1  # the adapters move from the first steps
  return config


@pytest.fixture(scope="module")
def sharded():
  return train_steps(_config())


def test_sharded_and_micro_batched_steps_equal_one_device(sharded):
  losses, params, _ = sharded
  assert losses[0] == pytest.approx(np.log(2), abs=1e-6)  # fresh adapters: h = 0 for each pair
  one_losses, one_params, _ = train_steps(_config("data:1,fsdp:1,tensor:1", "fsdp"),
                                          devices=jax.devices()[:1])
  micro_losses, micro_params, _ = train_steps(_config(microbatches=2))
  for other_losses, other_params in ((one_losses, one_params), (micro_losses, micro_params)):
    np.testing.assert_allclose(other_losses, losses, **TOLERANCE)
    assert_trees_close(other_params, params, **TOLERANCE)


def test_the_estimate_counts_the_rows_the_step_trains_on(sharded):
  """The analytic estimate and the compile report count a step's rows as its batches hold them:
  two a pair (toolkit.training.config.rows_per_step)."""
  _, _, setup = sharded
  shapes = {a.shape for a in setup.batches.abstract().values() if len(a.shape) == 3}
  assert len(shapes) == 1
  pairs, sides, _ = shapes.pop()
  config = _config()
  assert (pairs, sides) == (config.data.global_batch_size, 2)
  assert config_lib.rows_per_step(config, "dpo") == pairs * sides


def _without_adapters(tree):
  return {key: _without_adapters(value) if isinstance(value, dict) else value
          for key, value in tree.items() if not key.startswith("lora_")}


def test_the_reference_is_the_base_model_without_its_adapters_bitwise(sharded):
  _, params, setup = sharded
  batch = setup.batches.eval_batch(0)
  logps, tokens, reference = jax.jit(tasks._policy_and_reference, static_argnums=0)(  # pylint: disable=protected-access
      setup.layout.graphdef, params, batch)
  base_cfg = dataclasses.replace(setup.spec.model, lora_rank=0)
  base = state_lib.layout(base_cfg, optax.identity(), setup.spec.rules, setup.spec.mesh)
  expected, _ = jax.jit(tasks.completion_logps, static_argnums=0)(
      base.graphdef, _without_adapters(params), batch)
  np.testing.assert_array_equal(np.asarray(reference), np.asarray(expected))
  # The trained adapters moved the policy away from it; the counts are the completions'.
  assert np.abs(np.asarray(logps) - np.asarray(reference)).max() > 1e-3
  np.testing.assert_array_equal(tokens, np.asarray(batch["completion_weights"]).sum(-1))


def _train_losses(workdir) -> dict[int, float]:
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("field,value,words", [
    ("dpo.reference", "copy", "dpo.reference='copy' is unknown"),
    ("model.lora_dropout", 0.1, "model.lora_dropout=0.1: preference tuning trains without"),
    ("dpo.loss", "kto", "dpo.loss='kto' is unknown"),
    ("dpo.beta", 0.0, "dpo.beta=0.0 must be"),
    ("dpo.label_smoothing", 0.1, "dpo.label_smoothing=0.1 applies to loss='robust' only"),
    ("mesh.ici", "fsdp:4,sequence:2", "mesh.ici has sequence=2"),
    ("data.path", "", "data.source='preference' needs data.path"),
])
def test_a_setting_it_cannot_run_is_one_error_naming_the_field(field, value, words):
  config = _config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
    config_lib.resolve(config)


def test_the_base_as_reference_needs_adapters():
  with pytest.raises(ConfigError, match="dpo.reference='base' is a LoRA model's base .* or "
                                        "dpo.reference='precomputed' .* or 'frozen'"):
    config_lib.resolve(_config(reference="base", lora_rank=0))


# --- the reference as a frozen copy of the starting weights in the train state ----------------

@pytest.mark.slow  # ~6 s; the full fine-tune's tests below run the copy in the default suite
def test_a_frozen_copy_in_micro_batches_trains_a_lora_model_as_its_base_does(sharded):
  """The copy holds the starting adapters (B = 0), so it is the base; its log-probabilities
  are computed a micro-batch at a time and put back in the batch's row order."""
  losses, params, _ = sharded
  frozen_losses, frozen_params, setup = train_steps(_config(reference="frozen", microbatches=2))
  assert setup.layout.reference and not setup.batches.precomputed_reference
  np.testing.assert_allclose(frozen_losses, losses, **TOLERANCE)
  assert_trees_close(frozen_params, params, **TOLERANCE)


def test_a_full_fine_tune_against_a_frozen_copy_resumes_as_the_precomputed_one_trains(
    full, tmp_path, capsys):
  """Stopped at step 4 and resumed, the copy comes back from the checkpoint (not the restored
  weights, against which the loss would be log 2 again): the losses are the precomputed
  reference's; the log states the copy's memory."""
  losses, _, _ = full
  config = _config(reference="frozen", lora_rank=0)
  config.train.update(log_every=1, eval_every=STEPS, checkpoint_every=2, steps=4)
  config.optimizer.schedule_steps = STEPS
  training.run(config, str(tmp_path))
  config.train.steps = STEPS
  training.run(config, str(tmp_path))
  resumed = _train_losses(tmp_path)
  np.testing.assert_allclose([resumed[s] for s in range(1, STEPS + 1)], losses, **TOLERANCE)
  assert not os.path.exists(tmp_path / dpo_reference.FILE)
  line = (r"reference: a frozen copy of the starting weights in the train state "
          r"\(dpo.reference='frozen'\), [\d.]+ [KM]iB per device")
  assert re.search(line, capsys.readouterr().out)


# --- the reference precomputed from the starting weights (toolkit/training/dpo_reference.py) ---

def test_a_precomputed_reference_trains_a_lora_model_as_its_base_does(sharded):
  """The two references of a LoRA run (its base in each step; the starting weights once, the
  adapters' B = 0 then) agree, so the runs do."""
  losses, params, _ = sharded
  pre_losses, pre_params, setup = train_steps(_config(reference="precomputed"))
  assert setup.batches.precomputed_reference
  np.testing.assert_allclose(pre_losses, losses, **TOLERANCE)
  assert_trees_close(pre_params, params, **TOLERANCE)


@pytest.fixture(scope="module")
def full():
  """A full fine-tune (no adapters): dpo.reference "auto" precomputes."""
  return train_steps(_config(lora_rank=0))


def test_a_full_fine_tune_sharded_equals_one_device(full):
  losses, params, setup = full
  assert setup.batches.precomputed_reference and setup.spec.model.lora_rank == 0
  assert losses[0] == pytest.approx(np.log(2), abs=1e-5)  # the policy is the reference
  assert losses[-1] < losses[0] - 1e-3
  one_losses, one_params, _ = train_steps(_config("data:1,fsdp:1,tensor:1", "fsdp", lora_rank=0),
                                          devices=jax.devices()[:1])
  np.testing.assert_allclose(one_losses, losses, **TOLERANCE)
  assert_trees_close(one_params, params, **TOLERANCE)


def test_the_precomputed_reference_is_the_starting_weights_per_side(full):
  """Each pair's reference equals the starting model's completion log-probabilities of that
  pair alone (one pair a batch is another program: a tolerance, not bits)."""
  _, _, setup = full
  start = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)["params"]
  arrays = setup.batches.held_out.arrays
  one = jax.jit(tasks.completion_logps, static_argnums=0)
  for i in (0, len(setup.batches.held_out) - 1):
    batch = {key: arrays[key][i:i + 1] for key in arrays}
    logps, _ = one(setup.layout.graphdef, start, batch)
    np.testing.assert_allclose(setup.batches.reference["held_out"][i], np.asarray(logps)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_full_fine_tune_resumes_exactly_and_needs_its_reference_file(tmp_path):
  config = _config(lora_rank=0)
  config.train.update(log_every=1, eval_every=STEPS, checkpoint_every=2)
  config.optimizer.schedule_steps = STEPS
  straight = training.run(config, str(tmp_path / "straight"))
  config.train.steps = 4
  training.run(config, str(tmp_path / "stopped"))
  config.train.steps = STEPS
  resumed = training.run(config, str(tmp_path / "stopped"))
  assert _train_losses(tmp_path / "stopped") == _train_losses(tmp_path / "straight")
  assert resumed.eval_metrics[STEPS] == straight.eval_metrics[STEPS]
  assert set(straight.eval_metrics[STEPS]) >= {"loss", "preference_accuracy",
                                                "choice_accuracy", "reward_margin"}
  # Without the file the restored weights cannot stand in for the starting ones.
  os.remove(tmp_path / "stopped" / dpo_reference.FILE)
  config.train.steps = STEPS + 2
  with pytest.raises(ConfigError, match="dpo_reference.npz is missing: .* new --workdir"):
    training.run(config, str(tmp_path / "stopped"))


def test_a_checkpoint_without_the_copy_resumes_only_as_another_runs_start(tmp_path):
  """A run's own checkpoints keep the reference they were written with; another run's
  (train.resume_from) start a frozen-copy run whose reference is the weights restored."""
  config = _config(reference="precomputed", lora_rank=0)
  config.train.update(steps=2, checkpoint_every=2, eval_every=2)
  training.run(config, str(tmp_path / "first"))
  config.dpo.reference, config.train.steps = "frozen", 3
  with pytest.raises(ConfigError, match=r"step 2 holds no frozen reference copy and this "
                                        r"config's dpo settings keep one: .* resume with the "
                                        r"settings it was written with \(--config.dpo.reference="
                                        r"'precomputed'\)"):
    training.run(config, str(tmp_path / "first"))
  assert sorted(os.listdir(tmp_path / "first" / "checkpoints")) == ["2"]
  config.train.resume_from = str(tmp_path / "first")
  config.train.log_every = 1
  training.run(config, str(tmp_path / "second"))
  assert _train_losses(tmp_path / "second")[3] == pytest.approx(np.log(2), abs=1e-6)


def test_a_population_refuses_a_frozen_copy_per_trial():
  configs = [search.apply(_config(reference="frozen"), {"optimizer.learning_rate": lr})
             for lr in (1e-3, 3e-3)]
  with pytest.raises(ConfigError, match="population mode: dpo.reference holds a frozen copy"):
    population.build(configs)
