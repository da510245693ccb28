"""toolkit/training/objectives/grpo.py on fixed rollouts against two references: trl's own GRPOTrainer
loss (1.16) computed in float64 from the same per-token log-probabilities, its gradient by
torch's autograd, and a float64 NumPy computation of the group advantages."""
from __future__ import annotations

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import extras
from tests.tiny_runs import TOLERANCE
from toolkit.training.objectives import grpo

PROMPTS, GENERATIONS, PROMPT, COMPLETION, VOCAB = 3, 4, 3, 7, 11
ROWS = PROMPTS * GENERATIONS
# (loss, beta, epsilon, epsilon_high)
VARIANTS = [("grpo", 0.0, 0.2, 0.2), ("grpo", 0.04, 0.2, 0.28), ("bnpo", 0.04, 0.2, 0.2),
            ("dr_grpo", 0.04, 0.2, 0.2), ("dapo", 0.0, 0.2, 0.28), ("dapo", 0.1, 0.1, 0.3)]


def _rollouts(seed: int = 0):
  """Per-token log-probabilities of ROWS completions under the trained model, the model that
  sampled them (off by up to ~0.5 nats, so that ratios leave the clip range both ways) and the
  reference; their completion masks (1-COMPLETION tokens, then padding); the advantages."""
  rng = np.random.default_rng(seed)
  logps = -rng.exponential(1.0, (ROWS, COMPLETION))
  old = logps + rng.normal(0.0, 0.3, (ROWS, COMPLETION))
  ref = logps + rng.normal(0.0, 0.5, (ROWS, COMPLETION))
  lengths = rng.integers(1, COMPLETION + 1, ROWS)
  mask = (np.arange(COMPLETION)[None, :] < lengths[:, None]).astype(np.float64)
  rewards = rng.integers(0, 2, (PROMPTS, GENERATIONS)).astype(np.float64)
  rewards[0] = [1.0, 0.0, 0.0, 0.0]  # one group each way is enough to clip both ways
  advantages = _numpy_advantages(rewards, "group").reshape(ROWS)
  return logps, old, ref, mask, advantages


def _numpy_advantages(rewards, scale: str):
  """Rewards minus their group's mean, over the group's (or the batch's) standard deviation
  with Bessel's correction + 1e-4, in float64 (trl's GRPOTrainer with scale_rewards)."""
  centered = rewards - rewards.mean(axis=1, keepdims=True)
  if scale == "none":
    return centered
  std = rewards.std(axis=1, ddof=1, keepdims=True) if scale == "group" else rewards.std(ddof=1)
  return centered / (std + 1e-4)


def _trl_loss(logps, old, ref, mask, advantages, loss, beta, epsilon, epsilon_high):
  """trl's GRPOTrainer._compute_loss in eval mode (no accumulation), its model's per-token
  log-probabilities given directly; (loss, the gradient with respect to them, logged metrics)."""
  torch = extras.require("torch")
  trl = extras.require("trl")
  per_token = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
  accelerator = types.SimpleNamespace(
      gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
      num_processes=1, sync_gradients=True)
  trainer = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *_, **__: (
          per_token, torch.zeros(ROWS, COMPLETION, dtype=torch.float64), None),
      top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
      beta=beta, loss_type=loss, epsilon_low=epsilon, epsilon_high=epsilon_high,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
      use_vllm=False, model=types.SimpleNamespace(training=False),
      current_gradient_accumulation_steps=1, max_completion_length=COMPLETION,
      _entropy_bonus_enabled=False, aux_loss_enabled=False, accelerator=accelerator,
      _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
  completion_mask = torch.tensor(mask, dtype=torch.long)
  inputs = {"prompt_ids": torch.zeros(ROWS, PROMPT, dtype=torch.long),
            "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
            "completion_ids": torch.zeros(ROWS, COMPLETION, dtype=torch.long),
            "completion_mask": completion_mask,
            "advantages": torch.tensor(advantages, dtype=torch.float64),
            "old_per_token_logps": torch.tensor(old, dtype=torch.float64),
            "ref_per_token_logps": torch.tensor(ref, dtype=torch.float64),
            "num_items_in_batch": completion_mask.sum()}
  value = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
  value.backward()
  logged = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
  return float(value.detach()), per_token.grad.numpy(), logged


def _meshkit_loss(logps, old, ref, mask, advantages, loss, beta, epsilon, epsilon_high):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return grpo.policy_loss(logps, f32(old), f32(ref), f32(advantages), f32(mask), beta=beta,
                          epsilon=epsilon, epsilon_high=epsilon_high, loss=loss)


@pytest.mark.parametrize("loss,beta,epsilon,epsilon_high", VARIANTS)
def test_loss_gradient_and_metrics_equal_trl(loss, beta, epsilon, epsilon_high):
  rollouts = _rollouts()
  settings = (loss, beta, epsilon, epsilon_high)
  expected, expected_grad, logged = _trl_loss(*rollouts, *settings)
  f = lambda x: _meshkit_loss(x, *rollouts[1:], *settings)
  (value, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(
      jnp.asarray(rollouts[0], jnp.float32))
  np.testing.assert_allclose(value, expected, **TOLERANCE)
  np.testing.assert_allclose(grad, expected_grad, **TOLERANCE)
  mask = rollouts[3]
  assert np.all(np.asarray(grad)[mask == 0] == 0.0)  # prompt and padding get no gradient
  # Both clip regions hold tokens, so the min and the clip are exercised.
  assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0
  np.testing.assert_allclose(metrics["clip_ratio_low"], logged["clip_ratio/low_mean"], **TOLERANCE)
  np.testing.assert_allclose(metrics["clip_ratio_high"], logged["clip_ratio/high_mean"],
                             **TOLERANCE)
  if beta:
    np.testing.assert_allclose(metrics["kl"], logged["kl"], **TOLERANCE)


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_group_advantages_equal_a_float64_reference(scale):
  rewards = np.random.default_rng(3).normal(0.0, 1.0, (PROMPTS, GENERATIONS))
  rewards[1] = 0.5  # a group whose completions all score alike gets advantage 0
  got = np.asarray(grpo.group_advantages(jnp.asarray(rewards, jnp.float32), scale))
  want = _numpy_advantages(rewards, scale)
  np.testing.assert_allclose(got, want, **TOLERANCE)
  np.testing.assert_array_equal(got[1], 0.0)


def test_token_logps_are_the_log_softmax_of_each_target():
  rng = np.random.default_rng(4)
  logits, targets = rng.normal(0.0, 2.0, (2, 5, VOCAB)), rng.integers(0, VOCAB, (2, 5))
  shifted = logits - logits.max(-1, keepdims=True)
  log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  want = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
  got = grpo.token_logps(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
  np.testing.assert_allclose(got, want, **TOLERANCE)


def test_settings_out_of_range_are_refused_by_name():
  for kwargs, words in [(dict(loss="ppo"), "loss='ppo' is unknown"),
                        (dict(scale="rank"), "scale_rewards='rank' is unknown"),
                        (dict(beta=-0.1), "beta=-0.1"), (dict(epsilon=0.0), "epsilon=0.0"),
                        (dict(epsilon_high=1.5), "epsilon_high=1.5")]:
    settings = {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2, "loss": "dapo",
                "scale": "group", **kwargs}
    with pytest.raises(ValueError, match=words):
      grpo.check(**settings)
