"""A LoRA checkpoint's adapters out to Hugging Face, two ways (`toolkit.convert export`):

  --merge_lora  each adapted weight becomes W + (lora_alpha / lora_rank) A B (in float32, then
                the weight's dtype): a plain model folder that transformers loads alone.
  --peft        `adapter_config.json` + `adapter_model.safetensors` in PEFT's LoRA format,
                which `peft.PeftModel.from_pretrained(base_model, folder)` loads on top of the
                base (the folder the run started from, which the config names).

PEFT stores each adapted `nn.Linear` (out_features, in_features) as `lora_A.weight`
(r, in_features) and `lora_B.weight` (out_features, r) under the module's name prefixed with
`base_model.model.` (its `PeftModel` -> `LoraModel` wrappers), and applies
`x @ (B A).T * lora_alpha / r`: meshkit's A and B transposed and with heads flattened, no other
change (`peft_tensors`, through the same `TensorMap` the weights use).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from models import lora
from toolkit.hf import writer
from toolkit.hf.tensors import LAYER, TensorMap

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_WEIGHT_TARGETS = {weight: target for target, (weight, _) in lora.TARGETS.items()}
_PARENTS = {"q": "layers/attention", "k": "layers/attention", "v": "layers/attention",
            "o": "layers/attention", "gate": "layers/mlp", "up": "layers/mlp",
            "down": "layers/mlp"}


def peft_tensors(cfg) -> list[TensorMap]:
  """Every adapter matrix of `cfg` and its PEFT tensor (one per layer)."""
  table = []
  for target in lora.targets(cfg):
    in_shape, out_shape = lora.shapes(cfg, target)
    module = f"base_model.model.model.layers.{LAYER}.{lora.TARGETS[target][1]}"
    path = f"{_PARENTS[target]}/{lora.PREFIX}{target}"
    n_in, n_out = len(in_shape), len(out_shape)
    # a (*in, r) <- lora_A.weight (r, in_features); b (r, *out) <- lora_B.weight (out_features, r)
    table.append(TensorMap(f"{path}/a", f"{module}.lora_A.weight", ((cfg.lora_rank,), in_shape),
                           tuple(range(1, n_in + 1)) + (0,)))
    table.append(TensorMap(f"{path}/b", f"{module}.lora_B.weight", (out_shape, (cfg.lora_rank,)),
                           (n_out,) + tuple(range(n_out))))
  return table


def peft_config(cfg, base_model: str) -> dict:
  """adapter_config.json for `cfg`'s adapters on the base folder `base_model` ('' unknown)."""
  alpha = cfg.lora_alpha
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
      "r": cfg.lora_rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
      "lora_dropout": cfg.lora_dropout,
      "target_modules": sorted(lora.TARGETS[t][1].split(".")[-1] for t in lora.targets(cfg)),
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
      "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
      "alpha_pattern": {}, "revision": None,
  }


def write_peft(folder: str, cfg, base_model: str,
               fetch: Callable[[TensorMap, tuple[int, ...]], np.ndarray]) -> list[str]:
  """The PEFT adapter files in the local `folder`; `fetch(entry, at)` returns one layer's
  meshkit array of an entry of `peft_tensors` (float32). Returns the file names."""
  table = peft_tensors(cfg)
  planned = [writer.Planned(entry, at, math.prod(entry.hf_shape) * 4)
             for entry in table for at, _ in entry.hf_tensors(cfg.n_layers)]
  writer.write_shard(os.path.join(folder, ADAPTER_WEIGHTS), planned, "float32",
                     lambda entry, at: entry.to_hf(np.asarray(fetch(entry, at), np.float32)))
  writer.write_json(os.path.join(folder, ADAPTER_CONFIG), peft_config(cfg, base_model))
  return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def adapter_of(path: str) -> str | None:
  """The adapter path ("layers/attention/lora_q") of the weight at `path`, if it has one."""
  parent, _, weight = path.rpartition("/")
  target = _WEIGHT_TARGETS.get(weight)
  return None if target is None else f"{parent}/{lora.PREFIX}{target}"


def merge(cfg, weight: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """One layer's weight with its adapter merged in (models.lora.merged, the config's alpha)."""
  return lora.merged(weight, a, b, cfg.lora_alpha, cfg.lora_rank)
