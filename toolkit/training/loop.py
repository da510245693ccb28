"""The training loop: `run(config, workdir)`.

It reads top to bottom in banner sections: setup -> restore or init -> compile -> loop ->
finish. Periodic work (log, eval, checkpoint) happens every N steps inside the loop; each is
a small function of the `Run` it works on.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training import goodput as goodput_lib, init_from
from toolkit.training.checkpoints import checkpoint, integrity
from toolkit.training import metrics as metrics_lib, profiler as profiler_lib
from toolkit.training import programs as programs_lib
from toolkit.training.checkpoints import resume, tiers
from toolkit.training import state as state_lib, step as step_lib, stragglers
from toolkit.training.objectives import tasks
from toolkit.training.checkpoints import storage
from toolkit.training.setup import Setup, build, peak_flops_total, units_of, work_per_step
from toolkit.training.startup import checkpoint_bytes, log, log_setup, prepare_workdir, write_config
from toolkit.training.stop_signal import StopSignal
from toolkit.training import watchdog as watchdog_lib


class NonFiniteLoss(RuntimeError):
  """Training produced a NaN or infinite loss; no checkpoint of that state was written."""


@dataclasses.dataclass
class RunResult:
  final_step: int
  train_losses: dict[int, float]
  eval_losses: dict[int, float]
  stopped_early: bool
  # How often Python traced the train step: 1 (compiled once), or 0 when a restart read it
  # back from the compilation cache's folder (toolkit/training/programs.py).
  step_traces: int = 0
  sample: str | None = None
  eval_metrics: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
  confusion: np.ndarray | None = None  # classification: the last eval's confusion matrix
  # Seconds the loop spent waiting for the next batch, and in the steps' intervals in all
  # (excluding eval and checkpoints): their ratio is the data-wait fraction of step time. A
  # source whose batches are the run's own work (GRPO's rollouts: its iterator's
  # `work_seconds`) has that time in rollout_seconds, not in the wait.
  data_wait_seconds: float = 0.0
  rollout_seconds: float = 0.0
  step_seconds: float = 0.0
  # Stopped by a second SIGINT/SIGTERM: saved, then ended without plots, sample or goodput.
  interrupted: bool = False
  start_step: int = 0  # the step it restored (0: from scratch)


# A function the caller passes to sample text from the trained state at the end of a run
# (toolkit.train passes toolkit.inference's): (config, setup, state) -> text or None.
Sampler = Callable[[ml_collections.ConfigDict, Setup, state_lib.State], "str | None"]


@dataclasses.dataclass(frozen=True)
class Every:
  """Periodic work a caller adds to the loop (toolkit.train adds toolkit.evaluation's harness
  tasks): fn(run, state, step) after every `steps`-th step and after the last."""
  steps: int
  fn: Callable[["Run", state_lib.State, int], None]


def run(config: ml_collections.ConfigDict, workdir: str, devices=None,
        sampler: Sampler | None = None, periodic: Sequence[Every] = (),
        batches: Callable[[Setup], object] | None = None) -> RunResult:
  """Trains per `config`, checkpointing into `workdir`; resumes if the workdir has a checkpoint.

  `devices` (default: all) lets a sweep run several trials at once on disjoint devices;
  `sampler`, when given, continues a prompt with the trained model at the end; `periodic`
  work runs every N steps beside eval and checkpoints; `batches(setup)`, when given, is the
  data source in place of the config's (one sampled from the model being trained:
  `observe(state)` before each batch, `evaluate(state, step)` for the eval's scalars)."""
  goodput = goodput_lib.Goodput()
  # --- setup: validate everything before touching the workdir --------------------------------
  with goodput.phase("startup"):
    setup = _build(config, devices, batches)
    workdir_lib.set_deadline(config.train.get("storage_timeout_s",
                                              workdir_lib.DEFAULT_DEADLINE_S))
    programs = programs_lib.for_run(config, setup.spec.mesh)  # a restart reads them back
    hf_folder = init_from.source(config, setup.spec.model, workdir)  # checked, or None
    prepare_workdir(workdir, checkpoint_bytes(setup))
    log_setup(config, setup)

    # --- restore or init: the newest checkpoint that restores (damaged ones set aside) -------
    local = tiers.open_tier(config, workdir)  # None unless train.local_checkpoint_dir
    checkpoints = checkpoint.Checkpoints(workdir_lib.join(workdir, "checkpoints"),
                                         keep=config.train.keep_checkpoints)
    resuming = any(tier.all_steps() for tier in filter(None, (checkpoints, local)))
    state, data_position = resume.restore_or_init(config, setup, checkpoints, log, hf_folder,
                                                  programs, local)
    start_step = int(jax.device_get(state["step"]))
    if start_step < config.train.steps:
      _precompute_reference(setup, state, workdir, resuming)
  result = RunResult(final_step=start_step, train_losses={}, eval_losses={},
                     stopped_early=False, start_step=start_step)
  if start_step >= config.train.steps:
    for tier in filter(None, (checkpoints, local)):
      tier.close()
    return nothing_to_train(config, start_step, result)
  if jax.process_index() == 0:
    write_config(config, workdir_lib.join(workdir, "config.json"))

  # --- compile once --------------------------------------------------------------------------
  with goodput.phase("compile"):
    train_step, eval_step = compile_steps(setup, programs)

  # --- loop ----------------------------------------------------------------------------------
  writer = _metric_writer(workdir, start_step)
  current = Run(config=config, setup=setup, eval_step=eval_step, checkpoints=checkpoints,
                local=local, writer=writer, result=result, goodput=goodput,
                programs=programs, periodic=tuple(periodic),
                profiler=profiler_lib.StepProfiler(profiler_lib.parse_profile_steps(
                    config.train.get("profile_steps", ""), config.train.steps), workdir, log))
  current.watchdog = watchdog_lib.Watchdog.for_run(config, workdir)  # armed by the first step
  # SIGTERM/SIGINT stop the loop after a step and save; the handlers stay until that save is
  # committed, so a second signal there still waits for it (stop_signal.py).
  with StopSignal() as stop:
    try:
      state = train_loop(current, state, train_step, start_step, data_position, stop)
    except BaseException as e:
      current.watchdog.stop()  # a failure, not a hang: close_outputs bounds its own waits
      close_outputs(current, failure=e)
      raise
    try:
      close_outputs(current)
    except BaseException:
      current.watchdog.stop()
      current.writer.close()
      raise
  if stop.urgent:  # the second signal: saved, and no more
    current.result.interrupted = True
    log(f"checkpoint saved at step {current.result.final_step}; exiting on the second signal")
  try:
    if not stop.urgent:
      finish(current, workdir, state, sampler)
  finally:
    current.watchdog.stop()
    current.writer.close()
  return current.result


def _metric_writer(workdir: str, start_step: int) -> metrics_lib.MetricWriter:
  """metrics.jsonl's writer from `start_step` on, saying which records of an earlier run past
  it were dropped (their steps are trained again)."""
  writer = metrics_lib.MetricWriter(workdir, start_step)
  if writer.dropped:
    log(f"metrics.jsonl: dropped the records of steps {writer.dropped[0]}-{writer.dropped[-1]}, "
        f"written by an earlier run past step {start_step}, where this one starts; those "
        f"steps are trained again")
  return writer


def _precompute_reference(setup: Setup, state, workdir: str, resuming: bool) -> None:
  """DPO's reference log-probabilities (dpo_reference.py), when the batches precompute them."""
  if getattr(setup.batches, "precomputed_reference", False):
    from toolkit.training import dpo_reference  # pylint: disable=g-import-not-at-top  # Grain
    dpo_reference.prepare(setup, state["params"], workdir, resuming, log)


def _build(config: ml_collections.ConfigDict, devices,
           batches: Callable[[Setup], object] | None) -> Setup:
  """`build`, with `batches(setup)` in place of the config's data source when given (one the
  model's own samples make needs it)."""
  setup = build(config, devices)
  if batches is not None:
    return dataclasses.replace(setup, batches=batches(setup))
  if getattr(setup.batches, "sampled", False):
    raise ConfigError(setup.batches.needs)
  return setup


def finish(run_: Run, workdir: str, state, sampler: Sampler | None) -> None:
  """After the last save is committed: plots, a sample, where the time went."""
  run_.watchdog.beat("the last checkpoint written")
  result = run_.result
  result.step_traces = run_.setup.step.traces
  write_plots(run_, workdir)
  if sampler is not None and not result.stopped_early:
    result.sample = sampler(run_.config, run_.setup, state)
    run_.watchdog.beat("the sample")
  log(f"checkpoint: {os.path.join(run_.checkpoints.directory, str(result.final_step))}")
  write_goodput(run_)


# --- compile --------------------------------------------------------------------------------

def compile_steps(setup: Setup, programs: programs_lib.Programs | None = None):
  """The compiled train and eval steps (read back from `programs` when it holds them), with
  the compile time and per-device memory logged."""
  log("compiling the step ...")
  start = time.perf_counter()
  train_step, eval_step = step_lib.compile_step(setup.step, setup.layout,
                                                setup.batches.abstract(), setup.spec.mesh,
                                                programs)
  integrity.compile_for(setup.layout.abstract, programs)  # the checkpoints' fingerprints
  memory = train_step.memory_analysis()
  read_back = programs is not None and "train_step" in programs.loaded
  log(f"compiled the step in {time.perf_counter() - start:.1f} s"
      + (" (read back from the compilation cache)" if read_back else "") + (
      f"; per device: {memory.argument_size_in_bytes / 2**20:.1f} MiB arguments, "
      f"{memory.temp_size_in_bytes / 2**20:.1f} MiB temporaries" if memory else ""))
  return train_step, eval_step


# --- the loop and its periodic work ---------------------------------------------------------

@dataclasses.dataclass
class Run:
  """What the loop's periodic work shares: the run's pieces, its outputs, its results."""
  config: ml_collections.ConfigDict
  setup: Setup
  eval_step: Callable
  checkpoints: checkpoint.Checkpoints
  writer: metrics_lib.MetricWriter
  result: RunResult
  goodput: goodput_lib.Goodput = dataclasses.field(default_factory=goodput_lib.Goodput)
  profiler: profiler_lib.StepProfiler = dataclasses.field(
      default_factory=lambda: profiler_lib.StepProfiler(None, ""))
  programs: programs_lib.Programs | None = None
  periodic: tuple[Every, ...] = ()
  watchdog: watchdog_lib.Watchdog = dataclasses.field(default_factory=watchdog_lib.Watchdog)
  local: checkpoint.Checkpoints | None = None   # the local tier (tiers.py), if any

  @property
  def tiers(self) -> list[checkpoint.Checkpoints]:
    return [self.checkpoints] + ([self.local] if self.local is not None else [])

  def __post_init__(self):
    self.units_per_step, self.flops_per_step = work_per_step(self.config, self.setup)
    self.peak_flops_total = peak_flops_total(self.config, self.setup.spec.mesh, self.programs)
    self.config_dict = checkpoint.config_to_dict(self.config)
    self.units = units_of(self.config, self.setup)


def train_loop(run_: Run, state, train_step, start_step: int, data_position: dict | None,
               stop: StopSignal):
  """Steps from `start_step` to train.steps, with log/eval/checkpoint every N steps; stops
  after a step on SIGTERM/SIGINT (saved). Returns the final state."""
  config, total_steps = run_.config, run_.config.train.steps
  t = config.train
  if start_step == 0:
    evaluate(run_, state, 0)
  # Batches are prepared ahead (Grain's threads or workers, or a prefetch thread) while steps
  # run; the iterator places each on the devices and resumes a checkpoint's data position.
  prefetch = config.data.get("prefetch", 2)  # absent from configs saved before it existed
  batch_iter = run_.setup.batches.iterator(start_step, data_position, prefetch)
  observe = getattr(batch_iter, "observe", lambda state: None)  # sampled from the model
  observe(state)
  pending: list = []
  interval = Interval()
  one_step_in_flight = run_.setup.spec.mesh.devices.flat[0].platform == "cpu"
  host_times = stragglers.HostTimes(t.get("straggler_every", 0), start_step)
  guard = "disallow" if t.transfer_guard else "allow"
  try:
    with jax.transfer_guard(guard):
      for current in range(start_step, total_steps):
        started = time.perf_counter()
        batch = interval.wait_for(batch_iter)
        host_seconds = time.perf_counter() - started  # this host's own part of the step
        if one_step_in_flight:
          wait_for_previous_step(pending)
        # The guard turns an implicit host->device copy (say a NumPy array reaching the step)
        # into an error; placing the batch is an explicit transfer and passes.
        run_.profiler.before_step(current + 1)
        host_times.add(host_seconds)
        state, step_metrics = train_step(state, batch)
        observe(state)
        done = current + 1
        run_.profiler.after_step(done, step_metrics)
        pending.append((done, step_metrics))
        run_.watchdog.step(done, step_metrics)  # progress once its metrics are computed
        at_end = done == total_steps
        # Read the stop flag once per step: a signal that lands during this step's flush, eval
        # or save is acted on next step, so "stopped" always means "flushed and saved".
        stopping = stop.should_stop(done)
        save_now = done % t.checkpoint_every == 0 or at_end or stopping
        local_now = not save_now and run_.local is not None and tiers.due(run_.config, done)
        # The first step's line comes at once (it shows the run is under way), then every
        # log_every steps.
        if done % t.log_every == 0 or save_now or local_now or done == start_step + 1:
          flush(run_, pending, interval)
        if host_times.due(done):
          report_stragglers(run_, host_times, done)
        # A second signal: straight to the save (one process only: eval and periodic work
        # are collectives the other processes would run).
        hurry = stopping and stop.urgent and not stop.multiprocess
        if (done % t.eval_every == 0 or at_end) and not hurry:
          evaluate(run_, state, done)
          run_.watchdog.beat(f"eval at step {done}")
        due = [] if hurry else [work for work in run_.periodic
                                if done % work.steps == 0 or at_end]
        for work in due:
          work.fn(run_, state, done)
          run_.watchdog.beat(f"periodic work at step {done}")
        if save_now or local_now:
          tiers.save(run_, done, state, batch_iter.position(),
                     run_.local if local_now else None)
          run_.watchdog.beat(f"checkpoint save at step {done}")
        if done % t.eval_every == 0 or save_now or local_now or due:
          interval.restart()  # step time excludes eval and checkpoint work
        run_.result.final_step = done
        if stopping:
          run_.result.stopped_early = True
          log(f"stopped at step {done} on request; checkpoint saved")
          break
  finally:
    batch_iter.close()
  return state


def report_stragglers(run_: Run, host_times: stragglers.HostTimes, step: int) -> None:
  """Names the processes slower than the others at their own part of the steps since the
  last report (stragglers.py); every process calls it at the same step."""
  slow, window = host_times.report(step)
  for straggler in slow:
    log(stragglers.line(straggler, window))
    run_.writer.write(step, "straggler", stragglers.record(straggler))


def wait_for_previous_step(pending: list) -> None:
  """On XLA's CPU backend, steps queued behind each other can deadlock: all but one simulated
  device wait in the next step's all-reduce (measured in the ViT run: "7 of 8 arrived" aborts).
  So on CPU the loop keeps one step in flight: it waits for the previous step's metrics before
  dispatching the next. The next batch is already prepared, so only dispatch waits."""
  if pending:
    jax.block_until_ready(pending[-1][1])


class Interval:
  """Wall time since the last restart, how much of it the loop waited for batches, and how
  much of that wait was the run's own work (an iterator's `work_seconds`: GRPO's rollouts)."""

  def __init__(self):
    self.restart()

  def restart(self) -> None:
    self.start, self.data_wait, self.work = time.perf_counter(), 0.0, 0.0

  def wait_for(self, batch_iter):
    waiting, work = time.perf_counter(), getattr(batch_iter, "work_seconds", 0.0)
    batch = next(batch_iter)
    self.data_wait += time.perf_counter() - waiting
    self.work += getattr(batch_iter, "work_seconds", 0.0) - work
    return batch


def flush(run_: Run, pending: list, interval: Interval) -> None:
  """Fetches pending step metrics, stops on a non-finite loss, logs the latest; the steps took
  from the interval's start until their metrics arrived (not only until they were
  dispatched). Restarts the interval."""
  fetched = jax.device_get([m for _, m in pending])
  seconds = time.perf_counter() - interval.start
  result = run_.result
  waited = max(0.0, interval.data_wait - interval.work)
  result.data_wait_seconds += waited
  result.rollout_seconds += interval.work
  result.step_seconds += seconds
  fetched[-1]["data_wait_fraction"] = waited / seconds if seconds > 0 else 0.0
  if interval.work:
    fetched[-1]["rollout_fraction"] = interval.work / seconds if seconds > 0 else 0.0
  fetched[-1].update(metrics_lib.throughput(seconds / len(pending), run_.units_per_step,
                                            run_.flops_per_step, run_.peak_flops_total,
                                            run_.setup.task.unit))
  for (at_step, _), values in zip(pending, fetched):
    values = {k: float(v) for k, v in values.items()}
    # A non-finite gradient poisons the parameters one step before the loss shows it.
    bad = [name for name in ("loss", "grad_norm") if not math.isfinite(values[name])]
    if bad:
      raise NonFiniteLoss(
          f"{bad[0]} is {values[bad[0]]} at step {at_step}; stopped without saving that "
          f"state. Lower optimizer.learning_rate or clip harder (optimizer.clip_norm)")
    result.train_losses[at_step] = values["loss"]
    run_.writer.write(at_step, "train", values)
  log(metrics_lib.progress_line(pending[-1][0], run_.config.train.steps, values,
                                seconds / len(pending), run_.units_per_step,
                                run_.flops_per_step, run_.peak_flops_total,
                                unit=run_.setup.task.unit, units=run_.units))
  pending.clear()
  interval.restart()


def evaluate(run_: Run, state, at_step: int) -> None:
  """Runs the held-out batches, writes and logs the task's summary (timed as eval)."""
  with run_.goodput.phase("eval"):
    _evaluate(run_, state, at_step)


def _evaluate(run_: Run, state, at_step: int) -> None:
  setup, result = run_.setup, run_.result
  batches = setup.batches
  if hasattr(batches, "evaluate"):  # a source sampled from the model evaluates the same way
    summary = batches.evaluate(state, at_step)
  else:
    outputs = [run_.eval_step(state, batches.eval_batch(i))
               for i in range(batches.eval_batches)]
    summary = setup.task.summarize(jax.device_get(outputs))
  scalars = {k: v for k, v in summary.items() if isinstance(v, float)}
  if "loss" in scalars:
    result.eval_losses[at_step] = scalars["loss"]
  result.eval_metrics[at_step] = scalars
  run_.writer.write(at_step, "eval", scalars)
  if setup.task.name == "classification":
    result.confusion = tasks.confusion_matrix(summary["labels"], summary["predictions"],
                                              setup.spec.model.num_classes)
  log(metrics_lib.eval_line(at_step, scalars, run_.units))


def nothing_to_train(config: ml_collections.ConfigDict, start_step: int,
                     result: RunResult) -> RunResult:
  """A checkpoint at or past train.steps: say so and stop before compiling anything."""
  if start_step > config.train.steps:
    raise ConfigError(f"the checkpoint is at step {start_step}, past train.steps="
                      f"{config.train.steps}; raise train.steps to continue training")
  log(f"the checkpoint is at train.steps={start_step} already: nothing to train; raise "
      f"--config.train.steps to continue")
  return result


# --- finish ---------------------------------------------------------------------------------

# After a failure: how long to wait for a save still in flight (a good checkpoint, unless the
# failure was the storage's own, which has nothing left worth waiting for).
WAIT_AFTER_FAILURE_S = 300
WAIT_AFTER_STORAGE_FAILURE_S = 10


def close_outputs(run_: Run, failure: BaseException | None = None) -> None:
  """Ends the profile window, waits for the last checkpoint (timed as checkpointing) and
  records the save timings; the metrics writer stays open for the run's last records. After a
  `failure` (about to be raised) the waits are bounded and their own errors dropped, so the
  first error is the one reported and nothing keeps the process from exiting, and the writer
  is closed too."""
  if failure is not None:
    try:
      run_.profiler.close()
    except Exception:  # pylint: disable=broad-except  # the failure is the one to report
      pass
    storage_failed = isinstance(failure, storage.StorageError)
    for tier in run_.tiers:
      tier.close(timeout_s=WAIT_AFTER_STORAGE_FAILURE_S if storage_failed
                 else WAIT_AFTER_FAILURE_S)
    run_.writer.close()
    return
  run_.profiler.close()
  with run_.goodput.phase("checkpoint"):  # the last async saves finishing
    for tier in run_.tiers:
      tier.close()
  tiers.write_save_timings(run_)


def write_goodput(run_: Run) -> None:
  """The goodput line and its metrics.jsonl record; the steps' time and the data wait come
  from the intervals the progress lines measured."""
  result, goodput = run_.result, run_.goodput
  goodput.add("steps", max(0.0, result.step_seconds - result.data_wait_seconds
                           - result.rollout_seconds))
  goodput.add("data_wait", result.data_wait_seconds)
  if result.rollout_seconds:
    goodput.add("rollouts", result.rollout_seconds)
  record = goodput.record()
  record.update(goodput_lib.job_fields(record, result.start_step, result.final_step,
                                       goodput.started_unix, time.time()))
  run_.writer.write(result.final_step, "goodput", record)
  log(goodput_lib.format_line(record))


def write_plots(run_: Run, workdir: str) -> None:
  """loss.png, and confusion.png for a classifier (process 0). A plot that cannot be written
  is a warning: the run itself is complete."""
  if jax.process_index() != 0:
    return
  try:
    plot = metrics_lib.plot_loss_curve(run_.writer.path, workdir_lib.join(workdir, "loss.png"),
                                       run_.units)
    if plot:
      log(f"loss curve: {plot}")
    result = run_.result
    if result.confusion is not None:
      last = max(result.eval_metrics)
      path = metrics_lib.plot_confusion_matrix(
          result.confusion, workdir_lib.join(workdir, "confusion.png"),
          f"held-out, step {last}: accuracy {result.eval_metrics[last]['accuracy']:.2%}")
      log(f"confusion matrix: {path}")
  except OSError as e:
    log(f"warning: a plot could not be written into {workdir} ({storage.cause(e)})")
