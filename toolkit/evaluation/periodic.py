"""Harness tasks every N training steps (`train.eval_tasks`, `train.eval_tasks_every`,
`train.eval_tasks_limit`), on the parameters in memory: no checkpoint is written or read.

`for_config(config)` is the loop's periodic work (toolkit/training/loop.py's `Every`; toolkit.train
hands it in). The tasks are loaded once, before training starts, so a bad name or unreachable
data stops the run at once; every `eval_tasks_every` steps (and after the last) the tasks run on
the current parameters, sharded as training holds them, and each task's metrics go to
metrics.jsonl (kind "eval_tasks", fields "TASK/METRIC") and TensorBoard (eval_tasks/TASK/METRIC),
with eval_tasks.png beside loss.png. Standard errors are not computed (no bootstrap).
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.evaluation import harness, tokens
from toolkit.training import config as config_lib
from toolkit.training import loop
from toolkit.training.checkpoints import storage
from toolkit.training import metrics as metrics_lib

FIELD = "train.eval_tasks"
PLOT = "eval_tasks.png"


def for_config(config: ml_collections.ConfigDict) -> list[loop.Every]:
  """The loop's periodic work for `config`'s train.eval_tasks: none when it names no task.
  Raises ConfigError (one line) for what would fail later: no lm-eval, a mesh that splits
  positions or layers, no tokenizer, a bad task, data out of reach."""
  t = config.train
  if not t.get("eval_tasks", ""):  # absent from configs saved before it existed
    return []
  specs = harness.parse_specs(t.eval_tasks, FIELD)
  harness.require()
  _check_model(config)
  codec = tokens.codec_for(config, field=FIELD, fix=(
      f"{FIELD} needs a model trained on text: a text data.source (stdlib_docs, tokens, chat) "
      f"or train.init_from=hf:DIR with DIR/tokenizer.json"))
  tasks = harness.load_tasks(specs, FIELD)
  evaluator = _Evaluator(config, codec, tasks)
  return [loop.Every(t.get("eval_tasks_every", 100), evaluator)]


def _check_model(config: ml_collections.ConfigDict) -> None:
  """A language model, on a mesh that keeps each sequence's positions and the layers whole
  (the scoring pass and the KV cache need them so)."""
  spec = config_lib.resolve(config)
  if spec.task not in config_lib.LANGUAGE_MODEL_TASKS:
    raise ConfigError(f"{FIELD}={config.train.eval_tasks!r} evaluates language models, not "
                      f"model.kind={config.model.get('kind')!r}; set {FIELD}=''")
  for logical, what in (("length", "context parallelism"), ("layers", "pipeline stages")):
    axes = [a for e in spec.rules.activation_spec((logical,), spec.mesh) if e
            for a in ((e,) if isinstance(e, str) else e)]
    split = [a for a in axes if spec.mesh.shape[a] > 1]
    if split:
      raise ConfigError(f"{FIELD} runs on the training mesh, whose {'x'.join(split)} axis "
                        f"splits {logical} ({what}); evaluate a checkpoint instead (python -m "
                        f"toolkit.evaluate on a mesh without it) and set {FIELD}=''")


@dataclasses.dataclass
class _Evaluator:
  """The periodic work: (run, state, step) -> the tasks' metrics written and logged."""
  config: ml_collections.ConfigDict
  codec: object
  tasks: list
  lm: object = None

  def __call__(self, run: loop.Run, state, step: int) -> None:
    with run.goodput.phase("eval"), jax.transfer_guard("allow"):
      start = time.perf_counter()
      values = self._evaluate(run, state)
      run.writer.write(step, "eval_tasks", values)
      loop.log(f"eval tasks at step {step}: " + ", ".join(
          f"{name} {value:.4f}" for name, value in values.items())
               + f" ({time.perf_counter() - start:.1f} s)")
      _plot(run)

  def _evaluate(self, run: loop.Run, state) -> dict[str, float]:
    config, spec = self.config, run.setup.spec
    if self.lm is None:
      from toolkit.evaluation.model import MeshkitLM  # pylint: disable=g-import-not-at-top
      rows = config.data.global_batch_size // config.train.microbatches  # fits in training
      self.lm = MeshkitLM(spec.model, state["params"], spec.mesh, spec.rules, self.codec,
                          config.data.seq_len, rows, harness.SAMPLING_SEED, name="training")
    else:
      self.lm.set_params(state["params"])
    limit = config.train.get("eval_tasks_limit", 0) or None
    results = harness.run(self.lm, self.tasks, limit=limit, bootstrap_iters=0)
    return harness.scalars(results)


def _plot(run: loop.Run) -> None:
  """eval_tasks.png (process 0); a plot that cannot be written is a warning."""
  if jax.process_index() != 0:
    return
  png = workdir_lib.join(os.path.dirname(run.writer.path), PLOT)
  try:
    metrics_lib.plot_eval_tasks(run.writer.path, png, run.units)
  except OSError as e:
    loop.log(f"warning: {PLOT} could not be written ({storage.cause(e)})")
