"""Tasks: the classifier's label-smoothed training loss against a float64 NumPy reference, and
its config checks."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import lm, vit
from models import ViT, ViTConfig
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib
from toolkit.training.objectives import tasks


def _reference_loss(logits: np.ndarray, labels: np.ndarray, smoothing: float) -> float:
  logits = logits.astype(np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  classes = logits.shape[-1]
  targets = (1 - smoothing) * np.eye(classes)[labels] + smoothing / classes
  return float(np.mean(-(targets * log_probs).sum(-1)))


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.5])
def test_smoothed_loss_matches_float64(smoothing):
  cfg = ViTConfig.preset("tiny")
  model = ViT(cfg, rngs=nnx.Rngs(params=0))
  model.head[...] = jax.random.normal(jax.random.key(1), model.head[...].shape)  # not all 0
  graphdef, params = nnx.split(model, nnx.Param)
  batch = {"images": jax.random.uniform(jax.random.key(2), (16, 8, 8, 1)),
           "labels": jax.random.randint(jax.random.key(3), (16,), 0, cfg.num_classes)}
  task = tasks.for_run("classification", smoothing)
  loss, metrics = task.loss(graphdef, params, batch)
  loss = float(loss)
  assert metrics == {}
  logits = np.asarray(model(batch["images"]))
  assert loss == pytest.approx(_reference_loss(logits, np.asarray(batch["labels"]), smoothing),
                               rel=1e-5)
  # Evaluation reports the plain cross-entropy whatever the training targets are.
  evaluated = task.evaluate(graphdef, params, {**batch, "weights": np.ones(16, np.float32)})
  assert float(evaluated["loss_sum"]) / 16 == pytest.approx(
      _reference_loss(logits, np.asarray(batch["labels"]), 0.0), rel=1e-5)


@pytest.mark.parametrize("experiment,value,message", [
    (vit, 1.0, r"train.label_smoothing=1.0 must be a finite number in \[0, 1\)"),
    (vit, -0.1, r"train.label_smoothing=-0.1 must be a finite number in \[0, 1\)"),
    (lm, 0.1, r"train.label_smoothing=0.1 applies to classifiers \(model.kind='vit'\); set it "
              r"to 0 for model.kind='llama'"),
])
def test_label_smoothing_is_checked(experiment, value, message):
  config = experiment.get_config("tiny")
  config.train.label_smoothing = value
  with pytest.raises(ConfigError, match=message):
    config_lib.resolve(config)


def test_confusion_matrix_counts_each_real_example_once():
  """Two eval batches, the second padded: the summary and its confusion matrix see only the
  weight-1 rows; the diagonal holds the correct ones."""
  labels = np.array([[0, 1, 2, 3], [3, 3, 9, 9]], np.int32)
  predictions = np.array([[0, 1, 5, 3], [3, 0, 9, 9]], np.int32)
  weights = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.float32)
  results = [{"loss_sum": 1.0, "count": w.sum(), "correct": ((p == l) * w).sum(),
              "labels": l, "predictions": p, "weights": w}
             for l, p, w in zip(labels, predictions, weights)]
  summary = tasks.classification_summary(results)
  matrix = tasks.confusion_matrix(summary["labels"], summary["predictions"], 10)
  assert summary["examples"] == matrix.sum() == 6
  assert summary["accuracy"] == np.trace(matrix) / 6 == 4 / 6
  assert matrix[2, 5] == 1 and matrix[3, 0] == 1 and matrix[9].sum() == 0
