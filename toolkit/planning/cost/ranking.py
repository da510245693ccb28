"""The ranking `python -m toolkit.cost` prints: each target's fastest layout that fits by the
analytic estimate (`layouts`), priced per pricing mode (`prices`), with preemption, time,
dollars, the chips a deadline needs and the Pareto front (`economics`), as a table, JSON and a
plot (`report`). The command's docstring states what the figures include."""
from __future__ import annotations

import json
import re
import time

import jax

from toolkit import workdir
from toolkit.planning.cost import economics, layouts as layouts_lib, prices as prices_lib, report

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
  """Estimates, prices and ranks `flag_values["targets"]` (toolkit.cost's flags, by name);
  prints the table, writes the JSON and plot asked for; returns the exit status."""
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
