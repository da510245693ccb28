"""Scoring requests as JSON: a user's context and the candidate items to score, checked against
the features a click model was trained on (its data source) and turned into model inputs.

  {"context": {"user": 12, "age": 2, "gender": 1, "occupation": 4, "zip3": 80},
   "candidates": [{"item": 50, "genres": [3, 7], "year": 61}, {"item": 181, ...}]}

Every feature of the source is given once, in the context or in every candidate (a candidate's
value for a context feature is a mistake). A categorical feature is an id or a list of ids (a
bag, at most the source's bag size); a dense feature is a number. MovieLens' ids are the table
rows `toolkit/data/movielens.py` gives them. Criteo's dense values are the raw integers of the
file (I1-I13, transformed as the reader transforms them) and its ids 32-bit hex strings as in
the file or integers (C1-C26); "" is an empty value, as in the file.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re

import numpy as np

from toolkit.data import criteo, movielens
from toolkit.inference.sampling import RequestError

MAX_CANDIDATES_DEFAULT = 1024
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")


@dataclasses.dataclass(frozen=True)
class Features:
  """A click source's features, as requests name them."""
  dense: tuple[str, ...]
  sparse: tuple[str, ...]
  bag: int          # the most ids in one categorical feature
  hex_ids: bool     # ids may come as the file's hex strings (Criteo)

  @classmethod
  def of(cls, source: str) -> Features:
    if source == "movielens":
      return cls((), movielens.FEATURES, movielens.MAX_GENRES, False)
    return cls(tuple(f"I{i}" for i in range(1, criteo.DENSE + 1)),
               tuple(f"C{i}" for i in range(1, criteo.SPARSE + 1)), 1, True)


@dataclasses.dataclass(frozen=True)
class Inputs:
  dense: np.ndarray    # (n, F) float32
  ids: np.ndarray      # (n, T, bag) int32
  lengths: np.ndarray  # (n, T) int32

  def __len__(self) -> int:
    return len(self.ids)


def parse_score_request(body, features: Features, table_rows: tuple[int, ...], hash_ids: bool,
                        max_candidates: int = MAX_CANDIDATES_DEFAULT) -> Inputs:
  """The model inputs of one request; RequestError naming the field otherwise."""
  if not isinstance(body, dict):
    raise RequestError('the body must be a JSON object: {"context": {...}, "candidates": '
                       '[{...}, ...]}')
  unknown = sorted(set(body) - {"context", "candidates", "id"})
  if unknown:
    raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; give context and "
                       f"candidates")
  context = body.get("context", {})
  candidates = body.get("candidates")
  if not isinstance(context, dict):
    raise RequestError("context must be an object of feature: value")
  if not isinstance(candidates, list) or not candidates:
    raise RequestError("candidates must be a non-empty list of objects of feature: value")
  if len(candidates) > max_candidates:
    raise RequestError(f"{len(candidates)} candidates; at most {max_candidates} a request "
                       f"(--max_candidates)")
  names = set(features.dense + features.sparse)
  for key in context:
    if key not in names:
      raise RequestError(f"context.{key} is not a feature of this model; its features: "
                         f"{', '.join(features.dense + features.sparse)}")
  given = set(context)
  for c, candidate in enumerate(candidates):
    if not isinstance(candidate, dict):
      raise RequestError(f"candidates[{c}] must be an object of feature: value")
    if not names.issuperset(candidate) or not given.isdisjoint(candidate):
      key = next(k for k in candidate if k not in names or k in given)
      raise RequestError(f"candidates[{c}].{key} is also in context; give each feature once"
                         if key in given else f"candidates[{c}].{key} is not a feature of this "
                         f"model")
  n = len(candidates)
  dense = np.zeros((n, len(features.dense)), np.float32)
  ids = np.zeros((n, len(features.sparse), features.bag), np.int32)
  lengths = np.zeros((n, len(features.sparse)), np.int32)
  for f, name in enumerate(features.dense):
    if name in context:
      dense[:, f] = _dense(context[name], f"context.{name}")
    else:
      dense[:, f] = _dense_column(_column(candidates, name), name)
  for t, name in enumerate(features.sparse):
    if name in context:
      bag = _ids(context[name], f"context.{name}", features, table_rows[t], hash_ids)
      ids[:, t, :len(bag)] = bag
      lengths[:, t] = len(bag)
    else:
      _ids_column(_column(candidates, name), name, features, table_rows[t], hash_ids,
                  ids[:, t], lengths[:, t])
  return Inputs(dense, ids, lengths)


def _column(candidates: list[dict], name: str) -> list:
  """Every candidate's value of `name`; RequestError naming the first that lacks it."""
  try:
    return [candidate[name] for candidate in candidates]
  except KeyError:
    c = next(i for i, candidate in enumerate(candidates) if name not in candidate)
    raise RequestError(f"candidates[{c}]: feature {name!r} is missing; give it in context or "
                       f"in every candidate") from None


def _dense_column(column: list, name: str) -> np.ndarray:
  """`_dense` of each value; all numbers at once where they are."""
  if all(type(v) in (int, float) for v in column):  # bools and strings take the long way
    values = np.asarray(column, np.float64)
    if np.isfinite(values).all():
      return np.log1p(np.maximum(values, 0))
  return np.asarray([_dense(v, f"candidates[{c}].{name}") for c, v in enumerate(column)])


def _ids_column(column: list, name: str, features: Features, rows: int, hash_ids: bool,
                ids: np.ndarray, lengths: np.ndarray) -> None:
  """Writes each candidate's bag of `name` into `ids` (n, bag) and `lengths` (n,): single ids
  (integers, or hex strings where the source has them) at once, anything else one by one."""
  kinds = {type(v) for v in column}
  values = None
  if kinds == {int}:
    try:
      values = np.asarray(column, np.int64)
    except OverflowError:
      values = None
  elif kinds == {str} and features.hex_ids and all(map(_HEX.fullmatch, column)):
    values = np.asarray([int(v, 16) for v in column], np.int64)
  low, high = (-2**31, 2**32) if hash_ids else (0, rows)
  if values is not None and ((values >= low) & (values < high)).all():
    ids[:, 0] = (values % 2**32).astype(np.uint32).view(np.int32) if hash_ids else values
    lengths[:] = 1
    return
  for c, value in enumerate(column):
    bag = _ids(value, f"candidates[{c}].{name}", features, rows, hash_ids)
    ids[c, :len(bag)] = bag
    lengths[c] = len(bag)


def _dense(value, field: str) -> float:
  """The reader's transform of a dense value: log(1 + max(x, 0)); "" is 0."""
  if value == "":
    return 0.0
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise RequestError(f"{field}={value!r} must be a finite number")
  return math.log1p(max(value, 0))


def _ids(value, field: str, features: Features, rows: int, hash_ids: bool) -> list[int]:
  bag = value if isinstance(value, list) else ([] if value == "" else [value])
  if len(bag) > features.bag:
    raise RequestError(f"{field} has {len(bag)} ids; at most {features.bag}")
  out = []
  for item in bag:
    if features.hex_ids and isinstance(item, str):
      if not _HEX.fullmatch(item):
        raise RequestError(f"{field}={value!r}: not a 32-bit hex id")
      item = int(item, 16)
    if isinstance(item, bool) or not isinstance(item, int):
      raise RequestError(f"{field}={value!r}: ids are integers")
    if hash_ids:
      if not -2**31 <= item < 2**32:
        raise RequestError(f"{field}={item}: ids are 32-bit integers")
      out.append(int(np.uint32(item % 2**32).view(np.int32)))
    elif not 0 <= item < rows:
      raise RequestError(f"{field}={item} is outside the table's rows [0, {rows})")
    else:
      out.append(item)
  return out
