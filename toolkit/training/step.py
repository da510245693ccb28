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
from toolkit.training import losses
from toolkit.training.programs import Programs
from toolkit.training.state import State, StateLayout

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


def token_order(batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """(inputs, targets, positions) of an LM batch as the model reads them: when the active
  rules split token positions over devices (context parallelism), all three in the
  load-balanced order of `sharding.sequence`, a permutation of whole rows that each device
  makes on its own (the rows arrive whole); otherwise as given, positions None (0..length-1).
  The mean loss over a permutation of (input, target) pairs is the same loss."""
  inputs, targets = batch["inputs"], batch["targets"]
  ways = sharding.active_ways("length")
  if ways == 1:
    return inputs, targets, None
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
  return tuple(sharding.sequence.balance(x, ways) for x in (inputs, targets, positions))


def cross_entropy_loss(graphdef: nnx.GraphDef, params, batch: Batch) -> jax.Array:
  """Mean next-token cross-entropy (nats) of batch["targets"] given batch["inputs"] (over
  chunks of the vocabulary loss when the model's loss_chunk is set: `toolkit.training.losses`)."""
  model = nnx.merge(graphdef, params)
  return losses.next_token_loss(model, *token_order(batch))[0]


def lm_loss(graphdef: nnx.GraphDef, params, batch: Batch) -> tuple[jax.Array, Metrics]:
  """The LM's training loss and its metrics: mean next-token cross-entropy (over chunks of the
  vocabulary when model.loss_chunk is set) plus model.z_loss x mean(logsumexp^2) plus the
  model's auxiliary loss (a mixture of experts' weighted router losses; 0 for a dense model),
  and the model's metrics (router statistics; none for a dense model). See
  `toolkit.training.losses`."""
  model = nnx.merge(graphdef, params)
  return losses.next_token_objective(model, *token_order(batch))


def split_microbatches(batch: Batch, count: int) -> Batch:
  """(B, ...) -> (count, B / count, ...), micro-batch m taking rows m, m + count, ... so each
  device keeps its own rows (no data moves between devices)."""
  def split(x):
    x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def loss_and_grads(loss_fn: Callable, params, batch: Batch, microbatches: int):
  """`loss_fn(params, batch) -> (loss, metrics)`: returns ((mean loss, mean metrics), the
  loss's gradient), accumulated in float32 over equal micro-batches."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if microbatches == 1:
    return grad_fn(params, batch)

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


def apply_grads(optimizer: optax.GradientTransformation, state: State, grads) -> State:
  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  return {**state, "step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
          "opt_state": opt_state}


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
                    evaluate: Callable | None = None) -> TrainStep:
  """`loss(graphdef, params, batch)` -> (mean loss, metrics) (default: `lm_loss`) and
  `evaluate(graphdef, params, batch)` -> eval output (default: next-token cross-entropy);
  see toolkit.training.tasks."""
  task_loss = loss or lm_loss
  task_eval = evaluate or cross_entropy_loss
  loss_fn = lambda params, batch: task_loss(graphdef, params, batch)

  def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
    step.traces += 1
    with sharding.activation_rules(rules, mesh):
      (loss, metrics), grads = loss_and_grads(loss_fn, state["params"], batch, microbatches)
    new_state = apply_grads(optimizer, state, grads)
    return new_state, step_metrics(loss, grads, state["params"], schedule(state["step"]),
                                   metrics)

  def eval_step(state: State, batch: Batch):
    with sharding.activation_rules(rules, mesh):
      return task_eval(graphdef, state["params"], batch)

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
