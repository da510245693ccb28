"""Click logs in the Criteo format (the Kaggle Display Advertising set and the 1 TB day files),
read into arrays, and generated at any size with a planted click model whose AUC is known.

The format: one example per line, 40 tab-separated columns: the label (0 or 1), 13 integer
features (I1-I13, possibly empty) and 26 categorical features (C1-C26, 32-bit ids written as
hex, possibly empty).

  examples = criteo.read(path)                  # Examples: labels, dense (n, 13), ids (n, 26)
  labels, planted = criteo.write_synthetic(path, examples=100_000, seed=0)

Reading follows DLRM's preprocessing: an integer x becomes log(1 + max(x, 0)) (empty: 0); a
categorical id is its 32-bit value as int32 (two's complement), empty is 0. Ids go into a
table's range through `models.embedding_bag.hash_ids`. A line with the wrong number of
columns, a label that is not 0 or 1, or a value that is not an integer or hex is one
ConfigError naming the file, the line and the column.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from toolkit.errors import ConfigError

DENSE, SPARSE = 13, 26
COLUMNS = 1 + DENSE + SPARSE


@dataclasses.dataclass(frozen=True)
class Examples:
  labels: np.ndarray  # (n,) int32, 0 or 1
  dense: np.ndarray   # (n, 13) float32, log(1 + max(x, 0))
  ids: np.ndarray     # (n, 26) int32, the hex ids' 32 bits

  def __len__(self) -> int:
    return len(self.labels)


def read(path: str) -> Examples:
  """Every example of a Criteo-format file; see the module docstring for the errors."""
  labels, dense, ids = [], [], []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      label, values, categories = parse_line(raw, f"{path} line {number}")
      labels.append(label)
      dense.append(values)
      ids.append(categories)
  if not labels:
    raise ConfigError(f"{path} holds no examples; a Criteo-format file has one per line")
  return Examples(np.asarray(labels, np.int32), np.asarray(dense, np.float32),
                  np.asarray(ids, np.uint32).view(np.int32))


def parse_line(raw: bytes, where: str) -> tuple[int, list[float], list[int]]:
  """(label, 13 transformed integers, 26 ids as unsigned 32-bit ints) of one line."""
  columns = raw.rstrip(b"\r\n").split(b"\t")
  if len(columns) != COLUMNS:
    raise ConfigError(f"{where}: {len(columns)} tab-separated columns, expected {COLUMNS} "
                      f"(label, {DENSE} integers, {SPARSE} hex ids)")
  if columns[0] not in (b"0", b"1"):
    raise ConfigError(f"{where}, column 1: label {columns[0][:20]!r} is not 0 or 1")
  values = []
  for column, text in enumerate(columns[1:1 + DENSE], 2):
    try:
      values.append(math.log1p(max(int(text), 0)) if text else 0.0)
    except ValueError:
      raise ConfigError(f"{where}, column {column}: {text[:20]!r} is not an integer") from None
  categories = []
  for column, text in enumerate(columns[1 + DENSE:], 2 + DENSE):
    try:
      value = int(text, 16) if text else 0
    except ValueError:
      value = -1
    if not 0 <= value < 2**32 or text.startswith((b"-", b"+", b"0x")) or b" " in text:
      raise ConfigError(f"{where}, column {column}: {text[:20]!r} is not a 32-bit hex id")
    categories.append(value)
  return int(columns[0]), values, categories


def write_synthetic(path: str, examples: int, seed: int = 0, vocabulary: int = 100_000,
                    exponent: float = 1.1,
                    missing: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """Writes `examples` lines with a planted click model; returns their labels and planted click
  logits (the AUC of those logits is the best any model can reach on the file).

  Each categorical column draws its ids from a power law over `vocabulary` values (the id of
  rank r has probability proportional to r^-`exponent`, as real click logs' ids do) and
  writes them as hex; each integer column is a geometric count. The planted click logit is a
  bias plus a weight per (column, id) and per log-count: label ~ Bernoulli(sigmoid(logit)).
  `missing` of the values are left empty."""
  rng = np.random.default_rng(seed)
  ranks = np.arange(1, vocabulary + 1, dtype=np.float64)
  popularity = ranks**-exponent
  popularity /= popularity.sum()
  # Random 32-bit ids, which do not reveal their rank, and a weight for each.
  values = rng.integers(0, 2**32, size=(SPARSE, vocabulary), dtype=np.uint64)
  id_weights = rng.normal(scale=0.6, size=(SPARSE, vocabulary))
  dense_weights = rng.normal(scale=0.3, size=DENSE)
  picks = np.stack([rng.choice(vocabulary, size=examples, p=popularity) for _ in range(SPARSE)],
                   axis=1)
  counts = rng.geometric(p=0.2, size=(examples, DENSE)) - 1
  sparse_missing = rng.uniform(size=(examples, SPARSE)) < missing
  dense_missing = rng.uniform(size=(examples, DENSE)) < missing
  logit = -1.5 + np.where(sparse_missing, 0.0,
                          id_weights[np.arange(SPARSE), picks]).sum(axis=1)
  logit += (np.where(dense_missing, 0.0, np.log1p(counts)) * dense_weights).sum(axis=1)
  probability = 1 / (1 + np.exp(-logit))
  labels = (rng.uniform(size=examples) < probability).astype(np.int32)
  with open(path, "w", encoding="ascii") as f:
    for i in range(examples):
      dense_text = ["" if dense_missing[i, j] else str(counts[i, j]) for j in range(DENSE)]
      sparse_text = ["" if sparse_missing[i, j] else f"{values[j, picks[i, j]]:08x}"
                     for j in range(SPARSE)]
      f.write("\t".join([str(labels[i]), *dense_text, *sparse_text]) + "\n")
  return labels, logit
