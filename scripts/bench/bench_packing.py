"""Benchmark: supervised fine-tuning tokens/s with conversations packed several to a row
against one per row, on the same data.

  python scripts/bench/bench_packing.py            # experiments/sft.py:cpu, rows of 128 tokens
  python scripts/bench/bench_packing.py --quick    # seconds: the smoke test

Both runs read experiments/sft.py's CPU variant (the synthetic repeat task, byte-level) with
rows of --seq_len tokens and the variant's global batch of rows, on one device: one with
`data.packing` off (each conversation alone in a padded row), one with it on (first-fit over a
global batch of rows, each conversation attending only within itself). Each step is compiled
as the training loop compiles it and runs on the batches the pipeline yields; the steps then
alternate in rounds. The table gives each one's median step time, row tokens/s (every
position, padding included), the packing efficiency (real tokens / row tokens, over the first
4,096 conversations in training order, as the start-up log counts them) and real tokens/s
(efficiency x row tokens/s): the conversations' tokens trained on per second.
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

from absl import app, flags

import jax

from experiments import sft
from toolkit import training
from toolkit.training import state as state_lib, step as step_lib

_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per row.", lower_bound=8)
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; the two runs alternate per round.")
_STEPS_PER_ROUND = flags.DEFINE_integer("steps_per_round", 10, "Steps of each kind per round.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 3, "Untimed steps of each kind first.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_QUICK = flags.DEFINE_bool("quick", False, "2 rounds of 2 steps (seconds; the smoke test).")
_BATCHES = 8  # distinct batches each run cycles through


def configs(seq_len: int) -> dict:
  """"off" and "on": the CPU variant with packing off and on, rows of `seq_len` tokens."""
  found = {}
  for mode in ("off", "on"):
    config = sft.get_config(f"cpu,packing={mode}")
    config.data.seq_len = seq_len
    found[mode] = config
  return found


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _run_steps(step, state, batches, count: int):
  start = time.perf_counter()
  for _ in range(count):
    state, metrics = step(state, next(batches))
    jax.block_until_ready(metrics)
  return state, (time.perf_counter() - start) / count


def benchmark(found: dict, rounds: int, steps_per_round: int, warmup_steps: int) -> dict:
  steps, states, batches, rows, stats = {}, {}, {}, {}, {}
  devices = jax.devices()[:1]
  for name, config in found.items():
    setup = training.build(config, devices)
    start = time.perf_counter()
    steps[name], _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                           setup.spec.mesh)
    states[name] = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
    iterator = setup.batches.iterator(0)
    batches[name] = itertools.cycle([next(iterator) for _ in range(_BATCHES)])
    iterator.close()
    rows[name] = config.data.global_batch_size * config.data.seq_len
    stats[name] = setup.batches.stats()
    states[name], per_step = _run_steps(steps[name], states[name], batches[name], warmup_steps)
    _progress(f"packing {name}: compiled in {time.perf_counter() - start:.1f} s, warm-up "
              f"{per_step * 1e3:.0f} ms/step; {setup.batches.describe().splitlines()[-1]}")
  names = list(found)
  seconds = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:   # rotate: cancel drift
      states[name], per_step = _run_steps(steps[name], states[name], batches[name],
                                          steps_per_round)
      seconds[name].append(per_step)
      _progress(f"round {r + 1}/{rounds} packing {name}: {per_step * 1e3:.1f} ms/step")
  results = {}
  for name, values in seconds.items():
    median = statistics.median(values)
    results[name] = {"median_step_s": median, "round_step_s": values,
                     "row_tokens_per_second": rows[name] / median,
                     "efficiency": stats[name].efficiency,
                     "documents_per_row": stats[name].documents / stats[name].rows,
                     "real_tokens_per_second": stats[name].efficiency * rows[name] / median}
  speedup = results["on"]["real_tokens_per_second"] / results["off"]["real_tokens_per_second"]
  return {"devices": len(devices), "seq_len": found["on"].data.seq_len,
          "global_batch_size": found["on"].data.global_batch_size, "rounds": rounds,
          "steps_per_round": steps_per_round, "results": results,
          "real_tokens_per_second_on_vs_off": speedup}


def format_report(result: dict) -> str:
  lines = [f"experiments/sft.py:cpu, {result['global_batch_size']} rows of {result['seq_len']} "
           f"tokens, {result['devices']} device; {result['rounds']} rounds x "
           f"{result['steps_per_round']} steps, alternating; medians",
           f"{'packing':<9}{'ms/step':>9}{'row tok/s':>11}{'docs/row':>10}{'efficiency':>12}"
           f"{'real tok/s':>12}"]
  for name, row in result["results"].items():
    lines.append(f"{name:<9}{row['median_step_s'] * 1e3:>9.1f}"
                 f"{row['row_tokens_per_second']:>11,.0f}{row['documents_per_row']:>10.2f}"
                 f"{row['efficiency']:>12.1%}{row['real_tokens_per_second']:>12,.0f}")
  lines.append(f"real tokens/s, packing on / off: "
               f"{result['real_tokens_per_second_on_vs_off']:.2f}x")
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start(mesh=sft.get_config("cpu").mesh)  # on a CPU: the one device the variant uses
  rounds, per_round, warmup = _ROUNDS.value, _STEPS_PER_ROUND.value, _WARMUP_STEPS.value
  if _QUICK.value:
    rounds, per_round, warmup = 2, 2, 1
  result = benchmark(configs(_SEQ_LEN.value), rounds, per_round, warmup)
  print(format_report(result))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
