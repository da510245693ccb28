"""MovieLens-100k's reader (toolkit/data/movielens.py) on generated files in RecBole's atomic
format: every rating becomes an example with its features in range, the split by time leaks no
user's future into training, a folder that holds the files is used without a download, and a
broken file is one error naming it."""
import os

import numpy as np
import pytest

from toolkit.data import movielens
from toolkit.errors import ConfigError

GENRES = ("Action", "Comedy", "Drama", "Horror", "Romance", "Sci-Fi", "War", "Western")


def _write(folder, users=30, items=40, ratings=600, seed=0):
  """Files in the wheel's format: a typed header, tab-separated columns."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "ml-100k.user"), "w") as f:
    f.write("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n")
    for u in range(1, users + 1):
      f.write(f"{u}\t{rng.integers(7, 70)}\t{'MF'[u % 2]}\t{('writer', 'other')[u % 2]}\t"
              f"{rng.integers(10000, 99999) if u % 5 else 'T8H1N'}\n")
  with open(os.path.join(folder, "ml-100k.item"), "w") as f:
    f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
    for i in range(1, items + 1):
      genres = " ".join(rng.choice(GENRES, size=1 + i % 7, replace=False))
      f.write(f"{i}\tMovie {i}\t{1990 + i % 9}\t{genres}\n")
  with open(os.path.join(folder, "ml-100k.inter"), "w") as f:
    f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    for _ in range(ratings):
      f.write(f"{rng.integers(1, users + 1)}\t{rng.integers(1, items + 1)}\t"
              f"{rng.integers(1, 6)}\t{rng.integers(874724710, 893286638)}\n")
  return str(folder)


def test_every_rating_is_an_example_with_its_features_in_range(tmp_path):
  folder = _write(tmp_path / "ml")
  got = movielens.read(folder)
  assert len(got) == 600 and got.ids.shape == (600, len(movielens.FEATURES), movielens.MAX_GENRES)
  ratings = np.loadtxt(os.path.join(folder, "ml-100k.inter"), skiprows=1)
  np.testing.assert_array_equal(got.labels, ratings[:, 2] >= 4)
  np.testing.assert_array_equal(got.timestamps, ratings[:, 3])
  for feature, rows in enumerate(got.rows):
    assert (got.ids[:, feature] < rows).all() and (got.ids[:, feature, 0] >= 1).all(), feature
  genres = movielens.FEATURES.index("genres")
  assert got.lengths[:, genres].max() == movielens.MAX_GENRES  # 7 genres cut to 6
  padded = np.arange(movielens.MAX_GENRES)[None, :] >= got.lengths[:, genres, None]
  assert (got.ids[:, genres][padded] == 0).all()
  assert (np.delete(got.lengths, genres, axis=1) == 1).all()


def test_the_split_by_time_puts_no_users_future_in_training(tmp_path):
  got = movielens.read(_write(tmp_path / "ml"))
  train, test = movielens.split(got, test_fraction=0.2)
  assert len(train) + len(test) == len(got) and 0.15 < len(test) / len(got) < 0.25
  user = movielens.FEATURES.index("user")
  for u in np.unique(got.ids[:, user, 0]):
    mine, theirs = (e.timestamps[e.ids[:, user, 0] == u] for e in (train, test))
    assert mine.size and theirs.size, u  # each user in both: 10+ ratings a user here
    assert mine.max() < theirs.min(), u
    assert theirs.size >= round(0.2 * (mine.size + theirs.size)), u
  for part in (train, test):
    assert (np.diff(part.timestamps) >= 0).all()
  with pytest.raises(ConfigError, match="test_fraction=1.5"):
    movielens.split(got, 1.5)


def test_a_folder_with_the_files_is_used_without_a_download(tmp_path, monkeypatch):
  _write(tmp_path / "ml-100k")
  monkeypatch.setattr(movielens.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
  assert movielens.fetch(str(tmp_path)) == str(tmp_path / "ml-100k")


def test_broken_files_are_one_error_naming_them(tmp_path):
  folder = _write(tmp_path / "ml")
  with open(os.path.join(folder, "ml-100k.inter"), "a") as f:
    f.write("3\t4\t5\n")
  with pytest.raises(ConfigError, match=r"ml-100k.inter line 602: 3 tab-separated columns"):
    movielens.read(folder)
  folder = _write(tmp_path / "ml2")
  with open(os.path.join(folder, "ml-100k.inter"), "a") as f:
    f.write("999\t4\t5\t874724710\n")
  with pytest.raises(ConfigError, match="user 999 or item 4 is not in"):
    movielens.read(folder)
  os.remove(os.path.join(folder, "ml-100k.user"))
  with pytest.raises(ConfigError, match="ml-100k.user does not exist"):
    movielens.read(folder)


def test_a_download_without_the_files_is_one_error_and_writes_nothing(tmp_path, monkeypatch):
  def fake_pip(args, **_):
    import zipfile  # pylint: disable=g-import-not-at-top
    with zipfile.ZipFile(os.path.join(args[args.index("-d") + 1], "recbole.whl"), "w") as w:
      w.writestr("recbole/__init__.py", "")
  monkeypatch.setattr(movielens.subprocess, "run", fake_pip)
  with pytest.raises(ConfigError, match=r"did not hold MovieLens-100k .*copy ml-100k.inter"):
    movielens.fetch(str(tmp_path))
  assert not os.listdir(tmp_path / "ml-100k")
