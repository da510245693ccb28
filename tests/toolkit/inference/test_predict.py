"""Batch prediction for a classifier (the ViT) from a checkpoint: inputs file -> predictions."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import vit as vit_experiment
from tests.tiny_runs import TOLERANCE
from toolkit import training
from toolkit.inference import classify
from toolkit.errors import ConfigError


def vit_config():
  config = vit_experiment.get_config("tiny")
  config.train.steps = 3
  config.train.checkpoint_every = 3
  return config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("vit")
  training.run(vit_config(), str(path))
  return path


def test_predictions_match_the_model_and_keep_input_order(workdir, tmp_path):
  config = vit_config()
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (37, 8, 8), dtype=np.uint8)  # 37: the last batch is padded
  labels = rng.integers(0, 10, 37).astype(np.int64)
  inputs = tmp_path / "in.npz"
  np.savez(inputs, images=images, labels=labels)
  out = tmp_path / "out.jsonl"
  summary = classify.run(config, str(workdir), str(inputs), str(out), batch_size=16, top_k=3)
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["index"] for r in records] == list(range(37))
  assert summary["traces"] == 1 and summary["examples"] == 37
  # Reference: the restored parameters run through the model directly on the host, unsharded
  # (classify ran on the config's mesh of 8 devices).
  from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
  params, model_cfg, *_ = restore_params(config, str(workdir))
  from models import build_model  # pylint: disable=g-import-not-at-top
  graphdef, _ = nnx.split(build_model(model_cfg, nnx.Rngs(params=0)))
  normalized = (images[..., None].astype(np.float32) / 255.0 - config.data.mean) / config.data.std
  logits = nnx.merge(graphdef, jax.device_get(params))(normalized)
  probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))
  np.testing.assert_array_equal([r["label"] for r in records], probabilities.argmax(-1))
  np.testing.assert_allclose([r["probability"] for r in records], probabilities.max(-1),
                             **TOLERANCE)
  assert all(len(r["top_k"]) == 3 and r["top_k"][0][0] == r["label"] for r in records)
  assert [r["true_label"] for r in records] == labels.tolist()
  assert summary["accuracy"] == pytest.approx(np.mean(probabilities.argmax(-1) == labels))


def test_bad_inputs_are_clear_errors(workdir, tmp_path):
  config = vit_config()
  wrong = tmp_path / "wrong.npz"
  np.savez(wrong, images=np.zeros((4, 5, 5), np.uint8))
  with pytest.raises(ConfigError, match=r"images have shape \(4, 5, 5, 1\), expected"):
    classify.run(config, str(workdir), str(wrong), str(tmp_path / "o.jsonl"))
  no_images = tmp_path / "none.npz"
  np.savez(no_images, pixels=np.zeros((4, 8, 8)))
  with pytest.raises(ConfigError, match="has no array 'images'"):
    classify.run(config, str(workdir), str(no_images), str(tmp_path / "o.jsonl"))
  with pytest.raises(ConfigError, match="does not exist"):
    classify.run(config, str(workdir), str(tmp_path / "missing.npz"), str(tmp_path / "o.jsonl"))
  with pytest.raises(ConfigError, match="top_k=11 must be in"):
    classify.run(config, str(workdir), str(wrong), str(tmp_path / "o.jsonl"), top_k=11)
  from tests.tiny_runs import tiny_config  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="not a classifier; generate text"):
    classify.run(tiny_config(), str(workdir), str(wrong), str(tmp_path / "o.jsonl"))
