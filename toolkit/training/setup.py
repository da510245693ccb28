"""The pieces of a run that do not depend on its workdir: `build(config)` validates the config
and derives mesh, data, optimizer, abstract state and the step. The loop, the benchmark, tests,
inference and ahead-of-time compiles all start from here."""
from __future__ import annotations

import dataclasses

import jax
import ml_collections
import optax

from toolkit import accelerators
from toolkit import data as data_lib
from toolkit.training import config as config_lib, state as state_lib, step as step_lib, tasks


@dataclasses.dataclass(frozen=True)
class Setup:
  spec: config_lib.RunSpec
  batches: data_lib.Batches | data_lib.GrainBatches
  optimizer: optax.GradientTransformation
  layout: state_lib.StateLayout
  step: step_lib.TrainStep
  task: tasks.Task = tasks.LM


def build(config: ml_collections.ConfigDict, devices=None) -> Setup:
  """Validates `config` against `devices` (default: all) and derives the run's pieces."""
  spec = config_lib.resolve(config, devices)
  mesh, rules, model_cfg = spec.mesh, spec.rules, spec.model
  batches = data_lib.from_config(config, spec)
  task = tasks.for_run(spec.task, config.train.get("label_smoothing", 0.0))
  schedule_steps = config.optimizer.schedule_steps or config.train.steps
  optimizer = step_lib.make_optimizer(config.optimizer, schedule_steps)
  schedule = step_lib.learning_rate_schedule(config.optimizer, schedule_steps)
  layout = state_lib.layout(model_cfg, optimizer, rules, mesh)
  step = step_lib.make_train_step(layout.graphdef, optimizer, schedule,
                                  config.train.microbatches, rules, mesh, loss=task.loss,
                                  evaluate=task.evaluate)
  return Setup(spec=spec, batches=batches, optimizer=optimizer, layout=layout, step=step,
               task=task)


def peak_flops_per_device(config: ml_collections.ConfigDict) -> float:
  """`train.peak_flops_per_device`, or the chip's bf16 peak from the accelerator table (0 when
  unknown, which turns MFU off)."""
  if config.train.peak_flops_per_device > 0:
    return config.train.peak_flops_per_device
  return accelerators.peak_flops_per_chip(jax.devices()[0].device_kind)


def work_per_step(config: ml_collections.ConfigDict, setup: Setup) -> tuple[int, float]:
  """(units per step, model FLOPs per step): tokens for an LM, examples for a classifier."""
  model_cfg = setup.spec.model
  if setup.task.name == "lm":
    tokens = config.data.global_batch_size * config.data.seq_len
    return tokens, model_cfg.flops_per_token(config.data.seq_len) * tokens
  examples = config.data.global_batch_size
  return examples, model_cfg.flops_per_example() * examples
