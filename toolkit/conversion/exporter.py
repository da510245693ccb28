"""A meshkit checkpoint -> a Hugging Face folder: config.json, safetensors shards of at most
2 GB with their index, and the tokenizer files of the folder the model came from.

The parameters are restored into the shardings of the run's own mesh (one device when that
mesh does not fit this machine) and gathered to the host one tensor (one layer) at a time.
The output folder and the source folder may be gs:// URLs (a gs:// output is written locally,
then uploaded: `output.staged`)."""
from __future__ import annotations

import os
import sys
import time

import jax
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

import sharding
from toolkit import hf
from toolkit import workdir as workdir_lib
from toolkit.conversion import output
from toolkit.errors import ConfigError
from toolkit.hf import folder as folder_lib
from toolkit.training.checkpoint import open_latest
from toolkit.training import config as config_lib, init_from, state as state_lib

# config.json fields meshkit's model config does not hold, carried over from the source folder.
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def _placement(config: ml_collections.ConfigDict):
  """The run's own model, mesh and rules, or one device when its mesh does not fit here."""
  try:
    spec = config_lib.resolve(config)
    return spec.model, spec.mesh, spec.rules
  except (ConfigError, sharding.ShardingError):
    config = ml_collections.ConfigDict(config.to_dict())
    config.mesh.update(ici="data:1", dcn="")
    config.sharding.update(preset="dp", param_overrides="", activation_overrides="")
    config.data.global_batch_size = config.train.microbatches
    spec = config_lib.resolve(config, jax.devices()[:1])
    return spec.model, spec.mesh, spec.rules


def _source_folder(config: ml_collections.ConfigDict, hf_source: str | None) -> str | None:
  """The Hugging Face folder the model came from: --hf_source, else train.init_from's when it
  still exists."""
  if hf_source:
    if workdir_lib.is_url(hf_source) and (
        why := workdir_lib.problem(hf_source, "--hf_source", reach=True)) is not None:
      raise ConfigError(why)
    if not workdir_lib.isdir(hf_source):
      raise ConfigError(f"--hf_source={hf_source!r} is not a directory; give the Hugging Face "
                        f"folder the model was imported from, or leave it out")
    return hf_source
  path = init_from.parse(config.train.get("init_from", ""))
  if not path or (workdir_lib.is_url(path) and workdir_lib.problem(path, reach=True)):
    return None  # optional: a folder that is gone (or out of reach) is left out
  return path if workdir_lib.isdir(path) else None


def _hf_config(model, config: ml_collections.ConfigDict, source: str | None) -> dict:
  carried = {}
  if source and workdir_lib.isfile(workdir_lib.join(source, folder_lib.CONFIG)):
    original = folder_lib.read_json(workdir_lib.join(source, folder_lib.CONFIG), "fix it or "
                                    "leave --hf_source out")
    carried = {k: original[k] for k in CARRIED_FIELDS if k in original}
  if "max_position_embeddings" not in carried:
    carried["max_position_embeddings"] = (
        int(model.rope_original_max_positions * model.rope_factor)
        if model.rope_type == "llama3" else int(config.data.seq_len))
  return {**hf.for_model(model).hf_config(model), **carried}


def _gather(array: jax.Array) -> np.ndarray:
  if array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def export_checkpoint(workdir: str, out: str, step: int | None = None,
                      hf_source: str | None = None,
                      max_shard_bytes: int = hf.MAX_SHARD_BYTES) -> list[str]:
  """Writes the Hugging Face folder `out` (local or gs://; it must not exist or be empty) from
  `workdir`'s checkpoint `step` (default: the latest); returns the names of the files
  written."""
  output.check_empty(out, "--out")
  manager, latest = open_latest(workdir, "--workdir")
  try:
    if step is None:
      step = latest
    elif step not in manager.manager.all_steps():
      raise ConfigError(f"--step={step}: {workdir} holds steps "
                        f"{', '.join(map(str, sorted(manager.manager.all_steps())))}; give one")
    config = ml_collections.ConfigDict(manager.saved_config(step))
    model, mesh, rules = _placement(config)
    architecture = hf.for_model(model)
    source = _source_folder(config, hf_source)
    layout = state_lib.layout(model, optax.identity(), rules, mesh)
    params = manager.restore_params(step, layout.abstract["params"])
  finally:
    manager.close()
  hf_config = _hf_config(model, config, source)
  start = time.perf_counter()

  def fetch(entry, at):
    array = params
    for part in entry.path.split("/"):
      array = array[part]
    return entry.to_hf(_gather(array[at] if at else array))

  if jax.process_index() != 0:
    for entry in architecture.tensors(model):  # every process takes part in the gathers
      for at, _ in entry.hf_tensors(model.n_layers):
        fetch(entry, at)
    return []
  with output.staged(out) as staging:
    written = hf.write_weights(staging, architecture.tensors(model), model.n_layers,
                               model.param_dtype, fetch, max_shard_bytes)
    hf.write_config(staging, hf_config)
    written.append(folder_lib.CONFIG)
    for name in folder_lib.TOKENIZER_FILES if source else ():
      if workdir_lib.isfile(workdir_lib.join(source, name)):  # small files: read whole
        workdir_lib.write_bytes(os.path.join(staging, name),
                                workdir_lib.path(workdir_lib.join(source, name)).read_bytes())
        written.append(name)
  _log(f"exported step {step} of {workdir} to {out} ({', '.join(written)}) in "
       f"{time.perf_counter() - start:.1f} s")
  return written
