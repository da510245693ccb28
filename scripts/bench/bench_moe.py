"""Benchmark: training tokens/s of a mixture of experts against the dense model that uses as
many weights per token.

  python scripts/bench/bench_moe.py                  # tiny sizes, 8 simulated devices
  python scripts/bench/bench_moe.py --size=cpu       # the CPU sizes (moe_cpu vs cpu)
  python scripts/bench/bench_moe.py --quick          # seconds: the smoke test

The pair: `moe_tiny` (8 experts of width 32, 2 per token) against `tiny` (one MLP of width
64), or `moe_cpu` (8 x 192, 2 per token) against `cpu` (384): the same attention, and per
token the same expert/MLP weights, plus the router's. Both train on the same batches, with
the batch split 8 ways: the dense model over fsdp 8 (`fsdp`), the mixture over fsdp 2 x
expert 4 (`fsdp_ep`, 2 experts per device), once per dispatch mode (dropless with the ring of
experts, and capacity with capacity factor 1.25). Each step is compiled by
`toolkit.training.build` as the training loop compiles it; the steps then alternate in
rounds (order rotated each round) and the table gives each one's median step time, tokens/s
and its ratio to the dense model.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

_DEVICES = 8
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_DEVICES}").strip()

import jax

from experiments import lm, moe
from toolkit import training
from toolkit.planning.report import human_count
from toolkit.training import state as state_lib, step as step_lib  # noqa: E402

_SIZE = flags.DEFINE_enum("size", "tiny", ["tiny", "cpu"], "Model sizes: tiny (moe_tiny vs "
                          "tiny) or cpu (moe_cpu vs cpu).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; the steps alternate per round.")
_STEPS_PER_ROUND = flags.DEFINE_integer("steps_per_round", 10, "Steps of each kind per round.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 3, "Untimed steps of each kind first.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_QUICK = flags.DEFINE_bool("quick", False, "2 rounds of 2 steps (seconds; the smoke test).")


def configs(size: str) -> dict:
  """name -> config: the dense model and the mixture in each dispatch mode."""
  dense = lm.get_config(size)
  dense.mesh.ici, dense.sharding.preset = "data:1,fsdp:-1", "fsdp"
  found = {"dense": dense}
  for mode in ("dropless", "capacity"):
    config = moe.get_config(f"{size},dispatch={mode}")
    found[f"moe {mode}"] = config
  return found


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _run_steps(step, state, batch, count: int):
  start = time.perf_counter()
  for _ in range(count):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
  return state, (time.perf_counter() - start) / count


def benchmark(found: dict, rounds: int, steps_per_round: int, warmup_steps: int) -> dict:
  steps, states, batches, tokens = {}, {}, {}, {}
  for name, config in found.items():
    setup = training.build(config)
    start = time.perf_counter()
    steps[name], _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                           setup.spec.mesh)
    states[name] = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
    batches[name] = setup.batches.batch(0)
    tokens[name] = config.data.global_batch_size * config.data.seq_len
    states[name], per_step = _run_steps(steps[name], states[name], batches[name], warmup_steps)
    _progress(f"{name}: compiled in {time.perf_counter() - start:.1f} s, warm-up "
              f"{per_step * 1e3:.0f} ms/step; {human_count(setup.spec.model.num_params())} parameters, "
              f"mesh {dict(setup.spec.mesh.shape)}")
  names = list(found)
  seconds = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:   # rotate: cancel drift
      states[name], per_step = _run_steps(steps[name], states[name], batches[name],
                                          steps_per_round)
      seconds[name].append(per_step)
      _progress(f"round {r + 1}/{rounds} {name}: {per_step * 1e3:.1f} ms/step")
  dense = statistics.median(seconds["dense"])
  return {"devices": jax.device_count(), "rounds": rounds, "steps_per_round": steps_per_round,
          "results": {name: {"median_step_s": statistics.median(values),
                             "round_step_s": values,
                             "tokens_per_second": tokens[name] / statistics.median(values),
                             "step_time_vs_dense": statistics.median(values) / dense}
                      for name, values in seconds.items()}}


def format_report(result: dict) -> str:
  lines = [f"{result['devices']} devices; {result['rounds']} rounds x "
           f"{result['steps_per_round']} steps, alternating; medians",
           f"{'step':<16}{'ms/step':>10}{'tokens/s':>12}{'time vs dense':>15}"]
  for name, row in result["results"].items():
    lines.append(f"{name:<16}{row['median_step_s'] * 1e3:>10.1f}"
                 f"{row['tokens_per_second']:>12,.0f}{row['step_time_vs_dense']:>15.2f}")
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
  rounds, per_round, warmup = _ROUNDS.value, _STEPS_PER_ROUND.value, _WARMUP_STEPS.value
  if _QUICK.value:
    rounds, per_round, warmup = 2, 2, 1
  result = benchmark(configs(_SIZE.value), rounds, per_round, warmup)
  result["size"] = _SIZE.value
  print(format_report(result))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
