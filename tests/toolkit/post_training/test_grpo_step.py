"""One GRPO step (toolkit/training/objectives/tasks.py `grpo_loss`) on rollouts sampled by the engine
(toolkit/post_training/rollouts.py `batch_of`): sharded over 8 devices it computes the loss and
update of one device (with and without LoRA) and of 2 micro-batches (the token mean); its
value is the float64 one of a ratio of 1 (one gradient step per rollout); the KL penalty's
reference is a LoRA model's base or a frozen copy of the starting weights, which is the float64
KL of the weights it started from and the same penalty as the base's."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from experiments import lm
from tests.tiny_runs import TOLERANCE, assert_trees_close
from toolkit import training
from toolkit.inference.sampling import SamplingParams
from toolkit.post_training import rollouts as rollouts_lib
from toolkit.training import state as state_lib, step as step_lib
from toolkit.training.objectives import tasks

GENERATIONS, MAX_TOKENS, SEQ_LEN = 4, 5, 12
PROMPTS = [np.array([5, 6, 7], np.int32), np.array([9, 2], np.int32),
           np.array([3, 1, 4, 1], np.int32), np.array([8], np.int32)]
# (loss, beta, LoRA rank, what the 8-device step is compared with): the token mean, whose
# micro-batches are combined by their tokens, and the mean of completion means with the KL
# penalty to a LoRA model's base.
ONE_DEVICE = dict(devices="one", ici="data:1,fsdp:1,tensor:1", preset="fsdp")
_SLOW = pytest.mark.slow  # ~15-20 s each on 2 cores; the default suite keeps the first
VARIANTS = [("dapo", 0.0, 0, ONE_DEVICE),
            pytest.param("dapo", 0.0, 0, dict(microbatches=2), marks=_SLOW),
            pytest.param("grpo", 0.04, 4, ONE_DEVICE, marks=_SLOW)]


def _config(rank: int, ici: str = "fsdp:4,tensor:2", preset: str = "fsdp_tp"):
  config = lm.get_config("tiny")
  config.mesh.ici, config.sharding.preset = ici, preset
  if rank:
    config.model.update(lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0)
  config.optimizer.warmup_steps = 0  # the first step moves the weights
  # Adam's first step moves a weight by lr * g / (|g| + eps): where a gradient nearly cancels
  # to below eps, the float32 differences of another reduction order are multiplied by up to
  # lr / eps. At eps = 1e-8 (3e5) one of 256 entries of lora_q's b came out 1.1e-6 apart on one
  # CI machine; at 1e-6 (3e3) one of wv's 1,024 entries did, 2.1e-6 apart, on an AMD EPYC
  # (Zen 5). At 1e-4 it is 30: the weights still move by up to lr, and what is compared is
  # the gradient with little amplification.
  config.optimizer.eps = 1e-4
  return config


def _reward(tokens) -> float:
  """A checkable rule: the share of even tokens in the completion."""
  return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


@functools.lru_cache(maxsize=None)
def _rollout_batch(loss: str, rank: int) -> dict:
  """The host batch of one rollout of the fresh model on 8 devices (sampled once)."""
  config = _config(rank)
  setup = training.build(config)
  params = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)["params"]
  rollouts = rollouts_lib.Rollouts(setup.spec.model, params, setup.spec.mesh, setup.spec.rules,
                                   SEQ_LEN + 4, SamplingParams(max_tokens=MAX_TOKENS,
                                                               temperature=1.0),
                                   GENERATIONS, batch_size=16)
  groups = rollouts(params, PROMPTS, seed=0, step=0)
  rewards = np.asarray([[_reward(r.tokens) for r in g.results] for g in groups])
  assert np.ptp(rewards, axis=1).max() > 0  # some group's completions score differently
  return rollouts_lib.batch_of(groups, rewards, SEQ_LEN, "group", loss)


def _step(loss: str, beta: float, rank: int, devices=None, microbatches: int = 1, **mesh):
  """(loss, params after the step, the step's metrics) of one GRPO step on the batch."""
  config = _config(rank, **mesh)
  setup = training.build(config, jax.devices()[:1] if devices == "one" else None)
  rules, mesh_ = setup.spec.rules, setup.spec.mesh
  grpo = functools.partial(tasks.grpo_loss, beta=beta, epsilon=0.2, epsilon_high=0.28,
                           loss=loss)
  step = step_lib.make_train_step(
      setup.layout.graphdef, setup.optimizer, step_lib.learning_rate_schedule(config.optimizer, 2),
      microbatches, rules, mesh_, loss=grpo)
  host = _rollout_batch(loss, rank)
  place = lambda x: jax.device_put(x, NamedSharding(mesh_, rules.activation_spec(
      ("batch",) + (None,) * (x.ndim - 1), mesh_)))
  batch = {key: place(value) for key, value in host.items()}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          batch)
  train, _ = step_lib.jit_step(step, setup.layout, abstract, mesh_)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
  before = jax.device_get(state["params"])
  state, metrics = train(state, batch)
  return host, before, jax.device_get(state["params"]), jax.device_get(metrics)


@functools.lru_cache(maxsize=None)
def _sharded(loss: str, beta: float, rank: int):
  return _step(loss, beta, rank)


@pytest.mark.parametrize("loss,beta,rank,other", VARIANTS)
def test_one_step_sharded_equals_micro_batches_and_one_device(loss, beta, rank, other):
  host, before, params, metrics = _sharded(loss, beta, rank)
  # A ratio of 1 and a KL of 0 at the start: the loss is minus the advantages' token mean
  # (dapo) or their mean over completions (grpo), in float64.
  weights = host["loss_weights" if loss == "dapo" else "completion_weights"].astype(np.float64)
  advantages = host["advantages"].astype(np.float64)
  want = (-(advantages * weights.sum(1)).sum() / weights.sum() if loss == "dapo"
          else -np.mean(advantages * (weights.sum(1) > 0)))
  np.testing.assert_allclose(metrics["loss"], want, **TOLERANCE)
  np.testing.assert_allclose(metrics["kl"], 0.0, atol=1e-6)
  assert metrics["grad_norm"] > 1e-4
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(params),
                                                          jax.tree.leaves(before)))
  assert moved > 1e-5
  _, _, other_params, other_metrics = _step(loss, beta, rank, **other)
  np.testing.assert_allclose(other_metrics["loss"], metrics["loss"], **TOLERANCE)
  assert_trees_close(other_params, params, **TOLERANCE)


def test_the_kl_penalty_needs_adapters_or_a_frozen_copy():
  with pytest.raises(ValueError, match="beta=0.04: the KL penalty's reference is a LoRA "
                                       "model's base or a frozen copy"):
    _step("dapo", 0.04, 0)


# --- the KL penalty's reference as a frozen copy of the starting weights (grpo.reference) ------

BETA = 0.04


def _two_steps(rank: int, frozen: bool, microbatches: int = 1):
  """The metrics of two GRPO steps (beta > 0) on the same rollouts, the starting and the
  trained parameters: the second step's policy has moved from the reference."""
  config = _config(rank)
  setup = training.build(config)
  rules, mesh = setup.spec.rules, setup.spec.mesh
  layout = state_lib.layout(setup.spec.model, setup.optimizer, rules, mesh, reference=frozen)
  step = step_lib.make_train_step(
      layout.graphdef, setup.optimizer, step_lib.learning_rate_schedule(config.optimizer, 2),
      microbatches, rules, mesh, loss=functools.partial(
          tasks.grpo_loss, beta=BETA, epsilon=0.2, epsilon_high=0.28, loss="dapo"),
      reference=tasks.grpo_reference)
  host = _rollout_batch("dapo", rank)
  place = lambda x: jax.device_put(x, NamedSharding(mesh, rules.activation_spec(
      ("batch",) + (None,) * (x.ndim - 1), mesh)))
  batch = {key: place(value) for key, value in host.items()}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          batch)
  train, _ = step_lib.jit_step(step, layout, abstract, mesh)
  state = state_lib.create(setup.spec.model, setup.optimizer, layout, 0)
  start = jax.device_get(state["params"])
  metrics = []
  for _ in range(2):
    state, m = train(state, batch)
    metrics.append(jax.device_get(m))
  if frozen:  # the copy is the starting weights, untouched by the steps
    assert_trees_close(jax.device_get(state["reference"]), start, rtol=0, atol=0)
  return metrics, start, jax.device_get(state["params"]), setup


def test_a_full_fine_tune_takes_the_kl_to_a_frozen_copy_of_its_start():
  """No adapters: the second step's KL is the float64 k3 estimate between the starting and the
  once-trained weights' log-probabilities of the completion tokens."""
  (first, second), start, _, setup = _two_steps(0, frozen=True, microbatches=2)
  np.testing.assert_allclose(first["kl"], 0.0, atol=1e-6)
  host = _rollout_batch("dapo", 0)
  once = _sharded("dapo", 0.0, 0)  # the same first step: the penalty's gradient is 0 at KL 0
  logps = jax.jit(tasks.token_logps, static_argnums=0)
  ref, new = (np.asarray(logps(setup.layout.graphdef, params, host), np.float64)
              for params in (start, once[2]))
  weights = host["loss_weights"].astype(np.float64)
  kl = np.exp(ref - new) - (ref - new) - 1
  want = (kl * weights).sum() / weights.sum()
  assert want > 20 * TOLERANCE["atol"]  # the policy moved: a KL the check can see
  np.testing.assert_allclose(second["kl"], want, **TOLERANCE)


@pytest.mark.slow  # ~20 s on 2 cores
def test_a_frozen_copy_penalizes_a_lora_model_as_its_base_does():
  base_metrics, _, base_params, _ = _two_steps(4, frozen=False)
  frozen_metrics, _, frozen_params, _ = _two_steps(4, frozen=True)
  assert base_metrics[1]["kl"] > 20 * TOLERANCE["atol"]
  for key in ("loss", "kl"):
    np.testing.assert_allclose([m[key] for m in frozen_metrics],
                               [m[key] for m in base_metrics], **TOLERANCE)
  assert_trees_close(frozen_params, base_params, **TOLERANCE)
