"""Sweep results: a CSV and a Markdown table of the trials, the best trial's launch command, a
PNG of every trial's eval-loss curve and a PNG of the final eval loss against each swept field.

Read back from the trials' own workdirs (trial.json, metrics.jsonl), so the same files come out
of a sweep that was interrupted and resumed as out of one that ran straight through.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
from collections.abc import Sequence
from typing import Any

from toolkit import workdir as workdir_lib
from toolkit.training import metrics as metrics_lib

# Columns that describe the run rather than its outcome: they differ between reruns.
TIMING_COLUMNS = ("tokens_per_second",)


@dataclasses.dataclass
class TrialResult:
  trial: str
  overrides: dict[str, Any]
  status: str
  steps: int
  eval_losses: dict[int, float]
  tokens_per_second: float
  workdir: str
  command: str

  @property
  def final_eval_loss(self) -> float:
    return self.eval_losses[max(self.eval_losses)] if self.eval_losses else math.nan

  @property
  def best_eval_loss(self) -> float:
    return min(self.eval_losses.values()) if self.eval_losses else math.nan


def eval_losses(workdir: str) -> dict[int, float]:
  """step -> eval loss; a step logged twice (a resumed segment) keeps its last record."""
  records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  return {r["step"]: r["loss"] for r in records if r["kind"] == "eval"}


def _sort_key(result: TrialResult):
  loss = result.final_eval_loss
  return (math.isnan(loss), loss, result.trial)


def rows(results: Sequence[TrialResult], fields: Sequence[str]) -> list[dict[str, Any]]:
  return [{"trial": r.trial, **{f: r.overrides.get(f) for f in fields},
           "final_eval_loss": r.final_eval_loss, "best_eval_loss": r.best_eval_loss,
           "steps": r.steps, "tokens_per_second": round(r.tokens_per_second, 1),
           "status": r.status, "workdir": r.workdir} for r in results]


def write(results: Sequence[TrialResult], fields: Sequence[str], directory: str,
          mode: str) -> dict[str, str]:
  """Writes results.csv, results.md, eval_loss.png and hyperparameters.png; returns paths."""
  table = rows(results, fields)
  paths = {"csv": os.path.join(directory, "results.csv"),
           "markdown": os.path.join(directory, "results.md")}
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, fieldnames=list(table[0]))
  writer.writeheader()
  writer.writerows(table)
  workdir_lib.write_text(paths["csv"], text.getvalue())
  ranked = sorted(results, key=_sort_key)
  best = ranked[0]
  lines = [f"# Sweep results ({len(results)} trials, {mode} mode)", "",
           "Sorted by final eval loss (nats per token); tokens/s counts each trial's own tokens "
           "over the wall time of the runs that trained it (compile and eval included).", "",
           "| " + " | ".join(["trial", *fields, "final eval", "best eval", "steps", "tokens/s",
                               "status"]) + " |",
           "|" + "---|" * (len(fields) + 6)]
  for r in ranked:
    values = [_short(r.overrides.get(f)) for f in fields]
    lines.append("| " + " | ".join([r.trial, *values, f"{r.final_eval_loss:.4f}",
                                    f"{r.best_eval_loss:.4f}", str(r.steps),
                                    f"{r.tokens_per_second:,.0f}", r.status]) + " |")
  lines += ["", f"Best trial: {best.trial} (final eval loss {best.final_eval_loss:.4f}). "
            "To train it on its own (it continues from its checkpoint in that workdir):", "",
            "```", best.command, "```", ""]
  plots = [plot_curves(results, os.path.join(directory, "eval_loss.png")),
           plot_vs_fields(results, fields, os.path.join(directory, "hyperparameters.png"))]
  for plot in filter(None, plots):
    lines.append(f"![{os.path.basename(plot)}]({os.path.basename(plot)})")
  workdir_lib.write_text(paths["markdown"], "\n".join(lines) + "\n")
  paths.update(curves=plots[0], fields=plots[1])
  return paths


def read_csv(path: str) -> list[dict[str, str]]:
  return list(csv.DictReader(io.StringIO(workdir_lib.read_text(path), newline="")))


def _short(value: Any) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_curves(results: Sequence[TrialResult], path: str) -> str | None:
  if not any(r.eval_losses for r in results):
    return None
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
  for r in results:
    points = sorted(r.eval_losses.items())
    if points:
      ax.plot([s for s, _ in points], [l for _, l in points], "o-", ms=3,
              label=f"{r.trial} ({r.status})")
  ax.set_xlabel("step")
  ax.set_ylabel("eval loss (nats per token)")
  ax.set_title("eval loss of every trial")
  ax.grid(alpha=0.3)
  if len(results) <= 16:
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  metrics_lib.save_figure(fig, path)
  plt.close(fig)
  return path


def plot_vs_fields(results: Sequence[TrialResult], fields: Sequence[str], path: str) -> str | None:
  finished = [r for r in results if not math.isnan(r.final_eval_loss)]
  numeric = [f for f in fields
             if all(isinstance(r.overrides.get(f), (int, float)) for r in finished)]
  if not finished or not fields:
    return None
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(fields), figsize=(4 * len(fields), 3.5), dpi=120,
                           squeeze=False)
  for ax, field in zip(axes[0], fields):
    xs = [r.overrides.get(field) for r in finished]
    if field not in numeric:
      labels = sorted({str(x) for x in xs})
      xs = [labels.index(str(x)) for x in xs]
      ax.set_xticks(range(len(labels)), labels)
    elif min(xs) > 0 and max(xs) / min(xs) >= 20:
      ax.set_xscale("log")
    colors = ["tab:blue" if r.status == "done" else "tab:gray" for r in finished]
    ax.scatter(xs, [r.final_eval_loss for r in finished], c=colors)
    ax.set_xlabel(field)
    ax.set_ylabel("final eval loss (nats per token)")
    ax.grid(alpha=0.3)
  fig.suptitle("final eval loss vs each swept field (gray: stopped early)")
  fig.tight_layout()
  metrics_lib.save_figure(fig, path)
  plt.close(fig)
  return path
