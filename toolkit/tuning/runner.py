"""Hyperparameter sweeps: `run(config_arg, workdir)`, behind `python -m toolkit.sweep`.

The experiment file's `get_sweep(arg)` declares the trials (`toolkit.tuning.search`). Two ways to
train them, chosen by --mode (auto: population when the trials differ only in values):

  population  up to K trials at a time in ONE compiled program (`toolkit.tuning.population`): the
              state has a leading trial axis split over a `population` mesh axis.
  processes   each trial a separate `training.run` on its own disjoint subset of the devices, up to
              K at once (fewer when the devices do not go round: then one after another).

Workdir layout:
  sweep.json                 the expanded trials (a restart must find the same ones)
  trials/NNN/                one trial: trial.json (status, steps, time), config.json,
                             metrics.jsonl, checkpoints/, loss.png, train.log (process mode)
  results.csv, results.md    the table and the best trial's launch command
  eval_loss.png, hyperparameters.png

Resuming: run the same command again. Finished trials are not rerun; the others continue from
their latest checkpoints (in either mode: every trial checkpoints in the single-run layout).
With `halving` in the sweep, trials are compared by eval loss at each rung and only the best
1/eta go on (decided when every live trial has reached the rung, so a resumed sweep decides
exactly as an uninterrupted one).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import io
import json
import math
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

import sharding
from toolkit import command_line
from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training import loop
from toolkit.tuning import population, results as results_lib, search

MODES = ("auto", "population", "processes")
LIVE, FINISHED = ("pending", "running"), ("done", "stopped", "diverged")


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A sweep declaration with its trials expanded into configs."""
  config_arg: str
  config_file: str
  sweep: search.Sweep
  overrides: list[dict[str, Any]]
  configs: list[ml_collections.ConfigDict]

  @property
  def fields(self) -> list[str]:
    return list(self.sweep.parameters)

  def command(self, index: int, workdir: str) -> str:
    return search.launch_command(self.config_file, self.sweep.base,
                                 {**self.sweep.fixed, **self.overrides[index]}, workdir)


def load(config_arg: str, fixed: dict[str, Any] | None = None) -> Loaded:
  """Calls `get_sweep(arg)` of `path[:arg]`, then `get_config(sweep.base)` of the same file;
  `fixed` adds to (or replaces) the sweep's own fixed fields."""
  path, _, arg = config_arg.partition(":")
  if not os.path.isfile(path) or not path.endswith(".py"):
    raise ConfigError(command_line.missing_config_file(config_arg))
  spec = importlib.util.spec_from_file_location("_sweep_experiment", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # as an import would: dataclasses look their module up
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  # a broken experiment file
    explain = command_line._experiment_error  # pylint: disable=protected-access
    raise ConfigError(explain(config_arg, path, e)) from None
  if not callable(getattr(module, "get_sweep", None)):
    raise ConfigError(f"--config={config_arg}: {path} defines no get_sweep(arg=None); add one "
                      f"that returns a toolkit.tuning.search.Sweep")
  try:
    sweep = module.get_sweep(arg or None)
    base = module.get_config(sweep.base)
  except ValueError as e:
    raise ConfigError(f"--config={config_arg}: {e}") from None
  if not isinstance(sweep, search.Sweep):
    raise ConfigError(f"--config={config_arg}: get_sweep returned {type(sweep).__name__}, not a "
                      f"toolkit.tuning.search.Sweep")
  if fixed:
    sweep = dataclasses.replace(sweep, fixed={**sweep.fixed, **fixed})
  base = search.apply(base, sweep.fixed, "sweep fixed")
  overrides = search.trials(sweep)
  configs = [search.apply(base, o) for o in overrides]
  return Loaded(config_arg, path, sweep, overrides, configs)


# --- trial records ---------------------------------------------------------------------------

def _write_json(path: str, value: Any) -> None:
  """Written whole (a temporary file renamed, or one gs:// upload): a killed sweep never leaves
  half a record."""
  workdir_lib.write_text(path, json.dumps(value, indent=2))


class Records:
  """trial.json of every trial: status, step reached, starts, seconds and tokens trained."""

  def __init__(self, loaded: Loaded, workdir: str):
    self.dirs = [os.path.join(workdir, "trials", f"{i:03d}") for i in range(len(loaded.configs))]
    self.records = []
    for i, directory in enumerate(self.dirs):
      path = os.path.join(directory, "trial.json")
      if workdir_lib.exists(path):
        record = json.loads(workdir_lib.read_text(path))
      else:
        record = {"trial": f"{i:03d}", "overrides": loaded.overrides[i], "status": "pending",
                  "step": 0, "starts": 0, "seconds": 0.0, "tokens": 0}
      record["command"] = loaded.command(i, directory)
      self.records.append(record)

  def __getitem__(self, index: int) -> dict:
    return self.records[index]

  def save(self, index: int, **changes) -> None:
    self.records[index].update(changes)
    workdir_lib.makedirs(self.dirs[index])
    _write_json(os.path.join(self.dirs[index], "trial.json"), self.records[index])


def _check_same_sweep(loaded: Loaded, workdir: str) -> None:
  path = os.path.join(workdir, "sweep.json")
  declared = json.loads(json.dumps({"config": loaded.config_arg, "base": loaded.sweep.base,
                                    "fixed": dict(loaded.sweep.fixed),
                                    "trials": loaded.overrides}))
  if workdir_lib.exists(path):
    saved = json.loads(workdir_lib.read_text(path))
    for key in ("base", "fixed", "trials"):
      if saved.get(key) != declared[key]:
        raise ConfigError(f"--workdir={workdir} holds a different sweep (its {key} differ from "
                          f"--config={loaded.config_arg}'s); use a fresh --workdir or the "
                          f"sweep's own declaration")
  else:
    _write_json(path, declared)


# --- running trials --------------------------------------------------------------------------

def _segment(config: ml_collections.ConfigDict, until: int) -> ml_collections.ConfigDict:
  """The trial's config trained up to `until` on its full learning-rate schedule."""
  if until == config.train.steps:
    return config
  return search.apply(config, {"train.steps": until, "optimizer.schedule_steps":
                               config.optimizer.schedule_steps or config.train.steps})


def _status(loaded: Loaded, index: int, step: int) -> str:
  return "done" if step >= loaded.configs[index].train.steps else "running"


def _tokens_per_step(config) -> int:
  return config.data.global_batch_size * config.data.seq_len


class _ThreadOutput(io.TextIOBase):
  """sys.stdout while trials train in threads: each line gets its trial's prefix on the
  console and goes, unprefixed, to that trial's train.log (on gs://: a local file, uploaded
  whole, after the log already there, when the trial's run ends)."""

  def __init__(self, stream):
    self.stream, self.local, self.lock = stream, threading.local(), threading.Lock()

  def attach(self, prefix: str, path: str) -> None:
    self.local.remote = path if workdir_lib.is_url(path) else None
    local = tempfile.mkstemp(prefix="meshkit-train-", suffix=".log")[1] if self.local.remote \
        else path
    self.local.prefix, self.local.file, self.local.buffer = prefix, open(local, "a"), ""

  def detach(self) -> None:
    if getattr(self.local, "file", None):
      self.local.file.close()
      if self.local.remote:
        earlier = (workdir_lib.path(self.local.remote).read_bytes()
                   if workdir_lib.exists(self.local.remote) else b"")
        with open(self.local.file.name, "rb") as f:
          workdir_lib.write_bytes(self.local.remote, earlier + f.read())
        os.remove(self.local.file.name)
    self.local.prefix = self.local.file = None

  def write(self, text: str) -> int:
    if getattr(self.local, "prefix", None) is None:
      with self.lock:
        return self.stream.write(text)
    self.local.buffer += text
    *lines, self.local.buffer = self.local.buffer.split("\n")
    with self.lock:
      for line in lines:
        self.stream.write(f"[{self.local.prefix}] {line}\n")
        self.local.file.write(line + "\n")
    return len(text)

  def flush(self) -> None:
    with self.lock:
      self.stream.flush()
      if getattr(self.local, "file", None):
        self.local.file.flush()


def _devices_per_trial(config, devices: int, concurrent: int) -> int:
  """The most devices <= devices / concurrent on which the trial's mesh fits (0: none)."""
  pairs = sharding.parse_axis_sizes(config.mesh.ici, "mesh.ici")
  fixed = math.prod(size for _, size in pairs if size != -1)
  wildcard = any(size == -1 for _, size in pairs)
  for size in range(devices // max(concurrent, 1), 0, -1):
    if (wildcard and size % fixed == 0) or size == fixed:
      return size
  return 0


def _run_processes(loaded: Loaded, records: Records, pending: Sequence[int], until: int,
                   devices: list, max_concurrent: int, log: Callable[[str], None]) -> None:
  config = loaded.configs[pending[0]]
  at_once = min(max_concurrent or len(devices), len(pending))
  size = _devices_per_trial(config, len(devices), at_once)
  while at_once > 1 and not size:
    at_once -= 1
    size = _devices_per_trial(config, len(devices), at_once)
  if not size:
    raise ConfigError(f"mesh.ici={config.mesh.ici!r} does not fit on {len(devices)} devices")
  at_once = min(at_once, len(devices) // size)
  log(f"process mode: {len(pending)} trials, {at_once} at a time on {size} device(s) each")
  subsets: queue.Queue = queue.Queue()
  for slot in range(at_once):
    subsets.put(devices[slot * size:(slot + 1) * size])
  output = _ThreadOutput(sys.stdout) if at_once > 1 else None

  def train_one(index: int) -> None:
    subset = subsets.get()
    trial = records[index]["trial"]
    try:
      records.save(index, status="running", starts=records[index]["starts"] + 1)
      if output:
        output.attach(trial, os.path.join(records.dirs[index], "train.log"))
      seg = _segment(loaded.configs[index], until)
      started = time.perf_counter()
      try:
        result = loop.run(seg, records.dirs[index], devices=subset)
        step = result.final_step
        status = _status(loaded, index, step)
        trained = len(result.train_losses)
      except loop.NonFiniteLoss as e:
        log(f"trial {trial} diverged: {e}")
        status, step, trained = "diverged", records[index]["step"], 0
      records.save(index, status=status, step=step,
                   seconds=records[index]["seconds"] + time.perf_counter() - started,
                   tokens=records[index]["tokens"] + trained * _tokens_per_step(seg))
    finally:
      if output:
        output.detach()
      subsets.put(subset)

  previous = sys.stdout
  if output:
    sys.stdout = output
  try:
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
      for future in concurrent.futures.as_completed([pool.submit(train_one, i) for i in pending]):
        future.result()
  finally:
    sys.stdout = previous


def _run_population(loaded: Loaded, records: Records, pending: Sequence[int], until: int,
                    devices: list, max_concurrent: int, log: Callable[[str], None]) -> None:
  group_size = max_concurrent or len(pending)
  groups = [pending[i:i + group_size] for i in range(0, len(pending), group_size)]
  for number, group in enumerate(groups):
    names = ",".join(records[i]["trial"] for i in group)
    log(f"population {number + 1}/{len(groups)}: trials {names} to step {until}")
    for i in group:
      records.save(i, status="running", starts=records[i]["starts"] + 1)
    segs = [_segment(loaded.configs[i], until) for i in group]
    outcomes = population.run(segs, [records.dirs[i] for i in group], until, devices, log)
    for i, seg, outcome in zip(group, segs, outcomes):
      trained = (outcome.diverged_at or until) - outcome.start_step
      records.save(i, status="diverged" if outcome.diverged_at else _status(loaded, i, until),
                   step=outcome.diverged_at or until,
                   seconds=records[i]["seconds"] + outcome.seconds,
                   tokens=records[i]["tokens"] + trained * _tokens_per_step(seg))


def _halve(loaded: Loaded, records: Records, rung: int, log: Callable[[str], None]) -> None:
  """Successive halving at `rung`: of the trials that reached it, the best 1/eta go on."""
  reached = [i for i, r in enumerate(records.records)
             if r["status"] != "diverged" and r["step"] >= rung]
  losses = {i: results_lib.eval_losses(records.dirs[i]).get(rung, math.inf) for i in reached}
  ranked = sorted(reached, key=lambda i: (losses[i], i))
  keep = max(1, len(ranked) // loaded.sweep.halving.eta)
  for i in ranked[keep:]:
    if records[i]["step"] == rung and records[i]["status"] != "stopped":
      records.save(i, status="stopped")
  log(f"halving at step {rung}: {keep} of {len(ranked)} trials go on "
      f"({', '.join(records[i]['trial'] for i in ranked[:keep])})")


@dataclasses.dataclass
class SweepResult:
  mode: str
  results: list[results_lib.TrialResult]
  paths: dict[str, str]
  seconds: float

  @property
  def best(self) -> results_lib.TrialResult:
    return min(self.results, key=results_lib._sort_key)  # pylint: disable=protected-access


def choose_mode(loaded: Loaded, mode: str, log: Callable[[str], None]) -> str:
  if mode not in MODES:
    raise ConfigError(f"--mode={mode!r} is unknown; use one of {', '.join(MODES)}")
  if mode == "processes":
    return mode
  try:
    population.varying_fields(loaded.configs)
  except ConfigError as e:
    if mode == "population":
      raise
    log(f"processes mode: {str(e).removeprefix('population mode: ')}")
    return "processes"
  return "population"


def run(config_arg: str, workdir: str, mode: str = "auto", max_concurrent: int = 0,
        devices=None, log: Callable[[str], None] = print,
        fixed: dict[str, Any] | None = None) -> SweepResult:
  """Runs (or resumes) the sweep declared by `config_arg` in `workdir` (`fixed`: see load)."""
  started = time.perf_counter()
  if max_concurrent < 0:
    raise ConfigError(f"--max_concurrent={max_concurrent} must be >= 0 (0: as many as fit)")
  loaded = load(config_arg, fixed)
  mode = choose_mode(loaded, mode, log)
  devices = list(jax.devices() if devices is None else devices)
  loop.prepare_workdir(workdir)
  _check_same_sweep(loaded, workdir)
  records = Records(loaded, workdir)
  steps = loaded.configs[0].train.steps
  if any(c.train.steps != steps for c in loaded.configs):
    raise ConfigError("the trials differ in train.steps; sweep it with halving instead, or run "
                      "separate sweeps")
  rungs = loaded.sweep.halving.rungs(steps) if loaded.sweep.halving else [steps]
  total = len(loaded.configs)
  log(f"sweep of {total} trials ({loaded.sweep.method}) in {mode} mode on {len(devices)} "
      f"devices; rungs {rungs}; workdir {workdir}")
  run_trials = _run_population if mode == "population" else _run_processes
  for rung in rungs:
    pending = [i for i, r in enumerate(records.records)
               if r["status"] in LIVE and r["step"] < rung]
    if pending:
      run_trials(loaded, records, pending, rung, devices, max_concurrent, log)
    if rung < steps and loaded.sweep.halving:
      _halve(loaded, records, rung, log)
    finished = sum(r["status"] in FINISHED or r["step"] >= rung for r in records.records)
    elapsed = time.perf_counter() - started
    log(f"sweep: {finished}/{total} trials at step {rung} or finished; {elapsed:.0f} s so far")
  for i, record in enumerate(records.records):
    if record["status"] == "running" and record["step"] >= steps:
      records.save(i, status="done")
  trial_results = [results_lib.TrialResult(
      trial=r["trial"], overrides=r["overrides"], status=r["status"], steps=r["step"],
      eval_losses=results_lib.eval_losses(records.dirs[i]),
      tokens_per_second=r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
      workdir=records.dirs[i], command=r["command"]) for i, r in enumerate(records.records)]
  paths = results_lib.write(trial_results, loaded.fields, workdir, mode)
  result = SweepResult(mode, trial_results, paths, time.perf_counter() - started)
  best = result.best
  log(f"results: {paths['markdown']}, {paths['csv']}; best trial {best.trial}: final eval loss "
      f"{best.final_eval_loss:.4f}\nbest trial's launch command:\n  {best.command}")
  return result
