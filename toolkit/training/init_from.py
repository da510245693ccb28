"""Starting a run from existing weights with a fresh optimizer: `train.init_from`.

Resume order (the rest is in `resume.py`): the workdir's latest checkpoint
-> `train.resume_from` -> `train.init_from` -> scratch. `train.init_from=hf:DIR` reads a
Hugging Face model folder (`toolkit.hf`) straight into the parameters' shardings; the
optimizer starts fresh at step 0.
"""
from __future__ import annotations

import dataclasses

from models import LlamaConfig
from toolkit import hf
from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training import state as state_lib

PREFIX = "hf:"
FIELD = "train.init_from"


def parse(value: str) -> str | None:
  """The folder named by a `train.init_from` value ('' -> None)."""
  if not value:
    return None
  if not value.startswith(PREFIX) or not value[len(PREFIX):]:
    raise ConfigError(f"{FIELD}={value!r}: give hf:DIR, a Hugging Face model folder (config.json "
                      f"and *.safetensors), or '' to start from scratch")
  return value[len(PREFIX):]


def check_model(folder: hf.HFFolder, model: LlamaConfig, field: str = FIELD) -> None:
  """Refuses a model config that differs from the folder's config.json in a field it sets."""
  derived = folder.model_config(model)
  for f in dataclasses.fields(LlamaConfig):
    if f.name != "init_std" and getattr(derived, f.name) != getattr(model, f.name):
      raise ConfigError(
          f"{field}={PREFIX}{folder.path}: its config.json gives model.{f.name}="
          f"{getattr(derived, f.name)!r}, the config has {getattr(model, f.name)!r}; take the "
          f"model from the folder (--config=experiments/hf.py:{folder.path}) or set "
          f"--config.model.{f.name}={getattr(derived, f.name)!r}")


def _has_checkpoint(workdir: str) -> bool:
  directory = workdir_lib.path(workdir_lib.join(workdir, "checkpoints"))
  return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def source(config, model: LlamaConfig, workdir: str) -> hf.HFFolder | None:
  """The Hugging Face folder this run starts from, or None when it resumes a checkpoint (its
  own or train.resume_from's) or starts from scratch. Everything about the folder (config,
  tensor names, shapes, tied embeddings) is checked here, before the workdir is touched."""
  path = parse(config.train.get("init_from", ""))
  if path is None or config.train.resume_from or _has_checkpoint(workdir):
    return None
  folder = hf.HFFolder(path, FIELD)
  check_model(folder, model)
  folder.check(model)
  return folder


def initial_state(folder: hf.HFFolder, setup, seed: int) -> state_lib.State:
  """Step 0 with the folder's weights in their shardings and a fresh optimizer state (with
  LoRA: the folder's weights are the frozen base, the adapters start fresh from `seed`)."""
  params = hf.read_params(folder, setup.spec.model, setup.layout.shardings["params"])
  return state_lib.from_params(params, setup.optimizer, setup.layout, seed, setup.spec.model)



def with_hf_model(config, path: str, field: str = "--hf"):
  """`config` (an experiment ConfigDict, changed in place and returned) with its model section
  taken from the Hugging Face folder `path` (`field` names where the path came from) and
  `train.init_from=hf:<path>`. Fields config.json does not describe (compute dtype, remat,
  parameter dtype, ...) keep the config's values."""
  folder = hf.HFFolder(path, field)
  model = config.model.to_dict()
  kind = model.pop("kind", "llama")
  if kind != folder.architecture.kind:
    raise ConfigError(f"{field}={path!r} holds a {folder.architecture.name}, a "
                      f"model.kind={folder.architecture.kind!r}; the config has "
                      f"model.kind={kind!r}: use a language-model experiment (experiments/hf.py)")
  known = {f.name for f in dataclasses.fields(LlamaConfig)}
  base = LlamaConfig(**{k: v for k, v in model.items() if k in known})
  config.model.update(dataclasses.asdict(folder.model_config(base)))
  config.train.init_from = PREFIX + workdir_lib.absolute(path)
  return config
