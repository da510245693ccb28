"""Click prediction with DLRM and a DCN-v2 cross network (models/dlrm.py): embedding tables split
row-wise over the batch's mesh axes (models/embedding_bag.py), the dense layers data parallel.

  python -m toolkit.train --config=experiments/dlrm.py:cpu --workdir=runs/dlrm_cpu

Variants after the colon, comma separated:
  cpu        (default) 100,000 lines of Criteo-format click logs with a planted click model
             (toolkit/data/criteo.py, synthetic:100000), 26 tables of 2,048 rows, one pass
             over the 90,000 training lines (350 steps of 256) on 8 devices
  tiny       the unit-test size: 2,000 lines, tables of 256 rows, 20 steps
  movielens  MovieLens-100k (toolkit/data/movielens.py, fetched once into data.path's cache)
             with user, item, age, gender, occupation, zip3, genre and year tables; each
             user's latest 20 % of ratings held out; 900 steps of 256 (three passes)

On MovieLens-100k the DCN's held-out AUC beats scikit-learn's logistic regression on the same
features (0.7812) by at least 0.008 on each of seeds 0, 1, 2 (docs/recommendations.md).
"""
import dataclasses

import ml_collections

from models.dlrm import DLRMConfig
from toolkit.training.config import defaults

_VARIANTS = ("cpu", "tiny", "movielens")
# MovieLens-100k's tables (toolkit/data/movielens.py: rows of its 8 features), rounded up to
# multiples of 8 so that 8 devices split them.
_MOVIELENS_ROWS = (944, 1688, 8, 8, 24, 384, 24, 80)


def get_config(arg: str | None = None):
  config = defaults()
  _set_model(config, DLRMConfig(table_rows=(2048,) * 26, embed_dim=16, bottom_mlp=(64, 16),
                                cross_layers=2, cross_rank=0, top_mlp=(64, 32)))
  config.mesh.ici = "data:-1"
  config.sharding.preset = "dp"
  # The tables row-wise over the batch's axes, stored as they are looked up.
  config.sharding.param_overrides = "table_rows=data+fsdp"
  config.sharding.activation_overrides = "table_rows=data+fsdp"
  config.sharding.max_replicated_fraction = 1.0  # the dense layers: small, data parallel
  config.data.update(source="criteo", path="synthetic:100000", global_batch_size=256,
                     eval_fraction=0.1, worker_count=0)
  config.optimizer.update(learning_rate=3e-3, warmup_steps=20, weight_decay=0.0)
  # One pass over the training lines: more passes memorize them (held-out AUC falls).
  config.train.update(steps=350, log_every=50, eval_every=70, checkpoint_every=350,
                      sample_tokens=0)
  for key in filter(None, (arg or "cpu").split(",")):
    if key not in _VARIANTS:
      raise ValueError(f"experiments/dlrm.py: unknown variant {key!r}; choose from "
                       f"{', '.join(_VARIANTS)}")
    if key == "tiny":
      _set_model(config, DLRMConfig(table_rows=(256,) * 26, embed_dim=8, bottom_mlp=(16, 8),
                                    cross_layers=1, cross_rank=4, top_mlp=(16,)))
      config.data.update(path="synthetic:2000", global_batch_size=64)
      config.train.update(steps=20, log_every=10, eval_every=20, checkpoint_every=10)
    if key == "movielens":
      _set_model(config, DLRMConfig(table_rows=_MOVIELENS_ROWS, embed_dim=32, dense_features=0,
                                    bottom_mlp=(), cross_layers=2, cross_rank=0,
                                    top_mlp=(64, 32), hash_ids=False))
      config.data.update(source="movielens", path="~/.cache/meshkit/movielens",
                         eval_fraction=0.2)
      # Three passes over the 80,000 training ratings: the held-out AUC peaks near the third.
      config.train.update(steps=900, eval_every=150, checkpoint_every=900)
  return config


def _set_model(config, model: DLRMConfig) -> None:
  config.model = ml_collections.ConfigDict({"kind": "dlrm", **dataclasses.asdict(model)})
