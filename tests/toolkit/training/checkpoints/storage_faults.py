"""Storage faults where no small disk can be mounted (the tests are not root): an OSError
injected where Orbax's Python side writes a checkpoint (etils.epath's open-for-writing and
mkdir) for every step from a given one on. TensorStore writes the arrays from C++ and is not
intercepted here; the first failing metadata write fails the save just the same.

  python -c "from tests.toolkit.training.checkpoints import storage_faults; storage_faults.train(28, 4)" \\
      --config=experiments/lm.py:tiny --workdir=...       # `toolkit.train`, ENOSPC from step 4
"""
from __future__ import annotations

import os
import re
import sys

_STEP_FOLDER = re.compile(r"/(\d+)\.orbax-checkpoint-tmp")


def install(error_code: int, from_step: int) -> None:
  """Makes writes into the temporary folder of step >= `from_step` raise OSError(error_code)."""
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  path_class = gpath._GPath  # pylint: disable=protected-access
  original_open, original_mkdir = path_class.open, path_class.mkdir

  def failing(path) -> bool:
    match = _STEP_FOLDER.search(str(path))
    return bool(match) and int(match.group(1)) >= from_step

  def refuse(path):
    raise OSError(error_code, os.strerror(error_code), str(path))

  def open_(self, mode="r", *args, **kwargs):
    if failing(self) and any(c in mode for c in "wax+"):
      refuse(self)
    return original_open(self, mode, *args, **kwargs)

  def mkdir_(self, *args, **kwargs):
    if failing(self):
      refuse(self)
    return original_mkdir(self, *args, **kwargs)

  path_class.open, path_class.mkdir = open_, mkdir_


def train(error_code: int, from_step: int) -> None:
  """`python -m toolkit.train` with the fault installed; flags come from sys.argv[1:]."""
  install(error_code, from_step)
  from toolkit import train as train_command  # pylint: disable=g-import-not-at-top
  sys.argv[0] = "toolkit.train"
  train_command.cli()
