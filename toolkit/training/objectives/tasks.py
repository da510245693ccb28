"""What a model is trained to do: its loss, its eval metrics, and how they are summarized.

A task is composed into the step (`toolkit.training.step.make_train_step(loss=..., evaluate=...)`)
rather than branched on inside it. `for_run` gives the task of a model family (`TASKS`) with
its training loss as configured:

  lm              next-token cross-entropy (plus a mixture of experts' router losses, reported
                  with its router statistics); batch {"inputs", "targets"} (batch, length) int32,
                  rows of packed documents also "segment_ids", "positions" and "loss_weights"
                  (toolkit.training.step), the loss then their weighted mean
  classification  softmax cross-entropy over classes; batch {"images" (batch, H, W, C) float32,
                  "labels" (batch,) int32}, eval batches also "weights" (batch,) float32,
                  1 for a real example and 0 for padding; trained against label-smoothed
                  targets when `train.label_smoothing` > 0 (`for_run`), evaluated against the
                  labels themselves
  dpo             direct preference optimization (toolkit/training/objectives/dpo.py, the `dpo` config
                  section) against a reference model (a LoRA model's base, the starting
                  weights' precomputed log-probabilities, or a frozen copy); batch {"inputs", "targets"
                  int32, "completion_weights" float32} (pairs, 2, length), side 0 chosen and
                  side 1 rejected (toolkit/data/preference.py); evaluated as the held-out
                  pairs' loss, preference accuracy and reward margin
  grpo            group relative policy optimization (toolkit/training/objectives/grpo.py, the `grpo`
                  config section) on completions sampled from the model being trained
                  (toolkit/post_training/grpo_task.py); batch {"inputs", "targets", the completion
                  mask, "advantages", "rewards"} (`grpo_loss`); evaluated as the held-out
                  prompts' mean reward, answered greedily
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import lora
from toolkit.data import keys
from toolkit.training.objectives import dpo, grpo
from toolkit.training.objectives.click_metrics import ClickMetrics
from toolkit.training.step import cross_entropy_loss, lm_loss

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  unit: str  # what throughput counts in the progress line: "tok" (tokens) or "img" (images)
  loss: Callable[[nnx.GraphDef, object, Batch], tuple[jax.Array, dict]]  # (mean loss, metrics)
  evaluate: Callable[[nnx.GraphDef, object, Batch], dict]         # per-batch sums
  summarize: Callable[[Sequence[dict]], dict]                      # -> {"loss": ..., ...}
  # What the task reads from a frozen copy of the starting weights, as batch entries, when the
  # state holds one (toolkit.training.step `with_reference`; `frozen_reference`).
  reference: Callable[[nnx.GraphDef, object, Batch], dict] | None = None


# --- next-token prediction --------------------------------------------------------------------

def lm_eval(graphdef: nnx.GraphDef, params, batch: Batch) -> dict:
  """The batch's mean cross-entropy; with "loss_weights" its weighted mean and the weights'
  sum ("weight"), so that the summary weighs each batch by the tokens it counts."""
  loss = cross_entropy_loss(graphdef, params, batch)
  if "loss_weights" not in batch:
    return {"loss": loss}
  return {"loss": loss, "weight": jnp.sum(batch["loss_weights"], dtype=jnp.float32)}


def lm_summary(results: Sequence[dict]) -> dict:
  """The mean loss over the eval batches: over every token alike (batches without weights
  hold the same number of tokens), or weighted by each batch's "weight"."""
  if results and "weight" in results[0]:
    weights = np.asarray([float(r["weight"]) for r in results])
    losses = np.asarray([float(r["loss"]) for r in results])
    loss = float(np.sum(losses * weights) / max(float(np.sum(weights)), 1e-30))
  else:
    loss = float(np.mean([r["loss"] for r in results]))
  return {"loss": loss, "bits_per_byte": loss / math.log(2)}


LM = Task(name="lm", unit="tok", loss=lm_loss, evaluate=lm_eval,
          summarize=lm_summary)


# --- classification ---------------------------------------------------------------------------

def classification_loss(graphdef: nnx.GraphDef, params, batch: Batch,
                        label_smoothing: float = 0.0) -> tuple[jax.Array, dict]:
  """Mean softmax cross-entropy (nats) of batch["labels"] given batch["images"] and no metrics;
  with `label_smoothing` s, against the targets (1 - s) * one_hot(label) + s / classes."""
  logits = nnx.merge(graphdef, params)(batch["images"])
  if not label_smoothing:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])), {}
  targets = optax.smooth_labels(jax.nn.one_hot(batch["labels"], logits.shape[-1]),
                                label_smoothing)
  return jnp.mean(optax.softmax_cross_entropy(logits, targets)), {}


def classification_eval(graphdef: nnx.GraphDef, params, batch: Batch) -> dict:
  """Sums over the real (weight 1) rows, plus each row's prediction for a confusion matrix."""
  logits = nnx.merge(graphdef, params)(batch["images"])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  weights = batch["weights"]
  predictions = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return {"loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights),
          "correct": jnp.sum((predictions == batch["labels"]) * weights),
          "predictions": predictions, "labels": batch["labels"], "weights": weights}


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
  """(num_classes, num_classes) counts: row = true class, column = predicted class."""
  matrix = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(matrix, (labels, predictions), 1)
  return matrix


def classification_summary(results: Sequence[dict]) -> dict:
  count = float(sum(float(r["count"]) for r in results))
  real = np.concatenate([np.asarray(r["weights"]) > 0 for r in results])
  labels = np.concatenate([np.asarray(r["labels"]) for r in results])[real]
  predictions = np.concatenate([np.asarray(r["predictions"]) for r in results])[real]
  return {"loss": float(sum(float(r["loss_sum"]) for r in results)) / count,
          "accuracy": float(sum(float(r["correct"]) for r in results)) / count,
          "examples": count, "labels": labels, "predictions": predictions}


CLASSIFICATION = Task(name="classification", unit="img", loss=classification_loss,
                      evaluate=classification_eval, summarize=classification_summary)

# --- click prediction (recommendation models) --------------------------------------------------

def _click_logits(graphdef: nnx.GraphDef, params, batch: Batch) -> jax.Array:
  return nnx.merge(graphdef, params)(batch["dense"], batch["ids"], batch["lengths"])


def click_loss(graphdef: nnx.GraphDef, params, batch: Batch) -> tuple[jax.Array, dict]:
  """Binary cross-entropy of the click logits, over the real (weight 1) rows."""
  logits = _click_logits(graphdef, params, batch)
  losses = optax.sigmoid_binary_cross_entropy(logits, batch["labels"])
  weights = batch["weights"]
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0), {}


def click_eval(graphdef: nnx.GraphDef, params, batch: Batch) -> dict:
  """The batch's loss sum and its rows' logits and labels, for the AUC over the whole set."""
  logits = _click_logits(graphdef, params, batch)
  losses = optax.sigmoid_binary_cross_entropy(logits, batch["labels"])
  return {"loss_sum": jnp.sum(losses * batch["weights"]), "count": jnp.sum(batch["weights"]),
          "logits": logits, "labels": batch["labels"], "weights": batch["weights"]}


def click_summary(results: Sequence[dict]) -> dict:
  """Log loss and ROC AUC over every real held-out row (click_metrics.ClickMetrics)."""
  metrics = ClickMetrics()
  for r in results:
    real = np.asarray(r["weights"]) > 0
    metrics.add(np.asarray(r["labels"])[real], np.asarray(r["logits"])[real])
  return {"loss": metrics.log_loss(), "auc": metrics.auc(), "examples": float(metrics.count)}


CLICK = Task(name="click", unit="ex", loss=click_loss, evaluate=click_eval,
             summarize=click_summary)

# --- preference tuning (DPO) ------------------------------------------------------------------

def completion_logps(graphdef: nnx.GraphDef, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Each side's completion log-probability and token count, (pairs, 2) each, from a batch of
  toolkit/data/preference.py's (pairs, 2, length) rows, both sides in one forward pass."""
  pairs, sides, length = batch["inputs"].shape
  rows = lambda x: x.reshape(pairs * sides, length)
  logits = nnx.merge(graphdef, params)(rows(batch["inputs"]))
  logps, tokens = dpo.completion_logps(logits, rows(batch["targets"]),
                                       rows(batch["completion_weights"]))
  return logps.reshape(pairs, sides), tokens.reshape(pairs, sides)


def preference_reference(graphdef: nnx.GraphDef, params, batch: Batch) -> dict:
  """A frozen reference copy's entry of a DPO batch (dpo.reference="frozen"): each side's
  completion log-probability under `params`, (pairs, 2). No dropout."""
  with lora.no_dropout():
    return {keys.REFERENCE_LOGPS: completion_logps(graphdef, params, batch)[0]}


def _policy_and_reference(graphdef: nnx.GraphDef, params, batch: Batch):
  """(log-probabilities, token counts, the reference's log-probabilities), (pairs, 2) each.
  The reference is the batch's log-probabilities of the starting weights (keys.REFERENCE_LOGPS:
  precomputed with the data, dpo.reference="precomputed", or in the step from a frozen copy,
  "frozen"), else the same weights with the LoRA adapters off (`lora.base_only`, "base"). No
  dropout."""
  with lora.no_dropout():
    logps, tokens = completion_logps(graphdef, params, batch)
  if keys.REFERENCE_LOGPS in batch:
    return logps, tokens, batch[keys.REFERENCE_LOGPS]
  with lora.base_only():
    reference, _ = completion_logps(graphdef, jax.lax.stop_gradient(params), batch)
  return logps, tokens, reference


def _objective(logps, tokens, reference, **settings):
  return dpo.preference_loss(logps[:, 0], logps[:, 1], reference[:, 0], reference[:, 1],
                             chosen_tokens=tokens[:, 0], rejected_tokens=tokens[:, 1],
                             **settings)


def preference_loss(graphdef: nnx.GraphDef, params, batch: Batch, *, beta: float, loss: str,
                    label_smoothing: float) -> tuple[jax.Array, dict]:
  """DPO's objective (toolkit/training/objectives/dpo.py) against the reference (`_policy_and_reference`)."""
  return _objective(*_policy_and_reference(graphdef, params, batch), beta=beta, loss=loss,
                    label_smoothing=label_smoothing)


def preference_eval(graphdef: nnx.GraphDef, params, batch: Batch, **settings) -> dict:
  """Per-batch sums over the held-out pairs: the loss, the pairs the implicit rewards rank
  right (trl's rewards/accuracies; 0 before training, when every reward is 0), the pairs whose
  chosen completion the model itself finds likelier, and the reward margin."""
  logps, tokens, reference = _policy_and_reference(graphdef, params, batch)
  loss, metrics = _objective(logps, tokens, reference, **settings)
  pairs = jnp.asarray(batch["inputs"].shape[0], jnp.float32)
  return {"loss_sum": loss * pairs, "pairs": pairs,
          "correct": metrics["preference_accuracy"] * pairs,
          "chosen_likelier": jnp.sum((logps[:, 0] > logps[:, 1]).astype(jnp.float32)),
          "margin_sum": metrics["reward_margin"] * pairs}


def preference_summary(results: Sequence[dict]) -> dict:
  total = lambda key: float(sum(float(r[key]) for r in results))
  pairs = total("pairs")
  return {"loss": total("loss_sum") / pairs, "preference_accuracy": total("correct") / pairs,
          "choice_accuracy": total("chosen_likelier") / pairs,
          "reward_margin": total("margin_sum") / pairs, "pairs": pairs}


# --- reinforcement learning (GRPO) on fixed rollouts ------------------------------------------
# The batch of a GRPO step (toolkit/post_training/rollouts.py `batch_of`, shapes in
# toolkit/data/prompts.py PromptSource): each row one completion after its prompt, (rows,
# length) "inputs" and "targets" int32 and the completion mask (`keys.mask_key`: micro-batches
# of the token means are combined by their tokens); "advantages" (rows,) float32, and
# "rewards" when the loop samples them (their mean is a metric).


def grpo_loss(graphdef: nnx.GraphDef, params, batch: Batch, *, beta: float, epsilon: float,
              epsilon_high: float, loss: str) -> tuple[jax.Array, dict]:
  """GRPO's clipped policy loss (toolkit/training/objectives/grpo.py) of one gradient step per rollout:
  the sampling model is the one being trained, so each ratio is 1 in value and carries the
  gradient; with `beta` > 0 the KL penalty is to the reference: the batch's log-probabilities
  of a frozen copy of the starting weights (keys.REFERENCE_TOKEN_LOGPS, put there by the
  step: `grpo_reference`), else a LoRA model's base. No dropout."""
  weights = batch[keys.mask_key(loss)]
  with lora.no_dropout():
    logps = token_logps(graphdef, params, batch)
  reference = logps
  if keys.REFERENCE_TOKEN_LOGPS in batch:
    reference = batch[keys.REFERENCE_TOKEN_LOGPS]
  elif beta:
    if not _has_adapters(params):
      raise ValueError(f"beta={beta}: the KL penalty's reference is a LoRA model's base or a "
                       f"frozen copy, and this model has no adapters and the batch no "
                       f"reference; set beta=0, model.lora_rank or grpo.reference='frozen'")
    with lora.base_only():
      reference = token_logps(graphdef, jax.lax.stop_gradient(params), batch)
  value, metrics = grpo.policy_loss(
      logps, jax.lax.stop_gradient(logps), jax.lax.stop_gradient(reference), batch["advantages"],
      weights, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, loss=loss)
  if "rewards" in batch:
    metrics["reward"] = jnp.mean(batch["rewards"])
  metrics["completion_tokens"] = jnp.sum(weights) / weights.shape[0]
  return value, metrics


def grpo_reference(graphdef: nnx.GraphDef, params, batch: Batch) -> dict:
  """A frozen reference copy's entry of a GRPO batch (grpo.reference="frozen"): each
  position's log-probability of its target under `params`, (rows, length). No dropout."""
  with lora.no_dropout():
    return {keys.REFERENCE_TOKEN_LOGPS: token_logps(graphdef, params, batch)}


def _has_adapters(params) -> bool:
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  return any("lora_" in jax.tree_util.keystr(path) for path, _ in paths)


def token_logps(graphdef: nnx.GraphDef, params, batch: Batch) -> jax.Array:
  """(rows, length): each position's log-probability of its target under the model."""
  return grpo.token_logps(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])


def grpo_eval(graphdef: nnx.GraphDef, params, batch: Batch, **settings) -> dict:
  """A GRPO batch's loss: what the compiled eval step computes. The run's evaluation is the
  held-out prompts' rewards, from the engine (toolkit/post_training/grpo_task.py `evaluate`)."""
  return {"loss": grpo_loss(graphdef, params, batch, **settings)[0]}


def grpo_summary(results: Sequence[dict]) -> dict:
  return {"loss": float(np.mean([float(r["loss"]) for r in results]))}


TASKS = {"lm": LM, "classification": CLASSIFICATION, "click": CLICK,
         "dpo": Task(name="dpo", unit="tok", loss=preference_loss, evaluate=preference_eval,
                     summarize=preference_summary, reference=preference_reference),
         "grpo": Task(name="grpo", unit="tok", loss=grpo_loss, evaluate=grpo_eval,
                      summarize=grpo_summary, reference=grpo_reference)}
GRPO_SETTINGS = ("beta", "epsilon", "epsilon_high", "loss")
# Where a post-training task's reference model comes from (the dpo and grpo sections'
# `reference`): "base" (a LoRA model's adapters off), "frozen" (a copy of the starting weights
# in the train state), "precomputed" (DPO only: toolkit/training/dpo_reference.py) or "auto".
REFERENCES = {"dpo": ("auto", "base", "frozen", "precomputed"), "grpo": ("auto", "base", "frozen")}


def frozen_reference(task: str, config) -> bool:
  """Whether the train state holds a frozen copy of the starting weights as the reference of
  `task` (the run's config): its section's reference="frozen", or GRPO's "auto" with a KL
  penalty (beta > 0) and no LoRA adapters whose base could serve."""
  if task not in REFERENCES:
    return False
  settings = config[task]
  reference = settings.get("reference", "auto")
  if task == "grpo" and reference == "auto":
    return bool(settings.get("beta", 0.0)) and not config.model.get("lora_rank", 0)
  return reference == "frozen"


def for_run(name: str, label_smoothing: float = 0.0, dpo_settings: dict | None = None,
            grpo_settings: dict | None = None) -> Task:
  """The task `name` with its training loss as configured; evaluation is never smoothed (the
  held-out loss stays the plain cross-entropy). `dpo_settings`: the dpo section (its beta, loss
  and label_smoothing are the objective's; its reference is the data's)."""
  task = TASKS[name]
  if label_smoothing:
    task = dataclasses.replace(task, loss=functools.partial(classification_loss,
                                                            label_smoothing=label_smoothing))
  if name == "dpo":
    dpo_settings = {key: dpo_settings[key] for key in ("beta", "loss", "label_smoothing")}
    task = dataclasses.replace(task, loss=functools.partial(preference_loss, **dpo_settings),
                               evaluate=functools.partial(preference_eval, **dpo_settings))
  if name == "grpo":
    grpo_settings = {key: grpo_settings[key] for key in GRPO_SETTINGS}
    task = dataclasses.replace(task, loss=functools.partial(grpo_loss, **grpo_settings),
                               evaluate=functools.partial(grpo_eval, **grpo_settings))
  return task
