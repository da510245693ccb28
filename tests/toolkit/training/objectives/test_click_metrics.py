"""AUC and log loss streamed over batches (toolkit/training/objectives/click_metrics.py) equal
scikit-learn's `roc_auc_score` and `log_loss` on the whole set, with tied scores, extreme
logits and uneven batches; a set of one class has no AUC; mismatched inputs are one error."""
import numpy as np
import pytest
from sklearn import metrics

from toolkit.training.objectives.click_metrics import ClickMetrics

TOLERANCE = 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_metrics_equal_scikit_learns_on_the_whole_set(seed):
  rng = np.random.default_rng(seed)
  n = 5_000
  logits = rng.normal(scale=2.0, size=n)
  logits[:400] = np.round(logits[:400])          # many ties
  logits[400:410] = (-40, 40, -35, 35, 0, 0, 30, -30, 20, -20)  # probabilities near 0 and 1
  labels = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(np.int64)
  got = ClickMetrics()
  for start, stop in zip([0, 7, 1000, 3333], [7, 1000, 3333, n]):
    got.add(labels[start:stop], logits[start:stop])
  probabilities = 1 / (1 + np.exp(-logits))
  assert got.count == n
  assert abs(got.auc() - metrics.roc_auc_score(labels, logits)) < TOLERANCE
  assert abs(got.log_loss() - metrics.log_loss(labels, probabilities)) < TOLERANCE


def test_one_class_has_no_auc_and_bad_input_is_one_error():
  got = ClickMetrics()
  with pytest.raises(ValueError, match="no examples"):
    got.log_loss()
  got.add([1, 1], [0.3, -0.2])
  assert np.isnan(got.auc())
  with pytest.raises(ValueError, match="3 labels for 2 logits"):
    got.add([0, 1, 1], [0.1, 0.2])
  with pytest.raises(ValueError, match="must be 0 or 1"):
    got.add([0, 2], [0.1, 0.2])
