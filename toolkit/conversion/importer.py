"""A Hugging Face folder -> a meshkit workdir: the weights read slice by slice into the
shardings of the config's mesh and rules, saved as the step-0 checkpoint of a training state
with a fresh optimizer, beside the config (model section from config.json)."""
from __future__ import annotations

import os
import sys
import time

import ml_collections

from toolkit import hf
from toolkit.conversion import output
from toolkit.training import checkpoint, config as config_lib, init_from, setup as setup_lib


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def import_checkpoint(hf_path: str, workdir: str,
                      config: ml_collections.ConfigDict | None = None) -> str:
  """Writes `workdir` (which must not exist or be empty) from the folder `hf_path`; returns
  the checkpoint's path. `config` (default: the training defaults) gives mesh, rules,
  optimizer and data; its model section is replaced by the folder's. Every check (config,
  tensor names, shapes, tied embeddings, the output folder) runs before anything is written."""
  config = init_from.with_hf_model(config or config_lib.defaults(), hf_path)
  output.check_empty(workdir, "--workdir")
  folder = hf.HFFolder(hf_path)
  folder.check(config_lib.model_config(config.model))  # every tensor, before devices start
  setup = setup_lib.build(config)
  start = time.perf_counter()
  state = init_from.initial_state(folder, setup, config.seed)
  _log(f"read {hf_path} into {setup.spec.mesh.size} device(s), mesh {dict(setup.spec.mesh.shape)}, "
       f"rules {setup.spec.rules.name}, in {time.perf_counter() - start:.1f} s")
  with output.staged(workdir) as staging:
    saver = checkpoint.Checkpoints(os.path.join(staging, "checkpoints"), keep=1)
    try:
      saver.save(0, state, checkpoint.config_to_dict(config), {"step": 0, "seed": config.seed,
                                                               "source": config.data.source})
    finally:
      saver.close()
    with open(os.path.join(staging, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  del state
  _log(f"wrote {workdir} (step 0) in {time.perf_counter() - start:.1f} s in all")
  return os.path.join(workdir, "checkpoints", "0")
