"""Held-out exact match of a chat model: each held-out conversation's last assistant turn is
generated greedily through the KV-cache engine (toolkit/inference/engine.py) from the turns
before it, rendered with the generation prompt, and compared with the data's answer as text.

  python scripts/dev/chat_exact_match.py --config=experiments/sft.py:cpu,base=runs/lm_cpu_hf \\
      --checkpoint=runs/sft_repeat

--checkpoint: a training workdir (its latest step); without it, the weights the config starts
from (train.init_from), i.e. the score before fine-tuning. The held-out conversations are the
config's (data.eval_path, or a synthetic task's own held-out split). Prints
"exact match: 97.3 % (249 of 256) ..." and a few of the outputs. The scoring is
toolkit/evaluation/exact_match.py.
"""
from __future__ import annotations


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file("config", None, "Experiment and variant.",
                                                lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "A training workdir; without it, "
                                        "the weights the config starts from.")
  cache_flag = command_line.define_runtime_flags()

  def run(argv) -> None:
    del argv
    import jax  # pylint: disable=g-import-not-at-top
    import sharding  # pylint: disable=g-import-not-at-top
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    from toolkit.evaluation import exact_match  # pylint: disable=g-import-not-at-top
    from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
    command_line.quiet_logging()
    runtime.start(cache_flag.value, mesh=config_flag.value.mesh)
    command_line.check_platform()
    config = config_flag.value
    try:
      if checkpoint_flag.value:
        params, model_cfg, *_ = restore_params(config, checkpoint_flag.value)
        params = jax.device_get(params)
      else:
        params, model_cfg = exact_match.initial_params(config, None)
      result = exact_match.score(config, params, model_cfg)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)
    print(result.format(), flush=True)

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(argv, config_flag))


if __name__ == "__main__":
  main()
