"""scripts/bench/bench_score.py's baseline, scripts/bench/torch_score_server.py: its PyTorch DLRM
given a checkpoint's weights scores as meshkit's model does (the comparison is of one model),
low-rank cross layers and MovieLens' bags without dense features included."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models.dlrm import DLRM, DLRMConfig
from tests import extras
from tests.tiny_runs import TOLERANCE


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(cross_rank=4),
    dict(dense_features=0, bottom_mlp=(), hash_ids=False),
], ids=["criteo", "low_rank", "movielens"])
def test_the_pytorch_baseline_scores_as_meshkits_model(overrides):
  torch = extras.require("torch")
  from scripts.bench.torch_score_server import TorchDLRM  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(DLRMConfig.preset("tiny"), **overrides)
  model = DLRM(cfg, rngs=nnx.Rngs(params=0))
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  rng = np.random.default_rng(0)
  batch, bag = 32, 3
  dense = rng.random((batch, cfg.dense_features), np.float32)
  high = min(cfg.table_rows) if not cfg.hash_ids else 2**31
  ids = rng.integers(0 if not cfg.hash_ids else -high, high,
                     (batch, len(cfg.table_rows), bag)).astype(np.int32)
  lengths = rng.integers(0, bag + 1, (batch, len(cfg.table_rows))).astype(np.int32)
  want = np.asarray(jax.nn.sigmoid(model(dense, ids, lengths)))
  with torch.inference_mode():
    got = TorchDLRM(cfg, params)(dense, ids, lengths).numpy()
  np.testing.assert_allclose(got, want, **TOLERANCE)
