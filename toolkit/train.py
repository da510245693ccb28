"""Training: `run(config, workdir)` and its command line.

  python -m toolkit.train --config=experiments/lm.py:cpu --workdir=/tmp/lm

The loop reads top to bottom: setup -> mesh -> data -> abstract state -> shardings ->
restore-or-init -> compile -> loop, with periodic work (log, eval, checkpoint) every N steps.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

import sharding
from toolkit import checkpoint, config as config_lib, data, metrics as metrics_lib, state as state_lib
from toolkit import command_line, topology, workdir as workdir_lib
from toolkit import pipeline, tasks
from toolkit import step as step_lib
from toolkit.config import ConfigError
from toolkit.sample import sample_text

# The end-of-run sample of a multi-process run gathers the parameters on every host; above this
# size it is skipped (toolkit.sample restores onto one device instead).
SAMPLE_GATHER_LIMIT_BYTES = 2**30


class NonFiniteLoss(RuntimeError):
  """Training produced a NaN or infinite loss; no checkpoint of that state was written."""


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _prepare_workdir(workdir: str) -> None:
  if (problem := workdir_lib.problem(workdir)) is not None:
    raise ConfigError(problem)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir={workdir!r} cannot be created ({e.strerror}); choose a "
                      f"writable directory") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir={workdir!r} is not writable; choose a writable directory")


class _StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits cleanly.

  With several processes all must stop after the same step, or the ones still training wait
  in a collective for the ones saving. JAX's runtime catches SIGTERM on any process and agrees
  with the others on a step (`reached_preemption_sync_point`, TPU maintenance events use it
  too), so SIGTERM is left to it and SIGINT is passed on to it as SIGTERM.
  """

  def __init__(self):
    self.requested = False
    self.multiprocess = jax.process_count() > 1
    self._previous = {}

  def __enter__(self):
    signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    if self.multiprocess:
      os.kill(os.getpid(), signal.SIGTERM)
      return
    self.requested = True
    log(f"received {signal.Signals(signum).name}: finishing this step, then saving")

  def should_stop(self, done: int) -> bool:
    """Whether to stop after step `done`; call it once per step, on every process."""
    if self.multiprocess:
      return multihost_utils.reached_preemption_sync_point(done)
    return self.requested

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


@dataclasses.dataclass
class RunResult:
  final_step: int
  train_losses: dict[int, float]
  eval_losses: dict[int, float]
  stopped_early: bool
  step_traces: int = 0  # how often Python traced the train step (1: compiled once)
  sample: str | None = None
  eval_metrics: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
  confusion: np.ndarray | None = None  # classification: the last eval's confusion matrix
  # Seconds the loop spent waiting for the next batch, and in the steps' intervals in all
  # (excluding eval and checkpoints): their ratio is the data-wait fraction of step time.
  data_wait_seconds: float = 0.0
  step_seconds: float = 0.0


def _peak_flops(config) -> float:
  if config.train.peak_flops_per_device > 0:
    return config.train.peak_flops_per_device
  return topology.peak_flops_per_chip(jax.devices()[0].device_kind)


@dataclasses.dataclass(frozen=True)
class Setup:
  """The pieces of a run that do not depend on the workdir; the loop, the benchmark, tests
  and ahead-of-time compiles all start from here."""
  spec: config_lib.RunSpec
  batches: data.Batches | pipeline.GrainBatches
  optimizer: optax.GradientTransformation
  layout: state_lib.StateLayout
  step: step_lib.TrainStep
  task: tasks.Task = tasks.LM


def build(config: ml_collections.ConfigDict, devices=None) -> Setup:
  """Validates `config` and derives mesh, data, optimizer, abstract state and the step."""
  spec = config_lib.resolve(config, devices)
  mesh, rules, model_cfg = spec.mesh, spec.rules, spec.model
  batches = pipeline.from_config(config, spec)
  task = tasks.TASKS[spec.task]
  schedule_steps = config.optimizer.schedule_steps or config.train.steps
  optimizer = step_lib.make_optimizer(config.optimizer, schedule_steps)
  schedule = step_lib.learning_rate_schedule(config.optimizer, schedule_steps)
  layout = state_lib.layout(model_cfg, optimizer, rules, mesh)
  step = step_lib.make_train_step(layout.graphdef, optimizer, schedule,
                                  config.train.microbatches, rules, mesh, loss=task.loss,
                                  evaluate=task.evaluate)
  return Setup(spec=spec, batches=batches, optimizer=optimizer, layout=layout, step=step,
               task=task)


def run(config: ml_collections.ConfigDict, workdir: str, devices=None) -> RunResult:
  """Trains per `config`, checkpointing into `workdir`; resumes if the workdir has a checkpoint.

  `devices` (default: all) lets a sweep run several trials at once on disjoint devices."""
  # --- setup: validate everything before touching the workdir --------------------------------
  setup = build(config, devices)
  mesh, rules, model_cfg = setup.spec.mesh, setup.spec.rules, setup.spec.model
  batches, layout, optimizer = setup.batches, setup.layout, setup.optimizer
  _prepare_workdir(workdir)
  total_steps = config.train.steps
  log(f"devices: {mesh.size} x {mesh.devices.flat[0].device_kind} in "
      f"{jax.process_count()} process(es); mesh {dict(mesh.shape)}; rules {rules.name}")
  log(layout.report.format())
  warning = layout.report.check_replicated(config.sharding.max_replicated_fraction,
                                           config.sharding.replicated_action)
  if warning:
    log(f"warning: {warning}")

  # --- restore or init -----------------------------------------------------------------------
  checkpoints = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"),
                                       keep=config.train.keep_checkpoints)
  source, restore_step = checkpoint.find_resume_point(checkpoints, config.train.resume_from)
  if source is not None:
    checkpoint.check_compatible(source.saved_config(restore_step), model_cfg,
                                f"{source.directory} step {restore_step}")
    state, data_position = source.restore(restore_step, layout.abstract)
    log(f"restored step {restore_step} from {source.directory}")
  else:
    state = state_lib.create(model_cfg, optimizer, layout, config.seed)
    data_position = None
  start_step = int(jax.device_get(state["step"]))
  if start_step > total_steps:
    raise ConfigError(f"the checkpoint is at step {start_step}, past train.steps={total_steps}; "
                      f"raise train.steps to continue training")
  config_dict = checkpoint.config_to_dict(config)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))

  # --- compile once --------------------------------------------------------------------------
  compile_start = time.perf_counter()
  train_step, eval_step = step_lib.compile_step(setup.step, layout, batches.abstract(), mesh)
  memory = train_step.memory_analysis()
  log(f"compiled the step in {time.perf_counter() - compile_start:.1f} s" + (
      f"; per device: {memory.argument_size_in_bytes / 2**20:.1f} MiB arguments, "
      f"{memory.temp_size_in_bytes / 2**20:.1f} MiB temporaries" if memory else ""))

  if setup.task.name == "lm":
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    flops_per_step = model_cfg.flops_per_token(config.data.seq_len) * tokens_per_step
  else:  # throughput in examples
    tokens_per_step = config.data.global_batch_size
    flops_per_step = model_cfg.flops_per_example() * tokens_per_step
  peak_total = _peak_flops(config) * mesh.size
  writer = metrics_lib.MetricWriter(workdir)
  result = RunResult(final_step=start_step, train_losses={}, eval_losses={}, stopped_early=False)

  def evaluate(at_step: int) -> None:
    outputs = [eval_step(state, batches.eval_batch(i)) for i in range(batches.eval_batches)]
    summary = setup.task.summarize(jax.device_get(outputs))
    scalars = {k: v for k, v in summary.items() if isinstance(v, float)}
    loss = result.eval_losses[at_step] = scalars["loss"]
    result.eval_metrics[at_step] = scalars
    writer.write(at_step, "eval", scalars)
    if setup.task.name == "lm":
      log(f"eval at step {at_step}: loss {loss:.4f} ({loss / math.log(2):.3f} bits per byte)")
      return
    result.confusion = tasks.confusion_matrix(summary["labels"], summary["predictions"],
                                              model_cfg.num_classes)
    log(f"eval at step {at_step}: loss {loss:.4f}, accuracy {scalars['accuracy']:.2%} "
        f"({int(scalars['examples'])} held-out examples)")

  def flush(pending: list, started: float, data_wait: float) -> None:
    """Fetches pending step metrics, stops on a non-finite loss, logs the latest; the steps
    took from `started` until their metrics arrived (not only until they were dispatched),
    `data_wait` seconds of which the loop waited for batches."""
    fetched = jax.device_get([m for _, m in pending])
    seconds = time.perf_counter() - started
    result.data_wait_seconds += data_wait
    result.step_seconds += seconds
    fetched[-1]["data_wait_fraction"] = data_wait / seconds if seconds > 0 else 0.0
    for (at_step, _), values in zip(pending, fetched):
      values = {k: float(v) for k, v in values.items()}
      # A non-finite gradient poisons the parameters one step before the loss shows it.
      bad = [name for name in ("loss", "grad_norm") if not math.isfinite(values[name])]
      if bad:
        raise NonFiniteLoss(
            f"{bad[0]} is {values[bad[0]]} at step {at_step}; stopped without saving that "
            f"state. Lower optimizer.learning_rate or clip harder (optimizer.clip_norm)")
      result.train_losses[at_step] = values["loss"]
      writer.write(at_step, "train", values)
    log(metrics_lib.progress_line(pending[-1][0], total_steps, values, seconds / len(pending),
                                  tokens_per_step, flops_per_step, peak_total,
                                  unit=setup.task.unit))
    pending.clear()

  def save(at_step: int) -> None:
    # The data position after the batch of step at_step - 1: the Grain iterator state, if any.
    position = batch_iter.position()
    assert position["step"] == at_step, (position, at_step)
    checkpoints.save(at_step, state, config_dict,
                     {**position, "seed": config.seed, "source": config.data.source})

  # --- loop ----------------------------------------------------------------------------------
  if start_step == 0:
    evaluate(0)
  elif start_step == total_steps:
    log(f"the checkpoint is at train.steps={total_steps} already: nothing to train; raise "
        f"--config.train.steps to continue")
  pending: list = []
  # Batches are prepared ahead (Grain's threads or workers, or a prefetch thread) while steps
  # run; the iterator places each on the devices and resumes a checkpoint's data position.
  prefetch = config.data.get("prefetch", 2)  # absent from configs saved before it existed
  batch_iter = (pipeline.iterator(batches, start_step, data_position, prefetch)
                if start_step < total_steps else None)
  interval_start = time.perf_counter()
  interval_wait = 0.0
  one_step_in_flight = mesh.devices.flat[0].platform == "cpu"
  guard = "disallow" if config.train.transfer_guard else "allow"
  try:
    with _StopSignal() as stop, jax.transfer_guard(guard):
      for current in range(start_step, total_steps):
        waiting = time.perf_counter()
        batch = next(batch_iter)
        interval_wait += time.perf_counter() - waiting
        if one_step_in_flight and pending:
          # On XLA's CPU backend, steps queued behind each other can deadlock: all but one
          # simulated device wait in the next step's all-reduce (measured in the ViT run:
          # "7 of 8 arrived" aborts). The next batch is ready, so only dispatch waits.
          jax.block_until_ready(pending[-1][1])
        # The guard turns an implicit host->device copy (say a NumPy array reaching the step)
        # into an error; placing the batch is an explicit transfer and passes.
        state, step_metrics = train_step(state, batch)
        done = current + 1
        pending.append((done, step_metrics))
        at_end = done == total_steps
        # Read the stop flag once per step: a signal that lands during this step's flush, eval
        # or save is acted on next step, so "stopped" always means "flushed and saved".
        stopping = stop.should_stop(done)
        save_now = done % config.train.checkpoint_every == 0 or at_end or stopping
        if done % config.train.log_every == 0 or save_now:
          flush(pending, interval_start, interval_wait)
          interval_start, interval_wait = time.perf_counter(), 0.0
        if done % config.train.eval_every == 0 or at_end:
          evaluate(done)
        if save_now:
          save(done)
        if done % config.train.eval_every == 0 or save_now:
          interval_start = time.perf_counter()  # step time excludes eval and checkpoint work
          interval_wait = 0.0
        result.final_step = done
        if stopping:
          result.stopped_early = True
          log(f"stopped at step {done} on request; checkpoint saved")
          break
  finally:
    if batch_iter is not None:
      batch_iter.close()
    checkpoints.close()
    writer.close()
  result.step_traces = setup.step.traces
  params = state["params"]
  want_sample = (setup.task.name == "lm" and config.train.sample_tokens > 0
                 and not result.stopped_early)
  if want_sample and jax.process_count() > 1:
    # Process 0 samples on its own, from parameters that other hosts hold parts of. Gathering
    # them is a collective: every process takes part, before process 0 goes on alone.
    if layout.report.total_bytes > SAMPLE_GATHER_LIMIT_BYTES:
      want_sample = False
      log(f"no sample: the parameters ({layout.report.total_bytes / 2**30:.1f} GiB) are too big "
          f"to gather on one host; sample from the checkpoint (python -m toolkit.sample)")
    else:
      params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    plot = metrics_lib.plot_loss_curve(writer.path, os.path.join(workdir, "loss.png"))
    if plot:
      log(f"loss curve: {plot}")
    if result.confusion is not None:
      last = result.eval_metrics[max(result.eval_metrics)]
      path = metrics_lib.plot_confusion_matrix(
          result.confusion, os.path.join(workdir, "confusion.png"),
          f"held-out, step {max(result.eval_metrics)}: accuracy {last['accuracy']:.2%}")
      log(f"confusion matrix: {path}")
    if want_sample:
      result.sample = sample_text(layout.graphdef, params, config.train.sample_prompt,
                                  config.train.sample_tokens, config.data.seq_len, seed=config.seed)
      log(f"sample:\n{result.sample}")
  return result


def cli() -> None:
  """`python -m toolkit.train` / `meshkit-train`: flags are defined here and nowhere else.

  On a TPU pod or GPU cluster every worker runs the same command; `toolkit.distributed` joins
  them into one job (flags, else SLURM / Open MPI / Cloud TPU, else one process).

  Exit status: 0 when training finished or stopped on SIGTERM/SIGINT with a checkpoint;
  2 for a command-line mistake; 1 for a config, workdir or checkpoint mistake, a non-finite
  loss, or a peer process that failed or never started. Every mistake prints one `error:` line
  on stderr, and nothing in the workdir changes. When JAX's runtime itself ends a process
  (process 0 died, or a peer stopped sending heartbeats) it exits on SIGABRT.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import distributed  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. Experiment file and variant, e.g. experiments/lm.py:tiny. "
      "Override single fields with --config.FIELD=VALUE (after --config).", lock_config=True)
  workdir_flag = flags.DEFINE_string(
      "workdir", None, "Required. Directory for checkpoints, metrics and plots; a run resumes "
      "from its latest checkpoint.")
  coordinator_flag = flags.DEFINE_string(
      "coordinator_address", None, "HOST:PORT of process 0, for several processes outside "
      "SLURM, Open MPI and Cloud TPU (which are detected). Same on every process.")
  num_processes_flag = flags.DEFINE_integer(
      "num_processes", None, "Processes in the job (with --coordinator_address).", lower_bound=1)
  process_id_flag = flags.DEFINE_integer(
      "process_id", None, "This process's index, 0..num_processes-1 (with "
      "--coordinator_address).", lower_bound=0)
  initialization_timeout_flag = flags.DEFINE_integer(
      "initialization_timeout", distributed.DEFAULT_INITIALIZATION_TIMEOUT_S,
      "Seconds for every process of a multi-process job to connect; then it fails.",
      lower_bound=1)
  heartbeat_timeout_flag = flags.DEFINE_integer(
      "heartbeat_timeout", distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
      "Seconds without a heartbeat after which a process counts as dead and the job stops.",
      lower_bound=1)
  plan_flag = flags.DEFINE_string(
      "plan", None, "A plan file from `python -m toolkit.compile ... --plan`: its mesh, rules "
      "preset, remat and micro-batch fields are set on top of --config.")

  def main(argv) -> None:
    del argv  # checked in parse_flags
    command_line.quiet_logging()
    config = config_flag.value
    if plan_flag.value:
      from toolkit import plan as plan_lib  # pylint: disable=g-import-not-at-top
      try:
        config = plan_lib.apply_plan(config, plan_flag.value,
                                     command_line.override_fields(sys.argv))
      except ConfigError as e:
        command_line.fail(e, command_line.USAGE_EXIT)
    try:
      processes = distributed.initialize(
          coordinator_flag.value, num_processes_flag.value, process_id_flag.value,
          initialization_timeout=initialization_timeout_flag.value,
          heartbeat_timeout=heartbeat_timeout_flag.value)
    except ConfigError as e:
      command_line.fail(e, command_line.USAGE_EXIT)
    if processes.process_count > 1:
      print(processes, flush=True)  # every process: one line each, to tell them apart
    try:
      run(config, workdir_flag.value)
    except (ConfigError, sharding.ShardingError, NonFiniteLoss) as e:
      command_line.fail(e)
    except jax.errors.JaxRuntimeError as e:
      if processes.process_count == 1:
        raise
      distributed.abandon(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"workdir": "a directory for checkpoints and metrics, e.g. "
                                               "--workdir=runs/lm"}))


if __name__ == "__main__":
  cli()
