"""The Criteo format (toolkit/data/criteo.py): a hand-written line reads as DLRM's
preprocessing says; generated files read back with their labels, their share of empty values
and power-law ids, and a planted model whose AUC is well above chance; each malformed line,
and an empty file, is one error naming the file, the line and the column."""
import math

import numpy as np
import pytest

from toolkit.data import criteo
from toolkit.errors import ConfigError
from toolkit.training.objectives.click_metrics import ClickMetrics


def _line(label="1", dense=None, sparse=None) -> str:
  dense = dense if dense is not None else ["3", "", "-2"] + ["0"] * 10
  sparse = sparse if sparse is not None else ["68fd1e64", "", "ffffffff"] + ["00000001"] * 23
  return "\t".join([label, *dense, *sparse]) + "\n"


def test_a_line_reads_as_dlrms_preprocessing(tmp_path):
  path = tmp_path / "day_0"
  path.write_text(_line() + _line(label="0", sparse=[""] * 26))
  got = criteo.read(str(path))
  assert len(got) == 2 and got.labels.tolist() == [1, 0]
  np.testing.assert_allclose(got.dense[0, :3], [math.log1p(3), 0.0, 0.0])  # empty, negative: 0
  assert got.dense.dtype == np.float32 and got.dense.shape == (2, criteo.DENSE)
  assert got.ids.dtype == np.int32 and got.ids.shape == (2, criteo.SPARSE)
  assert got.ids[0, :3].tolist() == [0x68FD1E64, 0, -1]  # 0xffffffff as int32
  assert (got.ids[1] == 0).all()


def test_generated_files_read_back_with_a_planted_model_above_chance(tmp_path):
  path = str(tmp_path / "synthetic.tsv")
  labels, planted = criteo.write_synthetic(path, examples=3000, seed=0, vocabulary=2000)
  got = criteo.read(path)
  np.testing.assert_array_equal(got.labels, labels)
  empty_ids = np.mean(got.ids == 0)
  assert 0.03 < empty_ids < 0.07  # missing=0.05
  counts = np.sort(np.bincount(np.unique(got.ids[:, 0], return_inverse=True)[1]))[::-1]
  assert counts[0] > 20 * np.median(counts)  # power-law ids: a head and a long tail
  metrics = ClickMetrics()
  metrics.add(labels, planted)
  assert 0.7 < metrics.auc() < 1.0
  again, _ = criteo.write_synthetic(str(tmp_path / "again.tsv"), 3000, seed=0, vocabulary=2000)
  np.testing.assert_array_equal(again, labels)  # the seed decides the file


@pytest.mark.parametrize("line,message", [
    ("1\t2\t3\n", r"line 2: 3 tab-separated columns, expected 40"),
    (_line(label="2"), r"line 2, column 1: label b'2' is not 0 or 1"),
    (_line(dense=["x"] + ["0"] * 12), r"line 2, column 2: b'x' is not an integer"),
    (_line(sparse=["zz"] + ["0"] * 25), r"line 2, column 15: b'zz' is not a 32-bit hex id"),
    (_line(sparse=["1ffffffff"] + ["0"] * 25), r"column 15: b'1ffffffff' is not a 32-bit hex"),
    (_line(sparse=["-1"] + ["0"] * 25), r"column 15: b'-1' is not a 32-bit hex id"),
])
def test_a_malformed_line_is_one_error_naming_it(tmp_path, line, message):
  path = tmp_path / "bad.tsv"
  path.write_text(_line() + line)
  with pytest.raises(ConfigError, match=message) as raised:
    criteo.read(str(path))
  assert str(path) in str(raised.value)


def test_an_empty_file_is_one_error(tmp_path):
  path = tmp_path / "empty.tsv"
  path.write_text("")
  with pytest.raises(ConfigError, match="holds no examples"):
    criteo.read(str(path))
