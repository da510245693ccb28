"""Evaluating a checkpoint on harness tasks (`python -m toolkit.evaluate`): the tasks loaded
first (a bad name or unreachable data fails before any weights are read), then the latest
step's parameters restored into the shardings of the config's mesh and rules, then the
harness's `simple_evaluate` on a MeshkitLM. The results are the harness's: a table on stdout,
its JSON in `output`.

The checkpoint is a training workdir (local or gs://) or one written by `toolkit.convert import`
from a Hugging Face folder (with --config=experiments/hf.py:FOLDER, whose tokenizer it then
uses).
"""
from __future__ import annotations

import os
import sys
import time

import jax
import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.conversion import exporter
from toolkit.evaluation import harness, tokens
from toolkit.inference import engine as engine_lib
from toolkit.inference.restore import restore_params
from toolkit.training import config as config_lib
from toolkit.training import metrics as metrics_lib


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def run(config: ml_collections.ConfigDict, checkpoint_path: str, tasks: str, *,
        tokenizer: str = "", include_path: str | None = None, batch_size: int = 32,
        max_length: int = 0, limit: float | None = None, num_fewshot: int | None = None,
        output: str | None = None, log_samples: bool = False, bootstrap_iters: int = 100_000,
        seed: int | None = None, options: engine_lib.Options = engine_lib.Options()) -> dict:
  """Evaluates `checkpoint_path`'s latest step on `tasks` (comma-separated names or YAML
  files); returns the harness's results dict and writes it to `output` as JSON when given.
  `max_length`: tokens per input, 0 for the model's context (its Hugging Face export's
  max_position_embeddings, as the harness's `hf` backend reads it); `limit`: examples per task
  (a fraction when below 1); `seed`: None for the harness's seeds (harness.HARNESS_SEEDS)."""
  spec = config_lib.resolve(config)
  if spec.task not in config_lib.LANGUAGE_MODEL_TASKS:
    raise ConfigError(f"--config has model.kind={config.model.get('kind')!r}, not a language "
                      f"model; the harness's tasks evaluate language models")
  specs = harness.parse_specs(tasks, "--tasks")
  codec = tokens.codec_for(config, tokenizer)
  if output and not workdir_lib.is_url(output) and not os.path.isdir(
      os.path.dirname(os.path.abspath(output))):
    raise ConfigError(f"--output={output!r}: its folder does not exist; create it first")
  start = time.perf_counter()
  loaded = harness.load_tasks(specs, "--tasks", include_path)
  log(f"loaded {len(specs)} task spec(s) in {time.perf_counter() - start:.1f} s")
  params, model_cfg, mesh, rules, step = restore_params(config, checkpoint_path)
  from toolkit.evaluation.model import MeshkitLM  # pylint: disable=g-import-not-at-top  # lm_eval
  max_length = max_length or exporter.context_length(model_cfg, config)
  lm = MeshkitLM(model_cfg, params, mesh, rules, codec, max_length, batch_size,
                 harness.SAMPLING_SEED if seed is None else seed, options,
                 name=f"{checkpoint_path} step {step}")
  log(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; tokenizer "
      f"{codec.tokenizer.path}; max_length {max_length}, batch {lm.scorer.batch_size}")
  start = time.perf_counter()
  results = harness.run(lm, loaded, limit=limit, num_fewshot=num_fewshot,
                        bootstrap_iters=bootstrap_iters, log_samples=log_samples, seed=seed)
  log(f"evaluated in {metrics_lib.format_duration(time.perf_counter() - start)}: "
      f"{sum(lm.scorer.forward_calls.values())} scoring passes")
  if jax.process_index() == 0:
    print(harness.table(results), flush=True)
    if output:
      workdir_lib.write_text(output, harness.to_json(results))
      log(f"results: {output}")
  return results
