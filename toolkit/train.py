"""Training: `run(config, workdir)` and its command line.

  python -m toolkit.train --config=experiments/lm.py:cpu --workdir=/tmp/lm

The loop reads top to bottom: setup -> mesh -> data -> abstract state -> shardings ->
restore-or-init -> compile -> loop, with periodic work (log, eval, checkpoint) every N steps.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import sharding
from toolkit import checkpoint, config as config_lib, data, metrics as metrics_lib, state as state_lib
from toolkit import step as step_lib
from toolkit.config import ConfigError
from toolkit.sample import sample_text

# Dense bf16 peak FLOP/s per chip, used for MFU when train.peak_flops_per_device is 0.
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12,
}


class NonFiniteLoss(RuntimeError):
  """Training produced a NaN or infinite loss; no checkpoint of that state was written."""


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _prepare_workdir(workdir: str) -> None:
  if not workdir:
    raise ConfigError("--workdir is empty; give a directory for checkpoints and metrics")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir={workdir!r} cannot be created ({e.strerror}); choose a "
                      f"writable directory") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir={workdir!r} is not writable; choose a writable directory")


class _StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits cleanly."""

  def __init__(self):
    self.requested = False
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.requested = True
    log(f"received {signal.Signals(signum).name}: finishing this step, then saving")

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


def _peak_flops(config) -> float:
  if config.train.peak_flops_per_device > 0:
    return config.train.peak_flops_per_device
  return PEAK_FLOPS_BY_DEVICE_KIND.get(jax.devices()[0].device_kind, 0.0)


@dataclasses.dataclass(frozen=True)
class Setup:
  """The pieces of a run that do not depend on the workdir; the loop, the benchmark, tests
  and ahead-of-time compiles all start from here."""
  spec: config_lib.RunSpec
  batches: data.Batches
  optimizer: optax.GradientTransformation
  layout: state_lib.StateLayout
  step: step_lib.TrainStep


def build(config: ml_collections.ConfigDict, devices=None) -> Setup:
  """Validates `config` and derives mesh, data, optimizer, abstract state and the step."""
  spec = config_lib.resolve(config, devices)
  mesh, rules, model_cfg = spec.mesh, spec.rules, spec.model
  batch_sharding = jax.sharding.NamedSharding(mesh, rules.activation_spec(("batch", None), mesh))
  batches = data.Batches(data.TokenSource.from_config(config.data, model_cfg.vocab_size),
                         config.seed, config.data.seq_len, config.data.global_batch_size,
                         config.data.eval_batches, batch_sharding)
  schedule_steps = config.optimizer.schedule_steps or config.train.steps
  optimizer = step_lib.make_optimizer(config.optimizer, schedule_steps)
  schedule = step_lib.learning_rate_schedule(config.optimizer, schedule_steps)
  layout = state_lib.layout(model_cfg, optimizer, rules, mesh)
  step = step_lib.make_train_step(layout.graphdef, optimizer, schedule,
                                  config.train.microbatches, rules, mesh)
  return Setup(spec=spec, batches=batches, optimizer=optimizer, layout=layout, step=step)


def run(config: ml_collections.ConfigDict, workdir: str) -> RunResult:
  """Trains per `config`, checkpointing into `workdir`; resumes if the workdir has a checkpoint."""
  # --- setup: validate everything before touching the workdir --------------------------------
  setup = build(config)
  mesh, rules, model_cfg = setup.spec.mesh, setup.spec.rules, setup.spec.model
  batches, layout, optimizer = setup.batches, setup.layout, setup.optimizer
  _prepare_workdir(workdir)
  total_steps = config.train.steps
  log(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} in "
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
    state, _ = source.restore(restore_step, layout.abstract)
    log(f"restored step {restore_step} from {source.directory}")
  else:
    state = state_lib.create(model_cfg, optimizer, layout, config.seed)
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

  tokens_per_step = config.data.global_batch_size * config.data.seq_len
  flops_per_step = model_cfg.flops_per_token(config.data.seq_len) * tokens_per_step
  peak_total = _peak_flops(config) * jax.device_count()
  writer = metrics_lib.MetricWriter(workdir)
  result = RunResult(final_step=start_step, train_losses={}, eval_losses={}, stopped_early=False)

  def evaluate(at_step: int) -> None:
    losses = [eval_step(state, batches.eval_batch(i)) for i in range(config.data.eval_batches)]
    loss = float(np.mean(jax.device_get(losses)))
    result.eval_losses[at_step] = loss
    writer.write(at_step, "eval", {"loss": loss, "bits_per_byte": loss / math.log(2)})
    log(f"eval at step {at_step}: loss {loss:.4f} ({loss / math.log(2):.3f} bits per byte)")

  def flush(pending: list, seconds: float) -> None:
    """Fetches pending step metrics, stops on a non-finite loss, logs the latest."""
    fetched = jax.device_get([m for _, m in pending])
    for (at_step, _), values in zip(pending, fetched):
      values = {k: float(v) for k, v in values.items()}
      if not math.isfinite(values["loss"]):
        raise NonFiniteLoss(
            f"loss is {values['loss']} at step {at_step}; stopped without saving that state. "
            f"Lower optimizer.learning_rate or clip harder (optimizer.clip_norm)")
      result.train_losses[at_step] = values["loss"]
      writer.write(at_step, "train", values)
    log(metrics_lib.progress_line(pending[-1][0], total_steps, values, seconds / len(pending),
                                  tokens_per_step, flops_per_step, peak_total))
    pending.clear()

  def save(at_step: int) -> None:
    checkpoints.save(at_step, state, config_dict,
                     {"step": at_step, "seed": config.seed, "source": config.data.source})

  # --- loop ----------------------------------------------------------------------------------
  if start_step == 0:
    evaluate(0)
  pending: list = []
  interval_start = time.perf_counter()
  guard = "disallow" if config.train.transfer_guard else "allow"
  try:
    with _StopSignal() as stop, jax.transfer_guard(guard):
      for current in range(start_step, total_steps):
        with jax.transfer_guard("allow"):  # placing the batch is the one intended transfer
          batch = batches.batch(current)
        state, step_metrics = train_step(state, batch)
        done = current + 1
        pending.append((done, step_metrics))
        at_end = done == total_steps
        save_now = done % config.train.checkpoint_every == 0 or at_end or stop.requested
        if done % config.train.log_every == 0 or save_now:
          flush(pending, time.perf_counter() - interval_start)
          interval_start = time.perf_counter()
        if done % config.train.eval_every == 0 or at_end:
          evaluate(done)
        if save_now:
          save(done)
        if done % config.train.eval_every == 0 or save_now:
          interval_start = time.perf_counter()  # step time excludes eval and checkpoint work
        result.final_step = done
        if stop.requested:
          result.stopped_early = True
          log(f"stopped at step {done} on request; checkpoint saved")
          break
  finally:
    checkpoints.close()
    writer.close()
  result.step_traces = setup.step.traces
  if jax.process_index() == 0:
    plot = metrics_lib.plot_loss_curve(writer.path, os.path.join(workdir, "loss.png"))
    if plot:
      log(f"loss curve: {plot}")
    if config.train.sample_tokens > 0 and not result.stopped_early:
      result.sample = sample_text(layout.graphdef, state["params"], config.train.sample_prompt,
                                  config.train.sample_tokens, config.data.seq_len, seed=config.seed)
      log(f"sample:\n{result.sample}")
  return result


# --- command line ------------------------------------------------------------------------------
# absl and ml_collections report flag mistakes as tracebacks or multi-line "FATAL" blocks. The
# helpers below turn each into one `error:` line naming the flag and the fix.

_USAGE_EXIT = 2  # a mistake on the command line, found before anything ran


def _fail(message: str, exit_code: int = 1) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(exit_code)


def _config_argument(argv: list[str]) -> str | None:
  """The text given to --config (the last one wins, as in absl), or None."""
  value = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    match = re.fullmatch(r"--?config(?:=(.*))?", arg, re.S)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          argv[i + 1] if i + 1 < len(argv) else "")
  return value


def _override_paths(argv: list[str]) -> list[tuple[str, str]]:
  """(flag as typed, dotted field path) for each --config.FIELD override, in order."""
  found = []
  for arg in argv:
    if arg == "--":
      break
    match = re.match(r"(--?(?:no)?config\.([^=]*))", arg)
    if match:
      found.append((match.group(1), match.group(2)))
  return found


def _unknown_field(config: ml_collections.ConfigDict, flag: str, path: str) -> str | None:
  """Why `path` names no field of `config` (with the fields it could be), or None."""
  node, parents = config, ["config"]
  for key in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return (f"{flag}: config.{'.'.join(parents[1:])} is a value, not a section; override it "
              f"as --{'.'.join(parents)}=VALUE")
    if key not in node:
      known = sorted(node.keys())
      close = difflib.get_close_matches(key, known, n=1)
      hint = f"did you mean --{'.'.join(parents)}.{close[0]}? " if close else ""
      return (f"{flag}: {'.'.join(parents)} has no field {key!r}; {hint}known: "
              f"{', '.join(known)}")
    node, parents = node[key], parents + [key]
  return None


def _field_value(config, path: str):
  for key in path.split("."):
    config = config[key]
  return config


def _load_experiment(config_arg: str):
  """get_config() of `path[:arg]`, as config_flags calls it; only used to explain an error."""
  path, *arg = config_arg.split(":", 1)
  spec = importlib.util.spec_from_file_location("_experiment_for_error", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*arg)


def _explain_flag_error(error: Exception, argv: list[str]) -> str:
  """One line for an exception raised while absl parsed the command line."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  config_arg = _config_argument(argv)
  overrides = _override_paths(argv)
  if config_arg is None:
    if overrides:
      return (f"{overrides[0][0]} needs --config before it; give e.g. "
              f"--config=experiments/lm.py:tiny {overrides[0][0]}=...")
  else:
    config_index = max(i for i, arg in enumerate(argv) if re.match(r"--?config(=|$)", arg))
    early = [arg for arg in argv[:config_index] if re.match(r"--?(no)?config\.", arg)]
    if early:
      return (f"{early[0]} comes before --config; give --config={config_arg} first, then the "
              f"--config.FIELD overrides")
    config_path = config_arg.split(":", 1)[0]
    if not os.path.isfile(config_path):
      return _missing_config_file(config_arg)
    # get_config raised: config_flags re-raises its TypeError/ValueError with the traceback in
    # the text; the exception the experiment raised is further down the chain.
    chain, cause = [], error
    while cause is not None and len(chain) < 16:
      chain.append(cause)
      cause = cause.__cause__ or cause.__context__
    for outer, inner in zip(chain, chain[1:]):
      if str(outer).startswith("Error whilst parsing config file"):
        return _experiment_error(config_arg, config_path, inner)
    if any(os.path.samefile(frame.filename, config_path)
           for frame in traceback.extract_tb(chain[-1].__traceback__)
           if os.path.exists(frame.filename)):
      return _experiment_error(config_arg, config_path, chain[-1])
    try:
      config = _load_experiment(config_arg)
    except Exception:  # pylint: disable=broad-except
      config = None
    if isinstance(config, ml_collections.ConfigDict):
      for flag, path in overrides:
        reason = _unknown_field(config, flag, path)
        if reason:
          return reason
  if isinstance(error, flags.UnrecognizedFlagError):
    close = difflib.get_close_matches(error.flagname, list(flags.FLAGS), n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return f"unknown flag --{error.flagname}{hint} (see --help for the flags)"
  match = re.match(r"flag --([^=]+)=(.*?): (.*)", str(error), re.S)
  if isinstance(error, flags.IllegalFlagValueError) and match:
    name, value, reason = match.groups()
    reason = reason.strip().splitlines()[0] if reason.strip() else "invalid value"
    if name.startswith("config.") and config_arg is not None:
      field = name[len("config."):]
      try:
        current = _field_value(_load_experiment(config_arg), field)
      except Exception:  # pylint: disable=broad-except
        return f"--{name}={value}: {reason}"
      if isinstance(current, ml_collections.ConfigDict):
        return (f"--{name}={value}: config.{field} is a section; override one of its fields, "
                f"e.g. --{name}.{sorted(current.keys())[0]}=...")
      if isinstance(current, bool):
        return (f"--{name}={value}: config.{field} is a bool; give true or false, e.g. "
                f"--{name}={str(not current).lower()}")
      return (f"--{name}={value}: {reason}; config.{field} is of type "
              f"{type(current).__name__} ({current!r} in {config_arg}), give e.g. "
              f"--{name}={current}")
    return f"--{name}={value}: {reason}"
  first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  missing = re.fullmatch(r"Missing value for flag (-\S+)", first)
  if missing:
    return f"{missing.group(1)} needs a value; write {missing.group(1)}=VALUE"
  return f"{first} (see --help for the flags)"


def _missing_config_file(config_arg: str) -> str:
  path = config_arg.split(":", 1)[0]
  if not path:
    return "--config is empty; give an experiment file, e.g. --config=experiments/lm.py:tiny"
  where = "is a directory" if os.path.isdir(path) else "does not exist"
  return (f"--config={config_arg}: the experiment file {path} {where} (relative to "
          f"{os.getcwd()}); give e.g. --config=experiments/lm.py:tiny")


def _experiment_error(config_arg: str, config_path: str, error: BaseException) -> str:
  """The experiment's own message for get_config failing; its location if it is not a
  ValueError (then it is more likely a bug in the file than a bad variant)."""
  message = str(error).strip() or type(error).__name__
  for prefix in (f"{config_path}: ", f"{os.path.basename(config_path)}: "):
    message = message.removeprefix(prefix)
  if not isinstance(error, ValueError):
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.exists(f.filename) and os.path.samefile(f.filename, config_path)]
    where = f" at {config_path}:{frames[-1].lineno}" if frames else ""
    message = f"{type(error).__name__}{where}: {message}; fix the experiment file"
  return f"--config={config_arg}: {message}"


def cli() -> None:
  """`python -m toolkit.train` / `meshkit-train`: flags are defined here and nowhere else.

  Exit status: 0 when training finished or stopped on SIGTERM/SIGINT with a checkpoint;
  2 for a command-line mistake; 1 for a config, workdir or checkpoint mistake or a non-finite
  loss. Every mistake prints one `error:` line on stderr, and nothing in the workdir changes.
  """
  from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. Experiment file and variant, e.g. experiments/lm.py:tiny. "
      "Override single fields with --config.FIELD=VALUE (after --config).", lock_config=True)
  workdir_flag = flags.DEFINE_string(
      "workdir", None, "Required. Directory for checkpoints, metrics and plots; a run resumes "
      "from its latest checkpoint.")

  def parse(argv: list[str]) -> list[str]:
    # absl's own parser prints "FATAL Flags parsing error" blocks and lets some config_flags
    # exceptions escape as tracebacks; every one of them becomes one line here.
    try:
      rest = flags.FLAGS(argv)
    except (flags.Error, OSError, AttributeError, KeyError, TypeError, ValueError) as e:
      _fail(_explain_flag_error(e, argv), _USAGE_EXIT)
    if len(rest) > 1:
      _fail(f"unexpected arguments {' '.join(rest[1:])!r}; flags take the form --name=value "
            f"(see --help)", _USAGE_EXIT)
    config_arg = _config_argument(argv)
    if config_arg is None:
      _fail("--config is required; give an experiment file and variant, e.g. "
            "--config=experiments/lm.py:tiny", _USAGE_EXIT)
    if not isinstance(config_flag.value, ml_collections.ConfigDict):  # the file did not load
      _fail(_missing_config_file(config_arg) if not os.path.isfile(config_arg.split(":", 1)[0])
            else f"--config={config_arg}: get_config() did not return a ConfigDict; fix the "
                 f"experiment file", _USAGE_EXIT)
    if workdir_flag.value is None:
      _fail("--workdir is required; give a directory for checkpoints and metrics, e.g. "
            "--workdir=runs/lm", _USAGE_EXIT)
    return rest

  def main(argv) -> None:
    del argv  # checked in parse
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO; -v 0 shows it
    try:
      run(config_flag.value, workdir_flag.value)
    except (ConfigError, sharding.ShardingError, NonFiniteLoss) as e:
      _fail(e)

  app.run(main, flags_parser=parse)


if __name__ == "__main__":
  cli()
