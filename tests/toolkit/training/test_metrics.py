"""The metric writer's TensorBoard output without torch: tensorboardX's package imports torch
whenever it is installed (1.4 s of a restart's time to its first step), so the writer loads
tensorboardX with torch hidden. Likewise the training command imports Grain only for the data
that reads through it. Checked in a fresh process: this one may have imported both. And the
losses' units: one label for each on the console and in loss.png."""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys

import pytest

from tests.toolkit.test_cli import REPO, _env

_WRITE_AND_READ_BACK = """
import importlib.util, pathlib, struct, sys
import toolkit.train
assert "grain" not in sys.modules, "the training command imported Grain"
from toolkit.training import metrics
workdir = pathlib.Path(sys.argv[1])
writer = metrics.MetricWriter(str(workdir))
writer.write(7, "train", {"loss": 2.5})
writer.close()
assert "torch" not in sys.modules, "the metric writer imported torch"
from tensorboardX.proto import event_pb2
[events] = (workdir / "tensorboard").glob("events.out.tfevents.*")
data, scalars = events.read_bytes(), []
while data:  # TFRecord: length (8 bytes), its CRC (4), the record, its CRC (4)
  (length,) = struct.unpack("<Q", data[:8])
  event = event_pb2.Event.FromString(data[12:12 + length])
  scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  data = data[16 + length:]
print(scalars)
if importlib.util.find_spec("torch") is not None:
  import torch  # still importable after the writer hid it
  print("torch importable")
"""


def test_training_imports_and_tensorboard_scalars_without_torch_or_grain(tmp_path):
  result = subprocess.run([sys.executable, "-c", _WRITE_AND_READ_BACK, str(tmp_path)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.splitlines()[0] == "[(7, 'train/loss', 2.5)]", result.stdout


def _y_labels(fig) -> list[str]:
  """Every y-axis label of a figure: its axes' and their secondary axes'."""
  return [label for ax in fig.axes
          for label in [ax.get_ylabel(), *(child.get_ylabel() for child in ax.child_axes)]]


def test_losses_carry_one_unit_on_the_console_and_in_the_plot(tmp_path, monkeypatch):
  """The eval line and loss.png label the loss alike: nats per token, and an LM's loss / ln 2
  in bits per byte on byte-level data (bits per token otherwise); a classifier's loss in nats
  per image beside its accuracy. The progress line's loss is the same number as the train
  curve, the eval line's as the eval points."""
  from toolkit.training import metrics  # pylint: disable=g-import-not-at-top
  byte_lm, token_lm, classifier = (metrics.Units.of("tok", "byte"),
                                   metrics.Units.of("tok", "token"), metrics.Units.of("img"))
  assert byte_lm == metrics.Units("nats per token", "bits per byte") == metrics.Units()
  assert token_lm == metrics.Units("nats per token", "bits per token")
  assert classifier == metrics.Units("nats per image", None)
  assert (metrics.eval_line(300, {"loss": 2 * math.log(2)}, byte_lm)
          == "eval at step 300: loss 1.3863 nats per token (2.000 bits per byte)")
  assert (metrics.eval_line(10, {"loss": 3 * math.log(2)}, token_lm)
          == "eval at step 10: loss 2.0794 nats per token (3.000 bits per token)")
  assert (metrics.eval_line(5, {"loss": 0.5, "accuracy": 0.9, "examples": 40.0}, classifier)
          == "eval at step 5: loss 0.5000 nats per image, accuracy 90.00% (40 held-out examples)")
  step = {"loss": 0.5, "learning_rate": 1e-3, "grad_norm": 1.0}
  assert metrics.progress_line(1, 2, step, 0.1, 100, 0.0, 0.0, units=byte_lm).startswith(
      "step 1/2 | loss 0.5000 nats per token | lr 1.00e-03 |")
  assert metrics.progress_line(1, 2, step, 0.1, 100, 0.0, 0.0, unit="img", units=classifier
                               ).startswith("step 1/2 | loss 0.5000 nats per image |")

  figures = []
  monkeypatch.setattr(metrics, "save_figure", lambda fig, path: figures.append(fig))
  records = [{"step": 1, "kind": "train", "loss": 5.0}, {"step": 2, "kind": "train", "loss": 4.0},
             {"step": 0, "kind": "eval", "loss": 5.5}, {"step": 2, "kind": "eval", "loss": 4.1}]
  lm_metrics = tmp_path / "lm.jsonl"
  lm_metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
  for units in (byte_lm, token_lm):
    metrics.plot_loss_curve(str(lm_metrics), str(tmp_path / "loss.png"), units)
    assert _y_labels(figures[-1]) == [f"loss ({units.loss})", f"loss ({units.bits})"]
  vit_metrics = tmp_path / "vit.jsonl"
  vit_metrics.write_text("".join(json.dumps({**r, **({"accuracy": 0.5} if r["kind"] == "eval"
                                                      else {})}) + "\n" for r in records))
  metrics.plot_loss_curve(str(vit_metrics), str(tmp_path / "loss.png"), classifier)
  assert _y_labels(figures[-1]) == ["loss (nats per image)", "eval accuracy"]


def test_post_training_plots_its_measures_of_progress_beside_the_loss(tmp_path, monkeypatch):
  """Issue 62: GRPO's loss.png was a flat line at 0 (its loss is 0 on a step whose groups all
  scored alike). Beside the loss it now plots the reward and the held-out solved share, and
  DPO's the preference accuracies."""
  from toolkit.post_training import grpo_task  # pylint: disable=g-import-not-at-top
  from toolkit.training import metrics  # pylint: disable=g-import-not-at-top
  figures = []
  monkeypatch.setattr(metrics, "save_figure", lambda fig, path: figures.append(fig))
  runs = {
      "grpo": ([{"step": s, "kind": "train", "loss": 0.0, "reward": 0.1 * s} for s in (1, 2)]
               + [{"step": s, "kind": "eval", "reward": r, "solved": r, "prompts": 8.0}
                  for s, r in ((0, 0.25), (2, 0.5))],
               ["train mean reward (GRPO)", "held-out mean reward (GRPO)",
                "held-out solved share (GRPO)"]),
      "dpo": ([{"step": s, "kind": "train", "loss": 0.7, "preference_accuracy": 0.5}
               for s in (1, 2)]
              + [{"step": 2, "kind": "eval", "loss": 0.6, "preference_accuracy": 0.75,
                  "choice_accuracy": 0.625}],
              ["train preference accuracy (DPO)", "held-out preference accuracy (DPO)",
               "held-out: policy prefers chosen (DPO)"])}
  for name, (records, labels) in runs.items():
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics.plot_loss_curve(str(path), str(tmp_path / "loss.png"))
    axes = figures[-1].axes
    assert [line.get_label() for line in axes[-1].get_lines()] == labels, name
  assert "loss and grad_norm are 0 when every completion" in grpo_task.ZERO_LOSS_NOTE


@pytest.mark.parametrize("source, tokenizer, unit", [
    ("stdlib_docs", None, "byte"), ("synthetic", None, "token"), ("tokens", "bytes", "byte"),
    ("tokens", "path/to/tokenizer.json", "token")])
def test_what_one_token_is_follows_the_data(tmp_path, source, tokenizer, unit):
  """Bits per byte only where the tokens are bytes: the built-in docs and byte-level shards."""
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from toolkit import data  # pylint: disable=g-import-not-at-top
  config = lm.get_config("tiny")
  config.data.source = source
  if tokenizer:
    (tmp_path / "meta.json").write_text(json.dumps({"format": "meshkit-tokens-v1",
                                                    "tokenizer": tokenizer}))
    config.data.path = str(tmp_path)
  assert data.token_unit(config) == unit


def _events(folder) -> list:
  """Every event of every TensorBoard event file in `folder` (TFRecord: length (8 bytes), its
  CRC (4), the record, its CRC (4))."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  events = []
  for path in sorted(folder.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    while data:
      (length,) = struct.unpack("<Q", data[:8])
      events.append(event_pb2.Event.FromString(data[12:12 + length]))
      data = data[16 + length:]
  return events


def test_a_resumed_run_keeps_each_step_once_in_metrics_and_tensorboard(tmp_path):
  """Issue 32: after a resume from an older checkpoint, metrics.jsonl held steps 1-10 and then
  6-10 again. The records after the resumed step go (once, when the writer opens); a line cut
  short by a full disk stays, on a line of its own; TensorBoard gets a SessionLog START at the
  first step trained again, which purges its earlier events from there on."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from toolkit.training import metrics  # pylint: disable=g-import-not-at-top
  first = metrics.MetricWriter(str(tmp_path))
  for step in range(1, 11):
    first.write(step, "train", {"loss": 10.0 - step})
  first.write(10, "eval", {"loss": 1.0})
  first.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 11, "kind": "tra')  # cut short
  resumed = metrics.MetricWriter(str(tmp_path), start_step=5)
  assert resumed.dropped == [6, 7, 8, 9, 10]
  resumed.write(6, "train", {"loss": 3.5})
  resumed.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert lines[5:] == ['{"step": 11, "kind": "tra', '{"step": 6, "kind": "train", "loss": 3.5}']
  assert [(r["step"], r["loss"]) for r in metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
          ] == [(s, 10.0 - s) for s in range(1, 6)] + [(6, 3.5)]
  starts = [e.step for e in _events(tmp_path / "tensorboard")
            if e.session_log.status == event_pb2.SessionLog.START]
  assert starts == [6]

  again = metrics.MetricWriter(str(tmp_path), start_step=0)  # a run from scratch: nothing kept
  assert again.dropped == [1, 2, 3, 4, 5, 6]
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 11, "kind": "tra\n'
  assert metrics.MetricWriter(str(tmp_path), start_step=9).dropped == []
