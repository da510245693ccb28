"""`python -m toolkit.predict`: batch prediction for classifier models, an inputs file in, one
JSON line per example out (toolkit/inference/classify.py does the work).

  python -m toolkit.predict --config=experiments/vit.py:cpu --checkpoint=runs/vit_digits \\
      --inputs=images.npz --output=predictions.jsonl
"""
from __future__ import annotations

import sharding
from toolkit.errors import ConfigError
from toolkit.inference import classify


def cli() -> None:
  """`python -m toolkit.predict`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, runtime, xla_flags  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. The experiment file the checkpoint was trained with, e.g. "
      "experiments/vit.py:cpu.", lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "Required. A training workdir or "
                                        "its checkpoints/ folder; the latest step is used.")
  inputs_flag = flags.DEFINE_string("inputs", None, "Required. .npz / .npy of images, or a "
                                    "folder of class folders.")
  output_flag = flags.DEFINE_string("output", None, "Required. JSONL file for predictions.")
  batch_flag = flags.DEFINE_integer("batch_size", 256, "Examples per compiled batch.",
                                    lower_bound=1)
  top_k_flag = flags.DEFINE_integer("top_k", 3, "Classes listed per example.", lower_bound=1)
  cache_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_flag.value, mesh=config_flag.value.mesh,
                  xla_flags=xla_flags.setting_of(config_flag.value))
    command_line.check_platform()
    try:
      classify.run(config_flag.value, checkpoint_flag.value, inputs_flag.value, output_flag.value,
          batch_flag.value, top_k_flag.value)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"checkpoint": "a training workdir, e.g. "
                                                 "--checkpoint=runs/vit_digits",
                                   "inputs": "an .npz of images, e.g. --inputs=images.npz",
                                   "output": "a JSONL file, e.g. --output=predictions.jsonl"}))


if __name__ == "__main__":
  cli()
