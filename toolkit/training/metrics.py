"""Metric output: a JSONL file, TensorBoard event files (tensorboardX; no TensorFlow), the
progress line, and a loss-curve PNG. Only process 0 writes; a write that fails is one
StorageError."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import sys
import tempfile
import time

import jax
import numpy as np

from toolkit import workdir as workdir_lib
from toolkit.training.checkpoints import storage


@dataclasses.dataclass(frozen=True)
class Units:
  """The labels of a run's losses, the same wherever they are shown (the eval line on the
  console, loss.png, docs/training.md): `loss` for the loss itself, in nats per token for an LM
  (per image for a classifier), as metrics.jsonl and TensorBoard hold it; `bits` for an LM's
  loss / ln 2, in bits per byte when its tokens are bytes, else bits per token (None for a
  classifier)."""
  loss: str = "nats per token"
  bits: str | None = "bits per byte"

  @classmethod
  def of(cls, task_unit: str, token: str | None = None) -> Units:
    """`task_unit`: what the task counts ("tok" or "img", Task.unit); `token`: what one of an
    LM's tokens is ("byte" or "token", toolkit.data.inputs.token_unit), None for a classifier."""
    per = {"tok": "token", "img": "image", "ex": "example"}.get(task_unit, task_unit)
    return cls(f"nats per {per}", f"bits per {token}" if token else None)


def format_duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(step: int, total: int, metrics: dict[str, float], step_seconds: float,
                  tokens_per_step: int, flops_per_step: float, peak_flops_total: float,
                  unit: str = "tok", units: Units = Units()) -> str:
  """`tokens_per_step` counts `unit`s (tokens, or images for a classifier); the loss is
  labelled with `units.loss`; a `data_wait_fraction` in `metrics` is shown as the share of step
  time spent waiting for data, a `rollout_fraction` as the share spent making the batch."""
  tokens_per_second = tokens_per_step / step_seconds if step_seconds > 0 else float("nan")
  parts = [f"step {step}/{total}", f"loss {metrics['loss']:.4f} {units.loss}",
           f"lr {metrics['learning_rate']:.2e}", f"grad_norm {metrics['grad_norm']:.3f}",
           f"step {step_seconds * 1000:.0f} ms", f"{tokens_per_second:,.0f} {unit}/s"]
  if "data_wait_fraction" in metrics:
    parts.append(f"data wait {metrics['data_wait_fraction']:.1%}")
  if "rollout_fraction" in metrics:  # GRPO: sampling and scoring the step's batch
    parts.append(f"rollouts {metrics['rollout_fraction']:.1%}")
  if peak_flops_total > 0:
    parts.append(f"MFU {flops_per_step / step_seconds / peak_flops_total:.1%}")
  parts.append(f"ETA {format_duration((total - step) * step_seconds)}")
  return " | ".join(parts)


def eval_line(step: int, scalars: dict[str, float], units: Units) -> str:
  """The console's line for one eval: the loss in `units`, then for an LM the same loss in
  bits, for a classifier its accuracy, for click prediction its AUC."""
  if "reward" in scalars:  # GRPO: the held-out prompts answered greedily
    return (f"eval at step {step}: mean reward {scalars['reward']:.3f}, solved "
            f"{scalars['solved']:.2%} ({int(scalars['prompts'])} held-out prompts, greedy)")
  loss = scalars["loss"]
  if "preference_accuracy" in scalars:
    return (f"eval at step {step}: loss {loss:.4f} {units.loss}, preference accuracy "
            f"{scalars['preference_accuracy']:.2%}, policy prefers chosen "
            f"{scalars['choice_accuracy']:.2%}, reward margin {scalars['reward_margin']:.3f} "
            f"({int(scalars['pairs'])} held-out pairs)")
  if "accuracy" in scalars:
    return (f"eval at step {step}: loss {loss:.4f} {units.loss}, accuracy "
            f"{scalars['accuracy']:.2%} ({int(scalars['examples'])} held-out examples)")
  if "auc" in scalars:  # click prediction: log loss and ROC AUC over the held-out set
    return (f"eval at step {step}: log loss {loss:.4f} {units.loss}, AUC {scalars['auc']:.4f} "
            f"({int(scalars['examples'])} held-out examples)")
  return (f"eval at step {step}: loss {loss:.4f} {units.loss} "
          f"({loss / math.log(2):.3f} {units.bits})")


def throughput(step_seconds: float, units_per_step: int, flops_per_step: float,
               peak_flops_total: float, unit: str = "tok") -> dict[str, float]:
  """The progress line's speed figures as metrics.jsonl / TensorBoard fields: step_seconds,
  tokens_per_second (images_per_second for a classifier) and mfu (when the peak is known)."""
  name = {"tok": "tokens_per_second", "img": "images_per_second"}.get(unit, f"{unit}_per_second")
  values = {"step_seconds": step_seconds,
            name: units_per_step / step_seconds if step_seconds > 0 else 0.0}
  if peak_flops_total > 0 and step_seconds > 0:
    values["mfu"] = flops_per_step / step_seconds / peak_flops_total
  return values


def tensorboardx_modules():
  """tensorboardX's summary, EventsWriter and event_pb2, imported without torch.

  tensorboardX's package imports torch whenever it is installed (the test extra installs it),
  only to accept torch tensors, which we never pass: 1.4 s of a restart's time to its first
  step, more than a cached compile. torch is hidden while tensorboardX loads (its fallback
  then takes NumPy arrays) and is importable again afterwards."""
  hide_torch = "torch" not in sys.modules and "tensorboardX" not in sys.modules  # first call
  if hide_torch:
    sys.modules["torch"] = None  # `import torch` raises ImportError
  try:
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  finally:
    if hide_torch and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return summary, EventsWriter, event_pb2


class MetricWriter:
  """Appends records to workdir/metrics.jsonl and TensorBoard scalars to workdir/tensorboard.

  Both are written in the calling thread, so a failed write (a full disk, ...) raises
  StorageError right there, naming the file and the cause, and no writer thread is left behind
  to hold the process at exit (tensorboardX's SummaryWriter writes from a thread; once that
  thread dies its queue fills and the next write blocks forever).

  On gs:// (object stores have no append) metrics.jsonl is uploaded whole at each write, from
  the records kept in memory (an earlier run's records are read back first, so a resumed run
  keeps them), and the TensorBoard event file is written in a local temporary folder and
  uploaded whole after each flush, under the same name in workdir/tensorboard, where
  `tensorboard --logdir=gs://...` reads it. A record is ~250 bytes: 10,000 log steps make a
  2.5 MB upload per write.

  `start_step`: the step a run starts after (a resume: its checkpoint's step). Records of
  later steps, written by an earlier run that got further before it stopped (a resume from an
  older checkpoint redoes those steps), are dropped once, so metrics.jsonl holds each step
  once; TensorBoard is told the same (a SessionLog START at start_step + 1 purges its events
  from that step on). `dropped` says which steps went."""

  def __init__(self, workdir: str, start_step: int | None = None):
    self.enabled = jax.process_index() == 0
    self.path = workdir_lib.join(workdir, "metrics.jsonl")
    self._tensorboard = workdir_lib.join(workdir, "tensorboard")
    self._remote = workdir_lib.is_url(workdir)
    self._events = None
    self._lines: list[str] | None = None  # gs://: every line of metrics.jsonl
    self._staging: tempfile.TemporaryDirectory | None = None  # gs://: the local event file
    self._start_step = start_step
    self._where = self.path  # what a failed write names: metrics.jsonl or tensorboard/
    self.dropped: list[int] = []
    if self.enabled and start_step is not None:
      self._drop_after(start_step)

  def _drop_after(self, start_step: int) -> None:
    """Rewrites metrics.jsonl without the records of steps after `start_step` (all of them
    when a run starts from scratch, step 0's eval included); written whole, then renamed."""
    if not workdir_lib.exists(self.path):
      return
    lines = workdir_lib.read_text(self.path).splitlines()
    keep = [line for line in lines if _step_of(line) is None
            or (start_step > 0 and _step_of(line) <= start_step)]
    if len(keep) == len(lines):
      return
    self.dropped = sorted({_step_of(line) for line in lines} - {_step_of(line) for line in keep})
    text = "".join(f"{line}\n" for line in keep)
    try:
      if self._remote:
        self._lines = [f"{line}\n" for line in keep]
        workdir_lib.write_text(self.path, text)
      else:
        partial = f"{self.path}.partial"
        with open(partial, "w") as f:
          f.write(text)
        os.replace(partial, self.path)
    except OSError as e:
      raise storage.StorageError(f"{self.path} could not be rewritten ({storage.cause(e)}); "
                                 f"{storage.fix(e)}") from None

  def write(self, step: int, kind: str, values: dict[str, float]) -> None:
    """Appends the record and its scalars within the storage deadline (workdir.bounded: a
    disk or object store that stops answering is an error, not a hang)."""
    if not self.enabled:
      return
    self._where = self.path
    try:
      workdir_lib.bounded(lambda: self._write(step, kind, values), self.path)
    except OSError as e:
      raise storage.StorageError(f"metrics could not be written to {self._where} "
                                 f"({storage.cause(e)}); {storage.fix(e)}, then rerun the same "
                                 f"command to resume from the latest checkpoint") from None

  def _write(self, step: int, kind: str, values: dict[str, float]) -> None:
    summary, EventsWriter, event_pb2 = tensorboardx_modules()  # pylint: disable=invalid-name
    line = json.dumps({"step": step, "kind": kind, **values}) + "\n"
    if self._remote:
      if self._lines is None:
        self._lines = ([f"{l}\n" for l in workdir_lib.read_text(self.path).splitlines()]
                       if workdir_lib.exists(self.path) else [])
      self._lines.append(line)
      workdir_lib.write_text(self.path, "".join(self._lines))
    else:
      with open(self.path, "a") as f:
        f.write(line)
    self._where = self._tensorboard
    if self._events is None:
      self._events = EventsWriter(os.path.join(self._events_folder(), "events"))
      if self._start_step:  # a resume: TensorBoard forgets what an earlier run wrote after it
        self._events.write_event(event_pb2.Event(
            wall_time=time.time(), step=self._start_step + 1,
            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    for name, value in values.items():
      self._events.write_event(event_pb2.Event(
          wall_time=time.time(), step=step, summary=summary.scalar(f"{kind}/{name}", value)))
    self._events.flush()
    if self._remote:
      local = self._events._file_name  # pylint: disable=protected-access
      with open(local, "rb") as f:
        workdir_lib.write_bytes(workdir_lib.join(self._tensorboard, os.path.basename(local)),
                                f.read())

  def _events_folder(self) -> str:
    if not self._remote:
      os.makedirs(self._tensorboard, exist_ok=True)
      return self._tensorboard
    self._staging = tempfile.TemporaryDirectory(prefix="meshkit-tensorboard-")
    return self._staging.name

  def close(self) -> None:
    """Never raises: closing after a failure must not hide it."""
    if self._events is not None:
      try:
        self._events.close()
      except OSError:
        pass
      self._events = None
    if self._staging is not None:
      self._staging.cleanup()
      self._staging = None


def _step_of(line: str) -> int | None:
  """A metrics.jsonl line's step; None for a line that does not parse (kept as it is)."""
  try:
    record = json.loads(line)
  except ValueError:
    return None
  return record.get("step") if isinstance(record, dict) else None


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics.jsonl (local or gs://); a line that does not parse (cut short
  when the disk filled up) is skipped."""
  if not workdir_lib.exists(path):
    return []
  records = []
  for line in workdir_lib.path(path).read_bytes().decode(errors="replace").splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:
      continue
  return [r for r in records if isinstance(r, dict) and "step" in r and "kind" in r]


def save_figure(fig, png_path: str) -> None:
  """A matplotlib figure as a PNG at `png_path` (local or gs://), written whole."""
  data = io.BytesIO()
  fig.savefig(data, format="png")
  workdir_lib.write_bytes(png_path, data.getvalue())


def _points(records: list[dict], kind: str, name: str) -> list[tuple[int, float]]:
  return sorted({r["step"]: r[name] for r in records if r["kind"] == kind and name in r}.items())


def plot_loss_curve(metrics_path: str, png_path: str, units: Units = Units()) -> str | None:
  """Train and eval loss vs step from the JSONL file, labelled in `units` as on the console:
  the loss (nats per token) on the left axis and, on a right axis, the same curves as
  `units.bits` (loss / ln 2) for an LM, or the eval accuracy for a classifier."""
  records = read_metrics(metrics_path)
  if not records or jax.process_index() != 0:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  curves = _task_curves(records)
  if curves:  # post-training: its loss says little alone (GRPO's is 0 on most steps)
    fig, (ax, task) = plt.subplots(1, 2, figsize=(12, 4), dpi=120)
    for label, points, style in curves:
      task.plot([s for s, _ in points], [v for _, v in points], style, label=label)
    task.set_xlabel("step")
    task.set_ylim(-0.02, 1.02)
    task.grid(alpha=0.3)
    task.legend(loc="best", fontsize=8)
  else:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
  _draw_losses(ax, records, units)
  ax.set_title(os.path.basename(os.path.dirname(workdir_lib.absolute(metrics_path))))
  accuracy = _points(records, "eval", "accuracy")
  if accuracy:
    right = ax.twinx()
    right.plot([s for s, _ in accuracy], [a for _, a in accuracy], "s--", color="tab:green",
               label="eval accuracy")
    right.set_ylabel("eval accuracy")
    right.legend(loc="center right")
  elif units.bits:
    ax.secondary_yaxis("right", functions=(lambda nats: nats / math.log(2),
                                           lambda bits: bits * math.log(2))
                       ).set_ylabel(f"loss ({units.bits})")
  ax.legend(loc="upper right")
  fig.tight_layout()
  save_figure(fig, png_path)
  plt.close(fig)
  return png_path


# Post-training's measures of progress beside its loss: (record kind, field, label, style).
_TASK_CURVES = (("train", "reward", "train mean reward (GRPO)", "-"),
                ("eval", "reward", "held-out mean reward (GRPO)", "o-"),
                ("eval", "solved", "held-out solved share (GRPO)", "s-"),
                ("train", "preference_accuracy", "train preference accuracy (DPO)", "-"),
                ("eval", "preference_accuracy", "held-out preference accuracy (DPO)", "o-"),
                ("eval", "choice_accuracy", "held-out: policy prefers chosen (DPO)", "s-"),
                ("eval", "auc", "held-out ROC AUC (click prediction)", "o-"))


def _task_curves(records: list[dict]) -> list[tuple[str, list, str]]:
  """(label, points, style) of each of _TASK_CURVES the records hold."""
  found = [(label, _points(records, kind, name), style)
           for kind, name, label, style in _TASK_CURVES]
  return [curve for curve in found if curve[1]]


def _draw_losses(ax, records: list[dict], units: Units) -> None:
  """Train and eval loss vs step on `ax`, labelled in `units`."""
  for kind, style in (("train", "-"), ("eval", "o-")):
    points = _points(records, kind, "loss")
    if points:
      ax.plot([s for s, _ in points], [l for _, l in points], style, label=f"{kind} loss")
  ax.set_xlabel("step")
  ax.set_ylabel(f"loss ({units.loss})")
  ax.grid(alpha=0.3)


def plot_eval_tasks(metrics_path: str, png_path: str, units: Units = Units()) -> str | None:
  """The loss (as in loss.png) beside the harness tasks' metrics vs step (metrics.jsonl's
  "eval_tasks" records: "TASK/METRIC" fields), one line per metric; None before any."""
  records = read_metrics(metrics_path)
  names = sorted({k for r in records if r["kind"] == "eval_tasks" for k in r
                  if k not in ("step", "kind")})
  if not names or jax.process_index() != 0:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (losses, tasks) = plt.subplots(1, 2, figsize=(12, 4), dpi=120)
  _draw_losses(losses, records, units)
  losses.legend(loc="upper right")
  for name in names:
    points = _points(records, "eval_tasks", name)
    tasks.plot([s for s, _ in points], [v for _, v in points], "o-", label=name)
  tasks.set_xlabel("step")
  tasks.set_ylabel("task metric")
  tasks.set_title("lm-evaluation-harness tasks")
  tasks.grid(alpha=0.3)
  tasks.legend(loc="best", fontsize=8)
  fig.suptitle(os.path.basename(os.path.dirname(workdir_lib.absolute(metrics_path))))
  fig.tight_layout()
  save_figure(fig, png_path)
  plt.close(fig)
  return png_path


def plot_confusion_matrix(matrix, png_path: str, title: str) -> str:
  """Counts per (true class, predicted class) as a PNG heat map with the counts written in."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  classes = len(matrix)
  size = min(4 + 0.45 * classes, 14)
  fig, ax = plt.subplots(figsize=(size, size), dpi=110)
  ax.imshow(matrix, cmap="Blues")
  if classes <= 30:
    for (true, predicted), count in np.ndenumerate(matrix):
      if count:
        ax.text(predicted, true, str(count), ha="center", va="center", fontsize=8,
                color="white" if count > matrix.max() / 2 else "black")
    ax.set_xticks(range(classes))
    ax.set_yticks(range(classes))
  ax.set_xlabel("predicted class")
  ax.set_ylabel("true class")
  ax.set_title(title)
  fig.tight_layout()
  save_figure(fig, png_path)
  plt.close(fig)
  return png_path
