"""A Hugging Face folder -> a meshkit workdir: the weights read slice by slice into the
shardings of the config's mesh and rules, saved as the step-0 checkpoint of a training state
with a fresh optimizer, beside the config (model section from config.json).

Either may be a gs:// URL: a gs:// folder is read from a local cache copy (`toolkit.hf.folder`);
a gs:// workdir is written in place, Orbax's commit marker making the step count only once it
is complete (an upload of a local checkpoint would lack it), and removed again on failure."""
from __future__ import annotations

import contextlib
import sys
import time

import ml_collections

from toolkit import hf
from toolkit import workdir as workdir_lib
from toolkit.conversion import output
from toolkit.training import config as config_lib, init_from, setup as setup_lib
from toolkit.training.checkpoints import checkpoint


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def import_checkpoint(hf_path: str, workdir: str,
                      config: ml_collections.ConfigDict | None = None) -> str:
  """Writes `workdir` (local or gs://; it must not exist or be empty) from the folder
  `hf_path` (local or gs://); returns the checkpoint's path. `config` (default: the training
  defaults) gives mesh, rules, optimizer and data; its model section is replaced by the
  folder's. Every check (config, tensor names, shapes, tied embeddings, the output folder)
  runs before anything is written."""
  config = init_from.with_hf_model(config or config_lib.defaults(), hf_path)
  output.check_empty(workdir, "--workdir")
  folder = hf.HFFolder(hf_path)
  folder.check(config_lib.model_config(config.model))  # every tensor, before devices start
  setup = setup_lib.build(config)
  start = time.perf_counter()
  state = init_from.initial_state(folder, setup, config.seed)
  _log(f"read {hf_path} into {setup.spec.mesh.size} device(s), mesh {dict(setup.spec.mesh.shape)}, "
       f"rules {setup.spec.rules.name}, in {time.perf_counter() - start:.1f} s")
  if workdir_lib.is_url(workdir):
    try:
      _write(workdir, state, config)
    except BaseException:
      with contextlib.suppress(OSError):  # it was empty (check_empty): all of it is ours
        workdir_lib.path(workdir).rmtree()
      raise
  else:
    with output.staged(workdir) as staging:
      _write(staging, state, config)
  del state
  _log(f"wrote {workdir} (step 0) in {time.perf_counter() - start:.1f} s in all")
  return workdir_lib.join(workdir, "checkpoints", "0")


def _write(directory: str, state, config: ml_collections.ConfigDict) -> None:
  """The step-0 checkpoint and config.json in `directory` (local or gs://)."""
  saver = checkpoint.Checkpoints(workdir_lib.join(directory, "checkpoints"), keep=1)
  try:
    saver.save(0, state, checkpoint.config_to_dict(config), {"step": 0, "seed": config.seed,
                                                             "source": config.data.source})
  finally:
    saver.close()
  workdir_lib.write_text(workdir_lib.join(directory, "config.json"),
                         config.to_json_best_effort(indent=2))
