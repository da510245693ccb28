"""DPO's reference log-probabilities computed once (dpo.reference="precomputed"): the starting
weights' log-probability of each side of every training and held-out pair, in one pass over the
pairs on the training mesh before the first step, kept on the host (8 bytes a pair) and served
with the batches (toolkit/data/preference.py, `REFERENCE`). It is what a full fine-tune needs
instead of a frozen copy of the weights (as many bytes per device again as the parameters),
and what a LoRA run can use instead of a second forward pass of its base in each step.

The starting weights are whatever the run starts from (a fresh model, `train.init_from`,
`train.resume_from`); the log-probabilities go to <workdir>/dpo_reference.npz with a
fingerprint of the pairs, and a run that resumes its own checkpoints reads them back: the
weights it restores are no longer the starting ones. A missing file or pairs that changed is
one error naming the fix.
"""
from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from models import lora
from toolkit import workdir as workdir_lib
from toolkit.accelerators import human_bytes
from toolkit.data import preference
from toolkit.errors import ConfigError
from toolkit.training.objectives import tasks
from toolkit.training.setup import Setup

FILE = "dpo_reference.npz"


def fingerprint(pairs: preference.Pairs) -> str:
  """sha256 of the pairs' token and weight arrays: what the log-probabilities belong to."""
  digest = hashlib.sha256()
  for key in preference.KEYS:
    digest.update(np.ascontiguousarray(pairs.arrays[key]).tobytes())
  return digest.hexdigest()


def compute(setup: Setup, params, pairs: preference.Pairs) -> np.ndarray:
  """(len(pairs), 2) float32: each side's completion log-probability under `params`, the
  pairs in batches of the run's size on its mesh (the last one padded with pair 0), no
  dropout; every process gets all of them."""
  batches, spec = setup.batches, setup.spec
  replicated = NamedSharding(spec.mesh, PartitionSpec())

  def logps(params, batch):
    with sharding.activation_rules(spec.rules, spec.mesh), lora.no_dropout():
      return tasks.completion_logps(setup.layout.graphdef, params, batch)[0]

  forward = jax.jit(logps, out_shardings=replicated)
  size, out = batches.pairs_per_batch, []
  for start in range(0, len(pairs), size):
    picked = np.arange(start, start + size)
    picked = np.where(picked < len(pairs), picked, 0)[batches.rows]
    batch = batches.place({key: pairs.arrays[key][picked] for key in preference.KEYS})
    out.append(np.asarray(forward(params, batch)))
  return np.concatenate(out)[:len(pairs)].astype(np.float32)


def prepare(setup: Setup, params, workdir: str | None, resuming: bool = False,
            log: Callable[[str], None] = lambda line: None) -> None:
  """Attaches the reference log-probabilities to `setup.batches` when the run precomputes
  them: read back from the workdir when `resuming` (its own checkpoints), else computed from
  `params` (the starting weights) and written there (with a `workdir`)."""
  batches = setup.batches
  if not getattr(batches, "precomputed_reference", False):
    return
  path = workdir_lib.join(workdir, FILE) if workdir else "(no workdir)"
  prints = {"train": fingerprint(batches.train), "held_out": fingerprint(batches.held_out)}
  if resuming:
    batches.attach_reference(*read(path, prints))
    log(f"dpo reference: the starting weights' log-probabilities read back from {path}")
    return
  start = time.perf_counter()
  logps = {split: compute(setup, params, getattr(batches, split)) for split in prints}
  seconds = time.perf_counter() - start
  batches.attach_reference(logps["train"], logps["held_out"])
  if workdir and jax.process_index() == 0:
    buffer = io.BytesIO()
    np.savez(buffer, **logps, **{f"{split}_fingerprint": np.asarray(value)
                                 for split, value in prints.items()})
    workdir_lib.write_bytes(path, buffer.getvalue())
  pairs = len(batches.train) + len(batches.held_out)
  log(f"dpo reference: the starting weights' log-probabilities of {pairs:,} pairs in "
      f"{seconds:.1f} s, {human_bytes(pairs * 2 * 4)} on the host (a frozen copy would hold "
      f"{human_bytes(frozen_copy_bytes(params))} per device); saved to {path}")


def read(path: str, prints: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
  """(train, held_out) log-probabilities from `path`, checked against the pairs' prints."""
  fix = ("they come from the starting weights, which the checkpoints here no longer hold; "
         "train into a new --workdir (or restore the file)")
  if not workdir_lib.exists(path):
    raise ConfigError(f"{path} is missing: dpo.reference='precomputed' resumes with the "
                      f"reference log-probabilities written before step 1, and {fix}")
  try:
    with np.load(io.BytesIO(workdir_lib.read_bytes(path))) as saved:
      arrays = {key: saved[key] for key in saved.files}
    for split, value in prints.items():
      if str(arrays[f"{split}_fingerprint"]) != value:
        raise ConfigError(f"{path} holds the reference log-probabilities of other {split} "
                          f"pairs than data.* gives now; resume with the data the run started "
                          f"with, or {fix.split('; ')[1]}")
    return arrays["train"], arrays["held_out"]
  except (OSError, ValueError, KeyError) as e:
    raise ConfigError(f"{path} is unreadable ({e}); {fix}") from None


def frozen_copy_bytes(params) -> int:
  """Bytes of `params` on the first device: what a frozen copy of them would add there."""
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(params)
             if isinstance(leaf, jax.Array))

