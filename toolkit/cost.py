"""`python -m toolkit.cost`: which hardware, which layout, how long and how much to train a
config on a token budget, ranked across TPU slices and GPU clusters.

  python -m toolkit.cost --config=experiments/lm.py:size=7b --tokens=1e12 \\
      --targets=v5e-256,v5p-128,v6e-256,h100x64,h200x64 --pricing=on_demand,3y \\
      --deadline=14d --json=cost.json --png=cost.png

For each target the planner's candidate layouts are estimated by the analytic model
(toolkit/planning/cost/layouts.py; nothing compiles, so a GPU cluster is estimated like a TPU slice,
and the whole ranking takes seconds): the fastest layout that fits the chip's memory by the
estimate is priced for each --pricing mode from the price table (toolkit/planning/cost/prices.py;
--prices=FILE overrides its rows). Spot prices fold in preemption (--spot_mtbf_h, the
checkpoint interval and --restart_min; toolkit/planning/cost/economics.py has the formula). The
step time is compute at the chip's peak (times --compute_efficiency) plus communication at the
table's bandwidths without overlap (not the compiled program's memory traffic, which
toolkit.compile adds). Confirm a TPU winner's fit with
`python -m toolkit.compile --topology=TARGET`, which compiles the real step.

It is its own command rather than a toolkit.compile flag because it compiles nothing and
takes many targets; toolkit.compile answers for one target with the compiler's figures.
Exit status: 0 ranked, 1 no target fits, 2 bad input (one `error:` line).
"""
from __future__ import annotations

import os
import sys

from toolkit import command_line, workdir
from toolkit.planning.cost import prices as prices_lib

DEFAULT_TARGETS = "v5e-256,v5p-128,v6e-256,h100x64,h200x64"


def _define_flags(flags) -> None:
  flags.DEFINE_float("tokens", None, "Required. The token budget to train on, e.g. 1e12.")
  flags.DEFINE_list("targets", DEFAULT_TARGETS, "TPU types (v5p-128; v5e-256x2 for two "
                    "slices) and GPU clusters (h100x64: 8 nodes of 8) to compare.")
  flags.DEFINE_list("pricing", "on_demand,3y", f"Pricing modes: {', '.join(prices_lib.MODES)}.")
  flags.DEFINE_string("prices", "", "A JSON price file whose rows replace the shipped ones "
                      "(--write_prices writes the shipped table to start from).")
  flags.DEFINE_string("write_prices", "", "Write the shipped price table as JSON here and exit.")
  flags.DEFINE_string("deadline", "", "Also say how many chips of each family reach the budget "
                      "by then (14d, 36h, 2w), if tokens/s grew with the chips.")
  flags.DEFINE_float("spot_mtbf_h", 24.0, "Spot: mean hours between preemptions of the job.",
                     lower_bound=0.0)
  flags.DEFINE_float("mtbf_h", 0.0, "Other modes: mean hours between failures of the job "
                     "(0: none).", lower_bound=0.0)
  flags.DEFINE_float("restart_min", 10.0, "Minutes from a preemption to training again "
                     "(new machines, restore, compile).", lower_bound=0.0)
  flags.DEFINE_float("compute_efficiency", 1.0, "Fraction of peak FLOP/s the step's compute "
                     "reaches (1.0: the estimate's bound; MFU measured elsewhere, e.g. 0.5).",
                     lower_bound=0.01, upper_bound=1.0)
  flags.DEFINE_enum("rank_by", "dollars", ["dollars", "hours"], "Cheapest or fastest first.")
  flags.DEFINE_string("json", "", "Also write the ranking as JSON here.")
  flags.DEFINE_string("png", "", "Also plot time vs cost with the Pareto front here.")


def cli() -> None:
  """`python -m toolkit.cost`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. Experiment file and variant, e.g. experiments/lm.py:size=7b; "
      "--config.FIELD=VALUE overrides as in toolkit.train.", lock_config=True)
  _define_flags(flags)

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    from toolkit.planning.cost import layouts as layouts_lib, ranking  # pylint: disable=g-import-not-at-top
    from toolkit.planning.target import TargetError  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    import sharding  # pylint: disable=g-import-not-at-top
    values = flags.FLAGS.flag_values_dict()
    values["config_name"] = command_line.config_argument(sys.argv) or "config"
    try:
      targets = [layouts_lib.parse_target(n) for n in values["targets"]]
      # Host devices stand in for the largest target's chips (only their count matters).
      import jax  # pylint: disable=g-import-not-at-top
      os.environ["JAX_PLATFORMS"] = "cpu"
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", max(t.chips for t in targets))
      status = ranking.run(config_flag.value, values)
    except (ValueError, TargetError, ConfigError, sharding.ShardingError) as e:
      command_line.fail(e, 2)
    sys.exit(status)

  def parse(argv):
    if any(a.startswith("--write_prices=") and len(a) > 15 for a in argv):
      path = next(a for a in argv if a.startswith("--write_prices="))[15:]
      workdir.write_text(path, prices_lib.to_json(prices_lib.table()))
      print(f"wrote the shipped price table to {path}")
      sys.exit(0)
    return command_line.parse_flags(argv, config_flag, required={
        "tokens": "the token budget, e.g. --tokens=1e12"})

  app.run(main, flags_parser=parse)


if __name__ == "__main__":
  cli()
