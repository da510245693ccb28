"""Benchmark: `toolkit.train`'s tokens/s (images/s) on the benchmark model or an experiment,
this checkout against another.

  git worktree add /tmp/base <commit>          # the commit to compare against
  python scripts/bench/bench_train.py --baseline=/tmp/base --devices=8
  python scripts/bench/bench_train.py --baseline=/tmp/base --devices=1
  python scripts/bench/bench_train.py --baseline=/tmp/base --config=experiments/lm.py:cpu  # the demo
  python scripts/bench/bench_train.py --baseline=. --config=experiments/dlrm.py:cpu \
    --baseline_overrides=sharding.param_overrides=,sharding.activation_overrides=

The last compares two settings of one checkout: `--baseline=.` is this checkout, and
--baseline_overrides are config overrides of the baseline's runs only (there: the DLRM's
tables replicated against the experiment's row-wise tables).

The benchmark model is scripts/bench/bench_step.py's: d_model 256, 4 layers, 4 heads, MLP 1024,
vocabulary 32000, 8 sequences of 256 tokens, float32, synthetic data, fsdp over every device;
everything else is each checkout's own default (remat, attention, loss chunking). With
--config an experiment trains as it is (its model, data and mesh: `make demo`'s run for
experiments/lm.py:cpu), for --steps steps without evaluations or checkpoints between. Both
checkouts run with this interpreter (the same JAX), each from its own folder, as a user would
run `python -m toolkit.train`; rounds alternate between them. A round's figure is the median
rate (tokens/s, or images/s for an image model) of its progress lines after the first (which still holds start-up effects); the
result is the median over rounds of each checkout and the ratio this / baseline.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

_BASELINE = flags.DEFINE_string("baseline", None, "Checkout to compare against (a worktree).")
_CONFIG = flags.DEFINE_string(
    "config", "", "An experiment to train as it is, e.g. experiments/lm.py:cpu (the demo's "
    "model, data and mesh); empty: the benchmark model.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated CPU devices.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each runs both checkouts once.")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps per run.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Steps per progress line.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "Limit for one training run, in seconds.")
_JSON = flags.DEFINE_string("json", "", "Write the numbers as JSON here.")
_BASELINE_OVERRIDES = flags.DEFINE_list(
    "baseline_overrides", [], "Config overrides (key=value, comma separated; an empty value "
    "sets '') of the baseline's runs only.")

MODEL = dict(vocab_size=32000, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_dim=1024)
RATE = re.compile(r"^step \d+/\d+ \|.* \| ([\d,]+) (tok|img|ex)/s")
UNITS = {"tok": "tokens/s", "img": "images/s", "ex": "examples/s"}


def command(steps: int, log_every: int, workdir: str, config: str = "",
            extra: tuple[str, ...] = ()) -> list[str]:
  """The `toolkit.train` command line of one benchmark run: the benchmark model, or the
  experiment `config` as it is; `extra` overrides (key=value) last."""
  overrides = {"train.steps": steps, "train.log_every": log_every, "train.eval_every": steps,
               "train.checkpoint_every": steps, "train.sample_tokens": 0}
  if not config:
    overrides.update({**{f"model.{k}": v for k, v in MODEL.items()},
                      "data.source": "synthetic", "data.seq_len": 256,
                      "data.global_batch_size": 8, "mesh.ici": "data:1,fsdp:-1,tensor:1",
                      "sharding.preset": "fsdp"})
  return [sys.executable, "-m", "toolkit.train", f"--config={config or 'experiments/lm.py'}",
          f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items()),
          *(f"--config.{o}" for o in extra)]


def rate(checkout: str, devices: int, steps: int, log_every: int, timeout_s: int,
         config: str = "", extra: tuple[str, ...] = ()) -> tuple[float, str]:
  """One training run in `checkout`: the median rate of its progress lines after the first,
  and its unit (tokens/s, or images/s for an image model)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": checkout,
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  with tempfile.TemporaryDirectory() as workdir:
    done = subprocess.run(command(steps, log_every, os.path.join(workdir, "run"), config, extra),
                          cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
  if done.returncode:
    raise RuntimeError(f"toolkit.train in {checkout} exited {done.returncode}:\n"
                       f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
  matches = [m for line in done.stdout.splitlines() if (m := RATE.match(line))]
  rates = [float(m.group(1).replace(",", "")) for m in matches]
  if len(rates) < 2:
    raise RuntimeError(f"toolkit.train in {checkout} printed {len(rates)} progress lines; "
                       f"raise --steps")
  return statistics.median(rates[1:]), UNITS[matches[0].group(2)]


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  this = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  baseline = os.path.abspath(_BASELINE.value)
  if not os.path.isfile(os.path.join(baseline, "toolkit", "train.py")):
    raise app.UsageError(f"--baseline={_BASELINE.value} is not a meshkit checkout (no "
                         f"toolkit/train.py); make one with `git worktree add PATH COMMIT`")
  experiment = _CONFIG.value.partition(":")[0]
  if experiment and not os.path.isfile(os.path.join(this, experiment)):
    raise app.UsageError(f"--config={_CONFIG.value}: no experiment file {experiment} in "
                         f"{this}; e.g. --config=experiments/lm.py:cpu")
  rounds = {"this": [], "baseline": []}
  for r in range(_ROUNDS.value):
    for name, checkout in (("baseline", baseline), ("this", this)):
      extra = tuple(_BASELINE_OVERRIDES.value) if name == "baseline" else ()
      value, unit = rate(checkout, _DEVICES.value, _STEPS.value, _LOG_EVERY.value,
                         _TIMEOUT.value, _CONFIG.value, extra)
      rounds[name].append(value)
      print(f"round {r + 1}/{_ROUNDS.value}: {name:8s} {value:9,.0f} {unit}", flush=True)
  medians = {k: statistics.median(v) for k, v in rounds.items()}
  ratio = medians["this"] / medians["baseline"]
  named = f"{_CONFIG.value}, " if _CONFIG.value else ""
  print(f"{named}{_DEVICES.value} device(s): this {medians['this']:,.0f} {unit}, baseline "
        f"{medians['baseline']:,.0f} {unit} (medians of {_ROUNDS.value} rounds): {ratio:.2f}x")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"devices": _DEVICES.value, "config": _CONFIG.value or "benchmark model",
                 "unit": unit, "baseline": baseline, "rounds": rounds, "medians": medians,
                 "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
  flags.mark_flag_as_required("baseline")
  app.run(main)
