"""Benchmark: how long checkpoint saves block the training loop, and what the checkpoints'
fingerprints cost.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python scripts/bench/bench_checkpoint.py                      # the demo, then the 7b fingerprints
  python scripts/bench/bench_checkpoint.py --quick                # seconds: the smoke test

1. Blocking. Trains the CPU demo (experiments/lm.py:cpu, 8 simulated devices) for --steps
   steps with a checkpoint every --checkpoint_every, as `toolkit.train` does. Per save: the
   time the loop spent inside `Checkpoints.save` (timed here around the call, so any revision
   of the code is measured the same way) against the save's total time from that call until
   Orbax committed it (when Orbax reports its `/jax/orbax/write/async/total_duration_secs`
   event; that event's own duration starts where Orbax's save starts, which a revision may
   put after the call returns). The
   first save is reported apart (one-time costs), the others as medians; the blocking
   fraction is blocking / total per save. To measure another revision, run this file with
   that revision first on PYTHONPATH (its toolkit is then imported instead).
2. Fingerprints (toolkit/training/checkpoints/integrity.py): FLOPs and bytes read per device from the
   compiled program's cost analysis, for the demo's state on 8 CPU devices (plus the measured
   time) and for --topology's devices (default the 7b model on a v5p-128, compiled ahead of
   time with libtpu; skipped when libtpu is missing).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from absl import app, flags


def define_flags() -> None:
  """The command line's flags; defined only when this file runs as a script (another script
  imports `save_timings`)."""
  flags.DEFINE_integer("steps", 150, "Training steps of the demo.", lower_bound=1)
  flags.DEFINE_integer("checkpoint_every", 25, "Steps between checkpoints.", lower_bound=1)
  flags.DEFINE_string("topology", "v5p-128", "TPU topology for the fingerprint cost of "
                      "--fingerprint_config ('' skips it).")
  flags.DEFINE_string("fingerprint_config", "size=7b", "experiments/lm.py variant for "
                      "--topology.")
  flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
  flags.DEFINE_bool("quick", False, "The tiny model, 6 steps, no TPU compile.")


def save_timings(variant: str, steps: int, every: int, workdir: str | None = None,
                 overrides: dict | None = None) -> list[dict]:
  """Trains `experiments/lm.py:variant` (with config `overrides`, "section.field": value) into
  `workdir` (default: a temporary folder); per save {step, blocking_s, total_s}."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from toolkit import training  # pylint: disable=g-import-not-at-top
  from toolkit.training.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  committed: list[float] = []  # when each save was committed
  def listener(name, seconds, **_):
    del seconds
    if name == "/jax/orbax/write/async/total_duration_secs":
      committed.append(time.perf_counter())
  jax.monitoring.register_event_duration_secs_listener(listener)
  saves: list[dict] = []
  original = checkpoint.Checkpoints.save

  def timed_save(self, step, *args, **kwargs):
    start = time.perf_counter()
    original(self, step, *args, **kwargs)
    saves.append({"step": step, "started": start, "blocking_s": time.perf_counter() - start})

  checkpoint.Checkpoints.save = timed_save
  config = lm.get_config(variant)
  config.train.update(steps=steps, checkpoint_every=every, log_every=every, eval_every=steps,
                      sample_tokens=0)
  for field, value in (overrides or {}).items():
    section, name = field.split(".")
    config[section][name] = value
  try:
    if workdir is None:
      with tempfile.TemporaryDirectory() as temporary:
        training.run(config, temporary)
    else:
      training.run(config, workdir)
  finally:
    checkpoint.Checkpoints.save = original
    jax.monitoring.unregister_event_duration_listener(listener)
  for save, end in zip(saves, committed):
    save["total_s"] = end - save.pop("started")
  return saves


def summarize(saves: list[dict]) -> dict:
  first, rest = saves[0], saves[1:] or saves[:1]
  fractions = [s["blocking_s"] / s["total_s"] for s in rest]
  return {"saves": len(saves),
          "first": {**first, "fraction": first["blocking_s"] / first["total_s"]},
          "median_blocking_s": statistics.median(s["blocking_s"] for s in rest),
          "median_total_s": statistics.median(s["total_s"] for s in rest),
          "median_fraction": statistics.median(fractions),
          "all_saves_fraction": (sum(s["blocking_s"] for s in saves)
                                 / sum(s["total_s"] for s in saves))}


def fingerprint_cost(config, devices, time_it: bool) -> dict:
  """Cost analysis (per device) of the fingerprint program for `config`'s state on
  `devices`; with `time_it`, also its measured time on a real state."""
  import jax  # pylint: disable=g-import-not-at-top
  from toolkit import training  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  from toolkit.training.checkpoints import integrity
  setup = training.build(config, devices)
  abstract = setup.layout.abstract
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  compiled = jax.jit(lambda t: jax.tree.map(integrity.fingerprint, t)).lower(abstract).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  result = {"devices": len(devices), "state_bytes": state_bytes,
            "state_bytes_per_device": state_bytes / len(devices),
            "flops_per_device": float(cost.get("flops", 0.0)),
            "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0))}
  if time_it:
    state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
    integrity.fingerprints(state)
    seconds = []
    for _ in range(5):
      start = time.perf_counter()
      integrity.fingerprints(state)
      seconds.append(time.perf_counter() - start)
    result["median_seconds"] = statistics.median(seconds)
  return result


def main(argv) -> None:
  del argv
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import lm  # pylint: disable=g-import-not-at-top
  variant = "tiny" if flags.FLAGS.quick else "cpu"
  steps, every = (6, 2) if flags.FLAGS.quick else (flags.FLAGS.steps, flags.FLAGS.checkpoint_every)
  saves = save_timings(variant, steps, every)
  results = {"variant": variant, "steps": steps, "checkpoint_every": every, "per_save": saves,
             **summarize(saves)}
  print(f"saves of experiments/lm.py:{variant} ({len(saves)} saves, every {every} steps):")
  print(f"  first save: blocking {saves[0]['blocking_s'] * 1000:.1f} ms of "
        f"{saves[0]['total_s'] * 1000:.1f} ms ({results['first']['fraction']:.1%})")
  print(f"  later saves (median): blocking {results['median_blocking_s'] * 1000:.1f} ms of "
        f"{results['median_total_s'] * 1000:.1f} ms ({results['median_fraction']:.1%})")
  print(f"  all saves: {results['all_saves_fraction']:.1%} of the save time blocks the loop")
  try:
    import toolkit.training.checkpoints.integrity  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print("no fingerprints in this revision")
  else:
    results["fingerprints"] = {f"{variant} on cpu:8": fingerprint_cost(
        lm.get_config(variant), jax.devices(), time_it=True)}
    if flags.FLAGS.topology and not flags.FLAGS.quick:
      results["fingerprints"].update(_tpu_fingerprint_cost())
    for name, cost in results["fingerprints"].items():
      timing = (f", {cost['median_seconds'] * 1000:.1f} ms measured"
                if "median_seconds" in cost else "")
      print(f"fingerprints, {name}: {cost['flops_per_device']:.3g} FLOPs and "
            f"{cost['bytes_accessed_per_device'] / 2**20:,.1f} MiB read per device (state "
            f"{cost['state_bytes_per_device'] / 2**20:,.1f} MiB per device){timing}")
  if flags.FLAGS.json:
    with open(flags.FLAGS.json, "w") as f:
      json.dump(results, f, indent=2)


def _tpu_fingerprint_cost() -> dict:
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from toolkit.planning import target as target_lib  # pylint: disable=g-import-not-at-top
  reason = target_lib.libtpu_missing_reason()
  if reason:
    print(f"no TPU fingerprint cost: {reason}")
    return {}
  target = target_lib.target_for(flags.FLAGS.topology)
  name = f"lm.py:{flags.FLAGS.fingerprint_config} on {target.name}"
  return {name: fingerprint_cost(lm.get_config(flags.FLAGS.fingerprint_config), list(target.devices),
                                 time_it=False)}


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  define_flags()
  app.run(main)
