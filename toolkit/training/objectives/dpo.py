"""Direct preference optimization's objective (Rafailov et al., 2023) and two of its variants,
from the log-probabilities of the completions under the trained model and the reference.

  completion_logps(logits, targets, weights) -> (log p(completion) per row, tokens per row)
  preference_loss(chosen, rejected, ref_chosen, ref_rejected, beta=..., loss=...)
      -> (mean loss over the pairs, metrics)

A pair is one prompt with a preferred (chosen) and a dispreferred (rejected) completion; each
side's log-probability is the sum of its completion tokens' log-probabilities (prompt tokens and
padding carry weight 0). With h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) -
log ref(rejected)), the per-pair losses (`LOSSES`) are the ones trl's DPOTrainer computes
(trl 1.16, `loss_type`; tests/toolkit/training/objectives/test_dpo.py compares them):

  sigmoid   -log sigmoid(beta h)                                    DPO
  hinge     max(0, 1 - beta h)                                      SLiC
  ipo       (h' - 1 / (2 beta))^2, h' the same difference with each side's log-ratio divided
            by its completion's token count                          IPO (Azar et al., 2023)
  robust    (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e), e the
            label_smoothing: the preference labels flipped with probability e  (rDPO)

Metrics, means over the pairs: the implicit rewards beta x log pi/ref of each side, their
margin, the preference accuracy (the chosen reward above the rejected one) and each side's
log-probability under the trained model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("sigmoid", "hinge", "ipo", "robust")


def check(beta: float, loss: str, label_smoothing: float) -> None:
  """A ValueError naming the argument and its range for a value the objective cannot use."""
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is unknown; choose one of {', '.join(LOSSES)}")
  if not beta > 0:
    raise ValueError(f"beta={beta}: the reward scale must be > 0 (DPO's usual 0.1)")
  if loss == "robust" and not 0.0 <= label_smoothing < 0.5:
    raise ValueError(f"label_smoothing={label_smoothing}: the robust loss needs a flip "
                     f"probability in [0, 0.5)")
  if loss != "robust" and label_smoothing:
    raise ValueError(f"label_smoothing={label_smoothing} applies to loss='robust' only; "
                     f"with loss={loss!r} set it to 0")


def completion_logps(logits: jax.Array, targets: jax.Array,
                     weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum over positions of weights x log softmax(logits)[target], sum of weights), per row.

  logits (rows, length, vocab), any float dtype (the log-softmax runs in float32); targets
  (rows, length) int, the token each position predicts; weights (rows, length), 1 on the
  completion's tokens and 0 elsewhere."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  token_logps = picked - jax.nn.logsumexp(logits, axis=-1)
  weights = weights.astype(jnp.float32)
  return jnp.sum(token_logps * weights, axis=-1), jnp.sum(weights, axis=-1)


def preference_loss(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array,
                    ref_rejected: jax.Array, *, beta: float, loss: str = "sigmoid",
                    label_smoothing: float = 0.0, chosen_tokens: jax.Array | None = None,
                    rejected_tokens: jax.Array | None = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The mean of `loss` over the pairs, and the metrics (module docstring). Each argument is
  (pairs,): the completions' log-probabilities under the trained model (chosen, rejected) and
  under the reference; `ipo` also needs each completion's token count."""
  check(beta, loss, label_smoothing)
  chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
  h = chosen_ratio - rejected_ratio
  if loss == "sigmoid":
    per_pair = -jax.nn.log_sigmoid(beta * h)
  elif loss == "hinge":
    per_pair = jax.nn.relu(1.0 - beta * h)
  elif loss == "ipo":
    if chosen_tokens is None or rejected_tokens is None:
      raise ValueError("loss='ipo' divides each log-ratio by its completion's token count: "
                       "pass chosen_tokens and rejected_tokens")
    h = (chosen_ratio / jnp.maximum(chosen_tokens, 1.0)
         - rejected_ratio / jnp.maximum(rejected_tokens, 1.0))
    per_pair = (h - 1.0 / (2.0 * beta)) ** 2
  else:  # robust
    e = label_smoothing
    per_pair = ((-(1.0 - e) * jax.nn.log_sigmoid(beta * h) + e * jax.nn.log_sigmoid(-beta * h))
                / (1.0 - 2.0 * e))
  chosen_reward = beta * jax.lax.stop_gradient(chosen_ratio)
  rejected_reward = beta * jax.lax.stop_gradient(rejected_ratio)
  metrics = {
      "reward_chosen": jnp.mean(chosen_reward),
      "reward_rejected": jnp.mean(rejected_reward),
      "reward_margin": jnp.mean(chosen_reward - rejected_reward),
      "preference_accuracy": jnp.mean((chosen_reward > rejected_reward).astype(jnp.float32)),
      "logps_chosen": jnp.mean(jax.lax.stop_gradient(chosen)),
      "logps_rejected": jnp.mean(jax.lax.stop_gradient(rejected)),
  }
  return jnp.mean(per_pair), metrics
