"""A meshkit checkpoint -> a Hugging Face folder: config.json, safetensors shards of at most
2 GB with their index, and the tokenizer files of the folder the model came from. A LoRA
checkpoint goes out with its adapters merged into the weights or as a PEFT adapter folder
(`toolkit.conversion.adapters`).

The parameters are restored into the shardings of the run's own mesh (one device when that
mesh does not fit this machine) and gathered to the host one tensor (one layer) at a time.
The output folder and the source folder may be gs:// URLs (a gs:// output is written locally,
then uploaded: `output.staged`)."""
from __future__ import annotations

import contextlib
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
from toolkit.conversion import adapters, output
from toolkit.errors import ConfigError
from toolkit.hf import folder as folder_lib, writer as hf_writer
from toolkit.training.checkpoints.checkpoint import open_latest
from toolkit.training import config as config_lib, init_from, state as state_lib

# config.json fields meshkit's model config does not hold, carried over from the source folder.
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def _placement(config: ml_collections.ConfigDict):
  """The run's own model, mesh and rules, or one device when its mesh does not fit here."""
  if "attention" in config.model:
    # Exporting runs no attention; the run's kernel may be another platform's (cudnn from a
    # GPU), which the config check would refuse on this machine.
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.attention = "auto"
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


def _carried(source: str | None) -> dict:
  """The CARRIED_FIELDS of the Hugging Face folder `source` (none without one)."""
  if not source or not workdir_lib.isfile(workdir_lib.join(source, folder_lib.CONFIG)):
    return {}
  original = folder_lib.read_json(workdir_lib.join(source, folder_lib.CONFIG), "fix it or "
                                  "leave --hf_source out")
  return {k: original[k] for k in CARRIED_FIELDS if k in original}


def context_length(model, config: ml_collections.ConfigDict, source: str | None = None) -> int:
  """The model's context, as its export's max_position_embeddings states it: the Hugging Face
  folder's it came from (`source`, else train.init_from's), else Llama 3's scaled RoPE's, else
  the sequence length it trained at (data.seq_len)."""
  carried = _carried(source if source is not None else _source_folder(config, None))
  if "max_position_embeddings" in carried:
    return int(carried["max_position_embeddings"])
  return (int(model.rope_original_max_positions * model.rope_factor)
          if model.rope_type == "llama3" else int(config.data.seq_len))


def _hf_config(model, config: ml_collections.ConfigDict, source: str | None) -> dict:
  carried = _carried(source)
  carried.setdefault("max_position_embeddings", context_length(model, config, source or ""))
  return {**hf.for_model(model).hf_config(model), **carried}


def _gather(array: jax.Array) -> np.ndarray:
  if array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


# How a LoRA checkpoint goes out (`lora` of export_checkpoint): its flag.
LORA_MODES = {"merge": "--merge_lora", "peft": "--peft"}


def export_checkpoint(workdir: str, out: str, step: int | None = None,
                      hf_source: str | None = None,
                      max_shard_bytes: int = hf.MAX_SHARD_BYTES, lora: str = "") -> list[str]:
  """Writes the Hugging Face folder `out` (local or gs://; it must not exist or be empty) from
  `workdir`'s checkpoint `step` (default: the latest); returns the names of the files
  written. A checkpoint with LoRA adapters needs `lora`: "merge" (the adapters merged into
  the weights) or "peft" (a PEFT adapter folder)."""
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
    _check_lora_mode(model, lora, workdir)
    layout = state_lib.layout(model, optax.identity(), rules, mesh)
    params = manager.restore_params(step, layout.abstract["params"])
    base = manager.base(step)
  finally:
    manager.close()
  if lora == "peft":
    return _export_peft(workdir, out, step, model, params, _base_folder(base, source))
  hf_config = _hf_config(model, config, source)
  start = time.perf_counter()

  def fetch(entry, at):
    value = _layer(params, entry.path, at)
    if lora == "merge" and (adapter := adapters.adapter_of(entry.path)) is not None:
      if _has(params, adapter):
        value = adapters.merge(model, value, _layer(params, adapter + "/a", at),
                               _layer(params, adapter + "/b", at))
    return entry.to_hf(value)

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
    if folder_lib.GENERATION_CONFIG not in written:  # the source folder's wins
      hf_writer.write_json(os.path.join(staging, folder_lib.GENERATION_CONFIG),
                           generation_config(hf_config, config))
      written.append(folder_lib.GENERATION_CONFIG)
  merged = " (LoRA adapters merged)" if lora == "merge" else ""
  _log(f"exported step {step} of {workdir} to {out}{merged} ({', '.join(written)}) in "
       f"{time.perf_counter() - start:.1f} s")
  return written


def _check_lora_mode(model, lora: str, workdir: str) -> None:
  rank = getattr(model, "lora_rank", 0)
  if rank and not lora:
    raise ConfigError(f"{workdir} holds LoRA adapters (model.lora_rank={rank}); give "
                      f"--merge_lora (a model with the adapters merged into its weights) or "
                      f"--peft (a PEFT adapter folder for the base model)")
  if lora and not rank:
    raise ConfigError(f"{LORA_MODES[lora]}: {workdir} holds no LoRA adapters "
                      f"(model.lora_rank=0); export it without {LORA_MODES[lora]}")


def generation_config(hf_config: dict, config: ml_collections.ConfigDict) -> dict:
  """generation_config.json: the ids generation starts and ends with, as transformers'
  `generate` reads them. A chat fine-tune (SFT, DPO, GRPO data) also ends at its template's
  end-of-turn token, as it learned to end an answer."""
  ends = hf_config.get("eos_token_id")
  ends = [] if ends is None else list(ends) if isinstance(ends, (list, tuple)) else [ends]
  if config.data.source in ("chat", "preference", "prompts"):
    from toolkit.data import chat  # pylint: disable=g-import-not-at-top  # imports Grain
    tokenizer = chat.ChatTokenizer.load(chat.tokenizer_path(
        config.data, config.train.get("init_from", "")), config.data.get("chat_template", ""))
    with contextlib.suppress(ConfigError):  # a template that writes nothing after an answer
      ends.append(tokenizer.end_of_turn())
  generation = {"_from_model_config": True}
  if hf_config.get("bos_token_id") is not None:
    generation["bos_token_id"] = hf_config["bos_token_id"]
  if ends:
    generation["eos_token_id"] = ends[0] if len(ends) == 1 else list(dict.fromkeys(ends))
  if hf_config.get("pad_token_id") is not None:
    generation["pad_token_id"] = hf_config["pad_token_id"]
  return generation


def _base_folder(base: dict | None, source: str | None) -> str:
  """The base a PEFT folder names: --hf_source, else the folder the run started from; a local
  folder relative to the current directory, not an absolute path of this machine."""
  folder = source or init_from.parse((base or {}).get("init_from", "")) or ""
  if not folder or workdir_lib.is_url(folder):
    return folder
  return os.path.relpath(workdir_lib.absolute(folder))


def _export_peft(workdir: str, out: str, step: int, model, params, base_model: str
                 ) -> list[str]:
  """The PEFT adapter folder `out`; every process takes part in the gathers."""
  fetch = lambda entry, at: _layer(params, entry.path, at)
  if jax.process_index() != 0:
    for entry in adapters.peft_tensors(model):
      for at, _ in entry.hf_tensors(model.n_layers):
        fetch(entry, at)
    return []
  with output.staged(out) as staging:
    written = adapters.write_peft(staging, model, base_model, fetch)
  _log(f"exported the LoRA adapters of step {step} of {workdir} to {out} as a PEFT folder "
       f"({', '.join(written)}; base {base_model or 'unknown: give --hf_source'})")
  return written


def _has(params, path: str) -> bool:
  node = params
  for part in path.split("/"):
    if not isinstance(node, dict) or part not in node:
      return False
    node = node[part]
  return True


def _layer(params, path: str, at: tuple[int, ...]) -> np.ndarray:
  """The parameter at `path`, indexed by `at` (its stacked axes), on the host."""
  array = params
  for part in path.split("/"):
    array = array[part]
  return _gather(array[at] if at else array)
