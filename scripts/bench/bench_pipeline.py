"""How fast the input pipeline alone produces batches, to set against what the step consumes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python scripts/bench/bench_pipeline.py --config=experiments/vit.py:cpu --batches=200

Builds the run's batches exactly as `toolkit.train` does (`training.build`), then draws
`--batches` batches from the same iterator the loop reads (Grain workers, prefetch, placement
on the devices included) and prints examples/s (and tokens/s for an LM). Compare with the
`img/s` or `tok/s` of the training log: the pipeline keeps up when it is faster.
"""
from __future__ import annotations

import time



def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file("config", None, "Experiment and variant.",
                                                lock_config=True)
  batches_flag = flags.DEFINE_integer("batches", 200, "Batches to draw.", lower_bound=2)

  def run(argv) -> None:
    del argv
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
    import jax  # pylint: disable=g-import-not-at-top
    from toolkit import training  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    config = config_flag.value
    try:
      setup = training.build(config)
    except ConfigError as e:
      command_line.fail(e)
    iterator = setup.batches.iterator(0, None, config.data.prefetch)
    jax.block_until_ready(next(iterator))  # start-up (Grain workers) is not throughput
    started = time.perf_counter()
    for _ in range(batches_flag.value):
      jax.block_until_ready(next(iterator))
    seconds = time.perf_counter() - started
    iterator.close()
    examples = batches_flag.value * config.data.global_batch_size / seconds
    line = (f"{config.data.source}: {batches_flag.value} batches of "
            f"{config.data.global_batch_size} in {seconds:.2f} s: {examples:,.0f} examples/s")
    if setup.task.name == "lm":
      line += f", {examples * config.data.seq_len:,.0f} tokens/s"
    print(line + f" ({config.data.worker_count} Grain workers)", flush=True)

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(argv, config_flag))


if __name__ == "__main__":
  main()
