"""toolkit/training/objectives/dpo.py against two references: a float64 NumPy computation of the
same objectives (values, and gradients with respect to the logits by central differences), and
trl's own DPOTrainer loss computed from the same per-token log-probabilities."""
from __future__ import annotations

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import extras
from tests.tiny_runs import TOLERANCE
from toolkit.training.objectives import dpo

PAIRS, LENGTH, VOCAB = 4, 10, 13
# Each variant's settings: (loss, beta, label_smoothing).
VARIANTS = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("hinge", 0.5, 0.0),
            ("ipo", 0.1, 0.0), ("ipo", 0.5, 0.0), ("robust", 0.1, 0.2)]


def _batch(seed: int = 0):
  """Logits of the chosen rows then the rejected rows (2 x PAIRS, LENGTH, VOCAB), their targets
  and completion weights (a prompt of 2-4 tokens, then the completion, then 0-3 of padding),
  and the reference's log-probabilities of each side."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0.0, 2.0, (2 * PAIRS, LENGTH, VOCAB))
  targets = rng.integers(0, VOCAB, (2 * PAIRS, LENGTH))
  weights = np.zeros((2 * PAIRS, LENGTH))
  for row in range(2 * PAIRS):
    start, pad = rng.integers(2, 5), rng.integers(0, 4)
    weights[row, start:LENGTH - pad] = 1.0
  # The reference a little off the model on each side, so that some pairs are ranked right.
  logps = (_token_logps(logits, targets) * weights).sum(-1)
  ref = logps.reshape(2, PAIRS) + rng.normal(0.0, 2.0, (2, PAIRS))
  return logits, targets, weights, ref


def _token_logps(logits, targets):
  """log softmax(logits)[target] per position, float64."""
  shifted = logits - logits.max(-1, keepdims=True)
  log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]


def _reference_loss(logits, targets, weights, ref, loss: str, beta: float, smoothing: float):
  """The objective in float64 NumPy, written from the papers (module docstring of dpo.py)."""
  logps, tokens = (_token_logps(logits, targets) * weights).sum(-1), weights.sum(-1)
  chosen_ratio, rejected_ratio = logps[:PAIRS] - ref[0], logps[PAIRS:] - ref[1]
  h = chosen_ratio - rejected_ratio
  log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
  if loss == "sigmoid":
    per_pair = -log_sigmoid(beta * h)
  elif loss == "hinge":
    per_pair = np.maximum(0.0, 1.0 - beta * h)
  elif loss == "ipo":
    per_pair = (chosen_ratio / tokens[:PAIRS] - rejected_ratio / tokens[PAIRS:]
                - 1.0 / (2.0 * beta)) ** 2
  else:
    per_pair = ((-(1 - smoothing) * log_sigmoid(beta * h) + smoothing * log_sigmoid(-beta * h))
                / (1 - 2 * smoothing))
  metrics = {"reward_chosen": beta * chosen_ratio.mean(),
             "reward_rejected": beta * rejected_ratio.mean(),
             "reward_margin": beta * h.mean(),
             "preference_accuracy": (chosen_ratio > rejected_ratio).mean(),
             "logps_chosen": logps[:PAIRS].mean(), "logps_rejected": logps[PAIRS:].mean()}
  return per_pair.mean(), metrics


def _meshkit_loss(logits, targets, weights, ref, loss: str, beta: float, smoothing: float):
  logps, tokens = dpo.completion_logps(logits, targets, weights)
  return dpo.preference_loss(logps[:PAIRS], logps[PAIRS:], ref[0], ref[1], beta=beta, loss=loss,
                             label_smoothing=smoothing, chosen_tokens=tokens[:PAIRS],
                             rejected_tokens=tokens[PAIRS:])


@pytest.mark.parametrize("loss,beta,smoothing", VARIANTS)
def test_loss_metrics_and_gradient_equal_a_float64_reference(loss, beta, smoothing):
  logits, targets, weights, ref = _batch()
  f = lambda x: _meshkit_loss(x, jnp.asarray(targets), jnp.asarray(weights, jnp.float32),
                              jnp.asarray(ref, jnp.float32), loss, beta, smoothing)
  (value, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(
      jnp.asarray(logits, jnp.float32))
  expected, expected_metrics = _reference_loss(logits, targets, weights, ref, loss, beta,
                                               smoothing)
  np.testing.assert_allclose(value, expected, **TOLERANCE)
  assert 0 < expected_metrics["preference_accuracy"] < 1  # pairs ranked both ways
  assert set(metrics) == set(expected_metrics)
  for name, want in expected_metrics.items():
    np.testing.assert_allclose(metrics[name], want, **TOLERANCE, err_msg=name)
  # Central differences of the float64 objective, entry by entry.
  eps, numeric = 1e-6, np.zeros_like(logits)
  for index in np.ndindex(logits.shape):
    up, down = logits.copy(), logits.copy()
    up[index] += eps
    down[index] -= eps
    numeric[index] = (_reference_loss(up, targets, weights, ref, loss, beta, smoothing)[0]
                      - _reference_loss(down, targets, weights, ref, loss, beta, smoothing)[0]
                      ) / (2 * eps)
  np.testing.assert_allclose(grad, numeric, **TOLERANCE)
  # Prompt and padding positions get no gradient; the completion's do.
  assert np.all(np.asarray(grad)[weights == 0] == 0.0)
  assert np.abs(np.asarray(grad)[weights == 1]).max() > 1e-3


def _trl_loss(token_logps, completion_mask, ref, loss: str, beta: float, smoothing: float):
  """trl's DPOTrainer._compute_loss on per-token log-probabilities given directly: a stand-in
  model returns them (zero where the mask is, as trl's fused head does for labels of -100),
  the reference's come precomputed, and the trainer's state is the attributes the loss reads."""
  torch = extras.require("torch")
  trl = extras.require("trl")
  log_probs = torch.tensor(token_logps * completion_mask[:, 1:], dtype=torch.float64)
  rows, length = completion_mask.shape
  outputs = types.SimpleNamespace(
      log_probs=log_probs, entropy=torch.zeros(rows, length - 1, dtype=torch.float64),
      mean_logits=torch.zeros(rows, length - 1, dtype=torch.float64),
      is_top1=torch.zeros(rows, length - 1, dtype=torch.bool))
  accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x,
                                      gather_for_metrics=lambda x: x)
  trainer = types.SimpleNamespace(
      model=types.SimpleNamespace(training=True), accelerator=accelerator,
      aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
      f_divergence_type="reverse_kl", loss_types=[loss], loss_weights=[1.0], beta=beta,
      label_smoothing=smoothing, use_weighting=False, _tp_size=1, _total_train_tokens=0,
      _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
  inputs = {"input_ids": torch.zeros(rows, length, dtype=torch.long),
            "attention_mask": torch.ones(rows, length, dtype=torch.long),
            "completion_mask": torch.tensor(completion_mask, dtype=torch.long),
            "ref_chosen_logps": torch.tensor(ref[0], dtype=torch.float64),
            "ref_rejected_logps": torch.tensor(ref[1], dtype=torch.float64)}
  value = trl.DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
  logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
  return float(value), {"reward_chosen": logged["rewards/chosen"],
                        "reward_rejected": logged["rewards/rejected"],
                        "reward_margin": logged["rewards/margins"],
                        "preference_accuracy": logged["rewards/accuracies"],
                        "logps_chosen": logged["logps/chosen"],
                        "logps_rejected": logged["logps/rejected"]}


@pytest.mark.parametrize("loss,beta,smoothing", VARIANTS)
def test_loss_and_metrics_equal_trl(loss, beta, smoothing):
  """trl's inputs: token t's log-probability predicts input t + 1, the completion mask marks
  input tokens; ours: logits at t with target t + 1, weights on the targets."""
  logits, targets, weights, ref = _batch(seed=1)
  completion_mask = np.concatenate([np.zeros((2 * PAIRS, 1)), weights], axis=1)[:, :LENGTH]
  weights = completion_mask[:, 1:]  # the targets of positions 0 .. LENGTH-2
  logits, targets = logits[:, :LENGTH - 1], targets[:, :LENGTH - 1]
  expected, expected_metrics = _trl_loss(_token_logps(logits, targets), completion_mask, ref,
                                         loss, beta, smoothing)
  assert 0 < expected_metrics["preference_accuracy"] < 1  # pairs ranked both ways
  value, metrics = _meshkit_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                                 jnp.asarray(weights, jnp.float32),
                                 jnp.asarray(ref, jnp.float32), loss, beta, smoothing)
  np.testing.assert_allclose(value, expected, **TOLERANCE)
  for name, want in expected_metrics.items():
    np.testing.assert_allclose(metrics[name], want, **TOLERANCE, err_msg=name)


def test_settings_out_of_range_are_refused_by_name():
  chosen = rejected = jnp.zeros(2)
  for kwargs, words in [(dict(beta=0.0), "beta=0.0"), (dict(beta=0.1, loss="kto"), "loss='kto'"),
                        (dict(beta=0.1, loss="robust", label_smoothing=0.5),
                         "label_smoothing=0.5"),
                        (dict(beta=0.1, label_smoothing=0.1), "loss='robust' only"),
                        (dict(beta=0.1, loss="ipo"), "chosen_tokens")]:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
      dpo.preference_loss(chosen, rejected, chosen, rejected, **kwargs)
