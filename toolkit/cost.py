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

import json
import math
import os
import re
import sys
import time

from toolkit import command_line, workdir
from toolkit.planning.cost import economics, prices as prices_lib

DEFAULT_TARGETS = "v5e-256,v5p-128,v6e-256,h100x64,h200x64"
_UNITS = {"h": 1.0, "d": 24.0, "w": 168.0}


def parse_deadline(text: str) -> float | None:
  """'14d' / '36h' / '2w' -> hours; '' -> None."""
  if not text:
    return None
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([hdw])\s*", text.lower())
  if not match or float(match.group(1)) <= 0:
    raise ValueError(f"--deadline={text!r}: write a positive duration with a unit, e.g. 14d, "
                     f"36h or 2w")
  return float(match.group(1)) * _UNITS[match.group(2)]


def _load_prices(path: str) -> dict:
  if not path:
    return prices_lib.table()
  if not workdir.exists(path):
    raise prices_lib.PriceError(f"--prices={path} does not exist; write one with "
                                f"--write_prices={path} and edit it")
  return prices_lib.table(prices_lib.parse(workdir.read_text(path), path))


def _options(config, layout, chips, price, modes, flags_values, log) -> list:
  """The priced options of one target (one per mode it has a price for)."""
  step = layout.step
  efficiency = flags_values["compute_efficiency"]
  step_s = step["compute_s"] / efficiency + step["ici_s"] + step["dcn_s"]
  step["total_s"], step["mfu"] = step_s, step["mfu"] * step["total_s"] / step_s
  tokens_per_s = step["tokens_per_step"] / step_s
  checkpoint_h = config.train.checkpoint_every * step_s / 3600
  found = []
  for mode in modes:
    dollars = price.per_chip_hour(mode) if price else None
    if dollars is None:
      log(f"  {chips.name}: no {mode} price in the table (--prices=FILE adds one)")
      continue
    mtbf = flags_values["spot_mtbf_h"] if mode == "spot" else flags_values["mtbf_h"]
    found.append(economics.Option(
        target=chips.name, mode=mode, chips=chips.chips, tokens_per_second=tokens_per_s,
        goodput=economics.goodput(mtbf or None, checkpoint_h, flags_values["restart_min"] / 60),
        dollars_per_chip_hour=dollars, tokens=flags_values["tokens"]))
  return found


def run(config, flag_values: dict, log=print) -> int:
  """Estimates, prices and ranks; prints the table; returns the exit status."""
  import jax  # pylint: disable=g-import-not-at-top
  from toolkit.planning.cost import layouts as layouts_lib, report  # pylint: disable=g-import-not-at-top
  modes = flag_values["pricing"]
  for mode in modes:
    if mode not in prices_lib.MODES:
      raise ValueError(f"--pricing: {mode!r} is unknown; choose from {', '.join(prices_lib.MODES)}")
  if not flag_values["tokens"] > 0:
    raise ValueError(f"--tokens={flag_values['tokens']:g}: give the token budget, a positive "
                     f"number such as 1e12")
  deadline_h = parse_deadline(flag_values["deadline"])
  shape = report.model_shape(config)
  log(f"model: {shape}")
  table = _load_prices(flag_values["prices"])
  targets = [layouts_lib.parse_target(n) for n in flag_values["targets"]]
  devices = jax.devices("cpu")
  options, layouts, deadline_chips = [], {}, {}
  for chips in targets:
    start = time.monotonic()
    target = layouts_lib.stand_in(chips, devices)
    log(f"{target.describe()}: estimating layouts ...")
    layout = layouts_lib.best_layout(config, target)
    layouts[chips.name] = layout
    if layout.candidate is None:
      log(f"  {chips.name}: {layout.reason}")
      continue
    log(f"  {chips.name}: {layout.candidate.label} of {layout.tried} candidates, "
        f"{layout.step['memory_bytes'] / 2**30:.1f} GiB per chip by the estimate "
        f"({time.monotonic() - start:.1f} s)")
    found = _options(config, layout, chips, table.get(chips.price_key), modes, flag_values, log)
    options += found
    for o in found:
      if deadline_h:
        deadline_chips[(o.target, o.mode)] = economics.chips_for_deadline(
            o, deadline_h, chips.family_sizes)
  if not options:
    log("no target has a layout that fits and a price; see the lines above")
    return 1
  ranked = economics.rank(options, flag_values["rank_by"])
  front = economics.pareto(options)
  front_keys = {(o.target, o.mode) for o in front}
  tokens = flag_values["tokens"]
  print(f"\n{tokens:.3g} tokens, ranked by {flag_values['rank_by']} (*: on the time-vs-cost "
        f"Pareto front). Step time: compute at "
        f"{flag_values['compute_efficiency']:.0%} of peak + communication without overlap "
        f"(analytic; GPU clusters are never compiled here).")
  print(report.format_table(ranked, layouts, front_keys, deadline_chips))
  used = {}
  for key in dict.fromkeys(t.price_key for t in targets):
    if key in table:
      used.setdefault(f"{table[key].source}, read {table[key].as_of}", []).append(key)
  for source, keys in used.items():
    print(f"prices of {', '.join(keys)}: {source}")
  if flag_values["png"]:
    title = f"{flag_values['config_name']} ({shape}): {tokens:.3g} tokens"
    print(f"plot: {report.plot(options, front, flag_values['png'], title, deadline_h)}")
  if flag_values["json"]:
    data = {"tokens": tokens, "rank_by": flag_values["rank_by"], "deadline_h": deadline_h,
            "compute_efficiency": flag_values["compute_efficiency"],
            "ranked": [{**o.as_dict(), "pareto": (o.target, o.mode) in front_keys,
                        "chips_for_deadline": deadline_chips.get((o.target, o.mode)),
                        "layout": layouts[o.target].candidate.overrides,
                        "step": layouts[o.target].step} for o in ranked],
            "unfit": {k: v.reason for k, v in layouts.items() if v.candidate is None},
            "prices": json.loads(prices_lib.to_json(table))["prices"]}
    workdir.write_text(flag_values["json"], json.dumps(data, indent=2, default=str))
    print(f"json: {flag_values['json']}")
  return 0


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
    from toolkit.planning.cost import layouts as layouts_lib  # pylint: disable=g-import-not-at-top
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
      status = run(config_flag.value, values)
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
