"""Click examples for recommendation models, as Grain data sources: `data.source="criteo"`
(a Criteo-format file, or `synthetic:N` lines with a planted click model) and
`data.source="movielens"` (MovieLens-100k, `data.path` the download cache).

Each example is {"dense" (F,) float32, "ids" (T, bag) int32, "lengths" (T,) int32, "label"}.
The held-out split is by time, never a random draw: the last `data.eval_fraction` of a click
log's lines, and for MovieLens each user's latest `data.eval_fraction` of ratings
(`movielens.split`). No future is trained on.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

import grain
import numpy as np

from toolkit.data import criteo, movielens
from toolkit.errors import ConfigError

SYNTHETIC = "synthetic:"
SYNTHETIC_VOCABULARY = 2_000  # ids per categorical column of `synthetic:N`


@dataclasses.dataclass(frozen=True)
class ClickArrays:
  """Examples in memory: a Grain data source."""
  dense: np.ndarray    # (n, F) float32
  ids: np.ndarray      # (n, T, bag) int32
  lengths: np.ndarray  # (n, T) int32
  labels: np.ndarray   # (n,) int32
  name: str
  held_out: int = 0    # the last `held_out` are the source's own held-out set; 0: none given

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {"dense": self.dense[index], "ids": self.ids[index], "lengths": self.lengths[index],
            "label": self.labels[index]}

  def __repr__(self) -> str:  # Grain keeps it in the iterator state
    return f"ClickArrays({self.name}, {len(self)})"

  def rows(self, index: np.ndarray, name: str) -> ClickArrays:
    return ClickArrays(self.dense[index], self.ids[index], self.lengths[index],
                       self.labels[index], name)


class ClicksToModel(grain.transforms.Map):
  """Examples -> model inputs; "weights" is 1 for real rows, 0 for eval padding."""

  def map(self, element: dict) -> dict:
    labels = element["label"].astype(np.float32)
    return {"step": element["step"], "dense": element["dense"], "ids": element["ids"],
            "lengths": element["lengths"], "labels": labels,
            "weights": element.get("weight", np.ones(labels.shape, np.float32))}


def load(data) -> ClickArrays:
  """All of `data.source`'s examples, in time order."""
  if data.source == "criteo":
    path = data.get("path", "")
    if path.startswith(SYNTHETIC):
      count = path[len(SYNTHETIC):]
      if not count.isdigit() or int(count) < 10:
        raise ConfigError(f"data.path={path!r}: give the number of lines, e.g. synthetic:20000")
      with tempfile.TemporaryDirectory() as folder:
        file = os.path.join(folder, "clicks.tsv")
        criteo.write_synthetic(file, int(count), seed=0, vocabulary=SYNTHETIC_VOCABULARY)
        examples = criteo.read(file)
    else:
      if not os.path.isfile(path):
        raise ConfigError(f"data.path={path!r} is not a file; give a Criteo-format file (a "
                          f"day file or the Kaggle train.txt) or synthetic:N")
      examples = criteo.read(path)
    return ClickArrays(examples.dense, examples.ids[:, :, None],
                       np.ones(examples.ids.shape, np.int32), examples.labels, path)
  train, test = movielens.split(movielens.read(movielens.fetch(data.path)),
                                data.eval_fraction)
  ids, lengths = (np.concatenate([a, b]) for a, b in ((train.ids, test.ids),
                                                      (train.lengths, test.lengths)))
  return ClickArrays(np.zeros((len(ids), 0), np.float32), ids, lengths,
                     np.concatenate([train.labels, test.labels]), "movielens", len(test))


def split(examples: ClickArrays, eval_fraction: float) -> tuple[ClickArrays, ClickArrays]:
  """(train, held out): the held-out examples are the last `eval_fraction` of them, or the
  source's own held-out set where it gives one (`held_out`)."""
  count = examples.held_out or max(1, int(round(len(examples) * eval_fraction)))
  if count >= len(examples):
    raise ConfigError(f"{examples.name}: {len(examples)} example(s) leave nothing to train on "
                      f"after holding out data.eval_fraction={eval_fraction}")
  cut = len(examples) - count
  return (examples.rows(np.arange(cut), examples.name + ":train"),
          examples.rows(np.arange(cut, len(examples)), examples.name + ":held_out"))
