"""List prices per chip-hour (a GPU counts as a chip), with the source and date of each row.

Prices change: every row says where it was read and when. `python -m toolkit.cost
--write_prices=prices.json` writes this table as JSON; edit it (your region, your negotiated
rates, today's spot prices) and pass it back with `--prices=prices.json`. A file replaces the
rows of the accelerators it names and keeps the others.

Modes: on_demand, 1y and 3y (committed use), spot (preemptible). A mode a row has no figure for
is left out of the ranking for that accelerator and said so. Spot prices move daily (Google
Cloud changes them up to once a day), so the shipped table gives none: put today's in a file.
"""
from __future__ import annotations

import dataclasses
import json
import math

MODES = ("on_demand", "1y", "3y", "spot")

_TPU_SOURCE = "https://cloud.google.com/tpu/pricing (us-central1 / us-east5, per chip-hour)"
_GPU_SOURCE = ("https://cloud.google.com/compute/gpus-pricing (us-central1; the 8-GPU machine's "
               "hourly price over its 8 GPUs, vCPUs and memory included)")
# Google Cloud's committed-use discounts for GPU machines (resource-based CUDs), applied to
# the on-demand price where the page gives no per-GPU committed price.
_GPU_CUD = {"1y": 0.37, "3y": 0.55}


@dataclasses.dataclass(frozen=True)
class Price:
  """Dollars per chip-hour of one accelerator (TPU generation or GPU type), by mode."""
  accelerator: str                  # "v5p", "v5e", "v6e", "v4", "h100", "h200", "b200"
  dollars: dict[str, float]         # mode -> $ per chip-hour; missing modes have no price
  source: str
  as_of: str                        # when the figures were read (YYYY-MM or YYYY-MM-DD)
  note: str = ""

  def per_chip_hour(self, mode: str) -> float | None:
    return self.dollars.get(mode)


def _gpu(name: str, on_demand: float, note: str) -> Price:
  cud = {mode: round(on_demand * (1 - off), 2) for mode, off in _GPU_CUD.items()}
  return Price(name, {"on_demand": on_demand, **cud}, _GPU_SOURCE, "2025-06",
               note + "; 1y/3y: the on-demand price less Google Cloud's GPU committed-use "
               "discounts (37 %, 55 %)")


# The list prices as this table's author last read them (2025); they are not re-read when the
# table is used, and no network is reachable from the machine that wrote it: check them.
PRICES: dict[str, Price] = {p.accelerator: p for p in (
    Price("v4", {"on_demand": 3.22, "1y": 2.03, "3y": 1.45}, _TPU_SOURCE, "2025-06"),
    Price("v5e", {"on_demand": 1.20, "1y": 0.84, "3y": 0.54}, _TPU_SOURCE, "2025-06"),
    Price("v5p", {"on_demand": 4.20, "1y": 2.94, "3y": 1.89}, _TPU_SOURCE, "2025-06"),
    Price("v6e", {"on_demand": 2.70, "1y": 1.89, "3y": 1.22}, _TPU_SOURCE, "2025-06"),
    _gpu("h100", 11.06, "a3-highgpu-8g at $88.49 per hour"),
    _gpu("h200", 10.60, "a3-ultragpu-8g at $84.81 per hour"),
)}


class PriceError(ValueError):
  """A price file that cannot be used: names the file, the row and the fix."""


def _row(path: str, index: int, entry) -> Price:
  where = f"--prices={path}: row {index}"
  if not isinstance(entry, dict):
    raise PriceError(f"{where} is {type(entry).__name__}; each row is an object with "
                     f"accelerator, dollars, source and as_of")
  missing = [k for k in ("accelerator", "dollars", "source", "as_of") if not entry.get(k)]
  if missing:
    raise PriceError(f"{where} lacks {', '.join(missing)}; every row names its accelerator, "
                     f"its dollars per chip-hour by mode, where they come from and when")
  dollars = entry["dollars"]
  if not isinstance(dollars, dict) or not dollars:
    raise PriceError(f"{where}: dollars must map modes ({', '.join(MODES)}) to $ per chip-hour")
  for mode, value in dollars.items():
    if mode not in MODES:
      raise PriceError(f"{where}: mode {mode!r} is unknown; use {', '.join(MODES)}")
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value) or value <= 0):
      raise PriceError(f"{where}: dollars.{mode}={value!r}; give a positive number of dollars "
                       f"per chip-hour")
  return Price(str(entry["accelerator"]).lower(), {m: float(v) for m, v in dollars.items()},
               str(entry["source"]), str(entry["as_of"]), str(entry.get("note", "")))


def parse(text: str, path: str) -> dict[str, Price]:
  """The rows of a price file (JSON: a list of rows, or {"prices": [...]})."""
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise PriceError(f"--prices={path} is not JSON ({e.msg} at line {e.lineno}); write it "
                     f"with python -m toolkit.cost --write_prices=FILE and edit that") from None
  rows = data.get("prices") if isinstance(data, dict) else data
  if not isinstance(rows, list) or not rows:
    raise PriceError(f"--prices={path}: expected a list of rows (or {{\"prices\": [...]}}); "
                     f"write one with python -m toolkit.cost --write_prices=FILE")
  return {p.accelerator: p for p in (_row(path, i, e) for i, e in enumerate(rows, 1))}


def table(overrides: dict[str, Price] | None = None) -> dict[str, Price]:
  """The shipped rows with `overrides` replacing those of the accelerators they name."""
  return {**PRICES, **(overrides or {})}


def to_json(prices: dict[str, Price]) -> str:
  return json.dumps({"prices": [dataclasses.asdict(p) for p in prices.values()]}, indent=2) + "\n"
