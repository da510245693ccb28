"""Trains one experiment once per seed and prints every seed's held-out result and their mean
+- standard deviation (min, max): how much a documented result depends on the seed.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python scripts/launch/seeds.py --config=experiments/vit.py:cpu --seeds=0,1,2 \\
    --workdir=runs/vit_seeds

Each seed is an ordinary `toolkit.train` run in `--workdir/seed_N` (rerun the command to resume
an interrupted one; finished seeds are only read back). `--config.FIELD=VALUE` overrides apply
to every seed. Writes `seeds.json` and `seeds.png` (every seed's held-out curve) in the workdir.
"""
from __future__ import annotations




def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file("config", None, "Experiment and variant.",
                                                lock_config=True)
  seeds_flag = flags.DEFINE_list("seeds", ["0", "1", "2"], "Comma-separated seeds.")
  workdir_flag = flags.DEFINE_string("workdir", None, "Required. One folder per seed inside.")
  cache_flag = command_line.define_runtime_flags()

  def run(argv) -> None:
    del argv
    import sharding  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    from toolkit.training import loop  # pylint: disable=g-import-not-at-top
    from toolkit.tuning import seeds as seeds_lib  # pylint: disable=g-import-not-at-top
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    command_line.quiet_logging()
    runtime.start(cache_flag.value, mesh=config_flag.value.mesh)  # CPU-only: quiet, devices
    command_line.check_platform()
    try:
      seeds = [int(s) for s in seeds_flag.value]
    except ValueError:
      command_line.fail(f"--seeds={','.join(seeds_flag.value)}: give comma-separated integers, "
                        f"e.g. --seeds=0,1,2", command_line.USAGE_EXIT)
    try:
      results = seeds_lib.run(config_flag.value, seeds, workdir_flag.value)
      paths = seeds_lib.write(results, workdir_flag.value)
    except (ConfigError, sharding.ShardingError, loop.NonFiniteLoss) as e:
      command_line.fail(e)
    print(seeds_lib.format_report(results), flush=True)
    print(f"wrote {paths['json']} and {paths['plot']}", flush=True)

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"workdir": "a folder for the runs, e.g. "
                                              "--workdir=runs/vit_seeds"}))


if __name__ == "__main__":
  main()
