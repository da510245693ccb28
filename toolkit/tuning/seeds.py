"""One experiment over several seeds: how much its result depends on the seed.

A seed picks the initialization, the data order and the augmentation draws; a recipe whose
result moves a lot between seeds will also move between machines (different float rounding
is a smaller push along the same unstable directions). `run(config, seeds, workdir)` trains
the config once per seed, as `toolkit.train` would, each in `workdir/seed_N` (a rerun resumes
unfinished seeds and only reads finished ones back), and reads each run's held-out metrics at its
last step from its `metrics.jsonl`. `summarize` gives mean, sample standard deviation, min and
max of every metric; `format_report` prints them; `plot_curves` draws every seed's eval curve.
Behind `python scripts/launch/seeds.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training import loop, metrics as metrics_lib
from toolkit.tuning import search


@dataclasses.dataclass(frozen=True)
class SeedResult:
  seed: int
  step: int                            # the run's last evaluated step
  metrics: dict[str, float]            # held-out metrics at that step
  curve: dict[int, dict[str, float]]   # step -> held-out metrics, every eval of the run
  seconds: float                       # wall time of this call's training (0: nothing left)


@dataclasses.dataclass(frozen=True)
class Spread:
  mean: float
  std: float  # sample standard deviation (0 for one seed)
  low: float
  high: float


def run(config: ml_collections.ConfigDict, seeds: Sequence[int], workdir: str,
        log: Callable[[str], None] = print, devices=None) -> list[SeedResult]:
  """Trains `config` with each seed in `workdir/seed_<seed>`, one after another."""
  if not seeds or len(set(seeds)) != len(seeds):
    raise ConfigError(f"seeds {', '.join(map(str, seeds)) or '(none)'}: give one or more "
                      f"distinct integers, e.g. --seeds=0,1,2")
  results = []
  for index, seed in enumerate(seeds):
    directory = os.path.join(workdir, f"seed_{seed}")
    log(f"=== seed {seed} ({index + 1}/{len(seeds)}): {directory}")
    start = time.perf_counter()
    if not _finished(directory, config.train.steps):
      loop.run(search.apply(config, {"seed": seed}, "seeds"), directory, devices)
    results.append(read(directory, seed, time.perf_counter() - start))
    log(f"=== seed {seed}: {_format_metrics(results[-1].metrics)} at step "
        f"{results[-1].step} ({results[-1].seconds:.0f} s)")
  return results


def _finished(directory: str, steps: int) -> bool:
  """Whether the run in `directory` has evaluated its last step (then there is nothing to
  train, and no need to build and compile it to find that out)."""
  records = metrics_lib.read_metrics(os.path.join(directory, "metrics.jsonl"))
  return any(r["kind"] == "eval" and r["step"] == steps for r in records)


def read(directory: str, seed: int, seconds: float = 0.0) -> SeedResult:
  """A finished run's held-out metrics from its metrics.jsonl (a resumed step's last record)."""
  records = metrics_lib.read_metrics(os.path.join(directory, "metrics.jsonl"))
  curve = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "kind")}
           for r in records if r["kind"] == "eval"}
  if not curve:
    raise ConfigError(f"{directory} has no held-out evaluation in metrics.jsonl; the run "
                      f"stopped before its first eval")
  last = max(curve)
  return SeedResult(seed=seed, step=last, metrics=curve[last], curve=curve, seconds=seconds)


def summarize(results: Sequence[SeedResult]) -> dict[str, Spread]:
  """Metric -> spread over the seeds, for the metrics every run reported."""
  names = [n for n in results[0].metrics if all(n in r.metrics for r in results)]
  summary = {}
  for name in names:
    values = [float(r.metrics[name]) for r in results]
    summary[name] = Spread(mean=statistics.fmean(values),
                           std=statistics.stdev(values) if len(values) > 1 else 0.0,
                           low=min(values), high=max(values))
  return summary


def _value(name: str, value: float) -> str:
  return f"{value:.2%}" if name == "accuracy" else f"{value:.4f}"


def _format_metrics(metrics: dict[str, float]) -> str:
  return ", ".join(f"{name} {_value(name, value)}" for name, value in metrics.items()
                   if name != "examples")


def format_report(results: Sequence[SeedResult]) -> str:
  """A table of every seed's final metrics and wall time, then mean +- std (min .. max)."""
  names = [n for n in summarize(results) if n != "examples"]
  lines = [" | ".join(["seed", "step", *names, "wall"]),
           *(" | ".join([str(r.seed), str(r.step), *(_value(n, r.metrics[n]) for n in names),
                         f"{r.seconds:.0f} s"]) for r in results)]
  count = f"{len(results)} seed" + ("s" if len(results) > 1 else "")
  lines.append(f"over {count} ({', '.join(str(r.seed) for r in results)}):")
  for name, s in summarize(results).items():
    if name != "examples":
      lines.append(f"  {name}: {_value(name, s.mean)} +- {_value(name, s.std)} "
                   f"(min {_value(name, s.low)}, max {_value(name, s.high)})")
  return "\n".join(lines)


def write(results: Sequence[SeedResult], workdir: str) -> dict[str, str]:
  """seeds.json (every seed's metrics and the summary) and seeds.png; returns their paths."""
  paths = {"json": os.path.join(workdir, "seeds.json"),
           "plot": os.path.join(workdir, "seeds.png")}
  workdir_lib.write_text(paths["json"], json.dumps(
      {"seeds": [dataclasses.asdict(r) for r in results],
       "summary": {n: dataclasses.asdict(s) for n, s in summarize(results).items()}}, indent=2))
  plot_curves(results, paths["plot"])
  return paths


def plot_curves(results: Sequence[SeedResult], path: str) -> str:
  """Every seed's held-out accuracy (or loss, for models without one) against the step, in
  the units the legend, the title and the report give it: percent, or nats per token (the
  loss as metrics.jsonl holds it)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  name = "accuracy" if "accuracy" in results[0].metrics else "loss"
  fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
  for r in results:
    points = sorted((step, m[name]) for step, m in r.curve.items() if name in m)
    scale = 100 if name == "accuracy" else 1
    ax.plot([s for s, _ in points], [v * scale for _, v in points], "o-", ms=3,
            label=f"seed {r.seed}: {_value(name, r.metrics[name])}")
  spread = summarize(results)[name]
  ax.set_title(f"held-out {name} over {len(results)} seeds: {_value(name, spread.mean)} "
               f"+- {_value(name, spread.std)}")
  ax.set_xlabel("step")
  ax.set_ylabel("held-out accuracy (%)" if name == "accuracy"
                else f"held-out loss ({metrics_lib.Units().loss})")
  if name == "accuracy":
    ax.set_ylim(max(0.0, 100 * spread.low - 10), 100)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  metrics_lib.save_figure(fig, path)
  plt.close(fig)
  return path
