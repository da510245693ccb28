"""`python -m toolkit.evaluate`: a checkpoint on lm-evaluation-harness tasks (EleutherAI's
lm-eval; `pip install -e '.[eval]'`), by name or as local task files, sharded like the config's
mesh (toolkit/evaluation/ does the work; docs/evaluation.md).

  python -m toolkit.evaluate --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu \\
      --tasks=experiments/eval_tasks/arithmetic_choice.yaml --output=runs/lm_cpu/eval.json
  python -m toolkit.evaluate --config=experiments/hf.py:runs/hf_tiny \\
      --checkpoint=runs/hf_import --tasks=hellaswag,arc_easy --limit=100
"""
from __future__ import annotations


def cli() -> None:
  """`python -m toolkit.evaluate`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, runtime, xla_flags  # pylint: disable=g-import-not-at-top
  from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import offline  # pylint: disable=g-import-not-at-top
  from toolkit.generate import define_engine_flags, engine_options  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. The experiment file the checkpoint was trained with, e.g. "
      "experiments/lm.py:cpu; its mesh and sharding rules place the model.", lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "Required. A training workdir (or "
                                        "gs:// URL) or its checkpoints/ folder; the latest "
                                        "step is evaluated.")
  tasks_flag = flags.DEFINE_string("tasks", None, "Required. Harness task, group or tag names "
                                   "and local task YAML files, comma separated, e.g. "
                                   "hellaswag,arc_easy or experiments/eval_tasks/"
                                   "arithmetic_choice.yaml.")
  include_flag = flags.DEFINE_string("include_path", None, "A folder of local task YAML files "
                                     "whose task names --tasks may use.")
  tokenizer_flag = flags.DEFINE_string(
      "tokenizer", "", "How text becomes tokens: a tokenizer.json or the Hugging Face folder "
      "holding one, or 'bytes'. Default: the one the config trained with (data.tokenizer, "
      "train.init_from's folder, the shards' meta.json, or bytes for stdlib_docs).")
  batch_flag = flags.DEFINE_integer("batch_size", 32, "Rows per scoring pass and requests "
                                    "decoded together (rounded up to the mesh's batch ways).",
                                    lower_bound=1)
  max_length_flag = flags.DEFINE_integer("max_length", 0, "Tokens per input; longer ones are "
                                         "cut from the left. 0: the model's context (its "
                                         "export's max_position_embeddings, as the harness's "
                                         "hf backend reads it).", lower_bound=0)
  limit_flag = flags.DEFINE_float("limit", None, "Examples per task (a fraction of each task "
                                  "when below 1); default all.", lower_bound=0.0)
  fewshot_flag = flags.DEFINE_integer("num_fewshot", None, "Examples in the prompt; default "
                                      "each task's own.", lower_bound=0)
  output_flag = flags.DEFINE_string("output", None, "JSON file for the harness's results.")
  samples_flag = flags.DEFINE_bool("log_samples", False, "Keep every request and response in "
                                   "the JSON results.")
  bootstrap_flag = flags.DEFINE_integer("bootstrap_iters", 100_000, "Bootstrap resamples for "
                                        "the standard errors that need them; 0 skips those.",
                                        lower_bound=0)
  seed_flag = flags.DEFINE_integer("seed", None, "One seed for Python's random, NumPy, torch, "
                                   "the few-shot choice and sampling, as lm_eval's --seed N; "
                                   "default the harness's (0, 1234, 1234, 1234).", lower_bound=0)
  engine_flags = define_engine_flags()
  cache_dir_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_dir_flag.value, mesh=config_flag.value.mesh,
                  xla_flags=xla_flags.setting_of(config_flag.value))
    command_line.check_platform()
    limit = limit_flag.value
    try:
      offline.run(config_flag.value, checkpoint_flag.value, tasks_flag.value,
                  tokenizer=tokenizer_flag.value, include_path=include_flag.value,
                  batch_size=batch_flag.value, max_length=max_length_flag.value,
                  limit=int(limit) if limit is not None and limit >= 1 else limit,
                  num_fewshot=fewshot_flag.value, output=output_flag.value,
                  log_samples=samples_flag.value, bootstrap_iters=bootstrap_flag.value,
                  seed=seed_flag.value, options=engine_options(engine_flags))
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={
          "checkpoint": "a training workdir, e.g. --checkpoint=runs/lm_cpu",
          "tasks": "harness task names or task YAML files, e.g. --tasks=hellaswag"}))


if __name__ == "__main__":
  cli()
