"""Benchmark: a population of K trials in one program against K single-trial runs.

  python scripts/bench/bench_sweep.py                  # the CPU LM, K=8, 8 simulated devices
  python scripts/bench/bench_sweep.py --quick          # the tiny model: ~2 min on 2 cores, the smoke test

Two measurements, on the experiment's sweep (`experiments/lm.py` get_sweep):
  1. step time: the K-trial population step (trial axis split over a `population` mesh axis)
     against K x the step of one trial trained alone on all the devices (its experiment mesh);
     median of rounds that alternate the two, after warm-up. Target: ratio <= 0.5.
  2. sweep wall time: the experiment's whole sweep (`toolkit.tuning.runner.run`, --sweep_steps steps each,
     compiles, evals and checkpoints included) in population mode and in process mode (K runs
     at once on disjoint device subsets).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer(
    "devices", 8, "Simulated host devices (sets XLA_FLAGS unless it already names a count).")
_SWEEP = flags.DEFINE_string("sweep", "experiments/lm.py:cpu", "Experiment file:sweep variant.")
_TRIALS = flags.DEFINE_integer("trials", 8, "K: trials in the population (the first K).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds; population and single alternate.")
_STEPS = flags.DEFINE_integer("steps_per_round", 5, "Steps of each kind per round.")
_SWEEP_STEPS = flags.DEFINE_integer("sweep_steps", 30, "Steps per trial in the wall-time part "
                                    "(0 skips it).")
_AXIS = flags.DEFINE_integer("population_axis", 0, "Size of the population mesh axis (0: the "
                             "largest that fits, one trial per device group).")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_QUICK = flags.DEFINE_bool("quick", False, "The tiny sweep: its first 2 trials' step time, 1 "
                           "round of 2 steps; its 4 trials in 4-step sweeps (the smoke test).")

TARGET_RATIO = 0.5


def _time_steps(step, state, args, steps: int):
  import jax  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, *args)
  jax.block_until_ready(metrics)
  return state, (time.perf_counter() - start) / steps


def step_times(sweep_arg: str, trials: int, rounds: int, steps: int, axis_size: int = 0) -> dict:
  from toolkit.tuning import population
  from toolkit.training import state as state_lib, step as step_lib
  from toolkit import training as train
  from toolkit.tuning import runner as sweep_lib
  loaded = sweep_lib.load(sweep_arg)
  configs = loaded.configs[:trials]
  if len(configs) < trials:
    raise SystemExit(f"error: {sweep_arg} has {len(configs)} trials, fewer than --trials={trials}")
  pop = population.build(configs, axis_size=axis_size)
  pop_state = pop.init()
  batch = pop.batch(0)
  single = train.build(configs[0])
  single_state = state_lib.create(single.spec.model, single.optimizer, single.layout,
                                  configs[0].seed)
  single_step, _ = step_lib.compile_step(single.step, single.layout, single.batches.abstract(),
                                         single.spec.mesh)
  single_batch = single.batches.batch(0)
  pop_times, single_times = [], []
  pop_state, _ = _time_steps(pop.train_step, pop_state, (pop.hparams, batch), 2)  # compile
  single_state, _ = _time_steps(single_step, single_state, (single_batch,), 2)
  for r in range(rounds):
    pop_state, seconds = _time_steps(pop.train_step, pop_state, (pop.hparams, batch), steps)
    pop_times.append(seconds)
    single_state, seconds = _time_steps(single_step, single_state, (single_batch,), steps)
    single_times.append(seconds)
    print(f"round {r + 1}/{rounds}: population {pop_times[-1] * 1000:.0f} ms/step, single trial "
          f"{single_times[-1] * 1000:.0f} ms/step", flush=True)
  pop_ms = statistics.median(pop_times) * 1000
  single_ms = statistics.median(single_times) * 1000
  return {"trials": trials, "population_mesh": dict(pop.mesh.shape),
          "single_mesh": dict(single.spec.mesh.shape), "population_ms_per_step": pop_ms,
          "single_ms_per_step": single_ms, "ratio": pop_ms / (trials * single_ms),
          "round_ratios": [p / (trials * s) for p, s in zip(pop_times, single_times)]}


def sweep_times(sweep_arg: str, trials: int, steps: int) -> dict:
  from toolkit.tuning import runner as sweep_lib  # pylint: disable=g-import-not-at-top
  loaded = sweep_lib.load(sweep_arg)
  # Fewer steps, and evals/checkpoints at the same points in both modes.
  fixed = {"train.steps": steps, "train.eval_every": max(steps // 2, 1),
           "train.checkpoint_every": steps, "train.log_every": max(steps // 2, 1)}
  del loaded
  out = {}
  for mode in ("population", "processes"):
    workdir = tempfile.mkdtemp(prefix=f"bench_sweep_{mode}_")
    try:
      start = time.perf_counter()
      result = sweep_lib.run(sweep_arg, workdir, mode=mode, max_concurrent=trials,
                             fixed=fixed, log=lambda line: None)
      seconds = time.perf_counter() - start
      out["trials"] = len(result.results)  # the whole sweep: --trials counts the step part's
      out[mode] = {"seconds": seconds, "best_final_eval_loss": result.best.final_eval_loss,
                   "final_eval_losses": [r.final_eval_loss for r in result.results]}
      print(f"{mode}: {len(result.results)} trials x {steps} steps in {seconds:.1f} s", flush=True)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
  out["ratio"] = out["population"]["seconds"] / out["processes"]["seconds"]
  return out


def main(argv) -> None:
  del argv
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  command_line.quiet_logging()
  sweep_arg, trials = _SWEEP.value, _TRIALS.value
  rounds, steps, sweep_steps = _ROUNDS.value, _STEPS.value, _SWEEP_STEPS.value
  if _QUICK.value:
    sweep_arg, trials, rounds, steps, sweep_steps = "experiments/lm.py:tiny", 2, 1, 2, 4
  import jax  # pylint: disable=g-import-not-at-top
  print(f"{jax.device_count()} x {jax.devices()[0].device_kind}; sweep {sweep_arg}; K={trials}",
        flush=True)
  results = {"step": step_times(sweep_arg, trials, rounds, steps, _AXIS.value)}
  s = results["step"]
  print(f"\n| K | population mesh | population ms/step | single-trial mesh | single ms/step | "
        f"population / (K x single) (target <= {TARGET_RATIO}) |\n|---|---|---|---|---|---|\n"
        f"| {trials} | {s['population_mesh']} | {s['population_ms_per_step']:.0f} | "
        f"{s['single_mesh']} | {s['single_ms_per_step']:.0f} | {s['ratio']:.2f} |", flush=True)
  if sweep_steps:
    results["sweep"] = sweep_times(sweep_arg, trials, sweep_steps)
    w = results["sweep"]
    print(f"\n| {w['trials']} trials x {sweep_steps} steps | wall time |\n|---|---|\n"
          f"| population mode | {w['population']['seconds']:.1f} s |\n"
          f"| process mode | {w['processes']['seconds']:.1f} s |\n"
          f"| ratio | {w['ratio']:.2f} |", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(results, f, indent=2)


def _set_devices(argv: list[str]) -> None:
  """Simulated devices must be set before JAX starts, so before flags are parsed by absl."""
  count = next((a.split("=", 1)[1] for a in argv if a.startswith("--devices=")), "8")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  _set_devices(sys.argv)
  app.run(main)
