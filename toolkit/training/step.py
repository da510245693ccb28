"""The training step, composed of small pure functions:
loss -> grads (optionally over micro-batches) -> apply -> metrics.

`make_train_step` returns one function `(state, batch) -> (state, metrics)` that the loop,
the benchmark and ahead-of-time compiles all use; `compile_step` jits it with explicit
shardings and the state donated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from models import lora
from toolkit.training.objectives import losses
from toolkit.training.programs import Programs
from toolkit.training.state import State, StateLayout, combine, split_trainable

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def learning_rate_schedule(opt_config, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to peak * min_lr_ratio."""
  warmup = min(opt_config.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_config.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=opt_config.learning_rate * opt_config.min_lr_ratio)


def make_optimizer(opt_config, total_steps: int,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW; weight decay on matrices only (not norm scales).

  `schedule` replaces `learning_rate_schedule(opt_config, total_steps)`; population sweeps
  pass one computed from per-trial arrays (toolkit.tuning.population)."""
  if schedule is None:
    schedule = learning_rate_schedule(opt_config, total_steps)
  return optax.chain(
      optax.clip_by_global_norm(clip_threshold(opt_config.clip_norm)),
      optax.adamw(schedule, b1=opt_config.b1,
                  b2=opt_config.b2, eps=opt_config.eps, weight_decay=opt_config.weight_decay,
                  mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))


def clip_threshold(clip_norm):
  """optimizer.clip_norm as optax's threshold: 0 turns clipping off (an infinite threshold).
  `clip_norm` is a number, or a traced array when a population gives each trial its own."""
  if isinstance(clip_norm, (int, float)):
    return clip_norm if clip_norm > 0 else float("inf")
  return jnp.where(clip_norm > 0, clip_norm, jnp.inf)


# An LM batch: "inputs" and "targets" (batch, length) int32; rows packed with several
# documents (toolkit/data/packing.py) also carry "segment_ids" (batch, length) int32 (which
# document of the row, 1, 2, ...; 0 padding), "positions" (batch, length) int32 (within each
# document, from 0) and "loss_weights" (batch, length) float32 (1 where the target counts).
# What the loss functions call each of them:
_LM_KEYS = {"inputs": "inputs", "targets": "targets", "positions": "positions",
            "segment_ids": "segment_ids", "loss_weights": "weights"}


def token_order(batch: Batch) -> dict[str, jax.Array]:
  """The LM batch as the loss functions take it (`losses.next_token_loss`'s keywords: inputs,
  targets, and positions, segment_ids and weights where the batch has them): when the active
  rules split token positions over devices (context parallelism), all of them in the
  load-balanced order of `sharding.sequence`, positions 0..length-1 unless the batch has its
  own, a permutation of whole rows that each device makes on its own (the rows arrive whole);
  otherwise as given. The (weighted) mean loss over a permutation of (input, target) pairs is
  the same loss."""
  tokens = {name: batch[key] for key, name in _LM_KEYS.items() if key in batch}
  ways = sharding.active_ways("length")
  if ways == 1:
    return tokens
  inputs = tokens["inputs"]
  tokens.setdefault("positions", jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32),
                                                  inputs.shape))
  return {name: sharding.sequence.balance(x, ways) for name, x in tokens.items()}


def cross_entropy_loss(graphdef: nnx.GraphDef, params, batch: Batch) -> jax.Array:
  """Mean next-token cross-entropy (nats) of batch["targets"] given batch["inputs"] (over
  chunks of the vocabulary loss when the model's loss_chunk is set: `toolkit.training.objectives.losses`)."""
  model = nnx.merge(graphdef, params)
  return losses.next_token_loss(model, **token_order(batch))[0]


def lm_loss(graphdef: nnx.GraphDef, params, batch: Batch) -> tuple[jax.Array, Metrics]:
  """The LM's training loss and its metrics: mean next-token cross-entropy (over chunks of the
  vocabulary when model.loss_chunk is set) plus model.z_loss x mean(logsumexp^2) plus the
  model's auxiliary loss (a mixture of experts' weighted router losses; 0 for a dense model),
  and the model's metrics (router statistics; none for a dense model). See
  `toolkit.training.objectives.losses`."""
  model = nnx.merge(graphdef, params)
  return losses.next_token_objective(model, **token_order(batch))


def split_microbatches(batch: Batch, count: int) -> Batch:
  """(B, ...) -> (count, B / count, ...), micro-batch m taking rows m, m + count, ... so each
  device keeps its own rows (no data moves between devices)."""
  def split(x):
    x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def loss_and_grads(loss_fn: Callable, params, batch: Batch, microbatches: int):
  """`loss_fn(params, batch) -> (loss, metrics)`: returns ((mean loss, mean metrics), the
  loss's gradient), accumulated in float32 over equal micro-batches. A batch with per-token
  "loss_weights" (packed documents) has its micro-batches' losses combined by their weights
  (`weighted_loss_and_grads`), so the loss is the weighted mean over the whole batch."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if microbatches == 1:
    return grad_fn(params, batch)
  if "loss_weights" in batch:
    return weighted_loss_and_grads(grad_fn, params, batch, microbatches)

  def accumulate(carry, micro):
    loss_sum, grad_sum = carry
    (loss, metrics), grads = grad_fn(params, micro)
    return (loss_sum + loss, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum,
                                          grads)), metrics

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (loss_sum, grad_sum), metrics = jax.lax.scan(
      accumulate, (jnp.zeros((), jnp.float32), zeros), split_microbatches(batch, microbatches))
  grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grad_sum, params)
  metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
  return (loss_sum / microbatches, metrics), grads


def weighted_loss_and_grads(grad_fn: Callable, params, batch: Batch, microbatches: int):
  """`loss_and_grads` for a batch with "loss_weights": micro-batch m's loss is its weighted
  mean S_m / W_m (`losses.weight_total`), so W_m x loss_m summed over the micro-batches and
  divided by the whole batch's W is sum(weights x per-token loss) / sum(weights) over the
  global batch, not a mean of per-micro-batch means (which would overweight the tokens of
  sparse micro-batches); the gradients likewise. Terms that are not per-token means (the
  router's auxiliary loss) enter with their micro-batch's share of the weight, which is 1 / M
  when the micro-batches hold equal weight."""
  def accumulate(carry, micro):
    loss_sum, grad_sum = carry
    (loss, metrics), grads = grad_fn(params, micro)
    weight = jnp.sum(micro["loss_weights"], dtype=jnp.float32)
    return (loss_sum + weight * loss,
            jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32), grad_sum, grads)), \
        metrics

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (loss_sum, grad_sum), metrics = jax.lax.scan(
      accumulate, (jnp.zeros((), jnp.float32), zeros), split_microbatches(batch, microbatches))
  total = losses.weight_total(batch["loss_weights"])
  grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), grad_sum, params)
  metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
  return (loss_sum / total, metrics), grads


def apply_grads(optimizer: optax.GradientTransformation, state: State, grads) -> State:
  """The optimizer's update of the trainable parameters (`grads` is shaped like them); frozen
  ones pass through untouched (state.split_trainable)."""
  trainable, frozen = split_trainable(state["params"])
  updates, opt_state = optimizer.update(grads, state["opt_state"], trainable)
  return {**state, "step": state["step"] + 1,
          "params": combine(optax.apply_updates(trainable, updates), frozen),
          "opt_state": opt_state}


def with_frozen(loss_fn: Callable, frozen) -> Callable:
  """`loss_fn(params, batch)` as a function of the trainable parameters alone, the frozen ones
  held fixed: what the gradient is taken of (none is computed for frozen weights)."""
  return lambda trainable, batch: loss_fn(combine(trainable, frozen), batch)


# The batch entry that carries each row's LoRA dropout key into the loss (`with_dropout_keys`).
DROPOUT_KEYS = "lora_dropout_keys"


def with_dropout_keys(state: State, batch: Batch) -> Batch:
  """`batch` plus each row's dropout key for LoRA adapters (models.lora), from the state's rng
  and step: per row, so the masks are the same however the batch is split (micro-batches,
  devices). Unused (and compiled away) by a model without adapters."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
  rows = jax.tree.leaves(batch)[0].shape[0]
  return {**batch, DROPOUT_KEYS: sharding.constrain(lora.row_keys(key, rows), ("batch", None))}


def adapter_training(loss_fn: Callable, values: dict | None = None) -> Callable:
  """`loss_fn(params, batch)` with the model's LoRA adapters in training mode: dropout from the
  keys `with_dropout_keys` put in the batch (taken out before `loss_fn` sees it), and
  `values` ({"alpha", "dropout"}: a population trial's traced values) for the config's."""
  def loss(params, batch: Batch):
    batch = dict(batch)
    with lora.runtime(keys=batch.pop(DROPOUT_KEYS), **(values or {})):
      return loss_fn(params, batch)
  return loss


def with_reference(reference: Callable | None, state: State, batch: Batch,
                   microbatches: int = 1) -> Batch:
  """`batch` plus the entries `reference(params, batch)` computes from the state's frozen copy
  of the starting parameters (post-training's reference model: DPO's log-probabilities of
  each side, GRPO's of each token; toolkit.training.objectives.tasks) when the state holds one, else
  `batch` as given. Forward passes only, one per micro-batch of the step's split, so they
  hold no more activations than the step's own."""
  if "reference" not in state:
    return batch
  if reference is None:
    raise ValueError("the state holds a frozen reference copy and the task computes nothing "
                     "from it; give make_train_step its task's reference")
  frozen = jax.lax.stop_gradient(state["reference"])
  if microbatches == 1:
    return {**batch, **reference(frozen, batch)}
  entries = jax.lax.map(lambda micro: reference(frozen, micro),
                        split_microbatches(batch, microbatches))
  # Back to the batch's row order: micro-batch m held rows m, m + count, ...
  entries = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), entries)
  return {**batch, **entries}


def step_metrics(loss: jax.Array, grads, params, learning_rate: jax.Array,
                 task_metrics: Metrics) -> Metrics:
  return {**task_metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
          "param_norm": optax.tree.norm(params), "learning_rate": learning_rate}


@dataclasses.dataclass
class TrainStep:
  """The step function plus a count of how often Python traced it (tests assert it is 1)."""
  fn: Callable[[State, Batch], tuple[State, Metrics]]
  eval_fn: Callable[[State, Batch], jax.Array | Metrics]
  traces: int = 0


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, microbatches: int, rules: sharding.Rules,
                    mesh: Mesh, loss: Callable | None = None,
                    evaluate: Callable | None = None,
                    adapter_values: dict | None = None,
                    reference: Callable | None = None) -> TrainStep:
  """`loss(graphdef, params, batch)` -> (mean loss, metrics) (default: `lm_loss`) and
  `evaluate(graphdef, params, batch)` -> eval output (default: next-token cross-entropy);
  see toolkit.training.objectives.tasks. Gradients and updates cover the trainable parameters only
  (`state.split_trainable`: a LoRA model's adapters); `adapter_values` as in
  `adapter_training`. `reference(graphdef, params, batch)` -> batch entries: what the task
  reads from a frozen reference copy, for states that hold one (`with_reference`)."""
  task_loss = loss or lm_loss
  task_eval = evaluate or cross_entropy_loss
  loss_fn = adapter_training(lambda params, batch: task_loss(graphdef, params, batch),
                             adapter_values)
  from_reference = reference and (lambda params, batch: reference(graphdef, params, batch))

  def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
    step.traces += 1
    trainable, frozen = split_trainable(state["params"])
    with sharding.activation_rules(rules, mesh):
      batch = with_reference(from_reference, state, batch, microbatches)
      (loss, metrics), grads = loss_and_grads(with_frozen(loss_fn, frozen), trainable,
                                              with_dropout_keys(state, batch), microbatches)
    new_state = apply_grads(optimizer, state, grads)
    return new_state, step_metrics(loss, grads, trainable, schedule(state["step"]), metrics)

  def eval_step(state: State, batch: Batch):
    # No dropout; a population trial's own LoRA alpha.
    with sharding.activation_rules(rules, mesh), lora.runtime(
        alpha=(adapter_values or {}).get("alpha")):
      return task_eval(graphdef, state["params"], with_reference(from_reference, state, batch))

  step = TrainStep(fn=train_step, eval_fn=eval_step)
  return step


def jit_step(step: TrainStep, state_layout: StateLayout, abstract_batch: Batch, mesh: Mesh):
  """The train and eval steps jitted with explicit shardings, the train step donating the
  state; `compile_step` and ahead-of-time compiles (`toolkit.compile`) both lower these."""
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_shardings = jax.tree.map(lambda a: a.sharding, abstract_batch)
  train = jax.jit(step.fn, in_shardings=(state_layout.shardings, batch_shardings),
                  out_shardings=(state_layout.shardings, replicated), donate_argnums=0)
  evaluate = jax.jit(step.eval_fn, in_shardings=(state_layout.shardings, batch_shardings),
                     out_shardings=replicated)
  return train, evaluate


def compile_step(step: TrainStep, state_layout: StateLayout, abstract_batch: Batch, mesh: Mesh,
                 programs: Programs | None = None):
  """Lowers and compiles the train and eval steps once for these exact shapes and shardings,
  or reads them back from `programs` (a restart: nothing traced).

  Returns (train, eval) compiled executables; the train step donates the state."""
  programs = programs or Programs(None, "")
  train, evaluate = jit_step(step, state_layout, abstract_batch, mesh)
  return (programs.compile("train_step", train, state_layout.abstract, abstract_batch),
          programs.compile("eval_step", evaluate, state_layout.abstract, abstract_batch))
