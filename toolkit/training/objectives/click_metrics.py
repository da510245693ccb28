"""The metrics of a click (binary) prediction task over a whole evaluation set, streamed batch
by batch: ROC AUC and log loss, as scikit-learn's `roc_auc_score` and `log_loss` define them.

  metrics = ClickMetrics()
  for labels, logits in eval_batches:
    metrics.add(labels, logits)          # host arrays: labels in {0, 1}, logits (the model's)
  metrics.auc(), metrics.log_loss()

AUC is exact, not a histogram's estimate: the batches' labels and logits are kept (8 bytes an
example), and the AUC is the Mann-Whitney statistic over all of them, tied scores counted as
half (scikit-learn's trapezoids give the same). Log loss is computed from the logits
(softplus(z) - y z, no probability rounded to 0 or 1), summed as the batches come.
"""
from __future__ import annotations

import numpy as np


class ClickMetrics:
  """Labels and logits of the batches seen so far, and the metrics over all of them."""

  def __init__(self):
    self._labels: list[np.ndarray] = []
    self._logits: list[np.ndarray] = []
    self._loss_sum = 0.0
    self.count = 0

  def add(self, labels, logits) -> None:
    labels = np.asarray(labels, np.float64).reshape(-1)
    logits = np.asarray(logits, np.float64).reshape(-1)
    if labels.shape != logits.shape:
      raise ValueError(f"{labels.size} labels for {logits.size} logits; give one logit a label")
    if not np.isin(labels, (0.0, 1.0)).all():
      raise ValueError("click labels must be 0 or 1")
    self._labels.append(labels)
    self._logits.append(logits)
    self._loss_sum += float(np.sum(np.logaddexp(0.0, logits) - labels * logits))
    self.count += labels.size

  def log_loss(self) -> float:
    """Mean binary cross-entropy, in nats."""
    if not self.count:
      raise ValueError("no examples: add batches before asking for the log loss")
    return self._loss_sum / self.count

  def auc(self) -> float:
    """The area under the ROC curve; NaN when every label is the same (no pair to rank)."""
    labels, logits = np.concatenate(self._labels), np.concatenate(self._logits)
    positives = int(labels.sum())
    negatives = labels.size - positives
    if not positives or not negatives:
      return float("nan")
    ranks = _mean_ranks(logits)  # ties get their mean rank: half a pair each
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2)
                 / (positives * negatives))


def _mean_ranks(values: np.ndarray) -> np.ndarray:
  """1-based ranks of `values`, tied values sharing the mean of the ranks they span."""
  order = np.argsort(values, kind="stable")
  _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
  ranks = np.empty(values.size)
  ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
  return ranks
