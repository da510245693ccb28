"""GRPO as a training task (data.source="prompts", toolkit/post_training/grpo_task.py): a run samples
its batches from the model it trains, on 8 devices as on one; a stopped run resumes with the
same rollouts and losses (a full fine-tune's KL reference, a frozen copy, restored with it);
the held-out evaluation is the greedy answers' mean reward; each setting it cannot run is one
error naming its field."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo as grpo_experiment
from experiments import lm as lm_experiment
from tests.tiny_runs import TOLERANCE
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.post_training import grpo_task
from toolkit.training import config as config_lib

STEPS = 4


def even_characters(completion: str, answer) -> float:
  """A reward a fresh tiny model's completions score differently on (so its groups have
  advantages): the share of the completion's first four characters whose code is even."""
  del answer
  return sum(ord(c) % 2 == 0 for c in completion[:4]) / 4


REWARD = f"{__file__}:even_characters"


def _config(ici: str = "fsdp:4,tensor:2", preset: str = "fsdp_tp"):
  config = grpo_experiment.get_config("tiny")
  config.mesh.ici, config.sharding.preset = ici, preset
  config.grpo.reward = REWARD
  config.train.update(steps=STEPS, log_every=1, eval_every=STEPS, checkpoint_every=2)
  config.optimizer.update(warmup_steps=0, schedule_steps=STEPS)
  return config


def _records(workdir) -> dict[int, dict]:
  lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r for r in lines if r["kind"] == "train"}


@pytest.mark.slow  # 27 s; the step's own sharded == one device is in make test (test_grpo_step.py)
def test_a_run_on_8_devices_trains_as_on_one(tmp_path):
  sharded = grpo_task.run(_config(), str(tmp_path / "sharded"))
  one = grpo_task.run(_config("data:1,fsdp:1,tensor:1", "fsdp"), str(tmp_path / "one"),
                 devices=jax.devices()[:1])
  a, b = _records(tmp_path / "sharded"), _records(tmp_path / "one")
  assert sorted(a) == list(range(1, STEPS + 1))
  for step in a:
    np.testing.assert_allclose(b[step]["loss"], a[step]["loss"], **TOLERANCE)
    assert b[step]["reward"] == a[step]["reward"]  # the same completions were sampled
  rewards = [a[s]["reward"] for s in a]
  assert 0 < max(rewards) and min(rewards) < 1  # groups that score differently
  for result in (sharded, one):
    assert set(result.eval_metrics[0]) == {"reward", "solved", "prompts"}
    assert result.eval_metrics[STEPS]["prompts"] == 256  # the task's held-out split
  assert sharded.eval_metrics[STEPS] == one.eval_metrics[STEPS]
  # The rollouts are the run's work: goodput counts them as productive, not as data wait.
  lines = [json.loads(line) for line in open(tmp_path / "sharded" / "metrics.jsonl")]
  record = next(r for r in lines if r["kind"] == "goodput")
  assert record["rollouts_seconds"] > record["data_wait_seconds"]
  assert record["productive_fraction"] == pytest.approx(
      (record["steps_seconds"] + record["rollouts_seconds"]) / record["wall_seconds"])
  assert all(0 < a[step]["rollout_fraction"] < 1 for step in a)


def test_the_state_to_sample_from_is_computed_before_observe_returns():
  """The loop observes a step's state right after dispatching it: the wait for its compute
  is the step's time, not the next rollout's (goodput and the rollouts' line split them)."""
  config = _config("data:1,fsdp:1,tensor:1", "fsdp")
  setup = training.build(config, devices=jax.devices()[:1])
  batches = grpo_task.batches_for(config, log=lambda line: None)(setup)
  slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda _, y: jnp.tanh(y @ y), x))
  params = {"w": slow(jnp.ones((512, 512)))}  # dispatched, ~0.5 s of compute to come
  batches.observe({"params": params})
  assert params["w"].is_ready()


def test_the_library_run_without_rollouts_is_one_error(tmp_path):
  with pytest.raises(ConfigError, match="samples its batches from the model being trained"):
    training.run(_config(), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "config.json")


@pytest.mark.parametrize("field,value,words", [
    ("grpo.reward", "", "grpo.reward is empty"),
    ("grpo.loss", "ppo", "grpo.loss='ppo' is unknown"),
    ("grpo.scale_rewards", "rank", "grpo.scale_rewards='rank' is unknown"),
    ("grpo.generations", 1, "grpo.generations=1 must be"),
    ("grpo.max_tokens", 32, "grpo.max_tokens=32 leaves no room"),
    ("grpo.top_p", 0.0, "grpo.top_p=0.0 must be"),
    ("grpo.epsilon_high", 1.5, "grpo.epsilon_high=1.5 must be"),
    ("data.path", "", "data.source='prompts' needs data.path"),
    ("mesh.ici", "fsdp:4,sequence:2", "mesh.ici has sequence=2: GRPO"),
])
def test_a_setting_it_cannot_run_is_one_error_naming_the_field(field, value, words):
  config = _config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
    config_lib.resolve(config)


@pytest.mark.parametrize("rank,beta,reference,words", [
    (0, 0.04, "base", "grpo.reference='base' is a LoRA model's base .* or "
                      "grpo.reference='frozen'"),
    (8, 0.0, "frozen", "grpo.reference='frozen' with grpo.beta=0: without the KL penalty"),
    (8, 0.04, "copy", "grpo.reference='copy' is unknown; choose one of auto, base, frozen"),
])
def test_a_kl_reference_it_cannot_read_is_one_error(rank, beta, reference, words):
  config = _config()
  config.model.lora_rank = rank
  config.grpo.update(beta=beta, reference=reference)
  with pytest.raises(ConfigError, match=words):
    config_lib.resolve(config)


@pytest.mark.slow  # 19 s; make test stays within its 10-minute budget (docs/testing.md)
def test_a_stopped_run_resumes_with_the_same_rollouts_and_its_frozen_copy(tmp_path, capsys):
  """A run stopped at step 2 resumes with the same rollouts, losses and KL estimates: without
  adapters the KL penalty's reference ("auto") is a frozen copy of the starting weights,
  checkpointed with the state, and the KL grows from 0 as the policy leaves its start."""
  config = _config()
  config.model.lora_rank, config.grpo.beta = 0, 0.04
  grpo_task.run(config, str(tmp_path / "straight"))
  assert "reference: a frozen copy of the starting weights" in capsys.readouterr().out
  config.train.steps = 2
  grpo_task.run(config, str(tmp_path / "stopped"))
  config.train.steps = STEPS
  grpo_task.run(config, str(tmp_path / "stopped"))
  straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "stopped")
  assert straight[1]["kl"] == pytest.approx(0.0, abs=1e-6) and straight[STEPS]["kl"] > 1e-4
  for step in straight:
    for key in ("loss", "reward", "kl"):
      assert resumed[step][key] == straight[step][key], (step, key)


@pytest.mark.parametrize("spec,words", [
    ("experiments.grpo", "name the reward function as 'module:function'"),
    ("experiments.nowhere:f", "cannot import experiments.nowhere"),
    ("experiments.grpo:nothing", "has no function 'nothing'"),
    ("/no/such/file.py:f", "is not a file"),
])
def test_a_reward_that_does_not_load_is_one_error(spec, words):
  with pytest.raises(ConfigError, match=words):
    grpo_task.load_reward(spec)


def test_the_pod_scale_variant_trains_adapters_on_prompts_times_generations_rows():
  """experiments/grpo.py:size=8b, what toolkit.compile reports (docs/post_training.md): the
  adapters, and a step of 8 prompts x 8 completions, which the analytic estimate counts as the
  compiled step does (PromptSource's shapes)."""
  config = grpo_experiment.get_config("size=8b")
  assert (config.model.lora_rank, config.data.seq_len, config.data.global_batch_size) == (
      grpo_experiment.LORA_RANK, 1024, 8)
  assert config_lib.rows_per_step(config, "grpo") == 8 * config.grpo.generations == 64
  assert config_lib.rows_per_step(config, "lm") == 8
  assert config_lib.rows_per_step(config, "dpo") == 16  # pairs: both sides in one pass


def test_the_batch_splits_by_completions_not_prompts():
  """GRPO's step trains on prompts x generations rows: 4 prompts x 4 completions split 8 ways
  (before, the check divided the 4 prompts and refused); rows that do not split are one error
  naming both fields."""
  config = _config("data:1,fsdp:2,expert:4", "fsdp_ep")
  assert config_lib.resolve(config).batch_ways == 8
  config.grpo.generations = 3  # 12 rows
  with pytest.raises(ConfigError, match=r"data.global_batch_size=4 x grpo.generations=3 = 12 "
                                        r"rows \(micro-batch 12\) is not divisible by the "
                                        r"batch-sharding axes data=1xfsdp=2xexpert=4 \(8 ways\)"):
    config_lib.resolve(config)


def _moe_config(ici: str):
  config = _config(ici, "fsdp_ep")
  rank = config.model.lora_rank
  lm_experiment.set_model(config, "moe_tiny")
  # LoRA adapts the attention projections; the experts' MLPs are not adapted.
  config.model.update(lora_rank=rank, lora_targets="q,k,v,o")
  return config


@pytest.mark.slow  # two runs of the tiny mixture of experts: ~40 s
def test_a_mixture_of_experts_run_over_the_expert_axis_trains_as_on_one_device(tmp_path):
  """GRPO on a mesh with experts split 4 ways (fsdp 2 x expert 4) samples the same
  completions as one device and trains to its losses."""
  grpo_task.run(_moe_config("data:1,fsdp:2,expert:4"), str(tmp_path / "experts"))
  grpo_task.run(_moe_config("data:1,fsdp:1,expert:1"), str(tmp_path / "one"),
           devices=jax.devices()[:1])
  a, b = _records(tmp_path / "experts"), _records(tmp_path / "one")
  assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == sorted(a)
  for step in a:
    assert a[step]["reward"] == b[step]["reward"]
    np.testing.assert_allclose(a[step]["loss"], b[step]["loss"], **TOLERANCE)
  assert max(a[s]["reward"] for s in a) > 0
  assert any(abs(a[s]["loss"]) > 1e-3 for s in a)  # a step with advantages to learn from
