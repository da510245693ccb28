"""Harness tasks during training (`train.eval_tasks`): a tiny run evaluates a local task every
2 steps on the parameters in memory, writes the metrics to metrics.jsonl at those steps and
plots them beside the loss; evaluating the final checkpoint afterwards (toolkit.evaluate's
path) gives the same numbers. Configs the periodic evaluation cannot serve are refused before
training starts."""
from __future__ import annotations

import os

import pytest

from experiments import lm, vit
from tests import extras, tiny_runs
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.evaluation import harness, offline, periodic
from toolkit.training import metrics as metrics_lib

extras.require("lm_eval")
CHOICE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                      "experiments", "eval_tasks", "arithmetic_choice.yaml"))
TASK = "meshkit_arithmetic_choice"


def test_eval_tasks_every_n_steps_from_memory_equal_the_checkpoints(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  config = tiny_runs.tiny_config(steps=4)
  config.train.update(eval_tasks=CHOICE, eval_tasks_every=2, eval_tasks_limit=8, log_every=2,
                      eval_every=4, checkpoint_every=4)
  training.run(config, str(tmp_path), periodic=periodic.for_config(config))
  records = [r for r in metrics_lib.read_metrics(str(tmp_path / "metrics.jsonl"))
             if r["kind"] == "eval_tasks"]
  assert [r["step"] for r in records] == [2, 4]
  last = {k: v for k, v in records[-1].items() if k not in ("step", "kind")}
  assert set(last) == {f"{TASK}/acc", f"{TASK}/acc_norm"}
  assert all(0 <= v <= 1 for v in last.values())
  assert (tmp_path / "eval_tasks.png").is_file() and (tmp_path / "loss.png").is_file()
  # The same model read back from its checkpoint, through the command's path.
  results = offline.run(config, str(tmp_path), CHOICE, limit=8, bootstrap_iters=0,
                        batch_size=config.data.global_batch_size)
  assert harness.scalars(results) == last


@pytest.mark.parametrize("change, fragment", [
    (lambda c: c.data.update(source="synthetic"), "data.source='synthetic'"),
    (lambda c: c.mesh.update(ici="fsdp:2,sequence:4"), "context parallelism"),
], ids=["no tokenizer", "positions split"])
def test_configs_it_cannot_serve_are_refused_before_training(change, fragment):
  config = lm.get_config("tiny")
  config.train.eval_tasks = CHOICE
  change(config)
  with pytest.raises(ConfigError, match=fragment):
    periodic.for_config(config)


def test_a_classifier_is_refused():
  config = vit.get_config("tiny")
  config.train.eval_tasks = CHOICE
  with pytest.raises(ConfigError, match="evaluates language models"):
    periodic.for_config(config)
