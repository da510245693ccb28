"""Click prediction as a training task (model.kind="dlrm", data.source="criteo"): a run with its
tables row-wise over 8 devices trains as on one device, its held-out AUC rises, a run stopped
half way resumes to the same losses, and a model that does not fit its data is one error."""
import jax
import numpy as np
import pytest

from experiments import dlrm
from tests.tiny_runs import TOLERANCE
from toolkit import training
from toolkit.errors import ConfigError


def _config(ici: str = "data:8", **train):
  config = dlrm.get_config("tiny")
  config.mesh.ici = ici
  config.optimizer.schedule_steps = 20  # a run stopped early keeps the whole run's schedule
  config.train.update(**train)
  return config


@pytest.mark.slow
def test_row_wise_tables_on_8_devices_train_as_on_one(tmp_path):
  sharded = training.run(_config(), str(tmp_path / "sharded"))
  one = training.run(_config("data:1"), str(tmp_path / "one"), devices=jax.devices()[:1])
  steps = sorted(sharded.train_losses)
  assert steps == sorted(one.train_losses) and steps[-1] == 20
  np.testing.assert_allclose([sharded.train_losses[s] for s in steps],
                             [one.train_losses[s] for s in steps], **TOLERANCE)
  first, last = min(sharded.eval_metrics), max(sharded.eval_metrics)
  for metric in ("loss", "auc"):
    np.testing.assert_allclose(sharded.eval_metrics[last][metric],
                               one.eval_metrics[last][metric], **TOLERANCE)
  assert sharded.eval_metrics[last]["auc"] > sharded.eval_metrics[first]["auc"] + 0.05
  assert sharded.eval_metrics[last]["examples"] == 200  # every held-out line, none padded in


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_losses(tmp_path):
  straight = training.run(_config(), str(tmp_path / "straight"))
  training.run(_config(steps=10), str(tmp_path / "stopped"))
  resumed = training.run(_config(), str(tmp_path / "stopped"))
  assert resumed.train_losses[20] == straight.train_losses[20]


@pytest.mark.parametrize("field,value,message", [
    ("model.table_rows", (256,) * 25, "has 26 categorical and 13 dense features; the model has "
                                      "25 tables"),
    ("model.dense_features", 4, "model.dense_features=4: make them equal"),
    ("data.path", "synthetic:x", "give the number of lines"),
    ("data.path", "", "needs data.path"),
])
def test_a_model_that_does_not_fit_its_data_is_one_error(tmp_path, field, value, message):
  config = _config()
  section, name = field.split(".")
  config[section][name] = value
  if name == "dense_features":
    config.model.bottom_mlp = (16, 8)
  with pytest.raises(ConfigError, match=message):
    training.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()
