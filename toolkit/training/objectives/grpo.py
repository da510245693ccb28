"""Group relative policy optimization's objective (Shao et al., 2024, DeepSeekMath) on fixed
rollouts: G completions of each prompt, each scored by a reward, each token's log-probability
under the trained model, the model that sampled it ("old") and the reference.

  group_advantages(rewards (prompts, G), scale) -> advantages (prompts, G)
  token_logps(logits, targets) -> each position's log-probability of its target
  policy_loss(logps, old_logps, ref_logps, advantages, weights, ...) -> (loss, metrics)

Advantages: each completion's reward minus its group's mean, divided by the group's standard
deviation (Bessel-corrected, as trl's `nanstd`) + 1e-4 (`scale="group"`), by the whole
batch's (`"batch"`), or not divided (`"none"`, Dr. GRPO).

The per-token loss (trl 1.16's GRPOTrainer, token-level importance sampling): with
r = exp(logp - old_logp) and A the completion's advantage,

  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)

the second term the k3 estimate of KL(pi || ref) (Schulman), its gradient unbiased at r = 1.
Only completion tokens count (`weights` 1 there, 0 on the prompt and padding), reduced over
the batch by `loss` (`LOSSES`):

  grpo     each completion's mean over its tokens, then the mean over completions
  bnpo     the mean over every completion token of the batch
  dr_grpo  the sum over every completion token / (completions x max_completion_tokens)
  dapo     as bnpo within one batch (trl normalizes by the tokens of the whole global batch,
           which is the same thing when one step sees one batch)

Metrics: the mean KL estimate and the share of tokens whose ratio was clipped (below, r <
1 - epsilon with A < 0; above, r > 1 + epsilon_high with A > 0), means over completion tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
STD_EPSILON = 1e-4  # added to the standard deviation the advantages are divided by (trl)


def check(beta: float, epsilon: float, epsilon_high: float, loss: str,
          scale: str = "group") -> None:
  """A ValueError naming the argument and its range for a value the objective cannot use."""
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is unknown; choose one of {', '.join(LOSSES)}")
  if scale not in SCALES:
    raise ValueError(f"scale_rewards={scale!r} is unknown; choose one of {', '.join(SCALES)}")
  if not beta >= 0:
    raise ValueError(f"beta={beta}: the KL penalty's weight must be >= 0 (0 is off; trl's "
                     f"default 0, DeepSeekMath's 0.04)")
  for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
    if not 0 < value < 1:
      raise ValueError(f"{name}={value}: the clip range must be in (0, 1) (PPO's usual 0.2)")


def group_advantages(rewards: jax.Array, scale: str = "group") -> jax.Array:
  """(prompts, G) rewards -> (prompts, G) advantages (module docstring), float32."""
  rewards = jnp.asarray(rewards, jnp.float32)
  centered = rewards - jnp.mean(rewards, axis=1, keepdims=True)
  if scale == "none":
    return centered
  axis = 1 if scale == "group" else None
  count = rewards.shape[1] if scale == "group" else rewards.size
  mean = jnp.mean(rewards, axis=axis, keepdims=True)
  std = jnp.sqrt(jnp.sum((rewards - mean) ** 2, axis=axis, keepdims=True)
                 / max(count - 1, 1))
  return centered / (std + STD_EPSILON)


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """(rows, length): log softmax(logits)[target] at each position, in float32."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def policy_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array,
                advantages: jax.Array, weights: jax.Array, *, beta: float = 0.0,
                epsilon: float = 0.2, epsilon_high: float | None = None, loss: str = "dapo",
                max_completion_tokens: int | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss of `loss`'s reduction (module docstring) and the metrics. logps, old_logps,
  ref_logps and weights are (rows, length), a row one completion (its prompt's positions
  weighted 0); advantages (rows,); `max_completion_tokens` (dr_grpo's denominator) defaults
  to the rows' length."""
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  check(beta, epsilon, epsilon_high, loss)
  weights = weights.astype(jnp.float32)
  advantages = advantages.astype(jnp.float32)[:, None]
  ratio = jnp.exp(logps - old_logps)
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
  per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
  log_ref_ratio = ref_logps - logps
  kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
  if beta:
    per_token = per_token + beta * kl
  tokens = jnp.maximum(jnp.sum(weights), 1.0)
  if loss == "grpo":
    per_row = jnp.sum(per_token * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
    value = jnp.mean(per_row)
  elif loss == "dr_grpo":
    length = max_completion_tokens or logps.shape[1]
    value = jnp.sum(per_token * weights) / (logps.shape[0] * length)
  else:  # bnpo, dapo
    value = jnp.sum(per_token * weights) / tokens
  token_mean = lambda x: jnp.sum(jax.lax.stop_gradient(x) * weights) / tokens
  low = ((ratio < 1.0 - epsilon) & (advantages < 0)).astype(jnp.float32)
  high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).astype(jnp.float32)
  return value, {"kl": token_mean(kl), "clip_ratio_low": token_mean(low),
                 "clip_ratio_high": token_mean(high)}
