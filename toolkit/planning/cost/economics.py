"""From a step-time estimate and a price to the answers: tokens/s, time and dollars to a token
budget, $ per million tokens, chips to meet a deadline, and the Pareto front of time vs cost.

Preemption (spot, or a stated MTBF for any mode): a job preempted every `mtbf_h` hours on
average loses, per preemption, the work since its last checkpoint (half the checkpoint
interval on average) and the restart (`restart_h`: new machines, restore, compile). Each hour
of work then costs on average 1 + (interval / 2 + restart) / MTBF hours of wall time, so

  goodput = 1 / (1 + (checkpoint_interval_h / 2 + restart_h) / mtbf_h)

(the first-order model of Young, "A first order approximation to the optimum checkpoint
interval", CACM 1974; the waste is not counted twice when it is small against the MTBF).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


def goodput(mtbf_h: float | None, checkpoint_interval_h: float, restart_h: float) -> float:
  """The fraction of wall time that trains, by the formula in the module docstring; 1.0
  without preemptions (mtbf_h None or infinite)."""
  if not mtbf_h or math.isinf(mtbf_h):
    return 1.0
  return 1.0 / (1.0 + (checkpoint_interval_h / 2 + restart_h) / mtbf_h)


@dataclasses.dataclass(frozen=True)
class Option:
  """One target at one pricing mode, priced for a token budget."""
  target: str
  mode: str
  chips: int
  tokens_per_second: float           # while training (the step estimate)
  goodput: float
  dollars_per_chip_hour: float
  tokens: float                      # the budget

  @property
  def hours(self) -> float:
    """Wall-clock hours to the budget, preemption losses included."""
    return self.tokens / self.tokens_per_second / self.goodput / 3600

  @property
  def dollars(self) -> float:
    return self.hours * self.chips * self.dollars_per_chip_hour

  @property
  def dollars_per_million_tokens(self) -> float:
    return self.dollars / self.tokens * 1e6

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "hours": self.hours, "days": self.hours / 24,
            "dollars": self.dollars,
            "dollars_per_million_tokens": self.dollars_per_million_tokens}


def chips_for_deadline(option: Option, deadline_h: float, sizes: Sequence[int]) -> int | None:
  """The fewest chips among `sizes` (the target family's sizes) that reach the budget within
  `deadline_h`, assuming tokens/s grows in proportion to the chips (no scaling loss: a lower
  bound); None when even the largest size is too slow."""
  needed = option.chips * option.hours / deadline_h
  return next((s for s in sorted(sizes) if s >= needed), None)


def pareto(options: Sequence[Option]) -> list[Option]:
  """The options no other beats on both time and dollars (fastest first)."""
  front = []
  for o in sorted(options, key=lambda o: (o.hours, o.dollars)):
    if not front or o.dollars < front[-1].dollars:
      front.append(o)
  return front


def rank(options: Sequence[Option], by: str = "dollars") -> list[Option]:
  """Cheapest first (by='dollars') or fastest first (by='hours'); ties go to the other
  figure, then to the name, so a ranking is the same on every run."""
  other = "hours" if by == "dollars" else "dollars"
  return sorted(options, key=lambda o: (getattr(o, by), getattr(o, other), o.target, o.mode))
