"""The pieces of a run that do not depend on its workdir: `build(config)` validates the config
and derives mesh, data, optimizer, abstract state and the step. The loop, the benchmark, tests,
inference and ahead-of-time compiles all start from here."""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from toolkit import accelerators
from toolkit import data as data_lib
from toolkit.training import config as config_lib, metrics as metrics_lib, state as state_lib
from toolkit.training import step as step_lib
from toolkit.training.objectives import tasks
from toolkit.training.programs import Programs


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
  task = tasks.for_run(spec.task, config.train.get("label_smoothing", 0.0),
                       dict(config.dpo) if spec.task == "dpo" else None,
                       dict(config.grpo) if spec.task == "grpo" else None)
  schedule_steps = config.optimizer.schedule_steps or config.train.steps
  optimizer = step_lib.make_optimizer(config.optimizer, schedule_steps)
  schedule = step_lib.learning_rate_schedule(config.optimizer, schedule_steps)
  layout = state_lib.layout(model_cfg, optimizer, rules, mesh,
                            reference=tasks.frozen_reference(spec.task, config))
  step = step_lib.make_train_step(layout.graphdef, optimizer, schedule,
                                  config.train.microbatches, rules, mesh, loss=task.loss,
                                  evaluate=task.evaluate, reference=task.reference)
  return Setup(spec=spec, batches=batches, optimizer=optimizer, layout=layout, step=step,
               task=task)


def matmul_flops_per_second(size: int = 2048, repeats: int = 5, device=None,
                            devices=None) -> float:
  """Median FLOP/s of a jitted float32 (size x size) @ (size x size) on `device` (default: the
  first device), after one untimed call. With `devices`, one such matmul on each of them at
  once (a batch split over them) and the FLOP/s per device: what each gets while they share
  a host's cores, as simulated CPU devices do."""
  if devices:
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))
    shape = (len(mesh.devices), size, size)
  else:
    place, shape = device or jax.devices()[0], (size, size)
  a, b = (jax.device_put(jax.random.normal(jax.random.key(i), shape, jnp.float32), place)
          for i in range(2))
  dot = jax.jit(jnp.matmul)
  dot(a, b).block_until_ready()  # compile
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    dot(a, b).block_until_ready()
    seconds.append(time.perf_counter() - start)
  return 2 * size**3 / statistics.median(seconds)


def peak_flops_total(config: ml_collections.ConfigDict, mesh,
                     programs: Programs | None = None) -> float:
  """Peak FLOP/s of the devices in `mesh`, for MFU: `train.peak_flops_per_device` x devices
  when set (> 0); else the chip's bf16 peak from the accelerator table x devices; else, on CPU,
  the host's float32 matmul peak (1024^2 matmuls), measured now or once per machine and software
  when `programs` has a folder, however many devices the mesh holds: simulated CPU devices
  share the host's cores, so 1 device and 8 have the same peak; else 0, which turns MFU off."""
  if config.train.peak_flops_per_device > 0:
    return config.train.peak_flops_per_device * mesh.size
  device = mesh.devices.flat[0]
  table = accelerators.peak_flops_per_chip(device.device_kind)
  if table or device.platform != "cpu":
    return table * mesh.size
  return (programs or Programs(None, "")).value(
      "cpu_matmul_peak", lambda: matmul_flops_per_second(1024, 5, device))


def work_per_step(config: ml_collections.ConfigDict, setup: Setup) -> tuple[int, float]:
  """(units per step, model FLOPs per step): tokens for an LM, examples for a classifier."""
  model_cfg = setup.spec.model
  if setup.task.name == "lm":
    tokens = config.data.global_batch_size * config.data.seq_len
    return tokens, model_cfg.flops_per_token(config.data.seq_len) * tokens
  if setup.task.name == "grpo":  # the trained rows; the rollouts' decoding is not counted
    tokens = config_lib.rows_per_step(config, "grpo") * config.data.seq_len
    reference = 4 / 3 if config.grpo.beta else 1
    return tokens, model_cfg.flops_per_token(config.data.seq_len) * tokens * reference
  if setup.task.name == "dpo":  # two rows a pair; the base as reference adds a forward pass
    tokens = config_lib.rows_per_step(config, "dpo") * config.data.seq_len
    base = not getattr(setup.batches, "precomputed_reference", False)
    return tokens, model_cfg.flops_per_token(config.data.seq_len) * tokens * (4 / 3 if base
                                                                             else 1)
  examples = config.data.global_batch_size
  return examples, model_cfg.flops_per_example() * examples


def units_of(config: ml_collections.ConfigDict, setup: Setup) -> metrics_lib.Units:
  """How the run's losses are labelled: nats per token (per image for a classifier) and, for an
  LM, bits per byte on byte-level data, else bits per token."""
  if setup.task.name == "dpo":
    return metrics_lib.Units("per pair", None)
  if setup.task.name == "grpo":
    return metrics_lib.Units("per completion token", None)
  token = data_lib.token_unit(config) if setup.task.name == "lm" else None
  return metrics_lib.Units.of(setup.task.unit, token)
