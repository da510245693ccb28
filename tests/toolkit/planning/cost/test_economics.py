"""toolkit.cost's arithmetic against hand-computed numbers: goodput under preemption, time and
dollars to a token budget, the ranking's order and ties, the Pareto front, chips by deadline."""
from __future__ import annotations

import math

import pytest

from toolkit.planning.cost import economics

REL = 1e-12  # exact arithmetic: the same formulas computed by hand


def option(target="a", mode="on_demand", chips=64, tokens_per_second=1e6, goodput=1.0,
           price=2.0, tokens=1e12) -> economics.Option:
  return economics.Option(target=target, mode=mode, chips=chips,
                          tokens_per_second=tokens_per_second, goodput=goodput,
                          dollars_per_chip_hour=price, tokens=tokens)


def test_goodput_by_hand():
  # Preempted every 10 h on average, checkpoints every hour, 30 min to restart: each
  # preemption costs 0.5 h of redone work + 0.5 h of restart, 1 h per 10 h of work.
  assert economics.goodput(10.0, 1.0, 0.5) == pytest.approx(1 / 1.1, rel=REL)
  assert economics.goodput(None, 1.0, 0.5) == 1.0
  assert economics.goodput(math.inf, 1.0, 0.5) == 1.0
  # A shorter MTBF costs more, as the formula says: 2 h -> 1 / (1 + 1 / 2).
  assert economics.goodput(2.0, 1.0, 0.5) == pytest.approx(2 / 3, rel=REL)


def test_time_and_dollars_by_hand():
  o = option(goodput=1 / 1.1)
  # 1e12 tokens at 1e6 tokens/s = 1e6 s = 277.78 h of work, 305.56 h of wall time.
  assert o.hours == pytest.approx(1e6 / 3600 * 1.1, rel=REL)
  assert o.dollars == pytest.approx(1e6 / 3600 * 1.1 * 64 * 2.0, rel=REL)
  assert o.dollars_per_million_tokens == pytest.approx(o.dollars / 1e6, rel=REL)


def test_spot_with_a_short_mtbf_loses_to_on_demand_when_the_discount_is_small():
  # Spot at 70 % of the on-demand price, preempted every 2 h with hourly checkpoints and a
  # 30 min restart: goodput 2/3, so it costs 0.7 / (2/3) = 1.05x on-demand and takes 1.5x.
  on_demand = option(price=3.0)
  spot = option(mode="spot", price=2.1, goodput=economics.goodput(2.0, 1.0, 0.5))
  assert spot.dollars / on_demand.dollars == pytest.approx(1.05, rel=1e-9)
  assert spot.hours / on_demand.hours == pytest.approx(1.5, rel=1e-9)
  assert [o.mode for o in economics.rank([spot, on_demand])] == ["on_demand", "spot"]
  # With a day between preemptions spot wins: 0.7 / (1 / (1 + 1 / 24)) = 0.729x.
  spot_day = option(mode="spot", price=2.1, goodput=economics.goodput(24.0, 1.0, 0.5))
  assert [o.mode for o in economics.rank([on_demand, spot_day])] == ["spot", "on_demand"]


def test_ranking_is_deterministic_and_a_cheaper_price_moves_a_target_up():
  a, b = option("a", price=2.0, tokens_per_second=1e6), option("b", price=1.0,
                                                                 tokens_per_second=0.4e6)
  assert [o.target for o in economics.rank([a, b])] == ["a", "b"]  # b: 1.25x a's dollars
  assert [o.target for o in economics.rank([b, a])] == ["a", "b"]  # order of input ignored
  cheaper_b = option("b", price=0.7, tokens_per_second=0.4e6)       # now 0.875x
  assert [o.target for o in economics.rank([a, cheaper_b])] == ["b", "a"]
  assert [o.target for o in economics.rank([a, cheaper_b], by="hours")] == ["a", "b"]
  # Equal dollars and hours: by name, whatever the input order.
  twins = [option("z"), option("y")]
  assert [o.target for o in economics.rank(twins)] == ["y", "z"]


def test_pareto_front():
  fast_dear = option("fast", tokens_per_second=4e6, price=10.0)
  slow_cheap = option("slow", tokens_per_second=1e6, price=1.0)
  dominated = option("worse", tokens_per_second=0.9e6, price=2.0)  # slower and dearer than slow
  front = economics.pareto([dominated, slow_cheap, fast_dear])
  assert [o.target for o in front] == ["fast", "slow"]


def test_chips_for_a_deadline():
  o = option(chips=64)  # 277.8 h
  sizes = (8, 16, 32, 64, 128, 256)
  assert economics.chips_for_deadline(o, 277.8 / 1.5, sizes) == 128   # needs 96.0
  assert economics.chips_for_deadline(o, 600.0, sizes) == 32          # needs 29.6
  assert economics.chips_for_deadline(o, 10.0, sizes) is None         # needs 1,778
